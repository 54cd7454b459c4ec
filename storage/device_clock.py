"""Per-device clock figures: counted by the ingest batch that judged the samples, read by the
device API (docs/rules-and-alarms.md, "Device clocks")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from storage.sql import load_queries

_Q = load_queries("device_clock.sql")
RECORD_ADJUSTMENTS = _Q["record_adjustments"]
DEVICE_ADJUSTMENTS = _Q["device_adjustments"]


@dataclass(frozen=True, slots=True)
class ClockFigure:
    """How often one device's samples were adjusted for one reason, and the last time."""

    device_id: str
    reason: str
    count: int
    last_received_at: datetime  # the database time of the batch that judged it
    last_device_ts: datetime  # the time the sample was sent with
    last_judged_ts: datetime  # the time it was judged at


async def record_adjustments(conn: asyncpg.Connection, figures: Sequence[ClockFigure]) -> None:
    """Add `figures` (one per device and reason) in the caller's transaction; the counts
    are added to what other batches and nodes counted, never overwritten."""
    if not figures:
        return
    ordered = sorted(figures, key=lambda f: (f.device_id, f.reason))
    await conn.execute(
        RECORD_ADJUSTMENTS,
        [f.device_id for f in ordered],
        [f.reason for f in ordered],
        [f.count for f in ordered],
        [f.last_received_at for f in ordered],
        [f.last_device_ts for f in ordered],
        [f.last_judged_ts for f in ordered],
    )


async def device_adjustments(
    conn: asyncpg.Connection | asyncpg.Pool, device_id: str
) -> list[ClockFigure]:
    """The device's figures, one per reason, the latest adjustment first."""
    rows = await conn.fetch(DEVICE_ADJUSTMENTS, device_id)
    return [
        ClockFigure(
            device_id,
            row["reason"],
            int(row["count"]),
            row["last_received_at"],
            row["last_device_ts"],
            row["last_judged_ts"],
        )
        for row in rows
    ]
