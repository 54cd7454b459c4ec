"""Batched writes of the ingest path, all on the caller's connection and transaction."""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from hashlib import sha256
from typing import NamedTuple

import asyncpg
import msgspec

from storage.sql import lines, load_queries

_Q = load_queries("ingest.sql")
INSERT_TELEMETRY = _Q["insert_telemetry"]
UPSERT_PRESENCE = _Q["upsert_presence"]
UPSERT_DEVICE_MAPPINGS = _Q["upsert_device_mappings"]
DEVICE_MAPPINGS = _Q["device_mappings"]
INSERT_DEAD_LETTERS = _Q["insert_dead_letters"]
LIST_DEAD_LETTERS = _Q["list_dead_letters"]
LOCK_DEAD_LETTER = _Q["lock_dead_letter"]
DEAD_LETTERS_OF_REASON = _Q["dead_letters_of_reason"]
MARK_DEAD_LETTER_REPLAYED = _Q["mark_dead_letter_replayed"]
HEARD_SINCE = _Q["heard_since"]
COUNT_TELEMETRY = _Q["count_telemetry"]
PING = _Q["ping"]
ASSIGNED_XACT_ID = _Q["assigned_xact_id"]
XACT_STATUS = _Q["xact_status"]
CLOCK_NOW = _Q["clock_now"]
RECORD_MAPPED_FRAMES = _Q["record_mapped_frames"]


class Xact(NamedTuple):
    """A transaction that wrote: its id, and when the server that gave it started. Whether it
    committed can be asked later (`xact_status`), of that server only."""

    id: int
    server_started: datetime


class TelemetryRow(msgspec.Struct, frozen=True, gc=False):
    """One telemetry row to insert (a Struct: one per message, cheaper to build than a
    frozen dataclass). The time is whole microseconds since 1970-01-01T00:00:00Z
    (`Telemetry.micros`), sent as text and turned back exactly by the statement. The JSON
    texts are a JSON encoder's (one line: a newline inside a string is escaped)."""

    event_id: str
    device_id: str
    ts_us: int
    seq: int | None
    metrics_json: str | None
    events_json: str | None


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    topic: str
    payload: bytes  # what is kept: the whole payload, or its first bytes only
    reason: str
    detail: str
    payload_size: int  # of the whole payload as it arrived
    payload_sha256: str  # of the whole payload, hex
    # When the node read it off the broker, on the monotonic clock (``Inbound.received_at``):
    # its ``received_at``, however long it then waited in the node; None: when it is stored.
    received: float | None = None

    @property
    def truncated(self) -> bool:
        return self.payload_size > len(self.payload)

    @classmethod
    def whole(cls, topic: str, payload: bytes, reason: str, detail: str) -> DeadLetterRow:
        """A dead letter keeping all of ``payload``."""
        return cls(topic, payload, reason, detail, len(payload), sha256(payload).hexdigest())


@dataclass(frozen=True, slots=True)
class StoredDeadLetter:
    id: int
    topic: str
    payload: bytes
    reason: str
    detail: str
    received_at: datetime
    node_id: str
    replay_count: int
    replayed_at: datetime | None
    replay_outcome: str | None
    payload_size: int
    payload_sha256: str
    seen_count: int
    last_seen_at: datetime

    @property
    def truncated(self) -> bool:
        return self.payload_size > len(self.payload)


async def insert_telemetry(
    conn: asyncpg.Connection, rows: Sequence[TelemetryRow], node_id: str
) -> set[str]:
    """Insert rows, ignoring event ids already stored; return the ids that were new."""
    new, _, _ = await insert_telemetry_at(conn, rows, node_id)
    return new


async def insert_telemetry_at(
    conn: asyncpg.Connection,
    rows: Sequence[TelemetryRow],
    node_id: str,
    devices: Collection[str] = (),
    heard_at: datetime | None = None,
) -> tuple[set[str], datetime | None, Xact | None]:
    """`insert_telemetry`, the transaction's time on the database clock when a row was new
    (None when none was: nothing new to judge), and the transaction (None when nothing was
    sent); ``devices`` heard from are touched in the same statement (`touch_devices`), as
    heard now, or at ``heard_at`` (a replayed dead letter's receipt: a newer last_seen
    stays)."""
    if not rows and not devices:
        return set(), None, None
    # A column a parameter, each a text of lines; an empty line is NULL (ingest.sql).
    new, db_now, new_ids, xid, started = await conn.fetchrow(
        INSERT_TELEMETRY,
        lines([r.event_id for r in rows]),
        lines([r.device_id for r in rows]),
        "\n".join([str(r.ts_us) for r in rows]),
        "\n".join(["" if (seq := r.seq) is None else str(seq) for r in rows]),
        lines([r.metrics_json or "" for r in rows]),
        lines([r.events_json or "" for r in rows]),
        node_id,
        len(rows),
        lines(sorted(devices)),
        heard_at,
    )
    xact = Xact(xid, started)
    if not new:
        return set(), None, xact
    return {r.event_id for r in rows} if new_ids is None else set(new_ids), db_now, xact


