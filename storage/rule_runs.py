"""The stored samples and alarms a late sample's run is judged again from
(gateway.domain.rules.runs), read on the caller's ingest transaction."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import asyncpg
import msgspec

from protocol import MetricValue
from storage.sql import load_queries

_Q = load_queries("rule_runs.sql")
SAMPLES_BEFORE = _Q["samples_before"]
SAMPLES_FROM = _Q["samples_from"]
ALARMS_AFTER = _Q["alarms_after"]
DEVICE_SEQS = _Q["device_seqs"]
NEWEST_SAMPLES = _Q["newest_samples"]

_VALUE = msgspec.json.Decoder(int | float | bool | str)

# (device time, seq, event id, value) of one stored sample of a metric.
Sample = tuple[datetime, int | None, str, MetricValue]


def _samples(rows: list[asyncpg.Record]) -> list[Sample]:
    return [(row["ts"], row["seq"], row["event_id"], _VALUE.decode(row["value"])) for row in rows]


async def samples_before(
    conn: asyncpg.Connection, device_id: str, metric: str, at: datetime, limit: int
) -> list[Sample]:
    """The device's stored samples of ``metric`` at or before ``at``, newest first."""
    return _samples(await conn.fetch(SAMPLES_BEFORE, device_id, metric, at, limit))


async def samples_from(
    conn: asyncpg.Connection,
    device_id: str,
    metric: str,
    since: datetime,
    limit: int,
    *,
    max_future_skew_s: float,
) -> list[Sample]:
    """The device's stored samples of ``metric`` from ``since`` on, oldest first; one dated
    more than ``max_future_skew_s`` ahead of its receipt at its receipt (judged there), in
    its place among the others (left out where that is before ``since``, unless ``limit``
    rows came: a full page stays full, which the caller leaves to the ordering rule)."""
    rows = await conn.fetch(SAMPLES_FROM, device_id, metric, since, limit, max_future_skew_s)
    samples = _samples(rows)
    if len(samples) < limit:
        samples = [s for s in samples if s[0] >= since]
    # Stable: the database's order (device time, then seq, no seq first) but for those moved.
    samples.sort(key=lambda s: (s[0], s[1] is not None, s[1] or 0))
    return samples


async def alarms_after(
    conn: asyncpg.Connection, device_id: str, rule_key: str, after: datetime
) -> list[tuple[datetime, str]]:
    """The alarms of (device, rule) raised by a sample dated after ``after``, oldest first:
    (that sample's device time, its event id)."""
    rows = await conn.fetch(ALARMS_AFTER, device_id, rule_key, after)
    return [(row["sample_ts"], row["event_id"]) for row in rows]


async def device_seqs(
    conn: asyncpg.Connection, device_id: str, since: datetime, limit: int
) -> frozenset[int]:
    """The seqs of the device's stored messages from ``since`` on (any metric, any event)."""
    return frozenset(row["seq"] for row in await conn.fetch(DEVICE_SEQS, device_id, since, limit))


async def newest_samples(
    conn: asyncpg.Connection, wanted: Sequence[tuple[str, str, datetime | None, int | None]]
) -> list[Sample | None]:
    """The newest stored sample of each (device id, metric, device time, seq) of ``wanted``,
    in its order (None: none stored), in one statement: the sample of that device time and
    seq (the newest a rule state judged) where it holds the metric, else the newest by
    device time."""
    found: list[Sample | None] = [None] * len(wanted)
    if not wanted:
        return found
    rows = await conn.fetch(
        NEWEST_SAMPLES,
        [device for device, _, _, _ in wanted],
        [metric for _, metric, _, _ in wanted],
        [ts for _, _, ts, _ in wanted],
        [seq for _, _, _, seq in wanted],
    )
    for row in rows:
        found[row["n"] - 1] = (row["ts"], row["seq"], row["event_id"], _VALUE.decode(row["value"]))
    return found
