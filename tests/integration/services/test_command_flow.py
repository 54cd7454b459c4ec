"""Commands end to end: daemons dispatch, simulated devices answer, receipts are applied."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import aiomqtt
import asyncpg

from gateway.commands.lifecycle import cancel
from gateway.domain.command import Delivery
from protocol import Topics
from sim.responder import Behaviour, Responder, Script
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
FAST = "lease_s = 10\nack_window_s = 30\nreaper_interval_s = 1"


async def _create_many(dsn: str, devices: list[str], per_device: int) -> list[int]:
    conn = await asyncpg.connect(dsn)
    ids = []
    try:
        async with conn.transaction():
            for n in range(per_device):
                for device in devices:
                    created = await new_command(
                        conn, device_id=device, name="set", params={"n": n},
                        delivery=Delivery.REALTIME, idempotency_key=None, actor="test",
                        node_id="test", expire_after_s=3600,
                    )  # fmt: skip
                    ids.append(created.command.id)
    finally:
        await conn.close()
    return ids


async def _open(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM command WHERE status IN ('PENDING', 'CLAIMED', 'SENT')"
            )
        )
    finally:
        await conn.close()


async def test_commands_are_dispatched_answered_and_acked_is_not_success(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=f"[commands]\n{FAST}\n")
    script = Script(by_device={"dev-bad": Behaviour.FAIL_CODE, "dev-dup": Behaviour.DUPLICATE})
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=script)
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop))
    try:
        await responder.wait_subscribed()
        async with running_daemon(config):
            await _create_many(db_dsn, ["dev-ok", "dev-bad", "dev-dup"], per_device=3)

            async def finished() -> bool:
                return await _open(db_dsn) == 0

            await wait_until(finished, timeout=60, message="every command finished")
    finally:
        stop.set()
        await answering
    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetch(
            "SELECT device_id, status, result_code, raw_result_code FROM command"
        )
        duplicated = await conn.fetchval(
            "SELECT count(*) FROM command_receipt WHERE outcome = 'duplicated'"
        )
    finally:
        await conn.close()
    by_device: dict[str, set[str]] = {}
    for row in rows:
        by_device.setdefault(row["device_id"], set()).add(row["status"])
    assert by_device == {"dev-ok": {"ACKED"}, "dev-bad": {"FAILED"}, "dev-dup": {"ACKED"}}
    assert {r["raw_result_code"] for r in rows if r["device_id"] == "dev-bad"} == {"E-17"}
    assert duplicated == 3  # every second answer of dev-dup: kept, not applied


async def test_two_daemons_1000_commands_to_100_devices(db_dsn: str, mosquitto: Mosquitto) -> None:
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}",
                    mqtt_extra='shared_group = "cmd"', extra=f"[commands]\n{FAST}\n")
        for n in (1, 2)
    ]  # fmt: skip
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=Script())
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop))
    devices = [f"dev-{n:03d}" for n in range(100)]
    try:
        await responder.wait_subscribed()
        async with running_daemon(configs[0]), running_daemon(configs[1]):
            await _create_many(db_dsn, devices, per_device=10)

            async def finished() -> bool:
                return await _open(db_dsn) == 0

            await wait_until(finished, timeout=120, message="1000 commands finished")
    finally:
        stop.set()
        await answering
    conn = await asyncpg.connect(db_dsn)
    try:
        statuses = await conn.fetch("SELECT status, count(*) AS n FROM command GROUP BY status")
        acked_twice = await conn.fetchval(
            "SELECT count(*) FROM (SELECT command_id FROM command_audit WHERE to_status = 'ACKED' "
            "GROUP BY command_id HAVING count(*) > 1) AS twice"
        )
        stale_applied = await conn.fetchval(
            "SELECT count(*) FROM command_receipt r JOIN command c ON c.id = r.command_id "
            "WHERE r.outcome = 'accepted' AND r.claim_generation <> c.claim_generation"
        )
        out_of_order = await conn.fetchval(
            "SELECT count(*) FROM command a JOIN command b "
            "ON a.device_id = b.device_id AND a.id < b.id WHERE b.sent_at < a.finished_at"
        )
        nodes = await conn.fetchval("SELECT count(DISTINCT claimed_node_id) FROM command")
    finally:
        await conn.close()
    assert {r["status"]: r["n"] for r in statuses} == {"ACKED": 1000}
    assert acked_twice == 0
    assert stale_applied == 0
    assert out_of_order == 0  # one in flight per device, in creation order
    assert nodes == 2  # both daemons dispatched


async def _status(db: asyncpg.Connection, command_id: int) -> str:
    return str(await db.fetchval("SELECT status FROM command WHERE id = $1", command_id))


async def test_every_transition_is_counted_as_it_is_audited(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    """gateway_command_transitions_total{from,to} equals the command_audit rows (from, to).

    Commands go through the daemon only: created, cancelled and unbound through its API,
    dispatched to devices on the broker, answered or not, requeued, reaped. The tests move
    only the clocks the reaper reads (sent_at, timeout_at, expire_at) to choose its path.
    """
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port,
        extra=(f'[[api.tokens]]\ntoken = "{OPERATOR}"\nrole = "operator"\nname = "console"\n'
               "[commands]\nlease_s = 30\nack_window_s = 600\nreaper_interval_s = 0.2\n"),
    )  # fmt: skip
    script = Script(
        default=Behaviour.NO_ANSWER,
        by_device={"ok": Behaviour.SUCCESS, "nak": Behaviour.FAIL_CODE,
                   "slow": Behaviour.SENT_THEN_ACK, "away": Behaviour.OFFLINE},
    )  # fmt: skip
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=script)
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop))
    try:
        await responder.wait_subscribed()
        async with running_daemon(config) as daemon, aiohttp.ClientSession() as http:
            api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)

            async def create(device: str, delivery: str = "realtime") -> int:
                reply = await api.call("POST", f"/devices/{device}/commands", token=OPERATOR,
                                       json={"name": "set", "delivery": delivery})  # fmt: skip
                assert reply.status == 201, reply.body
                return int(reply.body["command"]["id"])

            async def reaches(command_id: int, *statuses: str) -> None:
                async def there() -> bool:
                    return await _status(db, command_id) in statuses

                await wait_until(there, timeout=60, message=f"command {command_id} {statuses}")

            async def cancel(command_id: int) -> dict[str, Any]:
                reply = await api.call("POST", f"/commands/{command_id}/cancel", token=OPERATOR)
                assert reply.status == 200, reply.body
                return dict(reply.body)

            async def clock(command_id: int, column: str) -> None:
                await db.execute(
                    f"UPDATE command SET {column} = now() - interval '10 minutes' "  # noqa: S608 - a column name of the test's own
                    "WHERE id = $1",
                    command_id,
                )

            # Answered: ACKED, FAILED (a failure code), SENT then ACKED.
            answered = [await create(d) for d in ("ok", "ok", "nak", "slow")]
            # A silent device: one SENT, two queued behind it (one in flight per device).
            a1, a2, a3 = [await create("mute-a") for _ in range(3)]
            await reaches(a1, "SENT")
            await cancel(a3)  # PENDING -> CANCELLED
            await clock(a2, "expire_at")
            await reaches(a2, "TIMEOUT")  # the reaper: PENDING -> TIMEOUT
            await clock(a1, "timeout_at")
            await reaches(a1, "FAILED")  # the reaper: SENT -> FAILED, timeout_at passed
            # No receipt within the ack window: the node answers TIMEOUT for the device, once
            # it has listened for the whole window (it started seconds ago): the clock it
            # measures its listening by is moved on, as the command's clocks are.
            assert daemon.components is not None
            reaper, moved = daemon.components.reaper, [0.0]
            reaper.clock = lambda: time.monotonic() + moved[0]
            await wait_until(lambda: reaper.heard_for_s() > 0, message="the reaper listening")
            moved[0] = 600.0
            b1 = await create("mute-b")
            await reaches(b1, "SENT")
            await clock(b1, "sent_at")
            await reaches(b1, "FAILED")  # realtime: SENT -> FAILED
            c1 = await create("mute-c", "deferrable")
            await reaches(c1, "SENT")
            await clock(c1, "sent_at")

            async def requeued() -> bool:
                retries = await db.fetchval("SELECT retry_count FROM command WHERE id = $1", c1)
                return bool(retries)

            await wait_until(requeued, message="the deferrable command requeued")
            c2 = await create("mute-c")
            # Cancelled in flight, then the next one expires in flight.
            d1, d2 = await create("mute-d"), await create("mute-d")
            await reaches(d1, "SENT")
            await cancel(d1)  # SENT -> CANCELLED
            await reaches(d2, "SENT")
            await clock(d2, "expire_at")
            await reaches(d2, "TIMEOUT")  # SENT -> TIMEOUT
            # A device that keeps saying it is offline: requeued until cancelled.
            e1 = await create("away", "deferrable")

            async def retried_twice() -> bool:
                retries = await db.fetchval("SELECT retry_count FROM command WHERE id = $1", e1)
                return int(retries) >= 2

            await wait_until(retried_twice, message="the offline device's command requeued")
            await cancel(e1)
            reply = await api.call("POST", "/devices/mute-c/unbind", token=OPERATOR)
            assert reply.status == 200, reply.body
            assert sorted(reply.body["cancelled"]) == [c1, c2]
            for command_id in answered:
                await reaches(command_id, "ACKED", "FAILED")

            async def settled() -> bool:
                return await _open(db_dsn) == 0

            await wait_until(settled, message="every command finished")
    finally:
        stop.set()
        await answering

    # The daemon has stopped: every count it will ever make is made.
    counted: Counter[tuple[str, str]] = Counter()
    for family in daemon.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "gateway_command_transitions_total" and sample.value:
                counted[(sample.labels["from_status"], sample.labels["to_status"])] = int(
                    sample.value
                )
    rows = await db.fetch(
        "SELECT from_status, to_status, count(*) AS n FROM command_audit"
        " WHERE from_status IS NOT NULL GROUP BY 1, 2"
    )
    audited = Counter({(r["from_status"], r["to_status"]): int(r["n"]) for r in rows})
    assert counted == audited
    # Everything else in the audit is a creation, which is no transition.
    others = await db.fetch(
        "SELECT DISTINCT action, to_status FROM command_audit WHERE from_status IS NULL"
    )
    assert [tuple(r) for r in others] == [("create", "PENDING")]
    # The paths the test meant to take were taken.
    assert {
        ("PENDING", "CLAIMED"), ("CLAIMED", "SENT"), ("PENDING", "CANCELLED"),
        ("SENT", "CANCELLED"), ("PENDING", "TIMEOUT"), ("SENT", "TIMEOUT"), ("SENT", "FAILED"),
        ("SENT", "PENDING"), ("SENT", "ACKED"),
    } <= set(audited)  # fmt: skip
    actions = {r["action"] for r in await db.fetch("SELECT action FROM command_audit")}
    assert {"receipt:TIMEOUT", "timeout", "expire", "cancel", "unbind"} <= actions


async def test_a_downlink_waiting_for_a_slow_broker_is_not_published_once_cancelled(
    db_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    """The broker takes one publish at a time (Receive Maximum 1) and stops answering: of a
    batch of two claims, the first downlink is written and waits for its PUBACK, the second
    waits for the slot. It is cancelled meanwhile (CLAIMED -> CANCELLED): when the broker
    answers again, it is not published, and the first is."""
    broker = Mosquitto(tmp_path / "slow", max_inflight_messages=1)
    broker.start()
    received: list[str] = []
    try:
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="watcher") as watcher:
            await watcher.subscribe("iot/devices/+/commands", qos=1)

            async def watch() -> None:
                async for message in watcher.messages:
                    received.append(str(message.topic))

            watching = asyncio.create_task(watch())
            config = make_config(dsn=db_dsn, mqtt_port=broker.port, extra=f"[commands]\n{FAST}\n")
            async with running_daemon(config) as daemon:
                assert daemon.components is not None
                dispatcher = daemon.components.dispatcher
                dispatcher.recheck_after_s = 0.0  # every late slot re-reads: no timing in this
                broker.pause()
                try:
                    first, second = await _create_many(db_dsn, ["dev-a", "dev-b"], 1)

                    async def both_claimed() -> bool:
                        statuses = {await _status(db, c) for c in (first, second)}
                        return statuses == {"CLAIMED"}

                    await wait_until(both_claimed, message="both commands claimed")
                    async with db.transaction():
                        cancelled = await cancel(db, second, actor="op:bob", node_id="test")
                    assert cancelled.previous_status == "CLAIMED"
                finally:
                    broker.resume()
                await dispatcher.flush()
                assert await _status(db, first) == "SENT"
                assert await _status(db, second) == "CANCELLED"
                # A marker published after the flush comes after any downlink of the batch.
                await watcher.publish("iot/devices/marker/commands", b"{}", qos=1)
                await wait_until(
                    lambda: "iot/devices/marker/commands" in received,
                    message="the marker through the broker",
                )
            watching.cancel()
    finally:
        broker.resume()
        broker.stop()
    assert received == ["iot/devices/dev-a/commands", "iot/devices/marker/commands"]
    trail = await db.fetch(
        "SELECT action FROM command_audit WHERE command_id = $1 ORDER BY id", second
    )
    assert [r["action"] for r in trail] == ["create", "claim", "cancel"]
