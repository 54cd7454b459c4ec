"""The console's API over real HTTP against real PostgreSQL: who am I, devices and their
telemetry, dead letters (admin), stream tickets."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import aiohttp
import asyncpg
import pytest

from gateway.alarms.lifecycle import create_alarm, transition
from gateway.config import TokenConfig
from gateway.domain.alarm import Action
from storage.alarms import db_now
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient
from tests.support.api_server import Served, serve_api

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="console"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture
async def served(db_dsn: str) -> AsyncIterator[Served]:
    async with serve_api(db_dsn, TOKENS) as served:
        yield served


@pytest.fixture
async def api(served: Served) -> AsyncIterator[ApiClient]:
    async with aiohttp.ClientSession() as http:
        yield ApiClient(served.base, http)


async def add_device(
    db: asyncpg.Connection, device_id: str, presence: str = "online", *, bound: bool = True
) -> None:
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen, presence, bound) "
        "VALUES ($1, $2, $3, $4, $5)",
        device_id, T0, T0 + timedelta(minutes=5), presence, bound,
    )  # fmt: skip


async def add_sample(
    db: asyncpg.Connection,
    device_id: str,
    ts: datetime,
    *,
    metrics: dict[str, Any] | None = None,
    events: list[dict[str, Any]] | None = None,
    seq: int | None = None,
) -> str:
    event_id = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    await db.execute(
        "INSERT INTO telemetry (event_id, device_id, ts, seq, metrics, events, node_id) "
        "VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, 'n')",
        event_id, device_id, ts, seq,
        None if metrics is None else json.dumps(metrics),
        None if events is None else json.dumps(events),
    )  # fmt: skip
    return event_id


async def raise_alarm(db: asyncpg.Connection, device_id: str, rule: str = "r1") -> int:
    async with db.transaction():
        created = await create_alarm(
            db, device_id=device_id, rule_key=rule, severity="MAJOR",
            telemetry_event_id=uuid.uuid4().hex, reason="test", node_id="n",
            now=await db_now(db),
        )  # fmt: skip
    assert created.alarm is not None
    return created.alarm.id


# --- who am I ------------------------------------------------------------------------------------


async def test_me_names_the_token_and_its_role(api: ApiClient) -> None:
    for token, name, role in [
        (VIEWER, "wall-screen", "viewer"),
        (OPERATOR, "console", "operator"),
        (ADMIN, "root", "admin"),
    ]:
        reply = await api.get("/me", token=token)
        assert (reply.status, reply.body) == (200, {"name": name, "role": role})
    reply = await api.get("/me", token="not-a-token-0123456789")
    assert (reply.status, reply.body["error"]) == (401, "UNAUTHORIZED")
    assert (await api.get("/me", token=None)).status == 401


# --- devices -------------------------------------------------------------------------------------


async def test_devices_are_listed_by_id_filtered_and_paged(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    presences = ["online", "offline", "unknown"]
    ids = [f"dev-{n:02d}" for n in range(12)]
    for n, device_id in enumerate(reversed(ids)):
        await add_device(db, device_id, presences[n % 3])
    opened = await raise_alarm(db, "dev-03", "r1")
    await raise_alarm(db, "dev-03", "r2")
    closed = await raise_alarm(db, "dev-04", "r1")
    async with db.transaction():
        await transition(db, closed, Action.HANDLE, actor="someone", node_id="n")
    assert opened

    everything = await api.get("/devices?limit=500")
    assert everything.status == 200, everything.body
    assert [d["device_id"] for d in everything.body["devices"]] == ids
    assert everything.body["items"] == everything.body["devices"]  # one envelope, old name kept
    assert everything.body["next_after"] is None
    first = everything.body["devices"][3]
    assert first == {
        "device_id": "dev-03",
        "presence": first["presence"],
        "first_seen": "2026-11-30T12:00:00Z",
        "last_seen": "2026-11-30T12:05:00Z",
        "open_alarms": 2,
    }
    by_id = {d["device_id"]: d for d in everything.body["devices"]}
    assert by_id["dev-04"]["open_alarms"] == 0  # HANDLED is no longer open
    assert by_id["dev-05"]["open_alarms"] == 0

    # Keyset pages of 5: every device once, in order.
    seen, after = [], None
    while True:
        reply = await api.get("/devices?limit=5" + (f"&after={after}" if after else ""))
        assert reply.status == 200
        seen += [d["device_id"] for d in reply.body["devices"]]
        after = reply.body["next_after"]
        if after is None:
            break
    assert seen == ids

    offline = await api.get("/devices?presence=offline")
    assert {d["presence"] for d in offline.body["devices"]} == {"offline"}
    assert len(offline.body["devices"]) == 4

    # The rules' selector syntax: ids and globs, comma-separated.
    chosen = await api.get("/devices?selector=dev-0[0-2],dev-1*,dev-07")
    assert [d["device_id"] for d in chosen.body["devices"]] == [
        "dev-00", "dev-01", "dev-02", "dev-07", "dev-10", "dev-11",
    ]  # fmt: skip
    paged, after = [], None
    while True:
        reply = await api.get("/devices?selector=dev-1*,dev-0?&limit=4" + (
            f"&after={after}" if after else ""))  # fmt: skip
        paged += [d["device_id"] for d in reply.body["devices"]]
        after = reply.body["next_after"]
        if after is None:
            break
    assert paged == ids

    for bad in (
        "selector=a,,b",
        "selector=x%20y",
        "selector=a%2F%2Fb",  # a/b is a Sparkplug edge node: picked
        "presence=gone",
        "after=a%20b",
        "limit=0",
    ):
        reply = await api.get(f"/devices?{bad}")
        assert (reply.status, reply.body.get("error")) == (400, "BAD_REQUEST"), (bad, reply.body)


async def test_sparkplug_devices_are_listed_and_paged_past(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    """Sparkplug ids (`{group}/{node}[/{device}]`) are in the list, and a page that ends on one
    gives a cursor the next request takes."""
    ids = ["Plant1/Line4", "Plant1/Line4/Mixer", "Plant1/Line4/Oven", "dev-01", "dev-02"]
    for device_id in ids:
        await add_device(db, device_id)
    seen, after, cursors = [], None, []
    while True:
        query = "/devices?limit=2" + (f"&after={quote(after, safe='')}" if after else "")
        reply = await api.get(query)
        assert reply.status == 200, reply.body
        seen += [d["device_id"] for d in reply.body["items"]]
        after = reply.body["next_after"]
        if after is None:
            break
        cursors.append(after)
    assert seen == sorted(ids)
    assert cursors == ["Plant1/Line4/Mixer", "dev-01"]
    for bad in ("a/b/c/d", "a//b", "/a"):
        reply = await api.get(f"/devices?after={quote(bad, safe='')}")
        assert (reply.status, reply.body.get("error")) == (400, "BAD_REQUEST"), (bad, reply.body)


async def test_one_device_by_id_in_the_query_sparkplug_or_native(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    """`GET /device?id=` is `GET /devices/{id}` for any id: a Sparkplug one cannot be in a path
    (the router decodes `%2F` first, and the path splits)."""
    oven = "Plant1/Line4/Oven"
    await add_device(db, oven)
    await add_device(db, "dev-01")
    await add_sample(db, oven, T0, metrics={"temp": 85.25})
    split = await api.get(f"/devices/{quote(oven, safe='')}")
    assert (split.status, split.body["error"]) == (404, "NOT_FOUND")

    reply = await api.get(f"/device?id={quote(oven, safe='')}")
    assert reply.status == 200, reply.body
    device = reply.body["device"]
    assert (device["device_id"], device["presence"], device["bound"]) == (oven, "online", True)
    assert device["latest_metrics"]["temp"]["value"] == 85.25
    native = await api.get("/device?id=dev-01")
    assert native.status == 200, native.body
    assert native.body == (await api.get("/devices/dev-01")).body

    missing = await api.get("/device?id=Plant1%2FLine4%2FPress")
    assert (missing.status, missing.body["error"], missing.body["device_id"]) == (
        404, "NOT_FOUND", "Plant1/Line4/Press",
    )  # fmt: skip
    for bad in ("a%2Fb%2Fc%2Fd", "a%2F%2Fb", "a%0A", "a%20b", ""):
        reply = await api.get(f"/device?id={bad}")
        assert (reply.status, reply.body.get("error")) == (400, "BAD_REQUEST"), (bad, reply.body)
    absent = await api.get("/device")
    assert (absent.status, absent.body.get("error")) == (400, "BAD_REQUEST"), absent.body


async def test_a_device_shows_its_latest_metrics_and_events(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    await add_device(db, "pump-1", "online", bound=False)
    await add_sample(db, "pump-1", T0, metrics={"temp": 20.5, "rpm": 900})
    await add_sample(db, "pump-1", T0 + timedelta(seconds=10), metrics={"temp": 21})
    await add_sample(
        db, "pump-1", T0 + timedelta(seconds=20),
        events=[{"type": "DOOR_OPEN"}, {"type": "ALARM_TEST", "level": 2}],
    )  # fmt: skip
    for n in range(25):
        await add_sample(db, "pump-1", T0 - timedelta(seconds=100 - n), events=[{"type": f"E{n}"}])
    await add_sample(db, "other", T0 + timedelta(hours=1), metrics={"temp": 99})
    await raise_alarm(db, "pump-1")

    reply = await api.get("/devices/pump-1")
    assert reply.status == 200, reply.body
    device = reply.body["device"]
    assert device["bound"] is False
    assert device["open_alarms"] == 1
    assert device["latest_metrics"] == {
        "temp": {"value": 21, "ts": "2026-11-30T12:00:10Z"},
        "rpm": {"value": 900, "ts": "2026-11-30T12:00:00Z"},
    }
    events = device["latest_events"]
    assert len(events) == 20
    assert events[:3] == [
        {"event": "DOOR_OPEN", "ts": "2026-11-30T12:00:20Z"},
        {"event": "ALARM_TEST", "ts": "2026-11-30T12:00:20Z"},
        {"event": "E24", "ts": "2026-11-30T11:58:44Z"},
    ]

    missing = await api.get("/devices/nobody")
    assert (missing.status, missing.body["error"], missing.body["device_id"]) == (
        404, "NOT_FOUND", "nobody",
    )  # fmt: skip
    assert (await api.get("/devices/bad%20id")).status == 400


async def test_telemetry_pages_are_exact_when_samples_share_a_time(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    await add_device(db, "meter-1")
    ids: list[tuple[datetime, str, int]] = []
    for n in range(9):
        ts = T0 + timedelta(seconds=n // 3)  # three samples at each time
        metrics = {"kwh": n} if n % 2 == 0 else {"volts": 230}
        ids.append((ts, await add_sample(db, "meter-1", ts, metrics=metrics, seq=n), n))
    await add_sample(db, "meter-2", T0, metrics={"kwh": 1})
    newest_first = [e for _, e, _ in sorted(ids, reverse=True)]

    for limit in (1, 2, 4):
        walked, before = [], None
        while True:
            reply = await api.get(
                f"/devices/meter-1/telemetry?limit={limit}"
                + (f"&before={before}" if before else "")
            )
            assert reply.status == 200, reply.body
            walked += [s["event_id"] for s in reply.body["samples"]]
            assert reply.body["items"] == reply.body["samples"]  # one envelope, old name kept
            before = reply.body["next_before"]
            if before is None:
                break
        assert walked == newest_first, limit

    page = (await api.get("/devices/meter-1/telemetry?limit=1")).body["samples"][0]
    assert set(page) == {"ts", "seq", "metrics", "events", "event_id"}
    assert page["events"] is None

    kwh = (await api.get("/devices/meter-1/telemetry?metric=kwh")).body["samples"]
    assert [s["metrics"]["kwh"] for s in kwh] == [
        n for *_, n in sorted(ids, reverse=True) if n % 2 == 0
    ]

    window = await api.get(
        "/devices/meter-1/telemetry?since=2026-11-30T12:00:01Z&until=2026-11-30T12:00:02Z"
    )
    assert sorted(s["seq"] for s in window.body["samples"]) == [3, 4, 5]

    for bad in ("before=nope", "before=1-abc", "since=yesterday", "since=2026-11-30T12:00:00"):
        reply = await api.get(f"/devices/meter-1/telemetry?{bad}")
        assert (reply.status, reply.body["error"]) == (400, "BAD_REQUEST"), (bad, reply.body)
    missing = await api.get("/devices/nobody/telemetry")
    assert (missing.status, missing.body["device_id"]) == (404, "nobody")


# Valid RFC 3339 times whose offset puts their UTC instant outside the years 1 to 9999.
PAST_THE_ENDS = ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00")


@pytest.mark.parametrize("param", ["since", "until"])
@pytest.mark.parametrize("ts", PAST_THE_ENDS)
async def test_a_telemetry_window_past_the_ends_of_time_in_utc_is_a_400(
    api: ApiClient, db: asyncpg.Connection, param: str, ts: str
) -> None:
    await add_device(db, "meter-1")
    reply = await api.get(f"/devices/meter-1/telemetry?{param}={ts.replace('+', '%2B')}")
    assert (reply.status, reply.body["error"], reply.body["param"]) == (400, "BAD_REQUEST", param)


# --- dead letters --------------------------------------------------------------------------------


async def add_dead_letter(db: asyncpg.Connection, payload: bytes, reason: str, topic: str) -> int:
    letter_id: int = await db.fetchval(
        "INSERT INTO dead_letter (topic, payload, reason, detail, node_id, payload_size, "
        "payload_sha256) VALUES ($1, $2, $3, 'why', 'n', $4, $5) RETURNING id",
        topic, payload, reason, len(payload), hashlib.sha256(payload).hexdigest(),
    )  # fmt: skip
    return letter_id


async def test_dead_letters_are_listed_and_replayed_by_admins_only(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    good = json.dumps({"ts": "2026-11-30T12:00:00Z", "metrics": {"temp": 5}}).encode()
    replayable = await add_dead_letter(db, good, "UNKNOWN_DEVICE", "iot/devices/late-1/telemetry")
    broken = await add_dead_letter(db, b"{nope", "MALFORMED", "iot/devices/late-2/telemetry")
    others = [
        await add_dead_letter(db, f"x{n}".encode(), "MALFORMED", "iot/devices/x/telemetry")
        for n in range(3)
    ]

    for token in (VIEWER, OPERATOR):
        for method, path in (("GET", "/dead-letters"), ("POST", f"/dead-letters/{broken}/replay")):
            reply = await api.call(method, path, token=token)
            assert (reply.status, reply.body["required_role"]) == (403, "admin"), (token, path)

    listed = await api.get("/dead-letters", token=ADMIN)
    assert listed.status == 200
    assert [d["id"] for d in listed.body["dead_letters"]] == [*reversed(others), broken, replayable]
    assert listed.body["items"] == listed.body["dead_letters"]  # the old name, kept
    first = listed.body["dead_letters"][-1]
    assert set(first) == {
        "id", "topic", "reason", "detail", "size", "kept", "received_at", "node_id",
        "replay_count", "replayed_at", "replay_outcome", "replayable", "not_replayable_because",
    }  # fmt: skip
    assert (first["size"], first["replay_count"], first["replayed_at"]) == (len(good), 0, None)

    malformed = await api.get("/dead-letters?reason=MALFORMED&limit=2", token=ADMIN)
    assert [d["id"] for d in malformed.body["dead_letters"]] == [others[2], others[1]]
    more = await api.get(
        f"/dead-letters?reason=MALFORMED&before={malformed.body['next_before']}", token=ADMIN
    )
    assert [d["id"] for d in more.body["dead_letters"]] == [others[0], broken]
    assert more.body["next_before"] is None

    replayed = await api.call("POST", f"/dead-letters/{replayable}/replay", token=ADMIN)
    assert (replayed.status, replayed.body) == (
        200, {"dead_letter_id": replayable, "outcome": "stored", "succeeded": True},
    )  # fmt: skip
    assert await db.fetchval("SELECT count(*) FROM telemetry WHERE device_id = 'late-1'") == 1
    still = await api.call("POST", f"/dead-letters/{broken}/replay", token=ADMIN)
    assert (still.status, still.body["outcome"], still.body["succeeded"]) == (
        200, "still_invalid: MALFORMED", False,
    )  # fmt: skip
    listed = await api.get("/dead-letters?limit=2", token=ADMIN)
    row = await db.fetchrow(
        "SELECT replay_count, replay_outcome FROM dead_letter WHERE id = $1", replayable
    )
    assert tuple(row) == (1, "stored")
    assert listed.status == 200

    missing = await api.call("POST", "/dead-letters/999999/replay", token=ADMIN)
    assert (missing.status, missing.body["dead_letter_id"]) == (404, 999999)
    assert (await api.call("POST", "/dead-letters/x/replay", token=ADMIN)).status == 400


async def test_a_dead_letter_shows_its_payload_and_whether_a_replay_can_ever_ingest_it(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    text = await add_dead_letter(
        db, b'{"ts": "x", "m\xc3\xa9": 1}', "INVALID", "iot/devices/a/telemetry"
    )
    binary = await add_dead_letter(db, b"\x00\xff\xfe{", "MALFORMED", "iot/devices/b/telemetry")
    bad_id = await add_dead_letter(db, b"{}", "BAD_DEVICE_ID", "iot/devices/b%20c/telemetry")
    cut = await add_dead_letter(db, b'{"ts": ', "OVERSIZED", "iot/devices/c/telemetry")
    await db.execute("UPDATE dead_letter SET payload_size = 70000 WHERE id = $1", cut)

    one = await api.get(f"/dead-letters/{text}", token=ADMIN)
    assert one.status == 200, one.body
    assert one.body["payload_text"] == '{"ts": "x", "mé": 1}'
    assert one.body["payload_hex"] == b'{"ts": "x", "m\xc3\xa9": 1}'.hex()
    assert (one.body["replayable"], one.body["not_replayable_because"]) == (True, None)
    assert (one.body["size"], one.body["kept"], one.body["seen_count"]) == (21, 21, 1)
    raw = (await api.get(f"/dead-letters/{binary}", token=ADMIN)).body
    assert (raw["payload_hex"], raw["payload_text"]) == ("00fffe7b", None)
    listed = {d["id"]: d for d in (await api.get("/dead-letters", token=ADMIN)).body["items"]}
    assert {i: listed[i]["replayable"] for i in (text, binary, bad_id, cut)} == {
        text: True, binary: False, bad_id: False, cut: False,
    }  # fmt: skip
    assert "neither JSON nor MessagePack" in listed[binary]["not_replayable_because"]
    assert "only the first bytes" in listed[cut]["not_replayable_because"]
    assert (listed[cut]["size"], listed[cut]["kept"]) == (70000, 7)

    for token in (VIEWER, OPERATOR):
        for method in ("GET", "DELETE"):
            refused = await api.call(method, f"/dead-letters/{text}", token=token)
            assert (refused.status, refused.body["error"]) == (403, "FORBIDDEN")
    missing = await api.get("/dead-letters/999999", token=ADMIN)
    assert (missing.status, missing.body["error"], missing.body["dead_letter_id"]) == (
        404, "NOT_FOUND", 999999,
    )  # fmt: skip


async def test_discarding_a_dead_letter_deletes_it_with_an_audit_row_once(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    payload = b"{broken"
    letter = await add_dead_letter(db, payload, "MALFORMED", "iot/devices/z/telemetry")
    reply = await api.call(
        "DELETE", f"/dead-letters/{letter}", token=ADMIN, headers={"X-Request-ID": "req-discard-1"}
    )
    assert reply.status == 200, reply.body
    assert (reply.body["dead_letter_id"], reply.body["discarded_by"]) == (letter, "root")
    assert await db.fetchval("SELECT count(*) FROM dead_letter WHERE id = $1", letter) == 0
    audit = await db.fetchrow("SELECT * FROM dead_letter_audit WHERE dead_letter_id = $1", letter)
    assert audit is not None
    assert (audit["action"], audit["actor"], audit["topic"], audit["reason"]) == (
        "discard", "root", "iot/devices/z/telemetry", "MALFORMED",
    )  # fmt: skip
    assert (audit["payload_size"], audit["payload_sha256"], audit["node_id"]) == (
        len(payload), hashlib.sha256(payload).hexdigest(), "api-test",
    )  # fmt: skip
    assert audit["request_id"] == "req-discard-1"

    again = await api.call("DELETE", f"/dead-letters/{letter}", token=ADMIN)
    assert (again.status, again.body["error"], again.body["actor"]) == (
        409, "ALREADY_DISCARDED", "root",
    )  # fmt: skip
    assert again.body["discarded_at"] is not None
    assert await db.fetchval("SELECT count(*) FROM dead_letter_audit") == 1
    gone = await api.get(f"/dead-letters/{letter}", token=ADMIN)
    assert gone.status == 404
    assert (await api.call("POST", f"/dead-letters/{letter}/replay", token=ADMIN)).status == 404
    never = await api.call("DELETE", "/dead-letters/424242", token=ADMIN)
    assert (never.status, never.body["error"]) == (404, "NOT_FOUND")
    assert (await api.call("DELETE", "/dead-letters/0", token=ADMIN)).status == 400


async def test_a_dead_letter_a_replay_holds_is_not_discarded(
    api: ApiClient, db: asyncpg.Connection, db_dsn: str
) -> None:
    letter = await add_dead_letter(db, b"{x", "MALFORMED", "iot/devices/h/telemetry")
    holder = await asyncpg.connect(db_dsn)
    try:
        async with holder.transaction():
            # What a replay does first: the letter locked for the time of its transaction.
            await holder.execute("SELECT id FROM dead_letter WHERE id = $1 FOR UPDATE", letter)
            busy = await api.call("DELETE", f"/dead-letters/{letter}", token=ADMIN)
            assert (busy.status, busy.body["error"], busy.body["dead_letter_id"]) == (
                409, "DEAD_LETTER_BUSY", letter,
            )  # fmt: skip
    finally:
        await holder.close()
    assert await db.fetchval("SELECT count(*) FROM dead_letter WHERE id = $1", letter) == 1
    assert await db.fetchval("SELECT count(*) FROM dead_letter_audit") == 0
    assert (await api.call("DELETE", f"/dead-letters/{letter}", token=ADMIN)).status == 200


async def test_an_audit_row_the_database_refuses_leaves_the_letter(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    letter = await add_dead_letter(db, b"{x", "MALFORMED", "iot/devices/r/telemetry")
    await db.execute(
        "ALTER TABLE dead_letter_audit ADD CONSTRAINT test_refuses CHECK (actor <> 'root')"
    )
    try:
        refused = await api.call("DELETE", f"/dead-letters/{letter}", token=ADMIN)
    finally:
        await db.execute("ALTER TABLE dead_letter_audit DROP CONSTRAINT test_refuses")
    assert (refused.status, refused.body["error"]) == (500, "AUDIT_FAILED")
    assert await db.fetchval("SELECT count(*) FROM dead_letter WHERE id = $1", letter) == 1


# --- stream tickets -----------------------------------------------------------------------------


async def test_a_stream_ticket_is_single_use_and_short_lived(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    issued = await api.call("POST", "/stream/tickets", token=VIEWER)
    assert issued.status == 201, issued.body
    ticket = issued.body["ticket"]
    expires = datetime.fromisoformat(issued.body["expires_at"])
    now = await db.fetchval("SELECT now()")
    assert timedelta(seconds=55) < expires - now <= timedelta(seconds=60)
    stored = await db.fetchrow("SELECT digest, token_name, role FROM stream_ticket")
    assert bytes(stored["digest"]) == hashlib.sha256(ticket.encode()).digest()  # never the ticket
    assert (stored["token_name"], stored["role"]) == ("wall-screen", "viewer")

    timeout = aiohttp.ClientTimeout(total=30)
    async with api.http.get(f"{api.base}/stream?ticket={ticket}", timeout=timeout) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert (await response.content.readline()).startswith(b":")
    again = await api.call("GET", f"/stream?ticket={ticket}", token=None)
    assert (again.status, again.body["error"]) == (401, "UNAUTHORIZED")

    expired = (await api.call("POST", "/stream/tickets", token=ADMIN)).body["ticket"]
    await db.execute("UPDATE stream_ticket SET expires_at = now() - interval '1 second'")
    assert (await api.call("GET", f"/stream?ticket={expired}", token=None)).status == 401
    unknown = "x" * 43
    assert (await api.call("GET", f"/stream?ticket={unknown}", token=None)).status == 401

    # The long-lived token never travels in a URL; no credentials at all is a 401.
    refused = await api.call("GET", f"/stream?token={ADMIN}", token=None)
    assert (refused.status, refused.body["param"]) == (400, "token")
    assert (await api.call("GET", "/stream", token=None)).status == 401
    assert (await api.call("GET", "/stream", token="wrong-token-0123456789")).status == 401
    bad_cursor = await api.call("GET", "/stream?last_event_id=7", token=VIEWER)
    assert (bad_cursor.status, bad_cursor.body["error"]) == (400, "BAD_REQUEST")
    assert (await api.call("POST", "/stream/tickets", token=None)).status == 401


async def test_a_ticket_opens_one_stream_however_many_nodes_race_for_it(db_dsn: str) -> None:
    """Two nodes on one database; 20 requests with the same ticket released at once, spread
    over both: exactly one stream opens, the others are 401."""
    async with (
        serve_api(db_dsn, TOKENS) as node_a,
        serve_api(db_dsn, TOKENS) as node_b,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(
            f"{node_a.base}/stream/tickets", headers={"Authorization": f"Bearer {OPERATOR}"}
        ) as reply:
            ticket = (await reply.json())["ticket"]
        gate = asyncio.Barrier(20)  # all released together
        opened: list[aiohttp.ClientResponse] = []

        async def redeem(n: int) -> int:
            await gate.wait()
            base = (node_a, node_b)[n % 2].base
            response = await http.get(f"{base}/stream?ticket={ticket}")
            if response.status == 200:
                opened.append(response)  # an open stream: closed below
            else:
                response.release()
            return response.status

        statuses = await asyncio.gather(*(redeem(n) for n in range(20)))
        for response in opened:
            response.close()
    assert sorted(statuses) == [200] + [401] * 19


# --- rules ---------------------------------------------------------------------------------------

RULES = """
[node]
id = "api-test"

