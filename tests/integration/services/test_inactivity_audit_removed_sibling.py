"""Two inactivity rules configured together, one removed by a reload (audit A).

A warning after 5 minutes of silence and a critical alarm after an hour, on the same
devices. The warning fired; a reload then removed the warning rule (too noisy). The
critical rule, configured beside it all along, took the warning's alarm for its own (as if
it were the warning renamed: "a rule no longer configured" holds the silence) and raised
nothing when the hour passed: a silent device never reached the critical level. The
contract: two inactivity rules configured together each raise their own; only a renamed
rule raises no second alarm for the same silence.
"""

from __future__ import annotations

import math

import asyncpg

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.inactivity import InactivityMonitor
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.support.hearing import Hearing
from gateway.support.metrics import Metrics
from tests.integration.services.test_alarms import _last_heard

WARN = RuleConfig(key="silent-5m", kind="inactivity", severity="WARNING", silent_seconds=300)
CRIT = RuleConfig(key="silent-1h", kind="inactivity", severity="CRITICAL", silent_seconds=3600)
RENAMED = RuleConfig(key="quiet-5m", kind="inactivity", severity="WARNING", silent_seconds=300)


def _monitor(
    pool: asyncpg.Pool, hearing: Hearing | None, *configs: RuleConfig
) -> InactivityMonitor:
    engine = AlarmEngine(rules=compile_rules(list(configs)), node_id="node-a", metrics=Metrics())
    heard = None if hearing is None else (lambda _keep_s: hearing)
    return InactivityMonitor(pool=pool, engine=engine, interval_s=1, hearing=heard)


async def _keys(db: asyncpg.Connection) -> list[str]:
    return [r["rule_key"] for r in await db.fetch("SELECT rule_key FROM alarm ORDER BY id")]


async def test_a_rule_configured_beside_a_removed_one_still_raises_its_own(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    await _last_heard(db, {"meter-1": 3700})
    # An hour ago the node had listened 10 minutes: the warning's silence had passed, the
    # critical one's had not.
    ten_minutes = Hearing(600.0, ((math.inf, 600.0),))
    await _monitor(pool, ten_minutes, WARN, CRIT).run_once()
    assert await _keys(db) == ["silent-5m"]
    # The warning rule is removed; the node has listened all along since.
    await _monitor(pool, None, CRIT).run_once()
    assert await _keys(db) == ["silent-5m", "silent-1h"]


async def test_a_renamed_rule_still_raises_no_second_alarm_for_the_same_silence(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    await _last_heard(db, {"meter-1": 3700})
    ten_minutes = Hearing(600.0, ((math.inf, 600.0),))
    await _monitor(pool, ten_minutes, WARN, CRIT).run_once()
    await _monitor(pool, None, RENAMED, CRIT).run_once()
    assert await _keys(db) == ["silent-5m", "silent-1h"]
