"""Several daemons in one `$share` group, on the SAME devices: every decision equals one node's.

mosquitto round-robins a shared group's messages over its members, so with N devices
published in turn, device d's k-th message goes to member (k·N + d) mod members: with N prime
to the member count (25 devices, 2 or 3 nodes) each device's consecutive samples go to
different nodes, and their commits can land out of order. Each test checks that split in the
stored rows (which node stored each sample) and in each node's metrics, then compares the
alarms with what one node decides from the same input in device order (the pure evaluator).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiomqtt
import asyncpg
import msgspec
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.inactivity import InactivityMonitor
from gateway.alarms.service import AlarmService
from gateway.config import parse_config
from gateway.domain.alarm import Action
from gateway.domain.rules import Firing, RuleSet, RuleStates, evaluate
from gateway.runtime.daemon import Daemon
from gateway.support.metrics import Metrics
from protocol import Telemetry, Topics, telemetry_event_id
from sim.publisher import publish_many
from storage.pool import create_pool
from tests.support.daemon import (
    DaemonProcess,
    config_toml,
    count_rows,
    http_healthy,
    make_config,
    metric,
    running_daemon,
)
from tests.support.mosquitto import Mosquitto, events_subscriber
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1_767_225_600_000
DEVICES = [f"dev-{n:02d}" for n in range(25)]  # odd, and prime to 3

THRESHOLDS = """
[[rules]]
key = "hot"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"

[[rules]]
key = "hot-3-samples"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
for_samples = 3
severity = "MAJOR"

