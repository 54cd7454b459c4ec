"""Campaigns end to end: real daemons on one database and one broker, the simulator's devices.

Two nodes abort a failing campaign exactly once; an operator cancels a campaign during its
rollout (and the rollout held on the real dispatchers); a node SIGKILLed holding claims has
them expire and reclaimed by the other node with a new generation, every command terminal once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg

from gateway.commands.campaigns import CampaignRequest, CampaignService, Targets
from gateway.domain.campaign import AbortCriteria
from gateway.domain.command import Delivery
from gateway.runtime.daemon import Daemon
from protocol import Topics
from sim.responder import Behaviour, Responder, Script
from storage.pool import create_pool
from tests.support.daemon import (
    DaemonProcess,
    config_toml,
    http_healthy,
    make_config,
    running_daemon,
)
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TERMINAL = ("ACKED", "FAILED", "TIMEOUT", "CANCELLED")
COMMANDS = "[commands]\nlease_s = 3\nreaper_interval_s = 0.5\n"


def _config(dsn: str, port: int, node: str) -> Any:
    return make_config(
        dsn=dsn, mqtt_port=port, node_id=node, extra=COMMANDS,
        mqtt_extra='shared_group = "campaigns"',
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _nodes(dsn: str, port: int, names: Sequence[str]) -> AsyncIterator[list[Daemon]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(running_daemon(_config(dsn, port, n))) for n in names
        ]


@contextlib.asynccontextmanager
async def _devices(port: int, script: Script) -> AsyncIterator[Responder]:
    responder = Responder(host="127.0.0.1", port=port, topics=Topics("iot"), script=script)
    stop = asyncio.Event()
    task = asyncio.create_task(responder.run(stop), name="responder")
    try:
        await responder.wait_subscribed()
        yield responder
    finally:
        stop.set()
        await task


async def _start(pool: asyncpg.Pool, n: int, **fields: Any) -> int:
    request = CampaignRequest(
        name="reboot", params={}, delivery=fields.pop("delivery", Delivery.REALTIME),
        targets=Targets(devices=tuple(f"dev-{i:04d}" for i in range(n))),
        per_minute=fields.pop("per_minute", None), abort=fields.pop("abort", None),
        idempotency_key=None,
    )  # fmt: skip
    created = await CampaignService(pool, "api", 3600.0).create(request, actor="api:console")
    return int(created.campaign.id)


async def _settled(pool: asyncpg.Pool, campaign_id: int) -> bool:
    """Closed, and no command of it open."""
    async with pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT status, (SELECT count(*) FROM command WHERE campaign_id = $1"
            " AND status IN ('PENDING', 'CLAIMED', 'SENT')) AS open FROM campaign WHERE id = $1",
            campaign_id,
        )
    assert row is not None
    return bool(row["status"] != "RUNNING" and row["open"] == 0)


async def _each_terminal_once(conn: asyncpg.Connection, campaign_id: int) -> dict[str, int]:
    """Every command of the campaign reached a terminal status by exactly one audited write."""
    rows = await conn.fetch(
        "SELECT c.id, c.status, count(a.id) FILTER (WHERE a.to_status = ANY($2::text[])) AS ends"
        " FROM command c LEFT JOIN command_audit a ON a.command_id = c.id"
        " WHERE c.campaign_id = $1 GROUP BY c.id",
        campaign_id,
        list(TERMINAL),
    )
    assert rows
    assert all(r["status"] in TERMINAL and r["ends"] == 1 for r in rows), [
        dict(r) for r in rows if r["ends"] != 1 or r["status"] not in TERMINAL
    ]
    finished = await conn.fetchval(
        "SELECT count(*) FROM outbox_event o JOIN command c ON o.aggregate_id = c.id::text"
        " WHERE o.event_type = 'command.finished' AND c.campaign_id = $1",
        campaign_id,
    )
    assert finished == len(rows)  # one command.finished event each
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return statuses


async def test_two_nodes_abort_a_failing_campaign_exactly_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    pool = await create_pool(db_dsn, min_size=1, max_size=4)
    try:
        script = Script(default=Behaviour.SUCCESS, failure_rate=0.5, seed=7)
        async with (
            _devices(mosquitto.port, script),
            _nodes(db_dsn, mosquitto.port, ["node-a", "node-b"]),
        ):
            # 600 at ten a second: the abort (after about 20 finished) comes long before the
            # rollout could let most of them out, however slow the machine is.
            campaign_id = await _start(
                pool, 600, per_minute=600, abort=AbortCriteria(failure_ratio=0.2, min_finished=20)
            )
            await wait_until(lambda: _settled(pool, campaign_id), timeout=90)
        async with pool.acquire() as conn:
            campaign = await conn.fetchrow("SELECT * FROM campaign WHERE id = $1", campaign_id)
            assert campaign is not None
            assert campaign["status"] == "ABORTED"
            statuses = await _each_terminal_once(conn, campaign_id)
            assert statuses.get("CANCELLED", 0) > 300  # the rollout kept most of them back
            assert statuses.get("FAILED", 0) >= 4
            trail = await conn.fetch(
                "SELECT action, node_id FROM campaign_audit WHERE campaign_id = $1 ORDER BY id",
                campaign_id,
            )
            assert [t["action"] for t in trail] == ["create", "abort"]
            assert trail[1]["node_id"] in ("node-a", "node-b")
            events = await conn.fetchval(
                "SELECT count(*) FROM outbox_event WHERE event_type = 'campaign.aborted'"
            )
            assert events == 1
            # Which node claims each command is a race this test does not force (at ten a
            # second one node may take them all); the settlers of both nodes race on the abort.
    finally:
        await pool.close()


async def test_cancel_during_rollout_stops_it_and_the_rollout_held_on_real_nodes(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    pool = await create_pool(db_dsn, min_size=1, max_size=4)
    try:
        async with (
            _devices(mosquitto.port, Script(default=Behaviour.SUCCESS)),
            _nodes(db_dsn, mosquitto.port, ["node-a", "node-b"]),
        ):
            # One a second: the cancel comes long before most of them are out.
            campaign_id = await _start(pool, 200, per_minute=60)

            async def acked_some() -> bool:
                async with pool.acquire() as conn:
                    n = await conn.fetchval(
                        "SELECT count(*) FROM command WHERE campaign_id = $1 AND status = 'ACKED'",
                        campaign_id,
                    )
                return int(n) >= 3

            await wait_until(acked_some, timeout=30)
            closed = await CampaignService(pool, "api", 3600.0).cancel(
                campaign_id, actor="api:console"
            )
            assert closed.status == "CANCELLED"
            await wait_until(lambda: _settled(pool, campaign_id), timeout=30)
        async with pool.acquire() as conn:
            statuses = await _each_terminal_once(conn, campaign_id)
            assert set(statuses) <= {"ACKED", "CANCELLED"}
            assert statuses["CANCELLED"] >= 150
            campaign = await conn.fetchrow("SELECT * FROM campaign WHERE id = $1", campaign_id)
            assert campaign is not None
            # Nothing left PENDING after the cancel; before it, at most one a second (plus the
            # bucket's one token at the start).
            claims = await conn.fetch(
                "SELECT a.at FROM command_audit a JOIN command c ON c.id = a.command_id"
                " WHERE c.campaign_id = $1 AND a.action = 'claim' ORDER BY a.at",
                campaign_id,
            )
            assert all(c["at"] <= campaign["finished_at"] for c in claims)
            elapsed = (campaign["finished_at"] - campaign["created_at"]).total_seconds()
            assert len(claims) <= elapsed * 1 + 2, (len(claims), elapsed)
    finally:
        await pool.close()


async def test_a_node_killed_holding_claims_has_them_reclaimed_with_a_new_generation(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    pool = await create_pool(db_dsn, min_size=1, max_size=4)
    proxy = TcpProxy("127.0.0.1", mosquitto.port)
    await proxy.start()
    http = free_port()
    path = tmp_path / "doomed.toml"
    path.write_text(
        # Not in the shared group: the broker keeps a dead member's share of the receipts
        # for its session, and this node never comes back in this test.
        config_toml(dsn=db_dsn, mqtt_port=proxy.port, node_id="doomed", http_port=http,
                    extra=COMMANDS)
    )  # fmt: skip
    doomed = DaemonProcess(path, tmp_path / "doomed.log")
    try:
        doomed.start()

        async def healthy() -> bool:
            assert doomed.alive(), doomed.log_tail()
            return await http_healthy(http)

        await wait_until(healthy, timeout=60)
        # Its downlinks cannot go out, and nothing tells it so: its claims stay CLAIMED. (A
        # node that knows its broker session is down claims nothing: the link dies silently.)
        proxy.black_hole()
        campaign_id = await _start(pool, 30)

        async def all_claimed_by_doomed() -> bool:
            async with pool.acquire() as conn:
                n = await conn.fetchval(
                    "SELECT count(*) FROM command WHERE campaign_id = $1 AND status = 'CLAIMED'"
                    " AND claimed_node_id = 'doomed'",
                    campaign_id,
                )
            return int(n) == 30

        await wait_until(all_claimed_by_doomed, timeout=30)
        doomed.kill()  # SIGKILL: no goodbye, its leases simply run out
        async with (
            _devices(mosquitto.port, Script(default=Behaviour.SUCCESS)),
            _nodes(db_dsn, mosquitto.port, ["survivor"]),
        ):
            await wait_until(lambda: _settled(pool, campaign_id), timeout=60)
        async with pool.acquire() as conn:
            assert (
                await conn.fetchval("SELECT status FROM campaign WHERE id = $1", campaign_id)
                == "COMPLETED"
            )
            assert await _each_terminal_once(conn, campaign_id) == {"ACKED": 30}
            rows = await conn.fetch("SELECT * FROM command WHERE campaign_id = $1", campaign_id)
            assert {(r["claim_generation"], r["claimed_node_id"], r["reclaim_count"])
                    for r in rows} == {(2, "survivor", 1)}  # fmt: skip
            steps = await conn.fetch(
                "SELECT a.command_id, a.action, a.claim_generation, a.node_id"
                " FROM command_audit a JOIN command c ON c.id = a.command_id"
                " WHERE c.campaign_id = $1 AND a.action IN ('claim', 'reclaim') ORDER BY a.id",
                campaign_id,
            )
            by_command: dict[int, list[tuple[str, int, str]]] = {}
            for s in steps:
                by_command.setdefault(s["command_id"], []).append(
                    (s["action"], s["claim_generation"], s["node_id"])
                )
            assert {tuple(v) for v in by_command.values()} == {
                (("claim", 1, "doomed"), ("reclaim", 1, "survivor"), ("claim", 2, "survivor"))
            }
            receipts = await conn.fetch(
                "SELECT r.outcome, r.claim_generation FROM command_receipt r"
                " JOIN command c ON c.id = r.command_id WHERE c.campaign_id = $1",
                campaign_id,
            )
            assert {(r["outcome"], r["claim_generation"]) for r in receipts} == {("accepted", 2)}
            assert len(receipts) == 30
    finally:
        doomed.cleanup()
        await proxy.stop()
        await pool.close()
