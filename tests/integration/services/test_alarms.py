"""Alarms raised by real telemetry through a running daemon (mosquitto + PostgreSQL)."""

from __future__ import annotations

import asyncio
import json
import math
from datetime import datetime

import aiomqtt
import asyncpg
import msgspec
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.inactivity import InactivityMonitor
from gateway.alarms.service import AlarmService
from gateway.domain.alarm import Action, AlarmStatus, AlarmSupersededError
from gateway.domain.rules import RuleConfig, compile_rules
from gateway.outbox.publisher import OutboxPublisher
from gateway.runtime.daemon import Daemon
from gateway.support.hearing import Hearing
from gateway.support.metrics import Metrics
from protocol import Topics
from sim.publisher import publish_many
from storage import ingest as ingest_repo
from storage import outbox
from storage.pool import create_pool
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto, events_subscriber
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1767225600000

RULES = """
[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"

[[rules]]
key = "sos"
kind = "event"
event = "SOS"
severity = "CRITICAL"

[[rules]]
key = "power"
kind = "event"
event = "POWER_OFF"
severity = "WARNING"

[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"
description = "The oven runs too hot."
"""


def _events(ts: int, *types: str) -> bytes:
    return msgspec.json.encode({"ts": ts, "events": [{"type": t} for t in types]})


def _temp(ts: int, value: float) -> bytes:
    return msgspec.json.encode({"ts": ts, "metrics": {"temp": value}})


