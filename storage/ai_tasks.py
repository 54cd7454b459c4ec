"""AI summary tasks: conditional writes for claim, result and sweep. Tasks come back as
:class:`AiTaskRow` (``request_payload`` decoded), a due task as :class:`DueTask`.

What came from the model's server (its raw response, an error message quoting it, the model
name it reported) is written through :func:`storable`: PostgreSQL text cannot hold a NUL, and
a refused write would leave the task PROCESSING with its answer lost."""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

import asyncpg
import msgspec

from protocol.events import AlarmCreated, EventType
from storage.sql import load_queries

_Q = load_queries("ai_tasks.sql")
INSERT_TASK = _Q["insert_task"]
INSERT_FIRST_TASKS = _Q["insert_first_tasks"]
LOCK_DUE = _Q["lock_due"]
START = _Q["start"]
ALARM_REASON = _Q["alarm_reason"]
RECENT_TELEMETRY = _Q["recent_telemetry"]
SUCCEED = _Q["succeed"]
FAIL = _Q["fail"]
FINISHED_BY_CLAIM = _Q["finished_by_claim"]
SWEEP_LOST = _Q["sweep_lost"]
RESET = _Q["reset"]
RELEASE = _Q["release"]
LATEST_FOR_ALARM = _Q["latest_for_alarm"]
FOR_ALARM = _Q["for_alarm"]


# What PostgreSQL text cannot hold: NUL, and a surrogate (no UTF-8 encodes one alone).
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> str:
    """``text`` as PostgreSQL text can hold it: each NUL (or lone surrogate) written as its
    JSON escape, ``\\u0000``; any other text unchanged."""
    return _UNSTORABLE.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


class AiTaskRow(msgspec.Struct, frozen=True, kw_only=True):
    """One ``ai_task`` row, its columns in table order, ``request_payload`` decoded."""

    id: int
    alarm_id: int
    attempt: int
    status: str
    model_name: str
    prompt_version: str
    request_payload: dict[str, Any] | None
    raw_response: str | None
    summary: str | None
    possible_cause: str | None
    inspection_suggestion: str | None
    risk_level: str | None
    confidence: float | None
    error_code: str | None
    error_message: str | None
    claim_token: uuid.UUID | None
    claimed_by: str | None
    created_at: datetime
    next_attempt_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    payload_pruned_at: datetime | None


class DueTask(msgspec.Struct, frozen=True, kw_only=True):
    """A PENDING task whose time has come, locked by :func:`lock_due`."""

    id: int
    alarm_id: int
    attempt: int
    model_name: str
    prompt_version: str


def task_row(record: asyncpg.Record) -> AiTaskRow:
    """A task row from a statement returning ``ai_task``'s columns: a column the row does not
    name fails here, not at a later lookup."""
    values = dict(record.items())
    if isinstance(values["request_payload"], str):  # jsonb comes as its text
        values["request_payload"] = msgspec.json.decode(values["request_payload"])
    return AiTaskRow(**values)


def _row(record: asyncpg.Record | None) -> AiTaskRow | None:
    return None if record is None else task_row(record)


async def insert_task(
    conn: asyncpg.Connection,
    *,
    alarm_id: int,
    attempt: int,
    model_name: str,
    prompt_version: str,
    delay_s: float = 0.0,
) -> int | None:
    value = await conn.fetchval(INSERT_TASK, alarm_id, attempt, model_name, prompt_version, delay_s)
    return None if value is None else int(value)


async def insert_first_tasks(
    conn: asyncpg.Connection, alarm_ids: Sequence[int], *, model_name: str, prompt_version: str
) -> None:
    """Attempt 1 of each alarm's summary, due now, in one statement."""
    await conn.execute(INSERT_FIRST_TASKS, list(alarm_ids), model_name, prompt_version)


async def lock_due(conn: asyncpg.Connection, prompt_versions: Sequence[str]) -> DueTask | None:
    """One due PENDING task whose prompt version is one of ``prompt_versions``, locked."""
    record = await conn.fetchrow(LOCK_DUE, list(prompt_versions))
    return None if record is None else DueTask(**dict(record.items()))


