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
    async with pool.acquire() as conn:
        await narrowed.forget_removed_rules(conn)  # the reload recorded, as its loop does
    assert await _timer(pool, narrowed, 61).run_once() == []
    # The pump cools down; the rule, not selecting it, does not judge that sample.
    await _store(narrowed, pool, _temp(sent + timedelta(seconds=30), 20.0), PUMP)
    # A later reload selects every device again: the pump is normal, nothing is due.
    widened = _engine("node-a")
    assert await _timer(pool, widened, 120).run_once() == []
    assert await _alarms(pool) == []


async def test_a_node_not_yet_widened_leaves_the_hold_a_widened_node_started(
    pool: asyncpg.Pool,
) -> None:
    """A rolling reload widens the rule to every device: node A reloaded, node B not yet.
    The pump's hold, started by node A's batch, is node A's to fire; node B's timer, which
    does not select the pump, leaves it pending."""
    narrow = msgspec.structs.replace(HELD, devices="*-boiler")
    node_b = _engine("node-b", narrow)
    async with pool.acquire() as conn:
        await node_b.forget_removed_rules(conn)  # node B's rules, recorded at its start
    node_a = _engine("node-a")  # widened
    async with pool.acquire() as conn:
        await node_a.forget_removed_rules(conn)
    await _store(node_a, pool, _temp(await _now(pool), 95.0), PUMP)  # the hold starts
    assert await _timer(pool, node_b, 61).run_once() == []
    assert len(await _timer(pool, node_a, 61).run_once()) == 1
