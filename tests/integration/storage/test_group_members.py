"""Migration 0044 (notify_group_member): a database upgraded with groups in it keeps, for each
group that repeats, the notifications its windows carried whose alarm is still open, once each
(its first window's, as that window listed it), oldest first; nothing of alarms dealt with, nor
of a group whose route never repeats. Its next repeat lists them all (docs/notifications.md,
"Repeat")."""

from __future__ import annotations

import json
import uuid

import asyncpg

from storage.migrate import migrate
from tests.support.schema import schema_before, version_of

MEMBERS = version_of("notify_group_member")


async def _alarms(conn: asyncpg.Connection, statuses: list[str]) -> list[int]:
    rows = await conn.fetch(
        """
        INSERT INTO alarm (device_id, rule_key, severity, telemetry_event_id, dedup_key,
                           triggered_at, node_id, status, false_at, false_by)
        SELECT 'dev-' || n, 'hot', 'MAJOR', 'e' || n, 'hot:dev-' || n || ':e' || n, now(), 'n0',
               s, CASE WHEN s = 'FALSE' THEN now() END, CASE WHEN s = 'FALSE' THEN 'op' END
        FROM unnest($1::text[]) WITH ORDINALITY AS u(s, n)
        ORDER BY n
        RETURNING id
        """,
        statuses,
    )
    return sorted(r["id"] for r in rows)


async def _window(
    conn: asyncpg.Connection, group_id: int, window: int, alarm_ids: list[int],
    events: dict[int, uuid.UUID],
) -> None:  # fmt: skip
    """A sent window of the group listing a notification of each alarm (the same event as an
    earlier window's, as a repeat lists it)."""
    notes = [
        {"event": "alarm.created", "event_id": str(events.setdefault(a, uuid.uuid4())),
         "alarm_id": a, "window_seen": window}
        for a in alarm_ids
    ]  # fmt: skip
    body = {"kind": "group", "window": window, "count": len(notes), "notifications": notes}
    delivery = await conn.fetchval(
        "INSERT INTO notify_delivery (event_id, outbox_id, event, receiver, body, status,"
        " finished_at, next_attempt_at, event_created_at, group_id) VALUES ($1, 1,"
        " 'notify.group', 'hook', $2::jsonb, 'SENT', now(), now(), now(), $3) RETURNING id",
        uuid.uuid4(), json.dumps(body), group_id,
    )  # fmt: skip
    await conn.executemany(
        "INSERT INTO notify_delivery_member (delivery_id, event_id, alarm_id) VALUES ($1, $2, $3)",
        [(delivery, events[a], a) for a in alarm_ids],
    )


async def test_an_upgraded_database_keeps_the_open_alarms_of_each_repeating_group(
    empty_db_dsn: str,
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await schema_before(conn, MEMBERS)
        a, b, c, d = await _alarms(conn, ["NEW", "FALSE", "NEW", "NEW"])
        repeating, quiet = [
            await conn.fetchval(
                "INSERT INTO notify_group (receiver, group_key, labels, repeat_interval_s)"
                " VALUES ('hook', $1, '{}', $2) RETURNING id",
                key, repeat,
            )
            for key, repeat in (("routes[0]{rule=hot}", 3600.0), ("routes[1]{}", 0.0))
        ]  # fmt: skip
        events: dict[int, uuid.UUID] = {}
        await _window(conn, repeating, 1, [a, b], events)
        await _window(conn, repeating, 2, [c], events)
        await _window(conn, repeating, 3, [a, c], events)  # a repeat: the same events
        await _window(conn, quiet, 1, [d], {})
        assert MEMBERS in await migrate(conn)
        rows = await conn.fetch(
            "SELECT group_id, event_id, alarm_id, body FROM notify_group_member ORDER BY seq"
        )
        assert [(r["group_id"], r["event_id"], r["alarm_id"]) for r in rows] == [
            (repeating, events[a], a),
            (repeating, events[c], c),
        ]
        assert [json.loads(r["body"])["window_seen"] for r in rows] == [1, 2]
    finally:
        await conn.close()
