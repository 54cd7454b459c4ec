"""Rule state rows: locked, read and written back on the caller's ingest transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, TypeAlias

import asyncpg
import msgspec

from protocol import micros
from storage.sql import lines, load_queries

_Q = load_queries("rule_state.sql")
CREATE_STATES = _Q["create_states"]
LOCK_STATES = _Q["lock_states"]
WRITE_STATES = _Q["write_states"]
# write_states' held rows to check ($3-$6) when the caller holds its rows under lock_states'
# lock: none.
UNDER_LOCK = ("", "", "", 0)
DROP_REMOVED = _Q["drop_removed"]
REGISTER_RULE_SET = _Q["register_rule_set"]
REGISTERED_KEYS = _Q["registered_keys"]
DROP_LEFTOVERS = _Q["drop_leftovers"]
DEVICE_PAGE = _Q["device_page"]
SEED_ADDED = _Q["seed_added"]
# The rule version of a row seed_added created: no definition (no node runs it) until the hold
# timer judges it under the rule from the sample it was placed at.
ADDED: Final = "added"
LIVE_RULE_SETS = _Q["live_rule_sets"]
GET_STATE = _Q["get_state"]
DUE_HOLDS = _Q["due_holds"]
STALE_HOLDS = _Q["stale_holds"]
WRITE_REJUDGED = _Q["write_rejudged"]
STALE_ROWS = _Q["stale_rows"]
LOCK_STALE_ROWS = _Q["lock_stale_rows"]
LIVE_DEFINITIONS = _Q["live_definitions"]


class RuleStateRow(msgspec.Struct, frozen=True, gc=False):
    """One `rule_state` row; `version` is the one read (a write is conditional on it).

    A msgspec Struct, not a dataclass: a batch builds one per (device, rule) it reads and
    one per row it writes back, and a frozen dataclass of 15 fields costs 2.4 µs to build
    against 0.12 µs (measured here), a few percent of a message's CPU in a drain."""

    device_id: str
    rule_key: str
    version: int
    rule_version: str
    firing: bool
    pending_count: int
    pending_since: datetime | None
    last_ts: datetime | None
    last_seq: int | None
    fired_ts: datetime | None
    fired_event_id: str | None
    released_ts: datetime | None
    clear_ts: datetime | None
    clear_event_id: str | None
    violating_ts: datetime | None
    last_device_ts: datetime | None


_COLUMNS = RuleStateRow.__struct_fields__


class StateWriteConflictError(Exception):
    """A rule state row changed since it was read: the batch must be evaluated again."""


class LockedRow(msgspec.Struct, frozen=True, gc=False):
    """A rule-state row as lock_states answers it, with its token ("version.xmin@start":
    which write of the row it is, on which run of the server). A node holds these between
    batches and hands them back to lock_states, which answers a row nobody wrote since with
    the very object it was given (a subclass the caller made stays itself)."""

    token: str
    row: RuleStateRow


# What a node holds of rule-state rows between batches, by (device id, rule key).
Held: TypeAlias = Mapping[tuple[str, str], LockedRow]


