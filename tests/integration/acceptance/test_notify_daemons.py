"""Notifications from real daemons: two nodes share the work and double nothing, a SIGKILL
mid-send loses nothing and doubles nothing, and a hanging receiver slows neither ingest, the
outbox publisher nor the other receivers (asserted by counts)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import aiomqtt
import asyncpg

from gateway.config import Config
from gateway.notify.service import NotifyService
from protocol import Topics
from sim.publisher import publish_many
from tests.support.daemon import (
    DaemonProcess,
    config_toml,
    count_rows,
    http_healthy,
    make_config,
    metric,
    running_daemon,
)
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.receivers import Received, WebhookServer, always, streamed, webhook_server
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1_767_225_600_000
DOOR = '[[rules]]\nkey = "door"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'


def _notify(
    server: WebhookServer,
    *,
    settings: str = "",
    receivers: str = "",
    poll_s: float = 0.1,
    events: Sequence[str] = ("alarm.created",),
) -> str:
    return f"""
[notify]
poll_s = {poll_s}
backoff_min_s = 0.05
backoff_max_s = 0.2
max_attempts = 20
{settings}

[[notify.receivers]]
name = "hook"
kind = "webhook"
url = "{server.url("/hook")}"
{receivers}

[[notify.routes]]
events = {json.dumps(list(events))}
receivers = ["hook"]
"""


def _doors(devices: list[str]) -> list[tuple[str, bytes]]:
    return [
        (TOPICS.telemetry(d), f'{{"ts": {T0 + n}, "events": [{{"type": "DOOR_OPEN"}}]}}'.encode())
        for n, d in enumerate(devices)
    ]


async def _publish(port: int, messages: list[tuple[str, bytes]]) -> None:
    async with aiomqtt.Client("127.0.0.1", port, max_inflight_messages=100) as client:
        await publish_many(client, messages, window=50)


async def _fetch(dsn: str, sql: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def _created_events(dsn: str) -> set[str]:
    rows = await _fetch(dsn, "SELECT event_id FROM outbox_event WHERE event_type = 'alarm.created'")
    return {str(r["event_id"]) for r in rows}


async def _all_sent(dsn: str, expected: int) -> bool:
    rows = await _fetch(dsn, "SELECT status FROM notify_delivery")
    return len(rows) == expected and all(r["status"] == "SENT" for r in rows)


async def _assert_consumed_once(dsn: str) -> None:
    """Every outbox event a route sends on (alarm.created here) consumed exactly once, no
    other event read at all; one delivery per (event, receiver)."""
    outbox = await _fetch(
        dsn, "SELECT event_id FROM outbox_event WHERE event_type = 'alarm.created'"
    )
    consumed = await _fetch(dsn, "SELECT event_id FROM consumed_event WHERE consumer = 'notify'")
    assert sorted(r["event_id"] for r in consumed) == sorted(r["event_id"] for r in outbox)
    pairs = await _fetch(dsn, "SELECT event_id, receiver FROM notify_delivery")
    assert len({(r["event_id"], r["receiver"]) for r in pairs}) == len(pairs)


async def test_two_nodes_deliver_every_event_split_between_them_and_double_none(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    devices = [f"door-{n:02d}" for n in range(12)]
    async with webhook_server(hook=lambda _n, _r: None) as server:  # hold until released
        configs = [
            make_config(
                dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}",
                mqtt_extra='shared_group = "alarms"',
                # Polling far off: the node that did not consume is woken by NOTIFY.
                extra=DOOR + _notify(server, settings="concurrency = 2", poll_s=300),
            )
            for n in range(2)
        ]  # fmt: skip
        async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
            await _publish(mosquitto.port, _doors(devices))
            # Two slots per node: a third request in flight at once is the other node's.
            await wait_until(
                lambda: server.in_flight.get("/hook", 0) >= 3, timeout=60, message="both send"
            )
            server.release.set()
            await wait_until(lambda: _all_sent(db_dsn, len(devices)), timeout=60)
            # A node counts a batch just after its commit: wait for the counters to reach it.
            outbox_events = len(devices)  # one alarm.created each, the only type routed

            def consumed() -> float:
                return sum(metric(d, "gateway_notify_events_consumed_total") for d in (one, two))

            await wait_until(lambda: consumed() >= outbox_events, timeout=60, message="consumed")
            assert consumed() == outbox_events  # the consumer doubled nothing, on either node
    expected = await _created_events(db_dsn)
    assert len(expected) == len(devices)
    assert {r.event_id for r in server.on("/hook")} == expected
    await _assert_consumed_once(db_dsn)
    senders = await _fetch(db_dsn, "SELECT sent_by, count(*) AS n FROM notify_delivery GROUP BY 1")
    by_node = {r["sent_by"]: r["n"] for r in senders}
    assert set(by_node) == {"node-0", "node-1"}, by_node
    assert sum(by_node.values()) == len(devices)


async def test_sigkill_while_deliveries_are_in_flight_loses_and_doubles_nothing(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    devices = [f"door-{n:02d}" for n in range(10)]
    http_port = free_port()
    async with webhook_server(hook=lambda _n, _r: None) as server:
        path = tmp_path / "gateway.toml"
        path.write_text(
            config_toml(
                dsn=db_dsn, mqtt_port=mosquitto.port, node_id="crash-node", http_port=http_port,
                extra=DOOR + _notify(
                    server, settings="concurrency = 2\nlease_s = 3", receivers="timeout_s = 2"
                ),
            )
        )  # fmt: skip
        process = DaemonProcess(path, tmp_path / "daemon.log")

        async def healthy() -> bool:
            assert process.alive(), process.log_tail()
            return await http_healthy(http_port)

        try:
            process.start()
            await wait_until(healthy, timeout=60, message="daemon healthy")
            await _publish(mosquitto.port, _doors(devices))
            await wait_until(
                lambda: server.in_flight.get("/hook", 0) >= 2, timeout=60, message="in flight"
            )
            process.kill()
            sending = await _fetch(
                db_dsn, "SELECT id FROM notify_delivery WHERE status = 'SENDING'"
            )
            assert sending, "the kill must land while deliveries are in flight"
            server.release.set()  # from now on the receiver answers at once
            process.start()
            await wait_until(healthy, timeout=60, message="daemon healthy again")
            await wait_until(
                lambda: _all_sent(db_dsn, len(devices)), timeout=90, message="all delivered"
            )
            assert process.terminate() == 0
        finally:
            process.cleanup()
    expected = await _created_events(db_dsn)
    assert len(expected) == len(devices)
    # At least once: every event reached the receiver, under its stable event id.
    assert {r.event_id for r in server.on("/hook")} == expected
    await _assert_consumed_once(db_dsn)
    rows = await _fetch(db_dsn, "SELECT event_id, attempts FROM notify_delivery")
    assert len(rows) == len(devices)
    assert {str(r["event_id"]) for r in rows} == expected
    # The ones in flight at the kill were sent again, a later attempt each.
    again = await _fetch(
        db_dsn,
        "SELECT attempts FROM notify_delivery WHERE id = ANY($1::bigint[])",
        [r["id"] for r in sending],
    )
    assert all(r["attempts"] >= 2 for r in again)


async def test_a_hanging_receiver_slows_neither_ingest_nor_the_outbox_nor_other_receivers(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    devices = [f"door-{n:02d}" for n in range(30)]
    plain = [
        (
            TOPICS.telemetry(f"meter-{n % 20}"),
            f'{{"ts": {T0 + n}, "metrics": {{"kwh": 1}}}}'.encode(),
        )
        for n in range(300)
    ]
    async with webhook_server(hang=lambda _n, _r: None) as server:
        notify = f"""
