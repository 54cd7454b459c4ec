"""Silences and deliveries over real HTTP against real PostgreSQL (behaviour §6, §9, §14)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg
import pytest
from structlog.testing import capture_logs

from gateway.config import TokenConfig
from tests.support.api_client import ADMIN, OPERATOR, VIEWER, ApiClient
from tests.support.api_server import serve_api

TOKENS = [
    TokenConfig(token=VIEWER, role="viewer", name="wall-screen"),
    TokenConfig(token=OPERATOR, role="operator", name="night shift"),
    TokenConfig(token=ADMIN, role="admin", name="root"),
]


@pytest.fixture
async def api(db_dsn: str) -> AsyncIterator[ApiClient]:
    async with serve_api(db_dsn, TOKENS) as served, aiohttp.ClientSession() as http:
        yield ApiClient(served.base, http)


def _later(hours: float = 1) -> str:
    return (datetime.now(UTC) + timedelta(hours=hours)).isoformat()


async def test_create_list_and_expire_a_silence(api: ApiClient, db: asyncpg.Connection) -> None:
    body = {
        "matchers": {"rules": ["hot"], "devices": "lab-*", "severities": ["MAJOR"]},
        "ends_at": _later(),
        "comment": "maintenance",
    }
    with capture_logs() as logs:
        created = await api.call("POST", "/silences", token=OPERATOR, json=body)
    assert created.status == 201, created.body
    silence = created.body
    assert silence["created_by"] == "night shift"
    assert silence["matchers"] == body["matchers"]
    assert silence["active"] is True
    assert silence["comment"] == "maintenance"
    assert OPERATOR not in repr(logs)
    # Omitted matchers match everything: stored as absent, not as empty.
    everything = await api.call("POST", "/silences", token=OPERATOR, json={"ends_at": _later()})
    assert everything.status == 201, everything.body
    assert everything.body["matchers"] == {}

    listed = await api.get("/silences")
    assert listed.status == 200
    assert [s["id"] for s in listed.body["items"]] == [everything.body["id"], silence["id"]]
    page = await api.get("/silences?limit=1")
    assert page.body["next_before"] == everything.body["id"]

    expired = await api.call("DELETE", f"/silences/{silence['id']}", token=OPERATOR)
    assert expired.status == 200, expired.body
    assert expired.body["active"] is False
    assert expired.body["expired_by"] == "night shift"
    active = await api.get("/silences?active=true")
    assert [s["id"] for s in active.body["items"]] == [everything.body["id"]]
    # Expiring again answers it as it is; an unknown id is a 404.
    again = await api.call("DELETE", f"/silences/{silence['id']}", token=OPERATOR)
    assert again.status == 200
    assert again.body["ends_at"] == expired.body["ends_at"]
    missing = await api.call("DELETE", "/silences/999999", token=OPERATOR)
    assert (missing.status, missing.body["error"]) == (404, "NOT_FOUND")
    # An end already past makes an ended silence (it silences nothing).
    past = await api.call(
        "POST", "/silences", token=OPERATOR, json={"ends_at": "2001-01-01T00:00:00Z"}
    )
    assert (past.status, past.body["active"]) == (201, False)
    assert await db.fetchval("SELECT count(*) FROM notify_silence") == 3


@pytest.mark.parametrize(
    "body",
    [
        {"matchers": {"rules": ["hot"]}},  # no ends_at
        {"ends_at": "tomorrow"},
        {"ends_at": "2030-01-01T00:00:00"},  # no offset
        {"ends_at": "0001-01-01T00:00:00+01:00"},  # in year 0 in UTC
        {"ends_at": "9999-12-31T23:59:59-01:00"},  # in year 10000 in UTC
        {"ends_at": "9999-12-31T23:59:59.999999Z"},  # the driver's infinity
        {"ends_at": "0001-01-01T00:00:00Z"},  # the driver's -infinity
        {"ends_at": "2030-01-01T00:00:00Z", "matchers": {"rules": []}},
        {"ends_at": "2030-01-01T00:00:00Z", "matchers": {"rules": ["bad key"]}},
        {"ends_at": "2030-01-01T00:00:00Z", "matchers": {"devices": "x y"}},
        {"ends_at": "2030-01-01T00:00:00Z", "matchers": {"devices": "d" * 65}},
        {"ends_at": "2030-01-01T00:00:00Z", "matchers": {"severities": ["HIGH"]}},
        {"ends_at": "2030-01-01T00:00:00Z", "matchers": {"labels": {}}},
        {"ends_at": "2030-01-01T00:00:00Z", "comment": "a\u0000b"},
        {"ends_at": "2030-01-01T00:00:00Z", "extra": 1},
    ],
)
async def test_a_bad_silence_is_a_4xx_and_changes_nothing(
    api: ApiClient, db: asyncpg.Connection, body: dict[str, object]
) -> None:
    reply = await api.call("POST", "/silences", token=OPERATOR, json=body)
    assert 400 <= reply.status < 500, reply.body
    assert reply.body["error"] in {"INVALID_BODY", "BAD_REQUEST"}, reply.body
    assert await db.fetchval("SELECT count(*) FROM notify_silence") == 0


async def test_silences_need_an_operator_and_reads_a_viewer(api: ApiClient) -> None:
    refused = await api.call("POST", "/silences", token=VIEWER, json={"ends_at": _later()})
    assert (refused.status, refused.body["error"]) == (403, "FORBIDDEN")
    anonymous = await api.get("/silences", token=None)
    assert anonymous.status == 401
    assert (await api.get("/deliveries", token=None)).status == 401
    assert (await api.call("DELETE", "/silences/1", token=VIEWER)).status == 403


async def _delivery(
    db: asyncpg.Connection, receiver: str, status: str, event: str = "alarm.created"
) -> int:
    silence = None
    if status == "SILENCED":
        silence = await db.fetchval(
            "INSERT INTO notify_silence (matchers, ends_at, created_by) "
            "VALUES ('{}', now() + interval '1 h', 't') RETURNING id"
        )
    value = await db.fetchval(
        """
        INSERT INTO notify_delivery (event_id, outbox_id, event, receiver, body, status,
            attempts, last_error, silence_id, event_created_at, finished_at, lease_owner,
            lease_until)
        VALUES ($1, 1, $2, $3, '{"event": "x"}', $4, 1, $5, $6, now(),
            CASE WHEN $4 IN ('SENT', 'FAILED', 'SILENCED') THEN now() END,
            CASE WHEN $4 = 'SENDING' THEN 'n1' END,
            CASE WHEN $4 = 'SENDING' THEN now() END)
        RETURNING id
        """,
        uuid.uuid4(),
        event,
        receiver,
        status,
        "HTTP 500: nope" if status == "FAILED" else None,
        silence,
    )
    return int(value)


async def test_deliveries_filtered_paged_and_one_with_its_body(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    failed = await _delivery(db, "hook", "FAILED")
    sent = await _delivery(db, "hook", "SENT")
    mail = await _delivery(db, "mail", "FAILED", event="command.failed")
    silenced = await _delivery(db, "mail", "SILENCED")

    everything = await api.get("/deliveries")
    assert [d["id"] for d in everything.body["items"]] == [silenced, mail, sent, failed]
    only_failed = await api.get("/deliveries?status=FAILED")
    assert [d["id"] for d in only_failed.body["items"]] == [mail, failed]
    assert only_failed.body["items"][0]["last_error"] == "HTTP 500: nope"
    hook_failed = await api.get("/deliveries?status=FAILED&receiver=hook")
    assert [d["id"] for d in hook_failed.body["items"]] == [failed]
    by_event = await api.get("/deliveries?event=command.failed")
    assert [d["id"] for d in by_event.body["items"]] == [mail]
    page = await api.get("/deliveries?limit=2")
    assert page.body["next_before"] == mail
    rest = await api.get(f"/deliveries?before={mail}")
    assert [d["id"] for d in rest.body["items"]] == [sent, failed]

    one = await api.get(f"/deliveries/{failed}")
    assert one.status == 200
    assert one.body["body"] == {"event": "x"}
    assert one.body["status"] == "FAILED"
    missing = await api.get("/deliveries/999999")
    assert (missing.status, missing.body["error"]) == (404, "NOT_FOUND")
    for bad in ("status=LOST", "receiver=a%20b", "event=Alarm", "limit=0", "before=x", "nope=1"):
        reply = await api.get(f"/deliveries?{bad}")
        assert (reply.status, reply.body["error"]) == (400, "BAD_REQUEST"), (bad, reply.body)
    assert (await api.get("/deliveries/abc")).status == 400