[[rules]]
key = "hot-5-seconds"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
for_seconds = 5
severity = "WARNING"
"""
PAIRS = [
    ("DOOR_OPEN", "DOOR_CLOSE"),
    ("SOS", "SOS_CLEAR"),
    ("SMOKE", "SMOKE_CLEAR"),
    ("WATER_LEAK", "WATER_LEAK_CLEAR"),
    ("POWER_OFF", "POWER_ON"),
    ("POWER_CUT", "POWER_RESTORE"),
]
EVENTS = "".join(
    f'\n[[rules]]\nkey = "{event.lower()}"\nkind = "event"\nevent = "{event}"\nseverity = "MAJOR"\n'
    for event, _ in PAIRS
)
CYCLES = 3


def _device_stream() -> list[Telemetry]:
    """One device's messages in device order: 3 cycles of (10 x 95, 10 x 70), then 3 cycles
    of every event followed by its clear; one second apart."""
    bodies: list[dict[str, object]] = []
    for _ in range(CYCLES):
        bodies += [{"metrics": {"temp": 95}}] * 10 + [{"metrics": {"temp": 70}}] * 10
    for _ in range(CYCLES):
        for event, clear in PAIRS:
            bodies += [{"events": [{"type": event}]}, {"events": [{"type": clear}]}]
    return [
        msgspec.convert({"ts": T0 + k * 1000, "seq": k, **body}, Telemetry)
        for k, body in enumerate(bodies)
    ]


STREAM = _device_stream()


def _publications() -> list[tuple[str, bytes]]:
    """Devices in turn: the k-th message of every device, then the (k+1)-th..."""
    return [
        (TOPICS.telemetry(device), msgspec.json.encode(message))
        for message in STREAM
        for device in DEVICES
    ]


def _one_node(rules: RuleSet) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    """What one node decides, reading each device's messages in device order: firings and
    clearings per (device, rule)."""
    fired: Counter[tuple[str, str]] = Counter()
    cleared: Counter[tuple[str, str]] = Counter()
    for device in DEVICES:
        states: RuleStates = {}
        for message in STREAM:
            event_id = telemetry_event_id(device, message)
            for outcome in evaluate(rules, states, device, event_id, message).outcomes:
                counter = fired if isinstance(outcome, Firing) else cleared
                counter[(device, outcome.rule_key)] += 1
    return fired, cleared


async def _fetch(dsn: str, query: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(query))
    finally:
        await conn.close()


async def _assert_each_device_reached_every_node(dsn: str, nodes: int) -> None:
    spread = await _fetch(
        dsn, "SELECT device_id, count(DISTINCT node_id) AS nodes FROM telemetry GROUP BY device_id"
    )
    assert {r["device_id"]: r["nodes"] for r in spread} == dict.fromkeys(DEVICES, nodes)


async def _assert_alarms_equal_one_node(dsn: str, rules: RuleSet) -> None:
    fired, cleared = _one_node(rules)
    # The input was built for these numbers; the evaluator agrees before the nodes are judged.
    assert set(fired.values()) == set(cleared.values()) == {CYCLES}
    assert len(fired) == len(DEVICES) * len(rules)
    rows = await _fetch(
        dsn,
        "SELECT device_id, rule_key, count(*) AS alarms, "
        "count(*) FILTER (WHERE cleared_at IS NOT NULL) AS cleared, "
        "count(*) FILTER (WHERE status = 'SUPERSEDED') AS superseded, "
        "count(*) FILTER (WHERE status IN ('NEW', 'PUSHED')) AS open "
        "FROM alarm GROUP BY device_id, rule_key",
    )
    got = {(r["device_id"], r["rule_key"]): r for r in rows}
    assert set(got) == set(fired)
    for key, row in got.items():
        assert (row["alarms"], row["cleared"]) == (fired[key], cleared[key]), key
        assert (row["superseded"], row["open"]) == (fired[key] - 1, 1), key
    firing = await _fetch(dsn, "SELECT count(*) AS n FROM rule_state WHERE firing")
    assert firing[0]["n"] == 0


async def _assert_every_event_heard_in_its_aggregates_order(
    dsn: str, heard: list[dict[str, str]]
) -> None:
    """Every node's outbox publisher claims from the same table: every event is published and
    reaches the app, each alarm's events in the order they were written (a claim never takes
    an event behind an unpublished one of its aggregate, whichever node holds that one)."""

    async def all_heard() -> bool:
        rows = await _fetch(
            dsn, "SELECT count(*) FILTER (WHERE status <> 'PUBLISHED') AS open, count(*) AS n"
            " FROM outbox_event"
        )  # fmt: skip
        return rows[0]["open"] == 0 and len({e["event_id"] for e in heard}) >= rows[0]["n"]

    await wait_until(all_heard, timeout=120, message="every event published and heard")
    written = await _fetch(
        dsn, "SELECT event_id::text, aggregate_type, aggregate_id FROM outbox_event ORDER BY id"
    )
    assert written, "the stream raises alarms: there are events"
    assert {e["event_id"] for e in heard} == {r["event_id"] for r in written}
    first_heard: dict[tuple[str, str], list[str]] = {}
    for event in heard:
        ids = first_heard.setdefault((event["aggregate_type"], event["aggregate_id"]), [])
        if event["event_id"] not in ids:
            ids.append(event["event_id"])
    in_order: dict[tuple[str, str], list[str]] = {}
    for row in written:
        in_order.setdefault((row["aggregate_type"], row["aggregate_id"]), []).append(
            row["event_id"]
        )
    assert first_heard == in_order


@contextlib.asynccontextmanager
async def _daemons(configs: Sequence[str]) -> AsyncIterator[list[Daemon]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_daemon(parse_config(c))) for c in configs]


@pytest.mark.parametrize("nodes", [2, 3])
async def test_nodes_in_a_shared_group_decide_every_alarm_as_one_node_would(
    db_dsn: str, mosquitto: Mosquitto, nodes: int
) -> None:
    rules_toml = THRESHOLDS + EVENTS
    configs = [
        config_toml(
            dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", extra=rules_toml,
            mqtt_extra='shared_group = "alarms"',
        )
        for n in range(nodes)
    ]  # fmt: skip
    publications = _publications()
    heard: list[dict[str, str]] = []  # the events as a person's app received them, in order

    async def listen(app: aiomqtt.Client) -> None:
        async for message in app.messages:
            assert isinstance(message.payload, bytes)
            heard.append(msgspec.json.decode(message.payload))

    async with events_subscriber(mosquitto.port) as app, _daemons(configs) as daemons:
        listener = asyncio.create_task(listen(app))
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=200) as pub:
            await publish_many(pub, publications, window=100)

        async def all_stored() -> bool:
            return await count_rows(db_dsn) == len(publications)

        def counted() -> list[float]:
            return [metric(d, "gateway_telemetry_received_total") for d in daemons]

        async def all_counted() -> bool:
            # A node counts a batch once it has committed it and acked it: just after the rows
            # are visible. A message counted twice would show as more than were published.
            return sum(counted()) >= len(publications)

        await wait_until(all_stored, timeout=120, message="every message stored")
        await wait_until(all_counted, timeout=30, message="every message counted")
        received = counted()
        rules = daemons[0].config.rule_set()
        await _assert_every_event_heard_in_its_aggregates_order(db_dsn, heard)
        listener.cancel()
    assert all(r > 0 for r in received), received
    assert sum(received) == len(publications)
    await _assert_each_device_reached_every_node(db_dsn, nodes)
    await _assert_alarms_equal_one_node(db_dsn, rules)


async def test_a_node_killed_mid_stream_changes_no_decision(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Two daemon processes share the devices; one is SIGKILLed mid-stream and restarted
    (its unacknowledged samples come back to it, late): the alarms are still one node's."""
    ports = [free_port(), free_port()]
    processes = []
    for n, port in enumerate(ports):
        path = tmp_path / f"node-{n}.toml"
        path.write_text(
            config_toml(
                dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", http_port=port,
                extra=THRESHOLDS, mqtt_extra='shared_group = "alarms"',
                ingest_extra="batch_max = 20\nlinger_ms = 0",
            )
        )  # fmt: skip
        processes.append(DaemonProcess(path, tmp_path / f"node-{n}.log"))
    threshold_part = [p for p in _publications() if b'"temp"' in p[1]]

    async def healthy(n: int) -> None:
        async def check() -> bool:
            assert processes[n].alive(), processes[n].log_tail()
            return await http_healthy(ports[n])

        await wait_until(check, timeout=60, message=f"node-{n} healthy")

    try:
        for n, process in enumerate(processes):
            process.start()
            await healthy(n)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=200) as pub:
            await publish_many(pub, threshold_part, window=100)

            async def stored_some() -> bool:
                return await count_rows(db_dsn) >= len(threshold_part) // 4

            await wait_until(stored_some, timeout=60)
            processes[1].kill()
        assert await count_rows(db_dsn) < len(threshold_part), "the kill must land mid-stream"
        processes[1].start()
        await healthy(1)

        async def all_stored() -> bool:
            return await count_rows(db_dsn) == len(threshold_part)

        await wait_until(all_stored, timeout=120, message="every message stored after restart")
        for process in processes:
            assert process.terminate() == 0
    finally:
        for process in processes:
            process.cleanup()
    await _assert_each_device_reached_every_node(db_dsn, 2)
    rules = parse_config(config_toml(dsn=db_dsn, mqtt_port=1, extra=THRESHOLDS)).rule_set()
    await _assert_alarms_equal_one_node(db_dsn, rules)