async def _rows(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def _value(dsn: str, query: str, *args: object) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


def _stored(daemon: Daemon, count: int):  # type: ignore[no-untyped-def]  # a predicate for wait_until
    def check() -> bool:
        value = daemon.metrics.registry.get_sample_value("gateway_ingest_handler_seconds_count")
        return (value or 0) >= count

    return check


async def _pushed(dsn: str, alarm_id: int) -> None:
    """Wait for the push, so that a person's action does not race it (it would get 409)."""

    async def check() -> bool:
        return await _value(dsn, "SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"

    await wait_until(check, timeout=30, message=f"alarm {alarm_id} pushed")


async def _send(port: int, messages: list[tuple[str, bytes]]) -> None:
    async with aiomqtt.Client("127.0.0.1", port) as pub:
        await publish_many(pub, messages, window=1)  # in order


async def test_the_same_telemetry_delivered_100_times_raises_one_alarm_one_event_one_push(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULES)
    message = (TOPICS.telemetry("door-1"), _events(T0, "DOOR_OPEN"))
    async with (
        running_daemon(config) as daemon,
        aiomqtt.Client("127.0.0.1", mosquitto.port) as watcher,
    ):
        await watcher.subscribe(f"{TOPICS.prefix}/events/alarm/#", qos=1)
        await _send(mosquitto.port, [message] * 100)
        await wait_until(_stored(daemon, 100), timeout=30)

        async def pushed() -> bool:
            status = await _value(db_dsn, "SELECT status FROM alarm")
            return status == "PUSHED"

        await wait_until(pushed, timeout=30, message="the alarm was pushed")
        created = 0
        async with asyncio.timeout(10):
            async for event in watcher.messages:
                assert isinstance(event.payload, bytes)
                kind = msgspec.json.decode(event.payload)["event_type"]
                created += kind == "alarm.created"
                if kind == "alarm.status_changed":  # the push: after the creation
                    break
    assert created == 1
    assert await _value(db_dsn, "SELECT count(*) FROM alarm") == 1
    assert await _value(db_dsn, "SELECT count(*) FROM telemetry") == 1
    events = await _rows(db_dsn, "SELECT event_type, status FROM outbox_event ORDER BY id")
    assert [(e["event_type"], e["status"]) for e in events] == [
        ("alarm.created", "PUBLISHED"), ("alarm.status_changed", "PUBLISHED"),
    ]  # fmt: skip
    audit = await _rows(db_dsn, "SELECT action, actor FROM alarm_audit ORDER BY id")
    assert [(a["action"], a["actor"]) for a in audit] == [
        ("create", "system:rules"), ("push", "system:outbox"),
    ]  # fmt: skip


async def test_threshold_storm_one_alarm_then_supersede_or_release_by_attention(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULES)
    topic = TOPICS.telemetry("oven-1")
    # A person's app gets the events: the alarms are pushed (a person may then confirm).
    async with events_subscriber(mosquitto.port), running_daemon(config) as daemon:
        storm = [(topic, _temp(T0 + n, 81 + n % 5)) for n in range(1000)]
        await _send(mosquitto.port, storm)
        await wait_until(_stored(daemon, 1000), timeout=60)
        assert await _value(db_dsn, "SELECT count(*) FROM alarm") == 1

        # Back under the clear value: cleared, never closed. Violated again: unattended, so
        # the first is superseded by the second.
        await _send(mosquitto.port, [(topic, _temp(T0 + 2000, 70)), (topic, _temp(T0 + 2001, 90))])
        await wait_until(_stored(daemon, 1002), timeout=30)
        first, second = await _rows(db_dsn, "SELECT * FROM alarm ORDER BY id")
        # Why each fired: the comparison, the value that broke it, the sample's time.
        assert json.loads(first["trigger"]) == {
            "metric": "temp", "op": ">", "threshold": 80, "value": 81,
            "sample_ts": "2026-01-01T00:00:00+00:00",
        }  # fmt: skip
        assert json.loads(second["trigger"])["value"] == 90
        assert second["rule_description"] == "The oven runs too hot."
        # The clear says why the alarm it clears fired, as every alarm.* event does.
        (cleared,) = await _rows(
            db_dsn, "SELECT payload FROM outbox_event WHERE event_type = 'alarm.cleared'"
        )
        cleared_payload = json.loads(cleared["payload"])
        assert cleared_payload["alarm_id"] == first["id"]
        assert cleared_payload["trigger"] == json.loads(first["trigger"])
        assert cleared_payload["rule_description"] == "The oven runs too hot."
        assert first["cleared_at"] is not None
        assert first["status"] == "SUPERSEDED"
        assert first["superseded_by"] == second["id"]
        assert first["active_key"] is None
        assert second["active_key"] == "oven-1:temp-high"

        # A person confirms the second; cleared and violated again: the third only takes the
        # key, the confirmed one keeps its status.
        await _pushed(db_dsn, second["id"])
        pool = await create_pool(db_dsn, min_size=1, max_size=2)
        try:
            await AlarmService(pool, "test").act(second["id"], Action.CONFIRM, actor="alice")
        finally:
            await pool.close()
        await _send(mosquitto.port, [(topic, _temp(T0 + 3000, 60)), (topic, _temp(T0 + 3001, 95))])
        await wait_until(_stored(daemon, 1004), timeout=30)
    rows = await _rows(db_dsn, "SELECT * FROM alarm ORDER BY id")
    assert len(rows) == 3
    assert rows[1]["status"] == "CONFIRMED"
    assert rows[1]["active_key"] is None
    assert rows[1]["superseded_by"] is None
    assert rows[2]["active_key"] == "oven-1:temp-high"


async def test_recovery_is_strictly_paired_and_never_closes(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULES)
    topic = TOPICS.telemetry("flat-7")
    async with running_daemon(config) as daemon:
        await _send(mosquitto.port, [
            (topic, _events(T0, "SOS", "DOOR_OPEN", "POWER_OFF")),
            (topic, _events(T0 + 1, "POWER_ON")),
            (topic, _events(T0 + 2, "DOOR_CLOSE")),
        ])  # fmt: skip
        await wait_until(_stored(daemon, 3), timeout=30)
    rows = {r["rule_key"]: r for r in await _rows(db_dsn, "SELECT * FROM alarm")}
    assert rows["sos"]["cleared_at"] is None  # POWER_ON does not clear an SOS
    assert rows["power"]["cleared_at"] is not None
    assert rows["door-open"]["cleared_at"] is not None
    event_ids = [r["event_id"] for r in await _rows(db_dsn, "SELECT event_id FROM telemetry")]
    by_ts = await _rows(db_dsn, "SELECT event_id FROM telemetry ORDER BY ts")
    assert rows["power"]["clear_event_id"] == by_ts[1]["event_id"]  # POWER_ON
    assert rows["door-open"]["clear_event_id"] == by_ts[2]["event_id"]  # DOOR_CLOSE
    assert len(event_ids) == 3
    assert all(r["status"] in {"NEW", "PUSHED"} for r in rows.values())  # clearing never closes


async def test_the_spec_chain_built_from_real_telemetry(db_dsn: str, mosquitto: Mosquitto) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULES)
    topic = TOPICS.telemetry("door-9")
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    service = AlarmService(pool, "test")
    try:
        async with events_subscriber(mosquitto.port), running_daemon(config) as daemon:
            await _send(mosquitto.port, [(topic, _events(T0 + n, "DOOR_OPEN")) for n in range(3)])
            await wait_until(_stored(daemon, 3), timeout=30)
            ids = [r["id"] for r in await _rows(db_dsn, "SELECT id FROM alarm ORDER BY id")]
            one, two, three = ids
            await _pushed(db_dsn, three)
            await service.act(three, Action.HANDLE, actor="bob")
            await _send(mosquitto.port, [(topic, _events(T0 + n, "DOOR_OPEN")) for n in (3, 4)])
            await wait_until(_stored(daemon, 5), timeout=30)
        # In id order: a row's physical order changes when it is updated (superseded).
        newer = "SELECT id FROM alarm WHERE id > $1 ORDER BY id"
        four, five = [r["id"] for r in await _rows(db_dsn, newer, three)]
        assert [v.alarm.id for v in await service.chain(five)] == [four, five]
        assert [v.alarm.id for v in await service.chain(three)] == [one, two, three]
        assert [v.alarm.id for v in await service.chain(two)] == [two]
        assert (await service.get(four)).status is AlarmStatus.SUPERSEDED
        for action in (Action.CONFIRM, Action.HANDLE, Action.CLOSE, Action.FALSE):
            with pytest.raises(AlarmSupersededError):
                await service.act(two, action, actor="carol")
        assert (await service.get(two)).superseded_by == three
    finally:
        await pool.close()


async def test_a_publisher_that_dies_mid_publish_is_replaced_and_the_push_happens_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=RULES)
    pool = await create_pool(db_dsn, min_size=1, max_size=4)
    try:
        # A person's app gets the events, whichever node publishes them: the push is theirs.
        async with events_subscriber(mosquitto.port):
            # A daemon raises the alarm; its publisher is stopped before it can publish.
            daemon = Daemon(config)
            stop = asyncio.Event()
            task = asyncio.create_task(daemon.run(stop))
            async with asyncio.timeout(30):
                await daemon.ready.wait()
            assert daemon.outbox is not None
            # "Kill" the publisher: a claim with a short lease that is never published.
            async with pool.acquire() as conn:
                await conn.execute("ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_notify")
            await _send(mosquitto.port, [(TOPICS.telemetry("d1"), _events(T0, "SOS"))])
            await wait_until(_stored(daemon, 1), timeout=30)
            stop.set()
            await task
            async with pool.acquire() as conn:
                claimed = await outbox.claim_due(conn, node_id="dead-node", lease_s=0.2, limit=10)
                # The daemon's publisher may have published before we stopped it: then the dead
                # node had nothing to claim, and the alarm is pushed already.
                assert len(claimed) <= 1
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as broker:

                async def publish(topic: str, payload: bytes) -> int:
                    await broker.publish(topic, payload, qos=1)
                    # aiomqtt's 3.1.1 PUBACK says nothing: the MQTT 5 answer, with the person's
                    # app subscribed, is 0 ("delivered to subscribers").
                    return 0

                survivor = OutboxPublisher(
                    pool=pool, dsn=db_dsn, node_id="survivor", topics=TOPICS, publish=publish,
                    metrics=Metrics(), lease_s=30,
                )  # fmt: skip

                async def drained() -> bool:
                    await survivor.run_once()
                    async with pool.acquire() as conn:
                        backlog, _ = await outbox.backlog(conn)
                    return backlog == 0

                await wait_until(drained, timeout=30, message="the expired lease was taken over")
            async with pool.acquire() as conn:
                if claimed:  # the dead node wakes up late: its lease is gone, nothing happens
                    assert not await outbox.mark_published(conn, claimed[0].id, "dead-node")
                pushes = await conn.fetchval("SELECT count(*) FROM alarm_audit WHERE action='push'")
                status = await conn.fetchval("SELECT status FROM alarm")
    finally:
        await pool.close()
    assert pushes == 1
    assert status == "PUSHED"