async def assigned_xact_id(conn: asyncpg.Connection) -> Xact | None:
    """The caller's transaction if it has an id (it wrote something), else None."""
    xid, started = await conn.fetchrow(ASSIGNED_XACT_ID)
    return None if xid is None else Xact(xid, started)


async def xact_status(conn: asyncpg.Connection, xact: Xact) -> tuple[bool, str | None]:
    """Whether ``conn``'s server is the one that gave ``xact`` its id, not restarted since,
    and if so whether it committed: 'committed', 'aborted', 'in progress', or None when it is
    too old to tell. Another server cannot tell (its status is None). Call it outside a
    transaction: 'committed' returns only once the answer's own commit has, which waits for a
    synchronous standby as the batch's COMMIT did (a timeout, a lost connection: ask again)."""
    same, status, _ = await conn.fetchrow(XACT_STATUS, xact.id, xact.server_started)
    return bool(same), status


async def touch_devices(conn: asyncpg.Connection, device_ids: Collection[str]) -> None:
    """Register unseen devices and move ``last_seen`` of the others to now."""
    await insert_telemetry_at(conn, (), "", device_ids)


async def record_presence(
    conn: asyncpg.Connection,
    presence: dict[str, str],
    heard_at: datetime | None = None,
    *,
    received: Mapping[str, float] | None = None,
    node_id: str | None = None,
) -> Xact | None:
    """Store the latest presence per device (``online``/``offline``), observed now or at
    ``heard_at`` (a replayed dead letter's receipt). ``received``: when ``node_id`` read each
    one off the broker, on the monotonic clock (the event loop's, ``Inbound.received_at``);
    a presence read before the one stored (by another node) is not applied. The
    transaction (None when there was nothing to store)."""
    if not presence:
        return None
    ids = sorted(presence)
    # Ages, not times: the statement puts them on the database's clock (its own start less
    # the age), so nodes' receipts compare on one clock whatever their wall clocks say.
    now = time.monotonic()
    ages = [receipt_age(now, (received or {}).get(i)) for i in ids]
    xid, started = await conn.fetchrow(
        UPSERT_PRESENCE, ids, [presence[i] for i in ids], heard_at, ages, node_id
    )
    return Xact(xid, started)


def receipt_age(now: float, received_at: float | None) -> float | None:
    """Seconds since ``received_at`` (monotonic), or None when unknown or out of bounds (not
    on this clock: no age rather than a wrong one)."""
    if received_at is None or received_at <= 0:
        return None
    age = now - received_at
    return age if 0.0 <= age < _MAX_RECEIPT_AGE_S else None


# No age a message reaches on its way: a batch waits as long as the database is away (the
# writer stores it again until it is back, the age measured again at each attempt), an hour
# and more; an age dropped there (the bound was an hour) left the presence with no receipt,
# stored in commit order. Only what the statement could not put on a timestamp is left out.
_MAX_RECEIPT_AGE_S = 1000.0 * 86400.0


async def record_mapped_frames(
    conn: asyncpg.Connection,
    frames: Sequence[tuple[str, str]],
    window_s: float,
    due: Mapping[str, tuple[str, dict[str, str]]],
    mapped: Mapping[str, tuple[str, dict[str, str]]],
) -> tuple[set[int], dict[str, tuple[str, dict[str, str]]]]:
    """Which of ``frames`` (device id, frame identity; in the batch's order) are a frame read
    from their device just before, within ``window_s`` (the stored one, or the one before in
    the list): their positions; and the mappings recorded. Records ``due`` (device id ->
    its mapping and wildcards, as `record_device_mappings`) in the same statement, one round
    trip in all. Each device's last frame becomes the stored one, on its mapping record,
    locked until the caller's transaction ends (nodes decide one after another). A device
    with a frame but no record (``mapped`` holds its mapping) is recorded."""
    last: dict[str, str] = {}
    for device, frame in frames:
        last[device] = frame
    record = dict(due)
    devices = sorted(last.keys() | record.keys())
    before: dict[str, str | None] = {}
    # Asked again only for devices the statement found no record of (module doc of the
    # statement): a record another node's batch inserted meanwhile, or one lost.
    for _ in range(3):
        rows = await conn.fetch(
            RECORD_MAPPED_FRAMES,
            devices,
            [record[d][0] if d in record else None for d in devices],
            [json.dumps(record[d][1], sort_keys=True) if d in record else None for d in devices],
            [last.get(d) for d in devices],
            float(window_s),
        )
        for row in rows:
            before[row["device_id"]] = row["frame"] if row["recent"] else None
        devices = [d for d in devices if d not in before]
        if not devices:
            break
        record.update((d, mapped[d]) for d in devices if d in mapped)
    again: set[int] = set()
    for position, (device, frame) in enumerate(frames):
        if before.get(device) == frame:
            again.add(position)
        before[device] = frame
    return again, record