async def test_inactivity_is_raised_once_by_racing_nodes_and_cleared_by_any_node(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    silent = (
        '[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = 300\n'
        'severity = "WARNING"\n'
    )
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", extra=silent,
                    mqtt_extra='shared_group = "alarms"')
        for n in range(2)
    ]  # fmt: skip
    first = [(TOPICS.telemetry(d), msgspec.json.encode({"ts": T0, "metrics": {"t": 1}}))
             for d in DEVICES]  # fmt: skip
    async with running_daemon(configs[0]), running_daemon(configs[1]):
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, first, window=50)
        stored = "SELECT count(*) AS n FROM telemetry"
        await wait_until(lambda: _is(db_dsn, stored, len(DEVICES)), timeout=60, message="stored")
    # Ten minutes of silence without waiting for them: move the stored fact.
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "UPDATE device SET first_seen = now() - interval '1 hour', "
            "last_seen = now() - interval '10 minutes'"
        )
    finally:
        await conn.close()
    pool = await create_pool(db_dsn, min_size=2, max_size=6)
    try:
        rules = configs[0].rule_set()
        monitors = [
            InactivityMonitor(
                pool=pool,
                engine=AlarmEngine(rules=rules, node_id=f"node-{n}", metrics=Metrics()),
                interval_s=1,
            )
            for n in range(3)
        ]
        start = asyncio.Barrier(len(monitors))

        async def race(monitor: InactivityMonitor) -> list[int]:
            await start.wait()
            return await monitor.run_once()

        raised = await asyncio.gather(*(race(m) for m in monitors))
    finally:
        await pool.close()
    assert sum(len(r) for r in raised) == len(DEVICES)
    again = [(t, msgspec.json.encode({"ts": T0 + 1000, "metrics": {"t": 2}})) for t, _ in first]
    async with running_daemon(configs[0]), running_daemon(configs[1]):
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, again, window=50)
        cleared = "SELECT count(*) AS n FROM alarm WHERE cleared_at IS NOT NULL"
        await wait_until(lambda: _is(db_dsn, cleared, len(DEVICES)), timeout=60,
                         message="every inactivity alarm cleared")  # fmt: skip
    rows = await _fetch(db_dsn, "SELECT device_id, count(*) AS n FROM alarm GROUP BY device_id")
    assert {r["device_id"]: r["n"] for r in rows} == dict.fromkeys(DEVICES, 1)
    nodes = await _fetch(db_dsn, "SELECT DISTINCT node_id FROM telemetry")
    assert len(nodes) == 2


