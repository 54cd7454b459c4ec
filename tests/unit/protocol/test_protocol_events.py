"""The event catalogue: the enum and the payload Structs cover each other, every payload
round-trips, and the alarm snapshot is the alarm, field for field, byte for byte."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from gateway.alarms.lifecycle import created_payload, event_payload
from gateway.domain.alarm import Alarm, AlarmStatus
from protocol.events import (
    PAYLOADS,
    AlarmSnapshot,
    EventPayload,
    EventType,
    decode_payload,
)
from tests.support import events


def test_every_event_type_has_a_payload_struct_and_every_struct_an_event_type() -> None:
    assert set(PAYLOADS) == set(EventType)
    assert set(PAYLOADS.values()) == set(get_args(EventPayload))


def test_every_payload_decodes_by_its_event_type() -> None:
    samples = events.samples()
    assert set(samples) == set(EventType)
    for event_type, payload in samples.items():
        decoded = decode_payload(event_type.value, msgspec.json.encode(payload))
        assert decoded == payload
        assert type(decoded) is PAYLOADS[event_type]


def test_a_type_outside_the_catalogue_or_a_payload_off_its_schema_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not\.a_type"):
        decode_payload("not.a_type", b"{}")
    with pytest.raises(msgspec.ValidationError):
        decode_payload("alarm.created", msgspec.json.encode(events.command("ACKED")))


def test_the_alarm_is_its_snapshot_with_the_domains_enums() -> None:
    assert issubclass(Alarm, AlarmSnapshot)
    assert Alarm.__struct_fields__ == AlarmSnapshot.__struct_fields__


def test_the_alarm_events_keep_their_wire_names() -> None:
    alarm = msgspec.convert(msgspec.to_builtins(events.snapshot()), Alarm)
    step = msgspec.to_builtins(
        event_payload(alarm, action="close", actor="ops", from_status=AlarmStatus.HANDLED)
    )
    assert set(step) == {"alarm", "action", "actor", "from"}
    assert step["from"] == "HANDLED"
    created = msgspec.to_builtins(created_payload(alarm, reason="r", supersedes=3))
    assert set(created) == {"alarm", "action", "actor", "from", "reason", "supersedes"}
    assert (created["action"], created["from"], created["supersedes"]) == ("create", None, 3)
    late = msgspec.to_builtins(created_payload(alarm, reason="r", supersedes=None, late=True))
    assert late["late"] is True
