"""A downlink the broker refuses for now (its PUBACK 0x87: an ACL denying the commands topic)
is answered by the node as a device's FAILED receipt would be: a realtime command FAILED on its
first claim. The database lost right then (a restart, a failover), that write used to be given
up at its first error: the claim waited out its lease and was reclaimed against the node
(`reclaim_count`, the `command-reclaims` alarm), then claimed again to meet the same refusal.
It is tried again while the lease lasts, as the FAILED write of an unsendable downlink is.

A real daemon behind an ACL'd mosquitto (MQTT 5), its database behind a TCP proxy: once the
claim that takes the command has committed (its COMMIT answered), the database is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import asyncpg

from gateway.domain.command import Delivery
from storage.pool import create_pool
from tests.integration.acceptance.test_broker_capabilities import _acl_broker
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.waiting import wait_until

# The lease far longer than the test's deadline: a claim left to lapse is seen as never answered.
COMMANDS = "[commands]\nlease_s = 120\nreaper_interval_s = 0.5\nack_window_s = 600\n"
# Telemetry and the probe's topics open; the commands topic read only: no downlink published.
TELEMETRY = (
    "pattern readwrite iot/devices/+/telemetry\n"
    "pattern readwrite iot/devices/gateway-probe/#\n"
    "pattern read iot/devices/+/commands\n"
)


async def test_a_refused_downlink_is_answered_on_its_first_claim_through_a_database_outage(
    db_dsn: str, tmp_path: Path
) -> None:
    broker = _acl_broker(tmp_path, TELEMETRY)
    database = proxy_for(db_dsn)
    await database.start()
    state = {
        "claiming": False,
        "committing": False,
        "committed": False,
        "done": False,
        "dropping": False,
    }
    tasks: list[asyncio.Task[None]] = []

    async def outage() -> None:
        await asyncio.sleep(0.2)  # the COMMIT's answer, on its way, is read meanwhile
        await database.cut()
        state["dropping"] = False
        await asyncio.sleep(1.0)  # the restart's length, not a synchronisation
        await database.resume()

    def from_server(chunk: bytes) -> bool:
        # The claim's rows come back (the command CLAIMED), then its COMMIT's answer.
        if not state["done"] and b"denied-1" in chunk and b"CLAIMED" in chunk:
            state["claiming"] = True
        elif state["committing"] and b"COMMIT" in chunk:
            state["committing"], state["committed"] = False, True
        return True

    def from_client(chunk: bytes) -> bool:
        if state["claiming"] and b"COMMIT" in chunk:
            state["claiming"], state["committing"], state["done"] = False, True, True
        elif state["committed"]:  # the claim is the node's: whatever it asks next fails
            state["committed"], state["dropping"] = False, True
            tasks.append(asyncio.create_task(outage()))
        return not state["dropping"]

    database.from_client = from_client
    database.from_server = from_server
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        config = make_config(
            dsn=through(db_dsn, database), mqtt_port=broker.port, protocol="5",
            node_id="node-a", extra=COMMANDS,
        )  # fmt: skip
        async with running_daemon(config):
            async with pool.acquire() as conn:
                created = await new_command(
                    conn, device_id="denied-1", name="set", params={"on": True},
                    delivery=Delivery.REALTIME, node_id="test",
                )  # fmt: skip
            seen: list[asyncpg.Record] = []

            async def failed() -> bool:
                async with pool.acquire() as conn:
                    row = await conn.fetchrow(
                        "SELECT * FROM command WHERE id = $1", created.command.id
                    )
                assert row is not None
                seen.append(row)
                return bool(row["status"] == "FAILED")

            await wait_until(lambda: bool(tasks), timeout=30)
            await tasks[0]
            with contextlib.suppress(AssertionError):  # the status is said below
                await wait_until(failed, timeout=30)
            row = seen[-1]
            assert (row["status"], row["claim_generation"], row["reclaim_count"]) == (
                "FAILED", 1, 0,
            ), dict(row)  # fmt: skip
            assert row["raw_result_code"] == "NOT_AUTHORIZED", dict(row)
            async with pool.acquire() as conn:
                trail = await conn.fetch(
                    "SELECT action, claim_generation FROM command_audit WHERE command_id = $1"
                    " ORDER BY id",
                    row["id"],
                )
            assert [(t["action"], t["claim_generation"]) for t in trail] == [
                ("create", 0), ("claim", 1), ("receipt:FAILED", 1),
            ]  # fmt: skip
    finally:
        for task in tasks:
            await task
        await pool.close()
        await database.stop()
        broker.stop()