[notify]
poll_s = 0.1

[[notify.receivers]]
name = "hang"
kind = "webhook"
url = "{server.url("/hang")}"
concurrency = 2
timeout_s = 30

[[notify.receivers]]
name = "ok"
kind = "webhook"
url = "{server.url("/ok")}"

[[notify.routes]]
events = ["alarm.created"]
receivers = ["hang", "ok"]
"""
        config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=DOOR + notify)
        async with running_daemon(config) as daemon:
            await _publish(mosquitto.port, _doors(devices) + plain)
            total = len(devices) + len(plain)

            async def stored() -> bool:
                return await count_rows(db_dsn) == total

            await wait_until(stored, timeout=60, message="ingest stored everything")
            await wait_until(lambda: len(server.on("/ok")) == len(devices), timeout=60)
            await wait_until(lambda: _outbox_drained(db_dsn), timeout=60)
            await wait_until(lambda: server.in_flight.get("/hang") == 2, timeout=30)
            statuses = await _fetch(
                db_dsn,
                "SELECT status, count(*) AS n FROM notify_delivery WHERE receiver = 'hang' "
                "GROUP BY status",
            )
            assert {r["status"]: r["n"] for r in statuses} == {
                "SENDING": 2,
                "PENDING": len(devices) - 2,
            }
            assert server.peak_in_flight["/hang"] == 2
            assert metric(daemon, "gateway_notify_in_flight", {"receiver": "hang"}) == 2
            assert metric(daemon, "gateway_notify_pending") >= len(devices) - 2
            server.release.set()
            await wait_until(lambda: _all_sent(db_dsn, 2 * len(devices)), timeout=90)
    pushed = await _fetch(db_dsn, "SELECT status FROM alarm")
    assert [r["status"] for r in pushed] == ["PUSHED"] * len(devices)


async def _events_published(dsn: str) -> bool:
    rows = await _fetch(dsn, "SELECT count(*) AS n FROM outbox_event WHERE status <> 'PUBLISHED'")
    return bool(rows[0]["n"] == 0)


async def _outbox_drained(dsn: str) -> bool:
    rows = await _fetch(dsn, "SELECT count(*) AS n FROM outbox_event WHERE status <> 'PUBLISHED'")
    alarms = await _fetch(dsn, "SELECT count(*) AS n FROM alarm WHERE status <> 'PUSHED'")
    return rows[0]["n"] == 0 and alarms[0]["n"] == 0


async def test_a_reload_swaps_receivers_and_routes(db_dsn: str, mosquitto: Mosquitto) -> None:
    async with webhook_server() as server:

        def config(path: str) -> Config:
            receiver = (
                f'[[notify.receivers]]\nname = "r"\nkind = "webhook"\nurl = "{server.url(path)}"\n'
            )
            return make_config(
                dsn=db_dsn, mqtt_port=mosquitto.port,
                extra=DOOR + "[notify]\npoll_s = 0.1\n" + receiver
                + '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["r"]\n',
            )  # fmt: skip

        async with running_daemon(config("/before")) as daemon:
            await _publish(mosquitto.port, _doors(["door-a"]))
            await wait_until(lambda: len(server.on("/before")) == 1, timeout=30)
            daemon.reload(config("/after"))  # what SIGHUP does
            await _publish(mosquitto.port, _doors(["door-b"]))
            await wait_until(lambda: len(server.on("/after")) == 1, timeout=30)
    assert server.on("/before")[0].json["device_id"] == "door-a"
    assert server.on("/after")[0].json["device_id"] == "door-b"
    assert len(server.received) == 2


async def test_a_silence_stops_the_sends_and_nothing_else(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=2)
    try:
        silence = await NotifyService(pool).create_silence(
            rules=["door"], devices=None, severities=None,
            ends_at=datetime.now(UTC) + timedelta(hours=1), comment="", created_by="test",
        )  # fmt: skip
    finally:
        await pool.close()
    async with webhook_server() as server:
        config = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, extra=DOOR + _notify(server),
        )  # fmt: skip
        async with running_daemon(config):
            await _publish(mosquitto.port, _doors(["door-a", "door-b"]))

            async def silenced() -> bool:
                rows = await _fetch(db_dsn, "SELECT status, silence_id FROM notify_delivery")
                return len(rows) == 2 and all(
                    (r["status"], r["silence_id"]) == ("SILENCED", silence["id"]) for r in rows
                )

            await wait_until(silenced, timeout=30, message="both deliveries SILENCED")
            # The alarms are raised, published and audited as ever.
            await wait_until(lambda: _events_published(db_dsn), timeout=30)
    # Silenced, and with nobody subscribed to the events, they reached nobody: still NEW
    # (docs/behaviour.md §5), not pushed.
    alarms = await _fetch(db_dsn, "SELECT status FROM alarm")
    assert [r["status"] for r in alarms] == ["NEW", "NEW"]
    audit = await _fetch(db_dsn, "SELECT alarm_id, count(*) AS n FROM alarm_audit GROUP BY 1")
    assert len(audit) == 2
    assert all(r["n"] == 1 for r in audit)  # raised, nothing else
    assert server.received == []


async def test_every_event_a_route_may_name_reaches_the_webhook_from_a_real_daemon(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Each of the seven notification events, produced by the daemon's own machinery (a rule,
    the reminder and escalation timers, people's actions over the API, the reaper failing a
    command the device never answered, the settler aborting its campaign), routed and sent."""
    events = [
        "alarm.created", "alarm.reminder", "alarm.escalated", "alarm.cleared", "alarm.closed",
        "command.failed", "campaign.aborted",
    ]  # fmt: skip
    hot = '[[rules]]\nkey = "temp-high"\nkind = "threshold"\nmetric = "temp"\nop = ">"\n'
    hot += 'value = 80\nclear_value = 75\nseverity = "CRITICAL"\n'
    timers = """
[alarms]
escalate_after_s = 1
repeat_interval_s = 1
timer_interval_s = 0.2

[commands]
ack_window_s = 1
reaper_interval_s = 0.2

[[api.tokens]]
name = "olga"
token = "operator-token-0123456789abcdef"
role = "operator"
"""
    async with webhook_server() as server:
        notify = _notify(server, events=events)
        http_port = free_port()
        config = make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port, extra=hot + timers + notify
        )

        def got(event: str) -> list[dict[str, object]]:
            return [r.json for r in server.on("/hook") if r.json["event"] == event]

        async def until_sent(*wanted: str) -> None:
            await wait_until(
                lambda: all(got(e) for e in wanted), timeout=60, message=f"{wanted} sent"
            )

        base = f"http://127.0.0.1:{http_port}"
        auth = {"Authorization": "Bearer operator-token-0123456789abcdef"}
        async with running_daemon(config), aiohttp.ClientSession(base, headers=auth) as http:

            async def post(path: str, body: object) -> dict[str, object]:
                async with http.post(path, json=body) as reply:
                    assert reply.status in (200, 201), (path, reply.status, await reply.text())
                    answer: dict[str, object] = await reply.json()
                    return answer

            hot_sample = f'{{"ts": {T0}, "metrics": {{"temp": 93}}}}'.encode()
            await _publish(mosquitto.port, [(TOPICS.telemetry("boiler-1"), hot_sample)])
            await until_sent("alarm.created", "alarm.reminder")  # PUSHED and not confirmed
            [created] = got("alarm.created")
            alarm_id = created["alarm_id"]
            await post(f"/alarms/{alarm_id}/confirm", {})
            await until_sent("alarm.escalated")  # confirmed, not handled within 1 s
            cool_sample = f'{{"ts": {T0 + 1}, "metrics": {{"temp": 70}}}}'.encode()
            await _publish(mosquitto.port, [(TOPICS.telemetry("boiler-1"), cool_sample)])
            await until_sent("alarm.cleared")
            await post(f"/alarms/{alarm_id}/handle", {})
            await post(f"/alarms/{alarm_id}/close", {})
            await until_sent("alarm.closed")
            # Nobody answers valve-1: the ack window fails the command, which aborts the
            # campaign (one finished, all failed).
            await post(
                "/campaigns",
                {
                    "name": "reboot",
                    "targets": {"devices": ["valve-1"]},
                    "abort": {"failure_ratio": 0.5, "min_finished": 1},
                },
            )
            await until_sent("command.failed", "campaign.aborted")

            # The webhook has the last request before the worker has its answer and marks the
            # delivery SENT; a stop in between leaves it to be sent again at the next start.
            async def all_marked_sent() -> bool:
                rows = await _fetch(db_dsn, "SELECT status FROM notify_delivery")
                return bool(rows) and all(r["status"] == "SENT" for r in rows)

            await wait_until(all_marked_sent, timeout=30, message="every delivery marked SENT")
    for event in events:
        assert got(event), event
    alarm_events = [e for e in events if e.startswith("alarm.")]
    for event in alarm_events:
        assert {(b["device_id"], b["alarm_id"]) for b in got(event)} == {("boiler-1", alarm_id)}
    assert {b["device_id"] for b in got("command.failed")} == {"valve-1"}
    # One delivery per (event, receiver), each sent once: nothing doubled.
    deliveries = await _fetch(db_dsn, "SELECT event_id, status FROM notify_delivery")
    assert all(r["status"] == "SENT" for r in deliveries)
    assert len({r["event_id"] for r in deliveries}) == len(deliveries)


