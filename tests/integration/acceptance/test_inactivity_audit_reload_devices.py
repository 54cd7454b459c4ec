"""Inactivity alarms across a reload that changes only the rule's `devices` (audit A).

The contract (behaviour.md §4): the next message clears an inactivity alarm whatever rule
raised it. A reload that narrows the rule's device selector so that it no longer selects a
device whose alarm is open must not leave that alarm standing for ever: the device is heard
from again, its silence is over.
"""

from __future__ import annotations

from tests.integration.acceptance.test_reload_nodes import (
    DOOR,
    SILENT,
    _configs,
    _heard_again,
    _offline_alarm,
    _two,
    _value,
)
from tests.support.mosquitto import Mosquitto


async def test_an_inactivity_alarm_clears_on_the_next_message_after_a_reload_deselects_its_device(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = _configs(db_dsn, mosquitto.port, DOOR + SILENT)
    narrowed = SILENT.replace('severity = "WARNING"', 'severity = "WARNING"\ndevices = "site-b-*"')
    async with _two(configs) as daemons:
        alarm_id = await _offline_alarm(db_dsn, mosquitto.port, daemons[0])
        for daemon, config in zip(
            daemons, _configs(db_dsn, mosquitto.port, DOOR + narrowed), strict=True
        ):
            daemon.reload(config)  # the rule now covers another site's devices only
        await _heard_again(db_dsn, mosquitto.port)  # whichever node takes it
        cleared = await _value(db_dsn, "SELECT cleared_at FROM alarm WHERE id = $1", alarm_id)
    assert cleared is not None, "the device was heard from again, yet its silence alarm stands"