async def lock_states(
    conn: asyncpg.Connection,
    keys: Sequence[tuple[str, str, str]],
    *,
    exist: bool = False,
    held: Held | None = None,
) -> list[LockedRow]:
    """Lock (creating where missing) the rows of (device id, rule key, rule version) keys;
    each row with its token.

    Every row is read and locked with no write, in one sorted order on every node. Without
    ``exist`` the missing rows are created first, in that order too, so two batches wait for
    each other, never deadlock. With ``exist`` (the caller has seen every row already: every
    batch but a device's first) the create is skipped: an insert attempt per row per batch,
    measured at ~2 µs of PostgreSQL CPU per row, half the cost of the rule state. A row the
    caller believed to exist but that is gone (a rule's state dropped) is created and locked
    after the others; PostgreSQL breaks the deadlock that may then rarely cause, and the
    writer retries.

    ``held``: rows the caller kept from earlier batches. A row whose version, xmin and server
    start still equal the held token is the same write of the row (an update always makes a
    new xmin, the version counts the row's writes, and transaction ids are issued again only
    by another run of a server: a promoted standby, a restore): it is answered as held (the
    held object itself), its columns not sent. Any other row is read whole.
    """
    if not keys:
        return []
    ordered = sorted(keys)
    devices, rules = lines([k[0] for k in ordered]), lines([k[1] for k in ordered])
    if not exist:
        await conn.execute(CREATE_STATES, devices, rules, lines([k[2] for k in ordered]))
    # Looked up before the answer is awaited: the caller's may change meanwhile (another
    # batch commits), and a hit must answer with the copy whose token was sent.
    sent: list[LockedRow | None] = (
        [None] * len(ordered) if not held else [held.get((k[0], k[1])) for k in ordered]
    )
    tokens = lines(["" if entry is None else entry.token for entry in sent])
    answer = _locked(await conn.fetch(LOCK_STATES, devices, rules, tokens), ordered, sent)
    if len(answer) < len(ordered):
        found = {(entry.row.device_id, entry.row.rule_key) for entry in answer}
        missing = [k for k in ordered if (k[0], k[1]) not in found]
        devices, rules = lines([k[0] for k in missing]), lines([k[1] for k in missing])
        await conn.execute(CREATE_STATES, devices, rules, lines([k[2] for k in missing]))
        tokens = lines([""] * len(missing))
        records = await conn.fetch(LOCK_STATES, devices, rules, tokens)
        answer += _locked(records, missing, [None] * len(missing))
    return answer


def _locked(
    records: Sequence[asyncpg.Record],
    ordered: Sequence[tuple[str, str, str]],
    sent: Sequence[LockedRow | None],
) -> list[LockedRow]:
    """lock_states' answer: each row as held (the token sent is the row's own) or as read."""
    answer = []
    for record in records:
        index = record[0] - 1  # the key's position in what was sent, from 1
        entry = sent[index]
        if record[3] and entry is not None:
            answer.append(entry)
        else:  # the columns come in field order, after the keys and the version
            device_id, rule_key, _ = ordered[index]
            row = RuleStateRow(device_id, rule_key, record[1], *record[4:])
            answer.append(LockedRow(f"{record[1]}.{record[2]}", row))
    return answer


async def write_states(
    conn: asyncpg.Connection,
    rows: Sequence[RuleStateRow],
    node_id: str,
    moved: Sequence[RuleStateRow] = (),
) -> str:
    """Write rows back, each conditional on the version it was read at (under lock_states'
    lock); the writing transaction's id as the rows' xmin shows it, with the server's start
    ("xid@start"; "" when there was nothing to write): a row written is then token
    f"{version + 1}.{xmin}" for lock_states.

    ``moved``: rows to write as ``rows`` are, each of which differs from the row read only in
    the columns a sample moves (`SAMPLE_MOVES`; the caller vouches for that): only those are
    sent and written, a cheaper write of what most rows of a batch are."""
    if not rows and not moved:
        return ""
    _, written, xmin = await conn.fetchrow(
        WRITE_STATES, _records(rows), node_id, *UNDER_LOCK, *_moved(moved)
    )
    if written != len(rows) + len(moved):
        raise StateWriteConflictError(
            f"{len(rows) + len(moved) - written} of {len(rows) + len(moved)} rule states"
            " changed since they were read"
        )
    return str(xmin)