async def start(
    conn: asyncpg.Connection,
    task_id: int,
    token: uuid.UUID,
    worker: str,
    request_payload: dict[str, Any],
    *,
    model_name: str,
) -> asyncpg.Record | None:
    payload = msgspec.json.encode(request_payload).decode()
    return await conn.fetchrow(START, task_id, token, worker, payload, model_name)


async def alarm_reason(conn: asyncpg.Connection, alarm_id: int) -> str | None:
    """Why the rule raised the alarm: kept with it; for an alarm created before migration
    0058, the reason in its ``alarm.created`` event, None once that event is pruned."""
    row = await conn.fetchrow(ALARM_REASON, alarm_id, EventType.ALARM_CREATED)
    if row is None:
        return None
    if row["reason"] is not None:
        return str(row["reason"])
    payload = row["created"]
    if payload is None:
        return None
    try:
        return msgspec.json.decode(payload, type=AlarmCreated).reason
    except msgspec.ValidationError:
        return None


async def recent_telemetry(
    conn: asyncpg.Connection, device_id: str, until: datetime, limit: int
) -> list[dict[str, Any]]:
    """The ``limit`` samples of the device stored by ``until`` (an alarm's triggered_at),
    newest device time first: by receipt, so a clock running ahead loses none of them."""
    rows = await conn.fetch(RECENT_TELEMETRY, device_id, until, limit)
    return [
        {
            "ts": row["ts"].isoformat(),
            "metrics": None if row["metrics"] is None else msgspec.json.decode(row["metrics"]),
            "events": None if row["events"] is None else msgspec.json.decode(row["events"]),
        }
        for row in rows
    ]


async def succeed(
    conn: asyncpg.Connection,
    task_id: int,
    token: uuid.UUID,
    *,
    summary: str,
    possible_cause: str,
    inspection_suggestion: str,
    risk_level: str,
    confidence: float,
    raw_response: str,
    model_name: str,
) -> AiTaskRow | None:
    return _row(
        await conn.fetchrow(
            SUCCEED,
            task_id,
            token,
            summary,
            possible_cause,
            inspection_suggestion,
            risk_level,
            confidence,
            storable(raw_response),
            storable(model_name),
        )
    )


async def fail(
    conn: asyncpg.Connection,
    task_id: int,
    token: uuid.UUID,
    *,
    error_code: str,
    error_message: str,
    raw_response: str | None,
) -> AiTaskRow | None:
    raw = None if raw_response is None else storable(raw_response)
    return _row(await conn.fetchrow(FAIL, task_id, token, error_code, storable(error_message), raw))


async def finished_by_claim(
    conn: asyncpg.Connection, task_id: int, token: uuid.UUID
) -> AiTaskRow | None:
    """The task as the result of claim ``token`` left it, or None (not finished by it)."""
    return _row(await conn.fetchrow(FINISHED_BY_CLAIM, task_id, token))


async def sweep_lost(conn: asyncpg.Connection, timeout_s: float) -> list[AiTaskRow]:
    return [task_row(r) for r in await conn.fetch(SWEEP_LOST, timeout_s)]


async def reset(conn: asyncpg.Connection, task_id: int) -> bool:
    return await conn.fetchval(RESET, task_id) is not None


async def release(conn: asyncpg.Connection, task_id: int, token: uuid.UUID) -> bool:
    """Claim ``token`` gives its task back (PENDING, due now); False if no longer its own."""
    return await conn.fetchval(RELEASE, task_id, token) is not None


async def latest_for_alarm(conn: asyncpg.Connection, alarm_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(LATEST_FOR_ALARM, alarm_id)


async def for_alarm(conn: asyncpg.Connection, alarm_id: int) -> list[asyncpg.Record]:
    return list(await conn.fetch(FOR_ALARM, alarm_id))
