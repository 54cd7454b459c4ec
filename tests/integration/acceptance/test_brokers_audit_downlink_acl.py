"""A broker whose ACL lets the gateway read its devices but not publish their downlinks.

mosquitto's `acl_file` refuses such a publish; to an MQTT 5 client it answers PUBACK 0x87 (not
authorized), which the gateway takes as a refusal for now (an ACL may be mended). The command
used to keep its claim until the lease ran out, a reclaim, again every lease: after the sixth a
`command-reclaims` alarm ("its nodes keep losing contact") for every command, and a realtime
command never failed, though realtime fails on any failure. The node knows why: it answers the
claim as a device's FAILED receipt would, naming the broker's refusal.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg

from gateway.domain.command import Delivery
from tests.integration.acceptance.test_broker_capabilities import _acl_broker
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon
from tests.support.waiting import wait_until

LEASE_S = 1.0
COMMANDS = f"[commands]\nlease_s = {LEASE_S}\nack_window_s = 60\nreaper_interval_s = 0.2\n"
# Telemetry read and written by anyone; the gateway's probe topics too; the commands topic
# read only: nobody may publish a downlink.
TELEMETRY = (
    "pattern readwrite iot/devices/+/telemetry\n"
    "pattern readwrite iot/devices/gateway-probe/#\n"
    "pattern read iot/devices/+/commands\n"
)


async def test_a_downlink_the_acl_refuses_is_answered_not_reclaimed(
    db_dsn: str, tmp_path: Path
) -> None:
    broker = _acl_broker(tmp_path, TELEMETRY)
    db = await asyncpg.connect(db_dsn)
    try:
        config = make_config(dsn=db_dsn, mqtt_port=broker.port, protocol="5", extra=COMMANDS)
        async with running_daemon(config):
            ids = {}
            for delivery in (Delivery.REALTIME, Delivery.DEFERRABLE):
                created = await new_command(
                    db, device_id=f"dev-{delivery.value}", name="set", params={"on": True},
                    delivery=delivery, node_id="test",
                )  # fmt: skip
                ids[delivery] = created.command.id

            async def moved() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT bool_and(status NOT IN ('PENDING', 'CLAIMED')"
                        " OR reclaim_count > 0 OR retry_count > 0) FROM command"
                    )
                )

            await wait_until(moved, timeout=30, message="each command answered or reclaimed")
            rows = {
                r["id"]: r
                for r in await db.fetch(
                    "SELECT id, status, reclaim_count, retry_count, raw_result_code, raw_ack,"
                    " next_attempt_at > now() AS later FROM command"
                )
            }
            audit = await db.fetch("SELECT command_id, action FROM command_audit ORDER BY id")
    finally:
        await db.close()
        broker.stop()
    realtime, deferrable = rows[ids[Delivery.REALTIME]], rows[ids[Delivery.DEFERRABLE]]
    trail = [tuple(r) for r in audit]
    assert realtime["status"] == "FAILED", (dict(realtime), trail)
    assert realtime["reclaim_count"] == 0, (dict(realtime), trail)
    assert realtime["raw_result_code"] == "NOT_AUTHORIZED", dict(realtime)
    assert "0x87" in realtime["raw_ack"], dict(realtime)
    # A deferrable command backs off as after a device's failure, and goes again later.
    assert deferrable["status"] == "PENDING", (dict(deferrable), trail)
    assert deferrable["reclaim_count"] == 0, (dict(deferrable), trail)
    assert deferrable["retry_count"] == 1, dict(deferrable)
    assert deferrable["later"], dict(deferrable)
    assert "reclaim" not in {action for _, action in trail}, trail