async def write_held_states(
    conn: asyncpg.Connection,
    held: Sequence[tuple[str, str, str]],
    rows: Sequence[RuleStateRow],
    node_id: str,
    moved: Sequence[RuleStateRow] = (),
) -> str | None:
    """Lock the rows of ``held`` (device id, rule key, the token the caller holds it with)
    and write ``rows`` and ``moved`` back (changed ones of them, as write_states), in one
    statement, only if every row is still the one held: the caller judged from what it held
    and took no lock first. The writing transaction's id as write_states answers it; None
    when a row was written by anyone since (or is gone): then nothing was written, and the
    caller reads the rows with lock_states (those locked here stay locked, unchanged)."""
    if not held:
        return ""
    ordered = sorted(held)
    complete, written, xmin = await conn.fetchrow(
        WRITE_STATES,
        _records(rows),
        node_id,
        lines([k[0] for k in ordered]),
        lines([k[1] for k in ordered]),
        lines([k[2] for k in ordered]),
        len(ordered),
        *_moved(moved),
    )
    if not complete:
        return None
    if written != len(rows) + len(moved):  # every row locked as held: cannot happen
        raise StateWriteConflictError(
            f"{len(rows) + len(moved) - written} of {len(rows) + len(moved)} rule states"
            " changed though held"
        )
    return str(xmin)


# The columns of a rule-state row that a sample judged in order moves on every write (the
# newest sample, and the newest violating or clearing one); a row that differs from the row
# read in none but these is written as write_states' ``moved``.
SAMPLE_MOVES: Final = (
    "last_ts",
    "last_seq",
    "clear_ts",
    "clear_event_id",
    "violating_ts",
    "last_device_ts",
)


def _moved(rows: Sequence[RuleStateRow]) -> tuple[str, ...]:
    # write_states' $7-$15: a column each, a text of lines; an empty line is NULL. A sample
    # judged in order sets the newest clearing or violating time to the newest sample's
    # time, the same object: converted once (a conversion is most of a row's cost here).
    # The newest's own device time is NULL but for a sample judged at another time: a
    # column of NULLs goes as one empty text.
    versions, last_ts, last_seq, clear_ts, violating_ts = [], [], [], [], []
    device_ts: list[str] | None = None
    for r in rows:
        versions.append(str(r.version))
        last = r.last_ts
        newest = "" if last is None else str(micros(last))
        last_ts.append(newest)
        last_seq.append("" if (seq := r.last_seq) is None else str(seq))
        at = r.clear_ts
        clear_ts.append("" if at is None else newest if at is last else str(micros(at)))
        at = r.violating_ts
        violating_ts.append("" if at is None else newest if at is last else str(micros(at)))
        if (at := r.last_device_ts) is not None:
            if device_ts is None:
                device_ts = [""] * len(rows)
            device_ts[len(versions) - 1] = str(micros(at))
    return (
        lines([r.device_id for r in rows]),
        lines([r.rule_key for r in rows]),
        "\n".join(versions),
        "\n".join(last_ts),
        "\n".join(last_seq),
        "\n".join(clear_ts),
        lines([r.clear_event_id or "" for r in rows]),
        "\n".join(violating_ts),
        "" if device_ts is None else "\n".join(device_ts),
    )


