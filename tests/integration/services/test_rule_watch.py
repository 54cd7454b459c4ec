"""Rules that cannot fail silently: the check over stored telemetry and the daemon's watch."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
from structlog.testing import capture_logs

from gateway.alarms.rule_watch import RuleWatch, find_unseen
from gateway.config import parse_config
from gateway.domain.rule_check import watched_names
from gateway.domain.rules import RuleSet
from storage.pool import create_pool
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)

RULES = """
[[rules]]
key = "hot"
kind = "threshold"
severity = "MAJOR"
metric = "temp"
op = ">"
value = 30

[[rules]]
key = "damp"
kind = "threshold"
severity = "WARNING"
metric = "humidty"
op = ">"
value = 80

[[rules]]
key = "door"
kind = "event"
severity = "MAJOR"
event = "DOOR_OPNE"

[[rules]]
key = "silent"
kind = "inactivity"
severity = "WARNING"
silent_seconds = 60
"""


def _rules(text: str = RULES) -> RuleSet:
    return parse_config(text).rule_set()


async def _store(
    pool: asyncpg.Pool, ts: datetime, *, metrics: str | None = None, events: str | None = None
) -> None:
    # A device whose clock is right: received when it is dated (the check's window is the
    # receipt's, test_rules_audit_check_clocks).
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO telemetry (event_id, device_id, ts, metrics, events, node_id, "
            "received_at) VALUES (encode(sha256(gen_random_uuid()::text::bytea), 'hex'), "
            "'dev-1', $1, $2::jsonb, $3::jsonb, 'n1', $1)",
            ts,
            metrics,
            events,
        )


class FixedClock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    async def __call__(self, _conn: asyncpg.Connection) -> datetime:
        return self.now


async def test_the_check_names_the_unseen_rules_with_the_closest_seen_names(
    pool: asyncpg.Pool,
) -> None:
    await _store(pool, NOW - timedelta(minutes=5), metrics='{"temp": 21.5, "humidity": 40}')
    await _store(pool, NOW - timedelta(minutes=4), events='[{"type": "DOOR_OPEN"}]')
    # Older than the window: its exact names do not count.
    await _store(pool, NOW - timedelta(hours=3), metrics='{"humidty": 1}')
    names = watched_names(_rules())
    assert [w.rule_key for w in names] == ["hot", "damp", "door"]  # inactivity watches no name
    async with pool.acquire() as conn:
        reports = await find_unseen(conn, names, NOW - timedelta(hours=1))
        sampled = await find_unseen(conn, names, NOW - timedelta(hours=1), sample_rows=1)
        everything = await find_unseen(conn, names, NOW - timedelta(hours=4))
    assert [(r.rule_key, r.name, r.closest) for r in reports] == [
        ("damp", "humidty", ("humidity",)),
        ("door", "DOOR_OPNE", ("DOOR_OPEN",)),
    ]
    assert "closest seen: humidity" in reports[0].describe()
    # A sample of one row misses names; each miss is confirmed on its own, so no false report.
    assert [r.rule_key for r in sampled] == ["damp", "door"]
    assert [r.rule_key for r in everything] == ["door"]


async def test_the_watch_logs_each_unseen_rule_once_after_the_configured_time(
    pool: asyncpg.Pool,
) -> None:
    # Inside the window the first report looks at ([NOW, NOW + 600s]).
    await _store(pool, NOW + timedelta(minutes=5), metrics='{"temp": 21.5, "humidity": 40}')
    clock = FixedClock(NOW)
    rules = _rules()
    watch = RuleWatch(pool=pool, rules=lambda: rules, after_s=600, clock=clock)
    with capture_logs() as logs:
        assert await watch.run_once() == []  # loaded just now: nothing is due yet
        clock.now = NOW + timedelta(seconds=599)
        assert await watch.run_once() == []
        clock.now = NOW + timedelta(seconds=600)
        first = await watch.run_once()
        clock.now = NOW + timedelta(seconds=900)
        again = await watch.run_once()
    assert [(r.rule_key, r.closest) for r in first] == [("damp", ("humidity",)), ("door", ())]
    assert again == []
    warnings = [entry for entry in logs if entry["event"] == "rule_never_matched"]
    assert [(w["rule"], w["name"], w["closest_seen"]) for w in warnings] == [
        ("damp", "humidty", ["humidity"]),
        ("door", "DOOR_OPNE", []),
    ]
    assert all(w["log_level"] == "warning" and w["window_s"] == 600 for w in warnings)

    # A reload adds a rule: it waits its own time, and the ones already reported stay quiet.
    rules = _rules(
        RULES + '\n[[rules]]\nkey = "wet"\nkind = "threshold"\nseverity = "WARNING"\n'
        'metric = "moisture"\nop = ">"\nvalue = 1\n'
    )
    assert await watch.run_once() == []
    clock.now += timedelta(seconds=600)
    # No telemetry since NOW + 5 min: `temp` is unseen now too, and reported (once); the two
    # reported already stay quiet.
    assert [r.rule_key for r in await watch.run_once()] == ["hot", "wet"]
    clock.now += timedelta(seconds=600)
    assert await watch.run_once() == []


async def test_a_rule_whose_name_is_seen_is_never_reported(pool: asyncpg.Pool) -> None:
    clock = FixedClock(NOW)
    rules = _rules()
    watch = RuleWatch(pool=pool, rules=lambda: rules, after_s=60, clock=clock)
    await watch.run_once()
    await _store(
        pool,
        NOW + timedelta(seconds=30),
        metrics='{"temp": 1, "humidty": 2}',
        events='[{"type": "DOOR_OPNE"}]',
    )
    clock.now = NOW + timedelta(seconds=61)
    assert await watch.run_once() == []


async def test_each_daemon_of_a_cluster_logs_a_rule_that_never_matched(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    extra = RULES + "\n[alarms]\nrule_check_after_s = 1\n"
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"n{i}", extra=extra)
        for i in (1, 2)
    ]
    # Dated ahead, so that it stays inside every window of this test: `temp` is seen. Stored
    # before the nodes start: a node's first report may come before the second node is ready.
    pool = await create_pool(db_dsn, min_size=1, max_size=1)
    try:
        await _store(
            pool, datetime.now(UTC) + timedelta(hours=1), metrics='{"temp": 1, "humidity": 2}'
        )
    finally:
        await pool.close()
    with capture_logs() as logs:
        async with running_daemon(configs[0]) as first, running_daemon(configs[1]) as second:
            assert first.components is not None
            assert second.components is not None
            assert "rule-watch" in [name for name, _ in first.components.loops]

            def reported() -> list[str]:
                return sorted(
                    entry["rule"] for entry in logs if entry["event"] == "rule_never_matched"
                )

            # Each node, for each of the two misspelled rules, once (here: both nodes).
            await wait_until(
                lambda: reported() == ["damp", "damp", "door", "door"],
                timeout=30,
                message="both nodes report damp and door, once each",
            )
    by_rule = {e["rule"]: e for e in logs if e["event"] == "rule_never_matched"}
    assert by_rule["damp"]["closest_seen"] == ["humidity"]
    assert reported() == ["damp", "damp", "door", "door"]  # and never again until they stopped


async def test_zero_turns_the_watch_off_and_a_reload_turns_it_on(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULES + "\n[alarms]\nrule_check_after_s = 0\n"
    )
    on = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULES + "\n[alarms]\nrule_check_after_s = 1\n"
    )
    with capture_logs() as logs:
        async with running_daemon(config) as daemon:
            assert daemon.components is not None
            watch = daemon.components.rule_watch
            assert watch.current_interval_s() is None  # idle: no pass, no query
            daemon.reload(on)
            assert watch.current_interval_s() == 1.0

            def reported() -> list[str]:
                return sorted(e["rule"] for e in logs if e["event"] == "rule_never_matched")

            await wait_until(
                lambda: reported() == ["damp", "door", "hot"],
                timeout=30,
                message="the watch the reload switched on reports the rules",
            )
            daemon.reload(config)
            assert watch.current_interval_s() is None
