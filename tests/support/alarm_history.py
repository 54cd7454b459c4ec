"""A scripted alarm history: alarms and their audit rows written with chosen times, straight
into a real PostgreSQL (the figures read what the tables hold, whoever wrote it)."""

from __future__ import annotations

import itertools
from datetime import datetime

import asyncpg

_EVENTS = itertools.count(1)
PERSON_COLUMNS = {"confirm": "confirmed", "handle": "handled", "close": "closed", "false": "false"}
_STATUS_AFTER = {"confirm": "CONFIRMED", "handle": "HANDLED", "close": "CLOSED", "false": "FALSE"}


async def raise_alarm(
    conn: asyncpg.Connection,
    rule: str,
    device: str,
    at: datetime,
    *,
    severity: str = "WARNING",
    actions: tuple[tuple[str, str, datetime], ...] = (),
) -> int:
    """An alarm raised at ``at`` (its creation audit row too), then people's ``actions``
    (action, actor, when) applied to its row and audited; its status is the last action's
    (NEW without any). Open alarms hold no active key: any number of a pair coexist."""
    event = f"ev-{next(_EVENTS)}"
    columns: dict[str, object] = {}
    status = "NEW"
    for action, actor, when in actions:
        prefix = PERSON_COLUMNS[action]
        columns[f"{prefix}_at"] = when
        columns[f"{prefix}_by"] = actor
        status = _STATUS_AFTER[action]
    names = ", ".join(columns)
    values = ", ".join(f"${n}" for n in range(9, 9 + len(columns)))
    alarm_id: int = await conn.fetchval(
        f"""INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id,
                               dedup_key, triggered_at, node_id, created_at
                               {", " + names if names else ""})
            VALUES ($1, $2, $3, $4, $5, $6, $7, 'history', $8 {", " + values if values else ""})
            RETURNING id""",  # noqa: S608 - column names from PERSON_COLUMNS
        device,
        rule,
        severity,
        status,
        event,
        f"{rule}:{device}:{event}",
        at,
        at,
        *columns.values(),
    )
    await audit(
        conn, alarm_id, "system:rules", action="create", from_status=None, to_status="NEW", at=at
    )
    before = "NEW"
    for action, actor, when in actions:
        after = _STATUS_AFTER[action]
        await audit(
            conn, alarm_id, actor, action=action, from_status=before, to_status=after, at=when
        )
        before = after
    return alarm_id


async def audit(
    conn: asyncpg.Connection,
    alarm_id: int,
    actor: str,
    *,
    action: str,
    from_status: str | None,
    to_status: str,
    at: datetime,
) -> None:
    await conn.execute(
        """INSERT INTO alarm_audit (alarm_id, actor, action, from_status, to_status, node_id, at)
           VALUES ($1, $2, $3, $4, $5, 'history', $6)""",
        alarm_id,
        actor,
        action,
        from_status,
        to_status,
        at,
    )
