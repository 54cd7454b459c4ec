"""The campaign API over real HTTP (loopback) against a real PostgreSQL (behaviour §7).

Outcomes are written from the issue's contract: 201/200 with the idempotency key, 422 for a bad
body, 409 naming unbound targets or for targets that resolve to nothing, counts per status,
cancel once, and the campaign's commands as ordinary commands with ``campaign_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg
import pytest

from gateway.commands.campaigns import SETTLER_ACTOR, _closed
from gateway.commands.dispatcher import smallest_downlink
from gateway.commands.receipts import apply_receipt
from gateway.config import TokenConfig
from gateway.domain.campaign import CampaignStatus
from protocol import CommandReceipt, ReceiptResult, Topics
from storage import commands as command_repo
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient, Reply
from tests.support.api_server import serve_api
from tests.support.waiting import wait_until

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]
STATUSES = ("PENDING", "CLAIMED", "SENT", "ACKED", "FAILED", "TIMEOUT", "CANCELLED")


def counts(**given: int) -> dict[str, int]:
    return {status: given.get(status, 0) for status in STATUSES}


@dataclass
class Api(ApiClient):
    db: asyncpg.Connection

    async def start(self, body: Any, *, token: str | None = OPERATOR) -> Reply:
        return await self.call("POST", "/campaigns", json=body, token=token)

    async def snapshot(self) -> tuple[int, ...]:
        """How many campaigns, commands, audit rows and outbox events there are."""
        row = await self.db.fetchrow(
            "SELECT (SELECT count(*) FROM campaign), (SELECT count(*) FROM command),"
            " (SELECT count(*) FROM campaign_audit), (SELECT count(*) FROM command_audit),"
            " (SELECT count(*) FROM outbox_event)"
        )
        assert row is not None
        return tuple(row)

    async def register(self, *devices: str, bound: bool = True) -> None:
        await self.db.executemany(
            "INSERT INTO device (device_id, first_seen, last_seen, bound)"
            " VALUES ($1, now(), now(), $2)",
            [(d, bound) for d in devices],
        )


@contextlib.asynccontextmanager
async def serve(dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve_api(dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield Api(base=served.base, http=http, db=db)


@pytest.fixture
async def api(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[Api]:
    async with serve(db_dsn, db) as served:
        yield served


async def test_create_with_a_device_list_makes_one_command_each_in_order(api: Api) -> None:
    devices = [f"dev-{n:02d}" for n in range(12)]
    reply = await api.start(
        {"name": "set", "params": {"level": 2}, "targets": {"devices": devices},
         "rollout": {"per_minute": 600}, "abort": {"failure_ratio": 0.25, "min_finished": 4},
         "idempotency_key": "push-1"}
    )  # fmt: skip
    assert reply.status == 201, reply.body
    assert reply.body["created"] is True
    campaign = reply.body["campaign"]
    assert (campaign["status"], campaign["total"], campaign["counts"]) == (
        "RUNNING", 12, counts(PENDING=12),
    )  # fmt: skip
    assert (campaign["name"], campaign["params"], campaign["delivery"]) == (
        "set", {"level": 2}, "realtime",
    )  # fmt: skip
    assert (campaign["target_devices"], campaign["target_selector"]) == (devices, None)
    assert (campaign["per_minute"], campaign["failure_ratio"], campaign["min_finished"]) == (
        600, 0.25, 4,
    )  # fmt: skip
    assert campaign["created_by"] == "console"

    rows = await api.db.fetch("SELECT * FROM command ORDER BY id")
    assert [r["device_id"] for r in rows] == devices  # ids follow the list's order
    assert {(r["name"], r["status"], r["campaign_id"], r["created_by"]) for r in rows} == {
        ("set", "PENDING", campaign["id"], "console")
    }
    # An ordinary command, with its campaign.
    one = await api.get(f"/commands/{rows[3]['id']}")
    assert one.status == 200, one.body
    assert (one.body["command"]["campaign_id"], one.body["command"]["params"]) == (
        campaign["id"], {"level": 2},
    )  # fmt: skip
    audit = await api.db.fetch(
        "SELECT actor, action, from_status, to_status FROM command_audit ORDER BY id"
    )
    assert [tuple(a) for a in audit] == [("console", "create", None, "PENDING")] * 12
    trail = await api.db.fetch("SELECT actor, action, from_status, to_status, request_id"
                               " FROM campaign_audit")  # fmt: skip
    assert [tuple(a)[:4] for a in trail] == [("console", "create", None, "RUNNING")]
    assert trail[0]["request_id"] == reply.headers["X-Request-Id"]
    events = await api.db.fetch("SELECT aggregate_type, aggregate_id, event_type FROM outbox_event")
    assert [tuple(e) for e in events] == [("campaign", str(campaign["id"]), "campaign.created")]

    # The same key: the same campaign, 200, nothing new, whatever the body says now.
    before = await api.snapshot()
    again = await api.start({"name": "other", "targets": {"devices": ["x"]},
                             "idempotency_key": "push-1"})  # fmt: skip
    assert (again.status, again.body["created"]) == (200, False)
    assert again.body["campaign"] == campaign
    assert await api.snapshot() == before

    got = await api.get(f"/campaigns/{campaign['id']}")
    assert (got.status, got.body) == (200, campaign)


async def test_a_selector_resolves_against_bound_known_devices_when_it_starts(api: Api) -> None:
    await api.register("pump-1", "pump-2", "pump-10", "fan-1")
    await api.register("pump-3", bound=False)
    reply = await api.start({"name": "reboot", "targets": {"selector": ["pump-?", "fan-*"]}})
    assert reply.status == 201, reply.body
    campaign = reply.body["campaign"]
    assert (campaign["target_selector"], campaign["target_devices"]) == (["pump-?", "fan-*"], None)
    stored = await api.db.fetchval("SELECT device_ids FROM campaign WHERE id = $1", campaign["id"])
    assert stored == ["fan-1", "pump-1", "pump-2"]  # the resolved list, stored
    assert campaign["total"] == 3
    # A device seen later is not a target of a campaign already started.
    await api.register("pump-4")
    assert (await api.get(f"/campaigns/{campaign['id']}")).body["total"] == 3
    single = await api.start({"name": "reboot", "targets": {"selector": "fan-1"}})
    assert (single.status, single.body["campaign"]["total"]) == (201, 1)


async def test_targets_count_what_a_campaign_would_command_and_create_nothing(api: Api) -> None:
    await api.register("pump-1", "pump-2", "pump-10", "fan-1")
    await api.register("pump-3", bound=False)
    before = await api.snapshot()
    reply = await api.get("/campaigns/targets?selector=pump-?,fan-*", token=VIEWER)
    assert reply.status == 200, reply.body
    assert reply.body == {
        "selector": ["pump-?", "fan-*"], "count": 3, "sample": ["fan-1", "pump-1", "pump-2"],
    }  # fmt: skip
    # The same selector started: exactly those devices, as the count said.
    started = await api.start({"name": "reboot", "targets": {"selector": ["pump-?", "fan-*"]}})
    assert started.body["campaign"]["total"] == reply.body["count"]
    assert (await api.snapshot())[0] == before[0] + 1
    none = await api.get("/campaigns/targets?selector=nothing-*")
    assert none.body == {"selector": ["nothing-*"], "count": 0, "sample": []}
    await api.register(*(f"many-{n:03d}" for n in range(30)))
    many = await api.get("/campaigns/targets?selector=many-*")
    assert (many.body["count"], len(many.body["sample"])) == (30, 20)
    assert many.body["sample"][0] == "many-000"
    for bad in ("selector=", "selector=a,,b", "selector=%00", "selector=a&selector=b", "x=1"):
        refused = await api.get(f"/campaigns/targets?{bad}")
        assert (refused.status, refused.body["error"]) == (400, "BAD_REQUEST"), (bad, refused.body)
    missing = await api.get("/campaigns/targets")
    assert missing.status == 400, missing.body
    assert (await api.get("/campaigns/targets?selector=a", token=None)).status == 401


async def test_unbound_targets_and_empty_targets_are_409_and_change_nothing(api: Api) -> None:
    await api.register("ok-1")
    await api.register("gone-2", "gone-1", bound=False)
    before = await api.snapshot()
    unbound = await api.start(
        {"name": "reboot", "targets": {"devices": ["ok-1", "gone-2", "new-1", "gone-1"]}}
    )
    assert unbound.status == 409, unbound.body
    assert unbound.body["error"] == "DEVICE_UNBOUND"
    assert unbound.body["device_ids"] == ["gone-1", "gone-2"]
    assert "gone-1" in unbound.body["message"]
    nothing = await api.start({"name": "reboot", "targets": {"selector": "nomatch-*"}})
    assert (nothing.status, nothing.body["error"]) == (409, "NO_TARGETS")
    only_unbound = await api.start({"name": "reboot", "targets": {"selector": "gone-*"}})
    assert (only_unbound.status, only_unbound.body["error"]) == (409, "NO_TARGETS")
    assert await api.snapshot() == before


async def test_a_campaign_is_refused_whole_as_a_command_to_any_of_its_targets_is_refused(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """What can never be sent is refused up front (behaviour §7), for each target: a downlink
    over the broker's maximum packet size (the longest id's is the largest), an id the broker
    cannot carry."""
    short, long = "dev-1", "dev-1-with-a-longer-id"
    params = {"blob": "x" * 2000}
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        api = Api(base=served.base, http=http, db=db)
        await api.register(short, long)
        # [mqtt] max_packet_size: the short id's downlink fits exactly, the long one's cannot.
        limit = smallest_downlink(Topics("iot").commands(short), "fw", params, mqtt5=True)
        served.commands.max_packet_size = limit
        fits = await api.call(
            "POST", f"/devices/{short}/commands", json={"name": "fw", "params": params},
            token=OPERATOR,
        )  # fmt: skip
        assert fits.status == 201, fits.body
        before = await api.snapshot()
        for targets in ({"devices": [short, long]}, {"selector": "dev-*"}):
            reply = await api.start({"name": "fw", "params": params, "targets": targets})
            assert reply.status == 422, reply.body
            assert reply.body["error"] == "DOWNLINK_TOO_LARGE"
            assert (reply.body["device_id"], reply.body["limit"]) == (long, limit)
            assert reply.body["size"] > limit
        # [mqtt] broker_family maps `.` to its own separator: such an id cannot be carried.
        served.commands.topics = Topics("iot", portable_ids=True)
        await api.register("dev.3")
        dotted = await api.start({"name": "fw", "targets": {"devices": [short, "dev.3"]}})
        assert (dotted.status, dotted.body["error"], dotted.body["device_id"]) == (
            400, "BAD_DEVICE_ID", "dev.3",
        )  # fmt: skip
        assert await api.snapshot() == before
        sendable = await api.start({"name": "fw", "targets": {"devices": [short, long]}})
        assert sendable.status == 201, sendable.body


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x"},
        {"name": "x", "targets": {}},
        {"name": "x", "targets": {"devices": ["a"], "selector": "a"}},
        {"name": "x", "targets": {"devices": ["bad id"]}},
        {"name": "x", "targets": {"selector": "bad glob*"}},
        {"name": "x", "targets": {"selector": []}},
        {"name": " ", "targets": {"devices": ["a"]}},
        {"name": "x", "targets": {"devices": ["a"]}, "rollout": {"per_minute": 0}},
        {"name": "x", "targets": {"devices": ["a"]}, "rollout": {}},
        {"name": "x", "targets": {"devices": ["a"]}, "rollout": {"per_minute": 1.5}},
        {"name": "x", "targets": {"devices": ["a"]}, "rollout": {"per_minute": "60"}},
        {"name": "x", "targets": {"devices": ["a"]}, "rollout": {"per_minute": True}},
        {"name": "x", "targets": {"devices": ["a"]},
         "abort": {"failure_ratio": 0.5, "min_finished": 2.5}},
        {"name": "x", "targets": {"devices": ["a"]},
         "abort": {"failure_ratio": 0, "min_finished": 1}},
        {"name": "x", "targets": {"devices": ["a"]},
         "abort": {"failure_ratio": 1.5, "min_finished": 1}},
        {"name": "x", "targets": {"devices": ["a"]}, "abort": {"failure_ratio": 0.5}},
        {"name": "x", "targets": {"devices": ["a"]}, "params": {"k": "\u0000"}},
        {"name": "x", "targets": {"devices": ["a"]}, "delivery": "later"},
        {"name": "x", "targets": {"devices": ["a"]}, "surprise": 1},
        ["not", "an", "object"],
    ],
)  # fmt: skip
async def test_a_bad_body_is_422_and_changes_nothing(api: Api, body: Any) -> None:
    before = await api.snapshot()
    reply = await api.start(body)
    assert reply.status == 422, reply.body
    assert reply.body["error"] == "INVALID_BODY"
    assert await api.snapshot() == before


async def test_a_count_written_as_a_whole_number_float_is_that_integer(api: Api) -> None:
    # JSON Schema's `integer` admits 60.0, and the document says `integer`: the API agrees.
    reply = await api.start(
        {"name": "x", "targets": {"devices": ["a"]}, "rollout": {"per_minute": 60.0},
         "abort": {"failure_ratio": 0.5, "min_finished": 3.0}}
    )  # fmt: skip
    assert reply.status == 201, reply.body
    campaign = reply.body["campaign"]
    assert (campaign["per_minute"], campaign["min_finished"]) == (60, 3)
    row = await api.db.fetchrow(
        "SELECT per_minute, min_finished FROM campaign WHERE id = $1", campaign["id"]
    )
    assert row is not None
    assert (row["per_minute"], row["min_finished"]) == (60, 3)


async def test_an_empty_device_list_is_409_and_changes_nothing(api: Api) -> None:
    before = await api.snapshot()
    reply = await api.start({"name": "x", "targets": {"devices": []}})
    assert (reply.status, reply.body["error"]) == (409, "NO_TARGETS")
    assert await api.snapshot() == before


async def test_roles_viewer_may_read_only(api: Api) -> None:
    body = {"name": "x", "targets": {"devices": ["a"]}}
    assert (await api.start(body, token=VIEWER)).status == 403
    assert (await api.start(body, token=None)).status == 401
    created = await api.start(body)
    assert created.status == 201
    cid = created.body["campaign"]["id"]
    assert (await api.call("POST", f"/campaigns/{cid}/cancel", token=VIEWER)).status == 403
    assert (await api.get(f"/campaigns/{cid}", token=VIEWER)).status == 200


async def test_lists_pages_filters_and_404s(api: Api) -> None:
    ids = []
    for n in range(5):
        reply = await api.start({"name": f"c{n}", "targets": {"devices": [f"d{n}a", f"d{n}b"]}})
        ids.append(reply.body["campaign"]["id"])
    cancelled = await api.call("POST", f"/campaigns/{ids[1]}/cancel", token=OPERATOR)
    assert cancelled.status == 200, cancelled.body

    assert await api.keyset_ids("/campaigns?limit=2") == sorted(ids, reverse=True)
    only = await api.get("/campaigns?status=CANCELLED")
    assert [c["id"] for c in only.body["items"]] == [ids[1]]
    assert (await api.get("/campaigns?status=RUNNING")).body["items"][-1]["id"] == ids[0]
    assert (await api.get("/campaigns?status=NOPE")).status == 400

    commands = await api.get(f"/campaigns/{ids[2]}/commands")
    assert commands.status == 200, commands.body
    assert [c["device_id"] for c in commands.body["items"]] == ["d2b", "d2a"]  # newest first
    assert {c["campaign_id"] for c in commands.body["items"]} == {ids[2]}
    first = await api.get(f"/campaigns/{ids[2]}/commands?limit=1")
    assert [c["device_id"] for c in first.body["items"]] == ["d2b"]
    rest = await api.get(f"/campaigns/{ids[2]}/commands?before={first.body['next_before']}")
    assert [c["device_id"] for c in rest.body["items"]] == ["d2a"]
    assert (await api.get(f"/campaigns/{ids[1]}/commands?status=PENDING")).body["items"] == []
    assert len((await api.get(f"/campaigns/{ids[1]}/commands?status=CANCELLED")).body["items"]) == 2

    missing = await api.get("/campaigns/999999")
    assert (missing.status, missing.body["error"], missing.body["campaign_id"]) == (
        404, "NOT_FOUND", 999999,
    )  # fmt: skip
    assert (await api.get("/campaigns/999999/commands")).status == 404
    assert (await api.call("POST", "/campaigns/999999/cancel", token=OPERATOR)).status == 404
    assert (await api.get("/campaigns/abc")).status == 400


async def test_cancel_closes_every_open_command_once_and_late_receipts_are_refused(
    api: Api,
) -> None:
    reply = await api.start({"name": "reboot", "targets": {"devices": ["a", "b", "c", "d"]}})
    campaign = reply.body["campaign"]
    # a is claimed and sent, b claimed, c acked; d stays PENDING.
    claimed = await command_repo.claim_due(
        api.db, node_id="n1", lease_s=60, limit=3, max_in_flight=1, actor="system:dispatcher"
    )
    by_device = {r.device_id: r for r in claimed}
    await command_repo.mark_sent(api.db, command_id=by_device["a"].id, generation=1,
                                 node_id="n1", timeout_s=60, actor="t")  # fmt: skip
    c = by_device["c"]
    async with api.db.transaction():
        await apply_receipt(api.db, device_id="c", node_id="n1", sent_timeout_s=60,
                            receipt=CommandReceipt(command_id=c.id, claim_generation=1,
                                                   node_id="n1", result=ReceiptResult.ACKED,
                                                   result_code=0))  # fmt: skip
    await api.db.execute("DELETE FROM outbox_event")

    results = await asyncio.gather(
        *(api.call("POST", f"/campaigns/{campaign['id']}/cancel", token=OPERATOR)
          for _ in range(6))
    )  # fmt: skip
    winners = [r for r in results if r.status == 200]
    assert len(winners) == 1, [r.body for r in results]
    for loser in results:
        if loser.status != 200:
            # Read closed already (400), or read RUNNING and beaten to the write (409).
            assert (loser.status, loser.body["error"], loser.body["current_status"]) in {
                (400, "ILLEGAL_TRANSITION", "CANCELLED"), (409, "STATUS_CHANGED", "CANCELLED"),
            }  # fmt: skip
    closed = winners[0].body
    assert (closed["status"], closed["counts"]) == ("CANCELLED", counts(ACKED=1, CANCELLED=3))
    assert closed["finished_at"] is not None
    assert closed["status_reason"] == "cancelled by console"
    rows = {r["device_id"]: r for r in await api.db.fetch("SELECT * FROM command")}
    assert {d: r["status"] for d, r in rows.items()} == {
        "a": "CANCELLED", "b": "CANCELLED", "c": "ACKED", "d": "CANCELLED",
    }  # fmt: skip
    audit = await api.db.fetch(
        "SELECT c.device_id, a.action, a.from_status, a.to_status FROM command_audit a"
        " JOIN command c ON c.id = a.command_id WHERE a.to_status = 'CANCELLED' ORDER BY c.id"
    )
    assert [tuple(a) for a in audit] == [
        ("a", "campaign-cancel", "SENT", "CANCELLED"),
        ("b", "campaign-cancel", "CLAIMED", "CANCELLED"),
        ("d", "campaign-cancel", "PENDING", "CANCELLED"),
    ]
    events = await api.db.fetch(
        "SELECT aggregate_type, event_type, payload FROM outbox_event ORDER BY id"
    )
    assert [(e["aggregate_type"], e["event_type"]) for e in events] == [
        ("command", "command.finished")] * 3 + [("campaign", "campaign.cancelled")]  # fmt: skip
    trail = await api.db.fetch("SELECT action, from_status, to_status FROM campaign_audit"
                               " ORDER BY id")  # fmt: skip
    assert [tuple(t) for t in trail] == [("create", None, "RUNNING"),
                                         ("cancel", "RUNNING", "CANCELLED")]  # fmt: skip

    # The device that was sent the command answers late: kept, refused, nothing changes.
    async with api.db.transaction():
        late = await apply_receipt(
            api.db, device_id="a", node_id="n1", sent_timeout_s=60,
            receipt=CommandReceipt(command_id=by_device["a"].id, claim_generation=1,
                                   node_id="n1", result=ReceiptResult.ACKED, result_code=0),
        )  # fmt: skip
    assert (late.outcome.value, late.reason and late.reason.value) == (
        "rejected", "COMMAND_CLOSED",
    )  # fmt: skip
    assert (
        await api.db.fetchval("SELECT status FROM command WHERE id = $1", by_device["a"].id)
        == "CANCELLED"
    )


async def test_a_cancel_that_loses_its_race_to_the_settler_is_409_and_changes_nothing(
    api: Api, db_dsn: str
) -> None:
    """behaviour §14: the request reads the campaign RUNNING; the settler's abort commits
    between that read and the request's write (its transaction holds the campaign's row until
    the request's write waits for it). The settler won: 409, and nothing of the cancel."""
    reply = await api.start({"name": "reboot", "targets": {"devices": ["a", "b"]}})
    campaign_id = reply.body["campaign"]["id"]
    before = await api.snapshot()
    settler = await asyncpg.connect(db_dsn)
    try:
        held = settler.transaction()
        await held.start()
        assert await _closed(
            settler, campaign_id, status=CampaignStatus.ABORTED, reason="failures",
            actor=SETTLER_ACTOR, action="abort", node_id="n2", request_id=None,
        )  # fmt: skip
        request = asyncio.create_task(
            api.call("POST", f"/campaigns/{campaign_id}/cancel", token=OPERATOR)
        )

        async def waiting() -> bool:
            return bool(
                await api.db.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )

        await wait_until(waiting, message="the cancel's write waits for the campaign's row")
        await held.commit()
        lost = await request
    finally:
        await settler.close()
    assert lost.status == 409, lost.body
    assert (lost.body["error"], lost.body["current_status"]) == ("STATUS_CHANGED", "ABORTED")
    assert (lost.body["actor"], lost.body["campaign_id"]) == (SETTLER_ACTOR, campaign_id)
    # The abort alone: its campaign audit row, its two commands' cancels, its three events.
    campaigns, commands, campaign_audit, command_audit, events = await api.snapshot()
    assert (campaigns, commands) == before[:2]
    assert (campaign_audit, command_audit, events) == (
        before[2] + 1, before[3] + 2, before[4] + 3,
    )  # fmt: skip
    trail = await api.db.fetch("SELECT actor, action FROM campaign_audit ORDER BY id")
    assert [tuple(t) for t in trail] == [("console", "create"), (SETTLER_ACTOR, "abort")]
