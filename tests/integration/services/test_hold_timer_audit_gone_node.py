"""The state of a rule removed while the last node still running it was live (audit A).

A reload drops the rule state of the rules no live node runs; a node stopped counts as live
for a minute. So when the last node that still ran a removed rule stopped for good (scaled
in, instead of reloaded), its rows stayed: no live node ran the rule, yet nothing dropped
them (the heartbeats do not), and a reload or a restart that took the rule up again found
them as they were: a hold pending from before (the device's samples since were judged by no
rule) fired at the first pass, though the device had long cleared. Each node's steps are run
directly: its reload (`replace_rules`, then what its loop does next, `forget_removed_rules`),
its start (a new engine, `forget_removed_rules`), a timer pass.
"""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.support.metrics import Metrics
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
DOOR = RuleConfig(key="door", kind="event", event="DOOR_OPEN", severity="MAJOR")


async def _reload(pool: asyncpg.Pool, engine: AlarmEngine, *configs: RuleConfig) -> None:
    engine.replace_rules(compile_rules(list(configs)))
    async with pool.acquire() as conn:
        await engine.forget_removed_rules(conn)


@pytest.mark.parametrize("taken_up_by", ["reload", "restart"])
async def test_a_rule_removed_before_its_last_node_stopped_comes_back_without_its_old_hold(
    pool: asyncpg.Pool, db: asyncpg.Connection, taken_up_by: str
) -> None:
    node_a, node_b = _engine("node-a", HELD, DOOR), _engine("node-b", HELD, DOOR)
    async with pool.acquire() as conn:
        for engine in (node_a, node_b):
            await engine.forget_removed_rules(conn)  # at their start
    sent = await _now(pool)
    await _store(node_a, pool, _temp(sent, 95.0), PUMP)  # the hold starts
    # A rolling reload removes the rule: node A first (node B still runs it: kept) ...
    await _reload(pool, node_a, DOOR)
    assert await db.fetchval("SELECT count(*) FROM rule_state WHERE rule_key = $1", HELD.key)
    await _store(node_a, pool, _temp(sent + timedelta(seconds=30), 20.0), PUMP)  # cools down
    # ... and node B is stopped for good: its heartbeat is as old as a dead node's.
    await db.execute(
        "UPDATE node_rule_set SET heartbeat_at = now() - interval '10 minutes'"
        " WHERE node_id = 'node-b'"
    )
    # Weeks later the rule is taken up again: the pump is normal, nothing is due.
    if taken_up_by == "reload":
        await _reload(pool, node_a, HELD, DOOR)
    else:
        node_a = AlarmEngine(rules=compile_rules([HELD, DOOR]), node_id="node-a", metrics=Metrics())
        async with pool.acquire() as conn:
            await node_a.forget_removed_rules(conn)
    assert await _timer(pool, node_a, 120).run_once() == []
    assert await _alarms(pool) == []


async def test_a_rule_another_live_node_runs_keeps_its_state_when_a_reload_takes_it_up(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """A rolling reload that adds a rule: the node reloaded first wrote its state, the next
    node to take it up keeps it."""
    node_a, node_b = _engine("node-a", DOOR), _engine("node-b", DOOR)
    async with pool.acquire() as conn:
        for engine in (node_a, node_b):
            await engine.forget_removed_rules(conn)
    await _reload(pool, node_b, HELD, DOOR)
    await _store(node_b, pool, _temp(await _now(pool), 95.0), PUMP)  # the hold starts on B
    await _reload(pool, node_a, HELD, DOOR)
    assert len(await _timer(pool, node_a, 61).run_once()) == 1


async def test_a_restarted_node_keeps_the_state_of_the_rules_it_ran_before(
    pool: asyncpg.Pool,
) -> None:
    node_a = _engine("node-a", HELD, DOOR)
    async with pool.acquire() as conn:
        await node_a.forget_removed_rules(conn)
    await _store(node_a, pool, _temp(await _now(pool), 95.0), PUMP)  # the hold starts
    restarted = _engine("node-a", HELD, DOOR)
    async with pool.acquire() as conn:
        await restarted.forget_removed_rules(conn)
    assert len(await _timer(pool, restarted, 61).run_once()) == 1


async def test_what_the_node_judged_between_its_reload_and_its_recording_is_kept(
    pool: asyncpg.Pool,
) -> None:
    """The reload swaps the rules, and the node's loop records them a moment later: a batch in
    between already judged the rule taken up. Its state is no leftover."""
    node_a = _engine("node-a", DOOR)
    async with pool.acquire() as conn:
        await node_a.forget_removed_rules(conn)
    node_a.replace_rules(compile_rules([HELD, DOOR]))
    await _store(node_a, pool, _temp(await _now(pool), 95.0), PUMP)  # the hold starts
    async with pool.acquire() as conn:
        await node_a.forget_removed_rules(conn)  # the loop records the reload
    assert len(await _timer(pool, node_a, 61).run_once()) == 1