def _records(rows: Sequence[RuleStateRow]) -> list[tuple[object, ...]]:
    # One array of records (the type rule_state_write_us2 has RuleStateRow's fields, in order,
    # its times as microseconds: migrations 0034, 0041).
    return [
        (
            r.device_id,
            r.rule_key,
            r.version,
            r.rule_version,
            r.firing,
            r.pending_count,
            None if (t := r.pending_since) is None else micros(t),
            None if (t := r.last_ts) is None else micros(t),
            r.last_seq,
            None if (t := r.fired_ts) is None else micros(t),
            r.fired_event_id,
            None if (t := r.released_ts) is None else micros(t),
            None if (t := r.clear_ts) is None else micros(t),
            r.clear_event_id,
            None if (t := r.violating_ts) is None else micros(t),
            None if (t := r.last_device_ts) is None else micros(t),
        )
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class HoldRule:
    """What the hold timer's query needs of a threshold rule with `for_seconds`."""

    rule_key: str
    rule_version: str
    for_seconds: float
    for_samples: int


async def lock_due_holds(
    conn: asyncpg.Connection,
    rules: Sequence[HoldRule],
    now: datetime,
    *,
    after: tuple[str, str] = ("", ""),
    limit: int,
) -> list[tuple[RuleStateRow, datetime]]:
    """Lock the pending rows of `rules` whose hold has passed by `now` (in (device, rule)
    order, after `after`), skipping rows another transaction holds; each with the time it was
    last written. Only in a transaction: the locks last until it ends."""
    if not rules:
        return []
    records = await conn.fetch(
        DUE_HOLDS,
        [r.rule_key for r in rules],
        [r.rule_version for r in rules],
        [r.for_seconds for r in rules],
        [r.for_samples for r in rules],
        now,
        after[0],
        after[1],
        limit,
    )
    width = len(_COLUMNS)
    return [(RuleStateRow(*record[:width]), record[width]) for record in records]


async def drop_removed(
    conn: asyncpg.Connection, rule_keys: Sequence[str], live_within_s: float
) -> int:
    """Delete the state of every rule neither in `rule_keys` nor run by a node whose heartbeat
    is younger than `live_within_s`; how many rows went."""
    return int(await conn.fetchval(DROP_REMOVED, list(rule_keys), live_within_s))


async def registered_keys(
    conn: asyncpg.Connection, node_id: str
) -> tuple[list[str], datetime] | None:
    """The rule keys `node_id` last registered, and its heartbeat then; None if it never
    registered."""
    row = await conn.fetchrow(REGISTERED_KEYS, node_id)
    return None if row is None else (list(row["rule_keys"]), row["heartbeat_at"])


async def drop_leftovers(
    conn: asyncpg.Connection,
    rule_keys: Sequence[str],
    node_id: str,
    live_within_s: float,
    *,
    last_heartbeat: datetime | None,
) -> int:
    """Delete the state of the rules `node_id` has just taken up (`rule_keys`) that no other
    node whose heartbeat is younger than `live_within_s` runs, except what `node_id` wrote
    since `last_heartbeat`; how many rows went."""
    if not rule_keys:
        return 0
    return int(
        await conn.fetchval(DROP_LEFTOVERS, list(rule_keys), live_within_s, node_id, last_heartbeat)
    )


async def device_page(conn: asyncpg.Connection, *, after: str, limit: int) -> list[str]:
    """The ids of the devices after ``after``, in order, at most ``limit``."""
    return [row[0] for row in await conn.fetch(DEVICE_PAGE, after, limit)]


async def seed_added(
    conn: asyncpg.Connection,
    pairs: Sequence[tuple[str, str, str]],
    node_id: str,
    *,
    lookback: int,
    max_future_skew_s: float,
) -> int:
    """Create the rows of (device id, rule key, metric) ``pairs`` (threshold rules a node has
    just taken up) whose device has a sample of the metric among its ``lookback`` newest
    stored, placed at that sample, under no definition: the hold timer judges them from it
    (``seed_added`` in rule_state.sql). Existing rows are left alone; how many were created."""
    if not pairs:
        return 0
    ordered = sorted(pairs)
    return int(
        await conn.fetchval(
            SEED_ADDED,
            [pair[0] for pair in ordered],
            [pair[1] for pair in ordered],
            [pair[2] for pair in ordered],
            lookback,
            max_future_skew_s,
            node_id,
            ADDED,
        )
    )


async def register_rule_set(
    conn: asyncpg.Connection, node_id: str, rules: Mapping[str, str]
) -> None:
    """Record the rules `node_id` runs (rule key -> its definition, `rule_version`), and its
    heartbeat (now)."""
    keys = sorted(rules)
    await conn.execute(REGISTER_RULE_SET, node_id, keys, [rules[key] for key in keys])


async def live_rule_sets(conn: asyncpg.Connection, live_within_s: float) -> dict[str, list[str]]:
    """Node id -> the rule keys it runs, for the nodes whose heartbeat is that young."""
    rows = await conn.fetch(LIVE_RULE_SETS, live_within_s)
    return {row["node_id"]: list(row["rule_keys"]) for row in rows}


async def get_state(
    conn: asyncpg.Connection, device_id: str, rule_key: str
) -> asyncpg.Record | None:
    return await conn.fetchrow(GET_STATE, device_id, rule_key)


async def lock_stale_holds(
    conn: asyncpg.Connection,
    rules: Sequence[HoldRule],
    node_id: str,
    live_within_s: float,
    *,
    after: tuple[str, str] = ("", ""),
    limit: int,
) -> list[RuleStateRow]:
    """Lock the pending rows of `rules` written under another definition that no other node
    whose heartbeat is younger than `live_within_s` runs (in (device, rule) order, after
    `after`), skipping rows another transaction holds. Only in a transaction."""
    if not rules:
        return []
    records = await conn.fetch(
        STALE_HOLDS,
        [r.rule_key for r in rules],
        [r.rule_version for r in rules],
        live_within_s,
        node_id,
        after[0],
        after[1],
        limit,
    )
    return [RuleStateRow(*record) for record in records]


async def write_rejudged(
    conn: asyncpg.Connection, rows: Sequence[RuleStateRow], node_id: str
) -> None:
    """Write back rows judged again under another definition (lock_stale_holds' rows, each
    with its new `rule_version` and pending run), conditional on the version read; the
    time the row was last written (the hold's clock) is kept."""
    if not rows:
        return
    written = await conn.fetchval(
        WRITE_REJUDGED,
        [r.device_id for r in rows],
        [r.rule_key for r in rows],
        [r.version for r in rows],
        [r.rule_version for r in rows],
        [r.pending_count for r in rows],
        [r.pending_since for r in rows],
        node_id,
    )
    if written != len(rows):
        raise StateWriteConflictError(
            f"{len(rows) - written} of {len(rows)} rule states changed since they were read"
        )


async def stale_rows(
    conn: asyncpg.Connection,
    rules: Sequence[HoldRule],
    node_id: str,
    live_within_s: float,
    *,
    after: tuple[str, str] = ("", ""),
    limit: int,
) -> list[tuple[str, str]]:
    """The keys of the firing and normal rows of threshold `rules` (and the pending rows of
    those that hold no time) written under another definition that no other node whose
    heartbeat is younger than `live_within_s` runs, in (device, rule) order after `after`;
    not locked. Reads every row of these rules: only after a rule set changed."""
    if not rules:
        return []
    records = await conn.fetch(STALE_ROWS, *_stale_args(rules, node_id, live_within_s),
                               after[0], after[1], limit)  # fmt: skip
    return [(record["device_id"], record["rule_key"]) for record in records]


async def lock_stale_rows(
    conn: asyncpg.Connection,
    keys: Sequence[tuple[str, str]],
    rules: Sequence[HoldRule],
    node_id: str,
    live_within_s: float,
) -> list[RuleStateRow]:
    """Lock those of `keys` (stale_rows' page) still stale, skipping rows another
    transaction holds. Only in a transaction."""
    if not keys:
        return []
    records = await conn.fetch(
        LOCK_STALE_ROWS,
        [device_id for device_id, _ in keys],
        [rule_key for _, rule_key in keys],
        *_stale_args(rules, node_id, live_within_s),
    )
    return [RuleStateRow(*record) for record in records]


def _stale_args(
    rules: Sequence[HoldRule], node_id: str, live_within_s: float
) -> tuple[list[str], list[str], list[bool], float, str]:
    return (
        [r.rule_key for r in rules],
        [r.rule_version for r in rules],
        [r.for_seconds > 0 for r in rules],
        live_within_s,
        node_id,
    )


async def live_definitions(
    conn: asyncpg.Connection, node_id: str, live_within_s: float
) -> frozenset[tuple[str, str]]:
    """The (rule key, definition) pairs the other live nodes run."""
    records = await conn.fetch(LIVE_DEFINITIONS, live_within_s, node_id)
    return frozenset(
        pair
        for record in records
        for pair in zip(record["rule_keys"], record["rule_versions"], strict=False)
    )
