"""A downlink the broker refuses for now (its PUBACK 0x87: an ACL denying the commands topic) is
answered by the node as a device's FAILED receipt would be: the command FAILED together with the
node's own receipt row, in one transaction, tried again while the claim's lease lasts. The
database lost as that transaction's COMMIT was answered (a restart, a failover, a link cut: the
server committed, the node cannot tell), the retry used to apply the receipt again: a SECOND
copy of the node's own receipt (judged `duplicated`, the command closed already), and the
transition never counted. The retry now finds the receipt its earlier attempt kept, and writes
nothing.

A real daemon behind an ACL'd mosquitto (MQTT 5), its database behind a PostgreSQL-reading
proxy (tests/support/pg_cut.py): cut when the COMMIT after the refusal's receipt is answered.
"""

from __future__ import annotations

from pathlib import Path

from gateway.domain.command import Delivery
from storage.commands import INSERT_RECEIPT
from storage.pool import create_pool
from tests.integration.acceptance.test_broker_capabilities import _acl_broker
from tests.support.commands import new_command
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.dsn import proxy_for, through
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

# The lease far longer than the test's deadline; no ack window judged meanwhile.
COMMANDS = "[commands]\nlease_s = 120\nreaper_interval_s = 0.5\nack_window_s = 600\n"
# Telemetry and the probe's topics open; the commands topic read only: no downlink published.
TELEMETRY = (
    "pattern readwrite iot/devices/+/telemetry\n"
    "pattern readwrite iot/devices/gateway-probe/#\n"
    "pattern read iot/devices/+/commands\n"
)
FAILED = {"from_status": "CLAIMED", "to_status": "FAILED"}


async def test_a_refusal_whose_commit_answer_was_lost_keeps_one_receipt(
    db_dsn: str, tmp_path: Path
) -> None:
    broker = _acl_broker(tmp_path, TELEMETRY)
    database = proxy_for(db_dsn)
    await database.start()
    cut = PgCut(database)
    # The refusal's receipt written, then its transaction's COMMIT: run, its answer lost.
    cut.arm(Statement(INSERT_RECEIPT), Statement("COMMIT"), at="answered")
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        config = make_config(
            dsn=through(db_dsn, database), mqtt_port=broker.port, protocol="5",
            node_id="node-a", extra=COMMANDS,
        )  # fmt: skip
        async with running_daemon(config) as daemon:
            async with pool.acquire() as conn:
                created = await new_command(
                    conn, device_id="denied-1", name="set", params={"on": True},
                    delivery=Delivery.REALTIME, node_id="test",
                )  # fmt: skip
            command_id = created.command.id
            await cut.outage()

            async def receipts() -> list[tuple[str, str | None, str | None]]:
                async with pool.acquire() as conn:
                    rows = await conn.fetch(
                        "SELECT outcome, reason, raw_result_code FROM command_receipt"
                        " WHERE command_id = $1 ORDER BY id",
                        command_id,
                    )
                return [(r["outcome"], r["reason"], r["raw_result_code"]) for r in rows]

            async def retried() -> bool:
                # The retry is done either way: it counted the transition it found committed,
                # or it kept a second receipt.
                return (
                    metric(daemon, "gateway_command_transitions_total", FAILED) >= 1
                    or len(await receipts()) >= 2
                )

            await wait_until(retried, timeout=30, message="the refusal's write tried again")
            assert await receipts() == [("accepted", None, "NOT_AUTHORIZED")]
            async with pool.acquire() as conn:
                row = await conn.fetchrow("SELECT * FROM command WHERE id = $1", command_id)
                trail = await conn.fetch(
                    "SELECT action, claim_generation FROM command_audit WHERE command_id = $1"
                    " ORDER BY id",
                    command_id,
                )
            assert row is not None
            assert (row["status"], row["claim_generation"], row["reclaim_count"]) == (
                "FAILED", 1, 0,
            ), dict(row)  # fmt: skip
            assert [(t["action"], t["claim_generation"]) for t in trail] == [
                ("create", 0), ("claim", 1), ("receipt:FAILED", 1),
            ]  # fmt: skip
            # Counted once: the transition its lost COMMIT did make.
            assert metric(daemon, "gateway_command_transitions_total", FAILED) == 1
    finally:
        await pool.close()
        await database.stop()
        broker.stop()