async def test_two_daemons_on_one_database_create_and_push_each_alarm_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", extra=RULES,
                    mqtt_extra='shared_group = "alarms"')
        for n in (1, 2)
    ]  # fmt: skip
    messages = [(TOPICS.telemetry(f"door-{n}"), _events(T0, "DOOR_OPEN")) for n in range(50)]
    async with (
        events_subscriber(mosquitto.port),  # a person's app: the pushes are real
        running_daemon(configs[0]),
        running_daemon(configs[1]),
    ):
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await publish_many(pub, messages * 2, window=50)  # and every one redelivered

        async def all_pushed() -> bool:
            count = await _value(db_dsn, "SELECT count(*) FROM alarm WHERE status = 'PUSHED'")
            return count == 50

        await wait_until(all_pushed, timeout=60, message="50 alarms pushed")
    assert await _value(db_dsn, "SELECT count(*) FROM alarm") == 50
    assert await _value(db_dsn, "SELECT count(*) FROM alarm_audit WHERE action = 'push'") == 50
    assert (
        await _value(db_dsn, "SELECT count(*) FROM outbox_event WHERE event_type = 'alarm.created'")
        == 50
    )


async def test_inactivity_raises_once_across_a_restart_and_the_next_message_clears_it(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    silent_rule = (
        '[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = 300\n'
        'severity = "WARNING"\n'
    )
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=silent_rule)
    topic = TOPICS.telemetry("meter-1")
    async with running_daemon(config) as daemon:
        await _send(mosquitto.port, [(topic, _temp(T0, 20))])
        await wait_until(_stored(daemon, 1), timeout=30)
    # Ten minutes of silence, without waiting ten minutes: move the stored fact.
    await _value(
        db_dsn,
        "UPDATE device SET first_seen = now() - interval '1 hour', "
        "last_seen = now() - interval '10 minutes'",
    )
    silent_since = await _value(db_dsn, "SELECT last_seen FROM device")
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        ruleset = compile_rules(
            [
                RuleConfig(
                    key="silent",
                    kind="inactivity",
                    severity="WARNING",
                    silent_seconds=300,
                    description="Meters report every minute.",
                )
            ]
        )
        for restart in range(2):  # a second node, or the same one restarted, decides the same
            engine = AlarmEngine(rules=ruleset, node_id=f"node-{restart}", metrics=Metrics())
            raised = await InactivityMonitor(pool=pool, engine=engine, interval_s=1).run_once()
            assert len(raised) == (1 if restart == 0 else 0)
    finally:
        await pool.close()
    async with running_daemon(config) as daemon:
        await _send(mosquitto.port, [(topic, _temp(T0 + 1, 21))])
        await wait_until(_stored(daemon, 1), timeout=30)
    (alarm,) = await _rows(db_dsn, "SELECT * FROM alarm")
    assert alarm["rule_key"] == "silent"
    assert alarm["rule_description"] == "Meters report every minute."
    assert datetime.fromisoformat(json.loads(alarm["trigger"])["silent_since"]) == silent_since
    assert alarm["cleared_at"] is not None
    assert alarm["status"] in {"NEW", "PUSHED"}