async def record_device_mappings(
    conn: asyncpg.Connection, mapped: dict[str, tuple[str, dict[str, str]]]
) -> None:
    """Which mapping each device was read through, with its topic wildcards."""
    if mapped:
        ids = sorted(mapped)
        await conn.execute(
            UPSERT_DEVICE_MAPPINGS,
            ids,
            [mapped[i][0] for i in ids],
            [json.dumps(mapped[i][1], sort_keys=True) for i in ids],
        )


async def device_mappings(
    conn: asyncpg.Connection | asyncpg.Pool, device_ids: Sequence[str]
) -> dict[str, tuple[str, dict[str, str]]]:
    """The mapping and topic wildcards of each of ``device_ids`` seen through a mapping."""
    if not device_ids:
        return {}
    rows = await conn.fetch(DEVICE_MAPPINGS, list(device_ids))
    return {row["device_id"]: (row["mapping"], json.loads(row["captures"])) for row in rows}


def _text(value: str) -> str:
    """``value`` as PostgreSQL text can hold it: a NUL (say, quoted from the payload by the
    decoder's message) would make the dead letter itself refused, and the message with it."""
    return value.replace("\x00", "\\u0000")


async def insert_dead_letters(
    conn: asyncpg.Connection, rows: Sequence[DeadLetterRow], node_id: str
) -> Xact | None:
    """Store dead letters; one the same bytes on the same topic already have pending (not yet
    replayed) is counted again (``seen_count``, ``last_seen_at``) instead. The transaction
    (None when there was nothing to store)."""
    if not rows:
        return None
    # One row per key and statement: ON CONFLICT cannot touch the same row twice.
    seen: dict[tuple[str, str], tuple[DeadLetterRow, int]] = {}
    for row in rows:
        key = (_text(row.topic), row.payload_sha256)
        first, count = seen.get(key, (row, 0))
        seen[key] = (first, count + 1)
    letters = [(topic, row, count) for (topic, _), (row, count) in seen.items()]
    # Ages, not times, as for presence: put on the database's clock by the statement.
    now = time.monotonic()
    xid, started = await conn.fetchrow(
        INSERT_DEAD_LETTERS,
        [topic for topic, _, _ in letters],
        [r.payload for _, r, _ in letters],
        [r.payload_size for _, r, _ in letters],
        [r.payload_sha256 for _, r, _ in letters],
        [_text(r.reason) for _, r, _ in letters],
        [_text(r.detail) for _, r, _ in letters],
        [count for _, _, count in letters],
        node_id,
        [receipt_age(now, r.received) for _, r, _ in letters],
    )
    return Xact(xid, started)


def _dead_letter(record: asyncpg.Record) -> StoredDeadLetter:
    return StoredDeadLetter(**dict(record.items()))


async def list_dead_letters(
    conn: asyncpg.Connection,
    *,
    reason: str | None = None,
    pending_only: bool = False,
    after_id: int = 0,
    limit: int = 100,
) -> list[StoredDeadLetter]:
    records = await conn.fetch(LIST_DEAD_LETTERS, reason, pending_only, after_id, limit)
    return [_dead_letter(r) for r in records]


async def dead_letters_of_reason(
    conn: asyncpg.Connection, ids: Sequence[int], reason: str
) -> set[int]:
    """Those of ``ids`` whose dead letter has ``reason``."""
    return {row["id"] for row in await conn.fetch(DEAD_LETTERS_OF_REASON, list(ids), reason)}


async def lock_dead_letter(
    conn: asyncpg.Connection, dead_letter_id: int
) -> StoredDeadLetter | None:
    record = await conn.fetchrow(LOCK_DEAD_LETTER, dead_letter_id)
    return None if record is None else _dead_letter(record)


async def heard_since(
    conn: asyncpg.Connection, device_ids: Sequence[str], since: datetime
) -> set[str]:
    """Of ``device_ids``, those whose presence changed or was read again (an unchanged
    presence's receipt), or that were heard, after ``since``."""
    rows = await conn.fetch(HEARD_SINCE, list(device_ids), since)
    return {row["device_id"] for row in rows}


async def mark_dead_letter_replayed(
    conn: asyncpg.Connection, dead_letter_id: int, outcome: str, *, succeeded: bool
) -> None:
    await conn.execute(MARK_DEAD_LETTER_REPLAYED, dead_letter_id, outcome, succeeded)


async def count_telemetry(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval(COUNT_TELEMETRY))


async def ping(conn: asyncpg.Connection) -> None:
    await conn.fetchval(PING)


async def clock_now(conn: asyncpg.Connection) -> datetime:
    """The database's clock, now (not the transaction's start)."""
    value: datetime = await conn.fetchval(CLOCK_NOW)
    return value
