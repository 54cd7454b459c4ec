"""PUSHED means a person really received the alarm (docs/behaviour.md §5), on two real daemons:
a PUBACK saying nobody was subscribed (MQTT 5, 0x10) pushes nothing and, with no receiver
either, the alarm stays NEW and is counted unreached once; an MQTT subscriber on the events
topic, a webhook answering 2xx, or a console ``/stream`` session (on another node than the one
that raised the alarm) that wrote the alarm's creation to its client, pushes it, the audit note
naming the channel; a stream refused, or closed before the alarm was made, pushes nothing; a
webhook that fails until FAILED leaves it NEW and shows the failed delivery on its audit
trail."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import aiomqtt
import asyncpg

from gateway.config import Config
from gateway.runtime.daemon import Daemon
from protocol import Topics
from tests.support.api_client import VIEWER
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.receivers import WebhookServer, always, smtp_server, webhook_server
from tests.support.sse import SseStream, open_stream
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
DEVICE = "door-1"
DOOR = '[[rules]]\nkey = "door"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'
SAMPLE = b'{"ts": 1767225600000, "events": [{"type": "DOOR_OPEN"}]}'
# Fast timers: the unreached bound is short so the test waits little for it.
ALARMS = "\n[alarms]\ntimer_interval_s = 0.1\nunreached_after_s = {after}\n"
WALL = f'\n[[api.tokens]]\ntoken = "{VIEWER}"\nrole = "viewer"\nname = "control-room"\n'


def _notify(server: WebhookServer, *, max_attempts: int = 5) -> str:
    return f"""
[notify]
poll_s = 0.1
backoff_min_s = 0.05
backoff_max_s = 0.1
max_attempts = {max_attempts}

[[notify.receivers]]
name = "hook"
kind = "webhook"
url = "{server.url("/hook")}"

[[notify.routes]]
events = ["alarm.created"]
receivers = ["hook"]
"""


@contextlib.asynccontextmanager
async def _two_nodes(
    db_dsn: str, mosquitto: Mosquitto, extra: str
) -> AsyncIterator[tuple[Daemon, Daemon]]:
    configs = [
        make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}",
            mqtt_extra='shared_group = "alarms"', extra=DOOR + extra,
        )
        for n in range(2)
    ]  # fmt: skip
    async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
        yield one, two


async def _door_opens(port: int) -> None:
    async with aiomqtt.Client("127.0.0.1", port) as client:
        await client.publish(TOPICS.telemetry(DEVICE), SAMPLE, qos=1)


async def _fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


async def _alarm(dsn: str) -> asyncpg.Record | None:
    rows = await _fetch(dsn, "SELECT id, status, unreached_at FROM alarm")
    assert len(rows) <= 1
    return rows[0] if rows else None


async def _created_published(dsn: str) -> bool:
    rows = await _fetch(dsn, "SELECT status FROM outbox_event WHERE event_type = 'alarm.created'")
    return [r["status"] for r in rows] == ["PUBLISHED"]


async def _status_is(dsn: str, status: str) -> bool:
    alarm = await _alarm(dsn)
    return alarm is not None and alarm["status"] == status


async def _audit(dsn: str) -> list[asyncpg.Record]:
    return await _fetch(dsn, "SELECT actor, action, from_status, to_status, note FROM alarm_audit")


async def test_no_subscriber_and_no_receiver_leaves_the_alarm_new_and_counted_unreached(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with _two_nodes(db_dsn, mosquitto, ALARMS.format(after=1.0)) as nodes:
        await _door_opens(mosquitto.port)
        # The broker took the event (PUBACK 0x10, no matching subscribers): it is published...
        await wait_until(lambda: _created_published(db_dsn), message="alarm.created published")
        # ... and nobody got it: the alarm stays NEW until the bound, then is found unreached.
        alarm = await _alarm(db_dsn)
        assert alarm is not None
        assert alarm["status"] == "NEW"

        def unreached() -> float:
            return sum(metric(node, "gateway_alarms_unreached_total") for node in nodes)

        await wait_until(lambda: unreached() >= 1, message="the alarm counted unreached")
        # Several passes on each node later, it is still counted once, by one node.
        passes = [node.components.timers for node in nodes if node.components is not None]
        for timers in passes:
            assert (await timers.run_once()).unreached == []
        assert unreached() == 1
    alarm = await _alarm(db_dsn)
    assert alarm is not None
    assert alarm["status"] == "NEW"
    assert alarm["unreached_at"] is not None
    audit = await _audit(db_dsn)
    assert [(r["action"], r["to_status"]) for r in audit] == [
        ("create", "NEW"),
        ("unreached", "NEW"),
    ]


async def test_a_subscriber_on_the_events_topic_gets_the_alarm_pushed(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with (
        aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="operator-app") as subscriber,
        _two_nodes(db_dsn, mosquitto, ALARMS.format(after=0)),
    ):
        await subscriber.subscribe("iot/events/#", qos=1)
        await _door_opens(mosquitto.port)
        async with asyncio.timeout(30):
            async for message in subscriber.messages:
                if b'"alarm.created"' in bytes(message.payload):  # type: ignore[arg-type]
                    break
        await wait_until(lambda: _status_is(db_dsn, "PUSHED"), message="the alarm pushed")
    pushes = [r for r in await _audit(db_dsn) if r["action"] == "push"]
    assert len(pushes) == 1
    assert pushes[0]["actor"] == "system:outbox"
    assert pushes[0]["note"].startswith("reached via MQTT: iot/events/alarm/")


async def test_a_webhook_answering_2xx_pushes_the_alarm_without_any_mqtt_subscriber(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with (
        webhook_server(hook=always(204)) as server,
        _two_nodes(db_dsn, mosquitto, _notify(server) + ALARMS.format(after=0)) as nodes,
    ):
        await _door_opens(mosquitto.port)
        await wait_until(lambda: _status_is(db_dsn, "PUSHED"), message="the alarm pushed")
        assert len(server.on("/hook")) == 1
        transitions = {"from_status": "NEW", "to_status": "PUSHED"}
        await wait_until(
            lambda: (
                sum(metric(n, "gateway_alarm_transitions_total", transitions) for n in nodes) == 1
            ),
            message="the push counted by the node that made it",
        )
    pushes = [r for r in await _audit(db_dsn) if r["action"] == "push"]
    assert len(pushes) == 1
    assert pushes[0]["actor"] == "system:notify"
    assert pushes[0]["note"].startswith("reached via webhook receiver hook (delivery ")


async def test_a_mail_the_smtp_server_accepted_pushes_the_alarm(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    mail = f"""
[notify]
poll_s = 0.1

