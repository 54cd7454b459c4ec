"""Alarms that stay true in the field (issue 22), with two daemons sharing the devices.

A reload that adds the first inactivity rule makes it fire; one that removes the quiet-hours
window wakes the alarms it held; a node started with fewer rules leaves the rule state of the
rules another live node runs; a reconnect that reads a retained `offline` again brings no
closed inactivity alarm back; an inactivity alarm whose rule a reload (or a restart) removed
clears on the device's next message, and a renamed rule raises none again for its silence.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import aiomqtt
import asyncpg
import msgspec
from structlog.testing import capture_logs

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.inactivity import InactivityMonitor
from gateway.alarms.service import AlarmService
from gateway.config import Config
from gateway.domain.alarm import Action
from gateway.runtime.daemon import Daemon
from gateway.support.metrics import Metrics
from protocol import Topics
from storage.pool import create_pool
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto, events_subscriber
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1_767_225_600_000
DEVICES = [f"dev-{n:02d}" for n in range(5)]
SILENT = (
    '[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = 300\nseverity = "WARNING"\n'
)
DOOR = '[[rules]]\nkey = "door"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'
SOS = '[[rules]]\nkey = "sos"\nkind = "event"\nevent = "SOS"\nseverity = "MAJOR"\n'
SHARED = 'shared_group = "alarms"'


def _configs(dsn: str, port: int, extra: str) -> list[Config]:
    return [
        make_config(dsn=dsn, mqtt_port=port, node_id=f"node-{n}", extra=extra, mqtt_extra=SHARED)
        for n in range(2)
    ]


@contextlib.asynccontextmanager
async def _two(configs: list[Config]) -> AsyncIterator[tuple[Daemon, Daemon]]:
    async with running_daemon(configs[0]) as first, running_daemon(configs[1]) as second:
        yield first, second


async def _value(dsn: str, query: str, *args: object) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def _execute(dsn: str, query: str, *args: object) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(query, *args)
    finally:
        await conn.close()


def _count_is(dsn: str, query: str, expected: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await _value(dsn, query) == expected

    return check


async def _publish(port: int, messages: list[tuple[str, bytes]], *, retain: bool = False) -> None:
    async with aiomqtt.Client("127.0.0.1", port) as pub:
        for topic, payload in messages:
            await pub.publish(topic, payload, qos=1, retain=retain)


def _telemetry(body: dict[str, object], ts: int = T0) -> list[tuple[str, bytes]]:
    return [(TOPICS.telemetry(d), msgspec.json.encode({"ts": ts, **body})) for d in DEVICES]


async def test_an_inactivity_rule_added_by_a_reload_fires(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = _configs(db_dsn, mosquitto.port, DOOR)
    async with _two(configs) as daemons:
        await _publish(mosquitto.port, _telemetry({"metrics": {"t": 1}}))
        stored = "SELECT count(*) FROM telemetry"
        await wait_until(_count_is(db_dsn, stored, len(DEVICES)), timeout=60, message="stored")
        # A real silence, heard by both nodes (a last_seen moved back would be a silence from
        # before they listened, which they do not judge).
        reloaded = _configs(db_dsn, mosquitto.port, DOOR + SILENT.replace("300", "3"))
        for daemon, config in zip(daemons, reloaded, strict=True):
            daemon.reload(config)
        alarms = "SELECT count(*) FROM alarm WHERE rule_key = 'silent'"
        await wait_until(
            _count_is(db_dsn, alarms, len(DEVICES)),
            timeout=30,
            message="every silent device alarmed by the rule the reload added",
        )
        # And a reload that removes it again stops raising: the device falls silent anew, and
        # no pass (the loop idles until a reload) raises anything.
        for daemon, config in zip(daemons, configs, strict=True):
            daemon.reload(config)
            assert daemon.components is not None
            assert daemon.components.inactivity.current_interval_s() is None
    per_device = await _value(
        db_dsn, "SELECT count(DISTINCT device_id) = count(*) FROM alarm WHERE rule_key = 'silent'"
    )
    assert per_device is True  # one alarm per device, whichever node raised it


async def _offline_alarm(dsn: str, port: int, daemon: Daemon) -> int:
    """dev-00 heard once, then silent for ten minutes and offline: its alarm, raised by a pass
    (this one, or the daemon's own)."""
    await _publish(port, _telemetry({"metrics": {"t": 1}})[:1])
    stored = "SELECT count(*) FROM telemetry"
    await wait_until(_count_is(dsn, stored, 1), timeout=60, message="stored")
    await _execute(
        dsn,
        "UPDATE device SET first_seen = now() - interval '1 hour', "
        "last_seen = now() - interval '10 minutes', presence = 'offline', presence_at = now()",
    )
    assert daemon.components is not None
    await daemon.components.inactivity.run_once()
    alarm_id = await _value(dsn, "SELECT id FROM alarm WHERE device_id = 'dev-00'")
    assert isinstance(alarm_id, int)
    return alarm_id


async def _heard_again(dsn: str, port: int) -> None:
    await _publish(port, _telemetry({"metrics": {"t": 2}}, ts=T0 + 60_000)[:1])
    stored = "SELECT count(*) FROM telemetry"
    await wait_until(_count_is(dsn, stored, 2), timeout=60, message="heard again")


async def test_an_inactivity_alarm_whose_rule_a_reload_removed_clears_on_the_next_message(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = _configs(db_dsn, mosquitto.port, DOOR + SILENT)
    async with _two(configs) as daemons:
        alarm_id = await _offline_alarm(db_dsn, mosquitto.port, daemons[0])
        for daemon, config in zip(daemons, _configs(db_dsn, mosquitto.port, DOOR), strict=True):
            daemon.reload(config)  # the operator removes the rule
        await _heard_again(db_dsn, mosquitto.port)  # whichever node takes it
        cleared = await _value(db_dsn, "SELECT cleared_at FROM alarm WHERE id = $1", alarm_id)
    assert cleared is not None


async def test_an_inactivity_alarm_of_a_rule_removed_across_a_restart_clears_on_the_next_message(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    with_rule = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=DOOR + SILENT)
    async with running_daemon(with_rule) as daemon:
        alarm_id = await _offline_alarm(db_dsn, mosquitto.port, daemon)
    without = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=DOOR)
    async with running_daemon(without):
        await _heard_again(db_dsn, mosquitto.port)
        cleared = await _value(db_dsn, "SELECT cleared_at FROM alarm WHERE id = $1", alarm_id)
    assert cleared is not None


async def test_a_renamed_inactivity_rule_raises_no_second_alarm_for_the_same_silence(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """The alarm of the old key stands for the silence (a rule no longer configured as an
    inactivity rule); the device's next message clears it, and the renamed rule alarms the
    next silence."""
    configs = _configs(db_dsn, mosquitto.port, DOOR + SILENT)
    renamed = _configs(db_dsn, mosquitto.port, DOOR + SILENT.replace('"silent"', '"gone"'))
    async with _two(configs) as daemons:
        alarm_id = await _offline_alarm(db_dsn, mosquitto.port, daemons[0])
        for daemon, config in zip(daemons, renamed, strict=True):
            daemon.reload(config)
            assert daemon.components is not None
            assert await daemon.components.inactivity.run_once() == []
        await _heard_again(db_dsn, mosquitto.port)
        cleared = await _value(db_dsn, "SELECT cleared_at FROM alarm WHERE id = $1", alarm_id)
        await _execute(db_dsn, "UPDATE device SET presence_at = now(), presence = 'offline'")
        assert daemons[0].components is not None
        await daemons[0].components.inactivity.run_once()
        keys = await _value(db_dsn, "SELECT array_agg(rule_key ORDER BY id) FROM alarm")
    assert cleared is not None
    assert keys == ["silent", "gone"]


def _window_around_now() -> str:
    now = datetime.now(UTC)
    start, end = now - timedelta(hours=1), now + timedelta(hours=1)
    return (
        '\n[alarms]\ntimer_interval_s = 0.2\n\n[[alarms.quiet_hours.windows]]\ndevices = "dev-*"\n'
        f'start = "{start:%H:%M}"\nend = "{end:%H:%M}"\n'
    )


async def test_delayed_alarms_wake_when_a_reload_removes_the_quiet_hours_window(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = _configs(db_dsn, mosquitto.port, DOOR + _window_around_now())
    # A person's app gets the events: woken, the alarms reach someone and are pushed.
    async with events_subscriber(mosquitto.port), _two(configs) as daemons:
        await _publish(mosquitto.port, _telemetry({"events": [{"type": "DOOR_OPEN"}]}))
        delayed = "SELECT count(*) FROM alarm WHERE status = 'DELAYED'"
        await wait_until(_count_is(db_dsn, delayed, len(DEVICES)), timeout=60,
                         message="every door alarm held back by the window")  # fmt: skip
        no_window = _configs(db_dsn, mosquitto.port, DOOR + "\n[alarms]\ntimer_interval_s = 0.2\n")
        for daemon, config in zip(daemons, no_window, strict=True):
            daemon.reload(config)
        pushed = "SELECT count(*) FROM alarm WHERE status = 'PUSHED'"
        await wait_until(
            _count_is(db_dsn, pushed, len(DEVICES)),
            timeout=30,
            message="the alarms the removed window held are woken and pushed",
        )
    woken = await _value(
        db_dsn, "SELECT count(*) FROM alarm_audit WHERE action = 'wake' AND actor = $1",
        "system:quiet-hours",
    )  # fmt: skip
    assert woken == len(DEVICES)  # once each, though both nodes' timers looked


def _webhook(url: str) -> str:
    return (
        "\n[notify]\npoll_s = 0.1\nbackoff_min_s = 0.05\nbackoff_max_s = 0.2\n"
        f'[[notify.receivers]]\nname = "hook"\nkind = "webhook"\nurl = "{url}"\n'
        '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["hook"]\n'
    )


async def test_notifications_a_removed_quiet_hours_window_held_are_sent_when_it_goes(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    # No MQTT subscriber: the webhook is the only way the alarms reach a person. Its
    # deliveries were made due at the window's end (an hour away); the window removed by a
    # reload, the alarms are woken and their deliveries go at once, so they are pushed.
    async with webhook_server() as hook:
        held = DOOR + _webhook(hook.url("/hook")) + _window_around_now()
        async with _two(_configs(db_dsn, mosquitto.port, held)) as daemons:
            await _publish(mosquitto.port, _telemetry({"events": [{"type": "DOOR_OPEN"}]}))
            delayed = "SELECT count(*) FROM alarm WHERE status = 'DELAYED'"
            await wait_until(_count_is(db_dsn, delayed, len(DEVICES)), timeout=60,
                             message="every door alarm held back by the window")  # fmt: skip
            waiting = "SELECT count(*) FROM notify_delivery WHERE status = 'PENDING'"
            await wait_until(_count_is(db_dsn, waiting, len(DEVICES)), timeout=30,
                             message="their deliveries wait for the window's end")  # fmt: skip
            assert hook.on("/hook") == []
            free = DOOR + _webhook(hook.url("/hook")) + "\n[alarms]\ntimer_interval_s = 0.2\n"
            for daemon, config in zip(daemons, _configs(db_dsn, mosquitto.port, free), strict=True):
                daemon.reload(config)
            pushed = "SELECT count(*) FROM alarm WHERE status = 'PUSHED'"
            await wait_until(
                _count_is(db_dsn, pushed, len(DEVICES)),
                timeout=30,
                message="the deliveries the removed window held are sent and push the alarms",
            )
        assert len(hook.on("/hook")) == len(DEVICES)


async def _states(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT rule_key, count(*) AS n FROM rule_state GROUP BY rule_key")
    finally:
        await conn.close()
    return {r["rule_key"]: r["n"] for r in rows}


async def test_a_node_with_fewer_rules_keeps_the_state_of_rules_a_live_node_runs(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    both = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-a",
                       extra=DOOR + SOS, mqtt_extra=SHARED)  # fmt: skip
    door_only = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-b",
                            extra=DOOR, mqtt_extra=SHARED)  # fmt: skip
    events = {"events": [{"type": "DOOR_OPEN"}, {"type": "SOS"}]}
    # The state of a rule nobody runs any more (an old configuration's).
    await _execute(
        db_dsn,
        "INSERT INTO rule_state (device_id, rule_key, rule_version) VALUES ('dev-00', 'gone', '')",
    )
    async with running_daemon(both):
        await _publish(mosquitto.port, _telemetry(events))
        sos = "SELECT count(*) FROM rule_state WHERE rule_key = 'sos'"
        await wait_until(_count_is(db_dsn, sos, len(DEVICES)), timeout=60, message="sos states")
        # Node A's start dropped the rule nobody runs, kept its own.
        assert await _states(db_dsn) == {"door": len(DEVICES), "sos": len(DEVICES)}
        with capture_logs() as logs:

            def differ() -> list[dict[str, object]]:
                return [e for e in logs if e["event"] == "rule_sets_differ"]

            async with running_daemon(door_only) as node_b:
                # Node B started (and dropped what no live node runs) before it was ready.
                assert await _states(db_dsn) == {"door": len(DEVICES), "sos": len(DEVICES)}
                assert len(differ()) == 1
                # A reload of B drops nothing of A's either (its pass logs again when done).
                node_b.reload(door_only)
                await wait_until(lambda: len(differ()) == 2, timeout=30,
                                 message="node B's reload pass ran")  # fmt: skip
                assert await _states(db_dsn) == {"door": len(DEVICES), "sos": len(DEVICES)}
                # And A goes on counting on its state.
                await _publish(mosquitto.port, _telemetry(events, ts=T0 + 1000))
                stored = "SELECT count(*) FROM telemetry"
                await wait_until(_count_is(db_dsn, stored, 2 * len(DEVICES)), timeout=60,
                                 message="second round stored")  # fmt: skip
                assert (await _states(db_dsn))["sos"] == len(DEVICES)
    for entry in differ():
        assert entry["kept_for_other_nodes"] == ["sos"]
        assert entry["nodes"] == ["node-a"]
    # Node A is gone (its heartbeat as old as a dead node's, without waiting for it): a node
    # that drops what no live node runs now drops the sos state.
    await _execute(
        db_dsn,
        "UPDATE node_rule_set SET heartbeat_at = now() - interval '10 minutes' "
        "WHERE node_id = 'node-a'",
    )
    async with running_daemon(door_only):
        assert await _states(db_dsn) == {"door": len(DEVICES)}


async def test_a_reconnect_reading_a_retained_offline_again_resurrects_no_closed_alarm(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    device = "dev-00"
    await _publish(mosquitto.port, [(TOPICS.device_status(device), b"offline")], retain=True)
    configs = _configs(db_dsn, mosquitto.port, SILENT)
    async with _two(configs) as daemons:
        presence = "SELECT count(*) FROM device WHERE presence = 'offline'"
        await wait_until(_count_is(db_dsn, presence, 1), timeout=30, message="offline stored")
        await wait_until(lambda: all(metric(d, "gateway_presence_updates_total") >= 1
                                     for d in daemons),
                         timeout=30, message="both nodes read the retained status")  # fmt: skip
        presence_at = await _value(db_dsn, "SELECT presence_at FROM device")
        pool = await create_pool(db_dsn, min_size=1, max_size=2)
        try:
            engine = AlarmEngine(rules=configs[0].rule_set(), node_id="t", metrics=Metrics())
            monitor = InactivityMonitor(pool=pool, engine=engine, interval_s=1)
            await monitor.run_once()  # whichever node raised it first, there is one
            alarm_id = await _value(db_dsn, "SELECT id FROM alarm WHERE rule_key = 'silent'")
            assert isinstance(alarm_id, int)
            service = AlarmService(pool, "t")
            await service.act(alarm_id, Action.HANDLE, actor="alice")
            await service.act(alarm_id, Action.CLOSE, actor="alice")

            # The broker restarts (its retained messages saved): both nodes reconnect,
            # subscribe again and read the retained `offline` again.
            seen = [metric(d, "gateway_presence_updates_total") for d in daemons]
            mosquitto.restart()
            await wait_until(
                lambda: all(
                    metric(d, "gateway_presence_updates_total") > s
                    for d, s in zip(daemons, seen, strict=True)
                ),
                timeout=60,
                message="both nodes read the retained status again",
            )
            # Nothing new was learnt: no new silence, no alarm for the one people closed.
            assert await monitor.run_once() == []
            assert await _value(db_dsn, "SELECT presence_at FROM device") == presence_at
        finally:
            await pool.close()
    alarms = await _value(db_dsn, "SELECT count(*) FROM alarm")
    assert alarms == 1
    status = await _value(db_dsn, "SELECT status FROM alarm")
    assert status == "CLOSED"
