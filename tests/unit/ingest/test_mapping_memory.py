"""What a node remembers of the mappings it recorded: a device is due when new to it,
changed (its mapping or its topic wildcards), or recorded REFRESH_S ago or longer; the least
recently recorded is forgotten first past the bound."""

from __future__ import annotations

from gateway.ingest.mapping_memory import REFRESH_S, MappingMemory


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


KITCHEN = ("tasmota", {"device": "kitchen"})
HALL = ("tasmota", {"device": "hall"})


def test_a_device_is_due_until_recorded_then_only_when_it_changes() -> None:
    memory = MappingMemory(clock=Clock())
    assert memory.due({"kitchen": KITCHEN, "hall": HALL}) == {"kitchen": KITCHEN, "hall": HALL}
    memory.recorded({"kitchen": KITCHEN})
    assert memory.due({"kitchen": KITCHEN, "hall": HALL}) == {"hall": HALL}
    # The same values in new objects (each message's own wildcards): not due.
    assert memory.due({"kitchen": ("tasmota", {"device": "kitchen"})}) == {}
    other_mapping = ("tasmota-2", {"device": "kitchen"})
    assert memory.due({"kitchen": other_mapping}) == {"kitchen": other_mapping}
    other_topic = ("tasmota", {"device": "Kitchen"})
    assert memory.due({"kitchen": other_topic}) == {"kitchen": other_topic}
    memory.recorded({"kitchen": other_topic})
    assert memory.due({"kitchen": other_topic}) == {}
    assert memory.due({"kitchen": KITCHEN}) == {"kitchen": KITCHEN}


def test_a_record_is_due_again_after_the_refresh() -> None:
    clock = Clock()
    memory = MappingMemory(clock=clock)
    memory.recorded({"kitchen": KITCHEN})
    clock.now += REFRESH_S - 1
    assert memory.due({"kitchen": KITCHEN}) == {}
    clock.now += 1
    assert memory.due({"kitchen": KITCHEN}) == {"kitchen": KITCHEN}
    memory.recorded({"kitchen": KITCHEN})  # recorded again: a refresh from now
    assert memory.due({"kitchen": KITCHEN}) == {}


def test_the_least_recently_recorded_is_forgotten_past_the_bound() -> None:
    memory = MappingMemory(devices=2, clock=Clock())
    memory.recorded({"a": KITCHEN, "b": KITCHEN})
    memory.recorded({"a": KITCHEN})  # recorded again: now the most recent
    memory.recorded({"c": KITCHEN})
    assert len(memory) == 2
    assert memory.due({"a": KITCHEN, "b": KITCHEN, "c": KITCHEN}) == {"b": KITCHEN}