[[notify.receivers]]
name = "ops-mail"
kind = "email"
host = "127.0.0.1"
port = {{port}}
from = "gateway@example.com"
to = ["ops@example.com"]

[[notify.routes]]
events = ["alarm.created"]
receivers = ["ops-mail"]
{ALARMS.format(after=0)}"""
    with smtp_server() as smtp:
        async with _two_nodes(db_dsn, mosquitto, mail.format(port=smtp.port)):
            await _door_opens(mosquitto.port)
            await wait_until(lambda: _status_is(db_dsn, "PUSHED"), message="the alarm pushed")
        assert len(smtp.handler.mails) == 1
    pushes = [r for r in await _audit(db_dsn) if r["action"] == "push"]
    assert [(r["actor"], r["note"].split(" (")[0]) for r in pushes] == [
        ("system:notify", "reached via email receiver ops-mail")
    ]


async def test_a_webhook_failing_until_failed_leaves_the_alarm_new_and_shows_on_it(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    async with (
        webhook_server(hook=always(500)) as server,
        _two_nodes(db_dsn, mosquitto, _notify(server, max_attempts=2) + ALARMS.format(after=0)),
    ):
        await _door_opens(mosquitto.port)

        async def failed() -> bool:
            rows = await _fetch(db_dsn, "SELECT status FROM notify_delivery")
            return [r["status"] for r in rows] == ["FAILED"]

        await wait_until(failed, message="the delivery FAILED")
        assert len(server.on("/hook")) == 2
        assert await _created_published(db_dsn)
    alarm = await _alarm(db_dsn)
    assert alarm is not None
    assert alarm["status"] == "NEW"
    [error] = await _fetch(db_dsn, "SELECT last_error FROM notify_delivery")
    failures = [r for r in await _audit(db_dsn) if r["action"] == "notify_failed"]
    assert [(r["actor"], r["from_status"], r["to_status"]) for r in failures] == [
        ("system:notify", "NEW", "NEW")
    ]
    assert failures[0]["note"] == f"notification failed: receiver hook: {error['last_error']}"


@contextlib.asynccontextmanager
async def _apart(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, extra: str = ALARMS.format(after=0)
) -> AsyncIterator[tuple[Daemon, Daemon]]:
    """Node A on the test's broker (it raises the door's alarm), node B on a broker of its own
    (it never sees the sample): whatever B does with the alarm, it learnt from the database."""
    other = Mosquitto(tmp_path / "broker-b")
    other.start()
    try:
        config_a, config_b = _apart_configs(db_dsn, mosquitto.port, other.port, extra)
        async with running_daemon(config_a) as a, running_daemon(config_b) as b:
            yield a, b
    finally:
        other.stop()


def _apart_configs(dsn: str, port_a: int, port_b: int, extra: str) -> list[Config]:
    return [
        make_config(dsn=dsn, mqtt_port=port, node_id=node, extra=DOOR + WALL + extra)
        for node, port in (("node-a", port_a), ("node-b", port_b))
    ]


def _base(node: Daemon) -> str:
    return f"http://127.0.0.1:{node.http_port}"


async def _pushes(dsn: str) -> list[asyncpg.Record]:
    return await _fetch(
        dsn, "SELECT actor, node_id, note FROM alarm_audit WHERE action = 'push' ORDER BY id"
    )


async def _created(stream: SseStream) -> int:
    while True:
        event = await stream.next(timeout=60)
        if event.event == "alarm.created":
            return int(event.data["aggregate_id"])


async def test_a_console_stream_on_another_node_gets_the_alarm_pushed(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        _apart(db_dsn, mosquitto, tmp_path) as (_, node_b),
        open_stream(http, _base(node_b), token=VIEWER) as stream,
    ):
        await stream.live()
        await _door_opens(mosquitto.port)
        alarm_id = await _created(stream)  # node B wrote it to its client...
        # ... and so it reached a person: pushed, by node B, although node A raised it.
        await wait_until(lambda: _status_is(db_dsn, "PUSHED"), message="the alarm pushed")
    [raised] = await _fetch(db_dsn, "SELECT id, node_id FROM alarm")
    assert (raised["id"], raised["node_id"]) == (alarm_id, "node-a")
    pushes = await _pushes(db_dsn)
    assert [tuple(r) for r in pushes] == [
        ("system:stream", "node-b", "reached via console stream (token control-room)")
    ]


async def test_the_same_alarm_stays_new_until_a_stream_writes_it_and_is_pushed_once(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Nobody: no receiver, no MQTT subscriber (MQTT 5 PUBACK 0x10), no stream: NEW. A stream
    refused, or closed before the alarm was made, changes nothing. Then two clients on both
    nodes resume from before the alarm and write its creation: it is pushed, once."""
    async with aiohttp.ClientSession() as http, _apart(db_dsn, mosquitto, tmp_path) as nodes:
        node_a, node_b = nodes
        hubs = [node.services.stream_hub for node in nodes]
        # Refused: a token that is not configured.
        async with http.get(
            f"{_base(node_b)}/stream", headers={"Authorization": "Bearer not-a-token-at-all"}
        ) as refused:
            assert refused.status == 401
        # Closed by its client before the alarm exists.
        async with open_stream(http, _base(node_b), token=VIEWER) as early:
            await early.live()
        await wait_until(
            lambda: all(hub is not None and hub.streams == 0 for hub in hubs),
            message="no stream open on either node",
        )
        await _door_opens(mosquitto.port)
        await wait_until(lambda: _created_published(db_dsn), message="alarm.created published")
        alarm = await _alarm(db_dsn)
        assert alarm is not None
        assert alarm["status"] == "NEW"
        assert await _pushes(db_dsn) == []

        # Two clients, one per node, resume from the start: both write the creation.
        async with (
            open_stream(http, _base(node_a), token=VIEWER, last_event_id="0:0") as on_a,
            open_stream(http, _base(node_b), token=VIEWER, last_event_id="0:0") as on_b,
        ):
            assert await _created(on_a) == await _created(on_b) == alarm["id"]
            await wait_until(lambda: _status_is(db_dsn, "PUSHED"), message="the alarm pushed")
            transitions = {"from_status": "NEW", "to_status": "PUSHED"}
            await wait_until(
                lambda: (
                    sum(metric(n, "gateway_alarm_transitions_total", transitions) for n in nodes)
                    == 1
                ),
                message="the push counted once, by the node that made it",
            )
    pushes = await _pushes(db_dsn)
    assert len(pushes) == 1
    assert pushes[0]["actor"] == "system:stream"
    assert pushes[0]["note"] == "reached via console stream (token control-room)"


