"""A pending hold whose device a reload stopped selecting (audit A).

The rule's `devices` is not part of its definition (`rule_version`): a reload that narrows
it leaves the device's pending row as it was, and the device's samples from then on are not
judged by the rule (it no longer selects the device). So a row left pending stood for a
violation nobody was following any more; once a later reload selected the device again, the
hold timer fired it at its first pass, though the device had long cleared (a sample the rule
did not judge) and reports by exception.
"""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import msgspec

from tests.integration.services.test_hold_timer import (
    HELD,
    _alarms,
    _engine,
    _now,
    _store,
    _temp,
    _timer,
)

PUMP = "a-pump"


async def test_a_hold_left_pending_by_a_narrowed_selector_does_not_fire_when_widened_again(
    pool: asyncpg.Pool,
) -> None:
    sent = await _now(pool)
    await _store(_engine("node-a"), pool, _temp(sent, 95.0), PUMP)  # the hold starts
    # A reload narrows the rule to the boilers: the pump's hold is no longer followed.
    narrowed = _engine("node-a", msgspec.structs.replace(HELD, devices="*-boiler"))
    assert await _timer(pool, narrowed, 61).run_once() == []
    # The pump cools down; the rule, not selecting it, does not judge that sample.
    await _store(narrowed, pool, _temp(sent + timedelta(seconds=30), 20.0), PUMP)
    # A later reload selects every device again: the pump is normal, nothing is due.
    widened = _engine("node-a")
    assert await _timer(pool, widened, 120).run_once() == []
    assert await _alarms(pool) == []