[[rules]]
key = "temp-high"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
clear_value = 75
severity = "CRITICAL"
devices = "sensor-*"
description = "too hot"

[[rules]]
key = "temp-low"
kind = "threshold"
metric = "temp"
op = "<"
value = 2
severity = "WARNING"

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"

[[rules]]
key = "silent"
kind = "inactivity"
silent_seconds = 300
severity = "WARNING"
"""


async def test_rules_give_a_threshold_rule_its_trigger_and_clear_values(db_dsn: str) -> None:
    async with serve_api(db_dsn, TOKENS, RULES) as served, aiohttp.ClientSession() as http:
        api = ApiClient(served.base, http)
        every = await api.get("/rules", token=VIEWER)
        assert every.status == 200, every.body
        assert [r["key"] for r in every.body["items"]] == [
            "temp-high", "temp-low", "door-open", "silent",
        ]  # fmt: skip
        hot = await api.get("/rules?device=sensor-1&metric=temp", token=VIEWER)
        assert hot.body["items"] == [
            {"key": "temp-high", "kind": "threshold", "severity": "CRITICAL",
             "description": "too hot", "devices": ["sensor-*"], "metric": "temp", "op": ">",
             "value": 80, "clear_value": 75, "for_samples": 1, "for_seconds": 0.0},
            {"key": "temp-low", "kind": "threshold", "severity": "WARNING", "description": "",
             "devices": ["*"], "metric": "temp", "op": "<", "value": 2, "clear_value": 2,
             "for_samples": 1, "for_seconds": 0.0},
        ]  # fmt: skip
        other = await api.get("/rules?device=pump-1&metric=temp", token=VIEWER)
        assert [r["key"] for r in other.body["items"]] == ["temp-low"]
        door = await api.get("/rules?device=pump-1", token=VIEWER)
        assert {r["key"]: r.get("event") for r in door.body["items"]}["door-open"] == "DOOR_OPEN"
        assert (await api.get("/rules?device=a%20b", token=VIEWER)).status == 400
        assert (await api.get("/rules", token=None)).status == 401