def _peak_and_rss_mib(pid: int) -> tuple[float, float]:
    """The process's peak resident set (``VmHWM``) and its resident set now, in MiB: the peak
    is what a body held whole for a moment would show, however soon it was freed."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmHWM", "VmRSS"))  # type: ignore[return-value]  # two kB figures


BIG_BODY = 100 * 1024 * 1024


async def test_a_receiver_answering_a_huge_error_body_costs_no_memory_and_delays_no_other(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """A receiver answering 500 with 100 MB: only the first bytes are read (the connection is
    closed, not drained), so the daemon's peak memory barely moves and the healthy receiver
    gets every event. Speed is for the report, not asserted here."""
    http_port = free_port()
    received_at: dict[str, float] = {}

    def ok(_n: int, got: Received) -> int:
        received_at[got.event_id] = time.monotonic()
        return 200

    async with webhook_server(big=always(500), ok=ok) as server:
        server.answers["/big"] = streamed(BIG_BODY)
        notify = f"""
[notify]
poll_s = 0.1
backoff_min_s = 0.05
backoff_max_s = 0.2
max_attempts = 2

[[notify.receivers]]
name = "big"
kind = "webhook"
url = "{server.url("/big")}"
timeout_s = 30

[[notify.receivers]]
name = "ok"
kind = "webhook"
url = "{server.url("/ok")}"