async def test_a_restarted_node_replaying_its_sessions_presence_raises_no_closed_silence_again(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Every node subscribes to the status topics directly, with a persistent session. Node B
    is stopped; meanwhile dev-dead says `online`, the fleet's other devices their births, and
    dev-dead's Will `offline` follows (no telemetry since). Node A stores them; the alarm is
    raised and people close it. B restarts and replays its session: dev-dead's `online` and
    `offline` in different batches, each a change, presence_at moved to B's now. The silence
    is the same (dev-dead was not heard from since): no second alarm."""
    silent = (
        '[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = 300\n'
        'severity = "WARNING"\n'
    )
    a, b = (
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", extra=silent,
                    mqtt_extra='shared_group = "alarms"')
        for n in "ab"
    )  # fmt: skip
    others = [(TOPICS.device_status(f"other-{n:03d}"), b"online") for n in range(600)]
    dead = TOPICS.device_status("dev-dead")
    conn = await asyncpg.connect(db_dsn)
    pool = await create_pool(db_dsn, min_size=1, max_size=4)
    try:
        # Each change of dev-dead's presence, in commit order (what B's replay writes; the
        # retained status read again moves only its receipt, no change).
        await conn.execute(
            "CREATE TABLE presence_log (id bigserial, presence text, presence_at timestamptz)"
        )
        await conn.execute(
            "CREATE FUNCTION log_presence() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.device_id = 'dev-dead' AND (TG_OP = 'INSERT'"
            " OR OLD.presence IS DISTINCT FROM NEW.presence) THEN"
            " INSERT INTO presence_log (presence, presence_at)"
            " VALUES (NEW.presence, NEW.presence_at); END IF; RETURN NEW; END $$"
        )
        await conn.execute(
            "CREATE TRIGGER log_presence AFTER INSERT OR UPDATE OF presence ON device "
            "FOR EACH ROW EXECUTE FUNCTION log_presence()"
        )
        async with running_daemon(b):
            pass  # B has subscribed once: its session keeps what it misses from now on
        monitor = InactivityMonitor(
            pool=pool,
            engine=AlarmEngine(rules=a.rule_set(), node_id="node-t", metrics=Metrics()),
            interval_s=1,
        )
        async with running_daemon(a):
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
                await pub.publish(dead, b"online", qos=1, retain=True)
                await publish_many(pub, others, window=50)
                await pub.publish(dead, b"offline", qos=1, retain=True)

            async def a_stored_the_will() -> bool:
                return bool(
                    await conn.fetchval(
                        "SELECT count(*) = 601 AND bool_or(device_id = 'dev-dead'"
                        " AND presence = 'offline') FROM device"
                    )
                )

            await wait_until(a_stored_the_will, timeout=60, message="A stored the Will")
            await monitor.run_once()  # (or A's own pass: one alarm either way)
            alarm_id = await conn.fetchval("SELECT id FROM alarm WHERE device_id = 'dev-dead'")
            service = AlarmService(pool, "desk")
            for action in (Action.CONFIRM, Action.HANDLE, Action.CLOSE):
                await service.act(alarm_id, action, actor="alice")
            replayed_from = await conn.fetchval("SELECT max(id) FROM presence_log")
            async with running_daemon(b):

                async def b_replayed_both() -> bool:
                    rows = await conn.fetch(
                        "SELECT presence FROM presence_log WHERE id > $1 ORDER BY id",
                        replayed_from,
                    )
                    return [r["presence"] for r in rows] == ["online", "offline"]

                await wait_until(b_replayed_both, timeout=60, message="B replayed its session")
                assert await monitor.run_once() == []
        rows = await conn.fetch("SELECT status FROM alarm WHERE device_id = 'dev-dead'")
    finally:
        await pool.close()
        await conn.close()
    assert [r["status"] for r in rows] == ["CLOSED"]


async def _is(dsn: str, count_query: str, expected: int) -> bool:
    (row,) = await _fetch(dsn, count_query)
    return bool(row["n"] == expected)