SILENT_300 = compile_rules(
    [RuleConfig(key="silent", kind="inactivity", severity="WARNING", silent_seconds=300)]
)


def _silence_monitor(
    pool: asyncpg.Pool, node: str = "node-a", hearing: Hearing | None = None
) -> InactivityMonitor:
    engine = AlarmEngine(rules=SILENT_300, node_id=node, metrics=Metrics())
    heard = None if hearing is None else (lambda _keep_s: hearing)
    return InactivityMonitor(pool=pool, engine=engine, interval_s=1, hearing=heard)


async def _last_heard(db: asyncpg.Connection, seconds_ago: dict[str, float]) -> None:
    await ingest_repo.touch_devices(db, set(seconds_ago))
    for device_id, ago in seconds_ago.items():
        await db.execute(
            "UPDATE device SET first_seen = now() - interval '1 day', "
            "last_seen = now() - make_interval(secs => $2) WHERE device_id = $1",
            device_id,
            ago,
        )


async def test_silence_before_the_nodes_first_subscribe_is_not_silence(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """A site power cut: broker and gateway down 6 minutes; the device (reporting every 60 s)
    was last heard 370 s ago. The node subscribed 11 s ago: it has listened 11 s, nothing
    before (the break began before its start), so no alarm; at 301 s of listening, one."""
    await _last_heard(db, {"dev-ok": 370})
    just_up = Hearing(11.0, ((math.inf, 11.0),))
    assert await _silence_monitor(pool, hearing=just_up).run_once() == []
    await _last_heard(db, {"dev-ok": 660})
    listened_301 = Hearing(301.0, ((math.inf, 301.0),))
    assert len(await _silence_monitor(pool, hearing=listened_301).run_once()) == 1


async def test_every_break_inside_a_silence_is_left_out_not_only_the_last(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """Last heard 480 s ago (reports every 280 s; silent_seconds 300). The node listened 100 s,
    broke 170 s, listened 5 s, broke 175 s (the report due in it went unheard), listened
    30 s: 135 s of listening, no alarm. Heard 650 s ago: 305 s of listening, an alarm."""
    await _last_heard(db, {"dev-280": 480, "dev-gone": 650})
    heard = Hearing(30.0, ((math.inf, 1000.0), (380.0, 210.0), (205.0, 30.0)))
    raised = await _silence_monitor(pool, hearing=heard).run_once()
    rows = await db.fetch("SELECT device_id FROM alarm WHERE id = ANY($1)", raised)
    assert [r["device_id"] for r in rows] == ["dev-gone"]


async def test_a_lagging_node_storing_online_then_offline_again_raises_no_closed_silence_again(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    """One silence, one alarm: the device said `online`, then died (its Will `offline`, no
    telemetry since). Node A stored both; the alarm was raised and people closed it. Node B,
    a batch behind (or replaying its persistent session after a restart), stores the same
    `online` and `offline` again: presence_at moves to B's now, but the device has not been
    heard from since, so the silence is the one people closed."""
    await _last_heard(db, {"dev-dead": 30})
    await ingest_repo.record_presence(db, {"dev-dead": "online"})  # node A: the birth
    await ingest_repo.record_presence(db, {"dev-dead": "offline"})  # node A: the Will
    (first,) = await _silence_monitor(pool).run_once()
    service = AlarmService(pool, "desk")
    for action in (Action.CONFIRM, Action.HANDLE, Action.CLOSE):
        await service.act(first, action, actor="alice")
    await ingest_repo.record_presence(db, {"dev-dead": "online"})  # node B, behind: the birth
    await ingest_repo.record_presence(db, {"dev-dead": "offline"})  # node B: the same Will
    assert await _silence_monitor(pool, "node-c").run_once() == []
    # Heard from again, then offline anew: a new silence, a new alarm.
    await ingest_repo.touch_devices(db, {"dev-dead"})
    await ingest_repo.record_presence(db, {"dev-dead": "online"})
    await ingest_repo.record_presence(db, {"dev-dead": "offline"})
    assert len(await _silence_monitor(pool, "node-c").run_once()) == 1
