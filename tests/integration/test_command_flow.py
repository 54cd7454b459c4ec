"""Commands end to end: daemons dispatch, simulated devices answer, receipts are applied."""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.commands import create_command
from gateway.domain.command import Delivery
from protocol import Topics
from sim.responder import Behaviour, Responder, Script
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
                    created = await create_command(
                        conn, device_id=device, name="set", params={"n": n},
                        delivery=Delivery.REALTIME, idempotency_key=None, created_by="test",
                        node_id="test", expire_after_s=3600,
                    )  # fmt: skip
                    ids.append(created.command["id"])
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