def _quiet_now() -> str:
    now = datetime.now(UTC)
    start, end = now - timedelta(hours=1), now + timedelta(hours=1)
    return (
        '\n[alarms]\ntimer_interval_s = 0.1\n\n[[alarms.quiet_hours.windows]]\ndevices = "door-*"\n'
        f'start = "{start:%H:%M}"\nend = "{end:%H:%M}"\n'
    )


async def test_inside_quiet_hours_a_stream_does_not_push_and_the_wake_up_it_writes_does(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """The console lists an alarm that quiet hours hold back, and that does not push it: it
    ends DELAYED (the hub-level test pins the stream's side without the outbox publisher's
    race). When the window goes (a reload), the alarm is woken, and the stream that writes
    ``alarm.woken`` pushes it: no MQTT subscriber, no receiver, only the console."""
    async with (
        aiohttp.ClientSession() as http,
        _apart(db_dsn, mosquitto, tmp_path, _quiet_now()) as nodes,
        open_stream(http, _base(nodes[1]), token=VIEWER) as stream,
    ):
        await stream.live()
        await _door_opens(mosquitto.port)
        alarm_id = await _created(stream)
        await wait_until(lambda: _status_is(db_dsn, "DELAYED"), message="the alarm held back")
        port_a, port_b = (node.config.mqtt.port for node in nodes)
        no_window = _apart_configs(db_dsn, port_a, port_b, ALARMS.format(after=0))
        for node, config in zip(nodes, no_window, strict=True):
            node.reload(config)
        while (woken := await stream.next(timeout=60)).event != "alarm.woken":
            pass
        assert woken.data["aggregate_id"] == str(alarm_id)
        await wait_until(lambda: _status_is(db_dsn, "PUSHED"), message="the woken alarm pushed")
    pushes = await _pushes(db_dsn)
    assert [tuple(r) for r in pushes] == [
        ("system:stream", "node-b", "reached via console stream (token control-room)")
    ]