[[notify.routes]]
devices = "warm-*"
receivers = ["ok"]

[[notify.routes]]
receivers = ["big", "ok"]
"""
        path = tmp_path / "gateway.toml"
        path.write_text(
            config_toml(
                dsn=db_dsn, mqtt_port=mosquitto.port, node_id="big-body", http_port=http_port,
                extra=DOOR + notify,
            )
        )  # fmt: skip
        process = DaemonProcess(path, tmp_path / "daemon.log")
        try:
            process.start()
            await wait_until(lambda: http_healthy(http_port), timeout=60, message="healthy")
            assert process.process is not None
            pid = process.process.pid
            # Warm up the whole path (alarm, outbox, consumer, the HTTP client) first.
            await _publish(mosquitto.port, _doors(["warm-0"]))
            await wait_until(lambda: len(server.on("/ok")) == 1, timeout=60, message="warm-up")
            peak_before, rss_before = _peak_and_rss_mib(pid)
            devices = [f"door-{n:02d}" for n in range(4)]
            published = time.monotonic()
            await _publish(mosquitto.port, _doors(devices))
            await wait_until(
                lambda: len(server.on("/ok")) == 1 + len(devices), timeout=90, message="ok got all"
            )

            async def big_failed() -> bool:
                rows = await _fetch(
                    db_dsn, "SELECT status FROM notify_delivery WHERE receiver = 'big'"
                )
                return len(rows) == len(devices) and all(r["status"] == "FAILED" for r in rows)

            await wait_until(big_failed, timeout=180, message="big's deliveries FAILED")
            peak_after, rss_after = _peak_and_rss_mib(pid)
            assert process.terminate() == 0
        finally:
            process.cleanup()
    lags = sorted(received_at[e] - published for e in list(received_at)[1:])
    print(
        f"\nbig-body: VmHWM {peak_before:.1f} -> {peak_after:.1f} MiB, "
        f"VmRSS {rss_before:.1f} -> {rss_after:.1f} MiB, "
        f"ok lag after publish: min {lags[0]:.2f} s, max {lags[-1]:.2f} s"
    )
    assert len(server.on("/big")) == 2 * len(devices)  # every attempt was made, and answered
    rows = await _fetch(db_dsn, "SELECT last_error FROM notify_delivery WHERE receiver = 'big'")
    assert all(r["last_error"] == "HTTP 500: " + "x" * 200 for r in rows), rows[0]
    assert peak_after - peak_before < 30, (peak_before, peak_after)


async def test_two_daemons_send_one_grouped_delivery_for_a_window_and_it_pushes_every_alarm(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Twenty door alarms ingested and consumed by two daemons sharing the work: one window of
    the route's group, one webhook request listing all twenty; the alarms stay NEW (nobody
    subscribes to the events) until the receiver accepts that request, then all are PUSHED.
    The window's group_wait is long; once every alarm is in it, its due time is moved to now,
    as the clock would."""
    devices = [f"door-{n:02d}" for n in range(20)]
    grouped = 'group_by = ["rule"]\ngroup_wait_s = 600\n'
    async with webhook_server() as server:
        notify = _notify(server, poll_s=0.1).replace(
            'receivers = ["hook"]\n', 'receivers = ["hook"]\n' + grouped
        )
        configs = [
            make_config(
                dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}",
                mqtt_extra='shared_group = "alarms"', extra=DOOR + notify,
            )
            for n in range(2)
        ]  # fmt: skip
        async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
            await _publish(mosquitto.port, _doors(devices))

            async def all_in_the_window() -> bool:
                rows = await _fetch(
                    db_dsn,
                    "SELECT (body ->> 'count')::int AS n FROM notify_delivery "
                    "WHERE event = 'notify.group'",
                )
                return [r["n"] for r in rows] == [len(devices)]

            await wait_until(all_in_the_window, timeout=60, message="every alarm in one window")
            statuses = await _fetch(db_dsn, "SELECT DISTINCT status FROM alarm")
            assert [r["status"] for r in statuses] == ["NEW"]
            assert server.on("/hook") == []
            await _fetch(
                db_dsn,
                "UPDATE notify_delivery SET next_attempt_at = now() WHERE event = 'notify.group'",
            )
            await wait_until(lambda: _all_sent(db_dsn, 1), timeout=60, message="window sent")

            def consumed() -> float:
                return sum(metric(d, "gateway_notify_events_consumed_total") for d in (one, two))

            await wait_until(lambda: consumed() >= len(devices), timeout=60, message="consumed")
            assert consumed() == len(devices)

            async def all_pushed() -> bool:
                rows = await _fetch(db_dsn, "SELECT DISTINCT status FROM alarm")
                return [r["status"] for r in rows] == ["PUSHED"]

            await wait_until(all_pushed, timeout=30, message="every alarm pushed by the window")
    [request] = server.on("/hook")
    body = request.json
    assert (body["kind"], body["count"], body["group"]) == ("group", 20, {"rule": "door"})
    listed = {n["device_id"] for n in body["notifications"]}
    assert listed == set(devices)
    assert {n["event_id"] for n in body["notifications"]} == await _created_events(db_dsn)
    await _assert_consumed_once(db_dsn)
    notes = await _fetch(db_dsn, "SELECT note FROM alarm_audit WHERE action = 'push'")
    assert len(notes) == len(devices)
    assert all("grouped delivery" in r["note"] for r in notes)
