"""The Sparkplug host's state per edge node (``sparkplug_node``), on the caller's connection
and transaction: locked and read for a batch, written back by it; and the rebirth requests
the loop sends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from storage.sql import lines, load_queries

_Q = load_queries("sparkplug.sql")
CREATE_NODES = _Q["create_nodes"]
LOCK_NODES = _Q["lock_nodes"]
WRITE_NODES = _Q["write_nodes"]
WRITE_BIRTHS = _Q["write_births"]
TAKE_REBIRTHS = _Q["take_rebirths"]
EXPIRE_MISSING = _Q["expire_missing"]
TAKE_UNBORN = _Q["take_unborn"]
GET_NODE = _Q["get_node"]
DB_EPOCH = _Q["db_epoch"]
METRIC_DEFINITION = _Q["metric_definition"]
OPEN_WRITES = _Q["open_writes"]


@dataclass(slots=True)
class NodeRow:
    """One edge node's state as stored; json columns as text (the caller decodes them)."""

    group_id: str
    edge_node_id: str
    born: bool
    bdseq: int | None
    seq: int | None
    missing: str
    trusted: bool
    aliases: str | None  # None: the caller holds them as they are (lock_nodes' ``held``)
    metrics: str | None  # as aliases
    devices: list[str]
    recent: list[str]
    rebirth_reason: str | None
    rebirth_wanted: bool
    births: str  # the births' token (version and server), for ``held`` next time
    dead_bdseq: int | None  # the bdSeq of a death taken before its session's birth
    unborn: list[str]  # devices of the session before not born again since its NBIRTH
    device_marks: str  # json {device: seq}: latest birth or death taken with a seq missing
    birth_ts: int | None  # the payload timestamp of the NBIRTH in force (epoch ms)
    born_epoch: float | None  # when it was taken (the database's clock, epoch seconds)
    device_lives: str  # json {device: [birth seq, death seq]} taken with a seq missing


@dataclass(frozen=True, slots=True)
class NodeWrite:
    group_id: str
    edge_node_id: str
    born: bool
    bdseq: int | None
    seq: int | None
    missing: str
    trusted: bool
    aliases: str | None  # None: as stored
    metrics: str | None  # None: as stored
    devices: list[str]
    recent: list[str]
    rebirth_reason: str | None
    born_now: bool
    dead_bdseq: int | None = None
    unborn: Sequence[str] = ()  # devices of the session before its NBIRTH not born again
    device_marks: str = "{}"  # json {device: seq} (migration 0059)
    birth_ts: int | None = None  # the NBIRTH's payload timestamp (migration 0061)
    device_lives: str = "{}"  # json {device: [birth seq, death seq]} (migration 0062)


@dataclass(frozen=True, slots=True)
class StoredNode:
    group_id: str
    edge_node_id: str
    born: bool
    bdseq: int | None
    seq: int | None
    trusted: bool
    aliases: str
    metrics: str
    devices: list[str]
    rebirth_reason: str | None
    rebirth_wanted_at: datetime | None
    rebirth_sent_at: datetime | None
    rebirth_requests: int
    born_at: datetime | None


async def lock_nodes(
    conn: asyncpg.Connection,
    keys: Sequence[tuple[str, str]],
    held: Mapping[tuple[str, str], str] | None = None,
) -> dict[tuple[str, str], NodeRow]:
    """Create the rows not seen yet, then lock and read every one (in key order). ``held``:
    the births' token of the nodes whose births the caller holds: theirs come back as None
    while the token is still the row's."""
    ordered = sorted(set(keys))
    if not ordered:
        return {}
    held = held or {}
    groups = [g for g, _ in ordered]
    nodes = [n for _, n in ordered]
    await conn.execute(CREATE_NODES, groups, nodes)
    records = await conn.fetch(LOCK_NODES, groups, nodes, [held.get(k, "") for k in ordered])
    rows = [NodeRow(*record.values()) for record in records]
    return {(row.group_id, row.edge_node_id): row for row in rows}


async def write_nodes(conn: asyncpg.Connection, writes: Sequence[NodeWrite]) -> None:
    """Each node's stream state, in one statement (it was one execution a node: ~50 a batch
    of the bench's stream); then the births of those whose births changed (``aliases`` and
    ``metrics`` not None), which moves their version."""
    if not writes:
        return
    await conn.execute(
        WRITE_NODES,
        lines([w.group_id for w in writes]),
        lines([w.edge_node_id for w in writes]),
        [w.born for w in writes],
        [w.bdseq for w in writes],
        [w.seq for w in writes],
        lines([w.missing for w in writes]),
        [w.trusted for w in writes],
        lines([_joined(w.devices) for w in writes]),
        lines([_joined(w.recent) for w in writes]),
        [w.rebirth_reason for w in writes],
        [w.born_now for w in writes],
        [w.dead_bdseq for w in writes],
        lines([_joined(w.unborn) for w in writes]),
        lines([w.device_marks for w in writes]),
        [w.birth_ts for w in writes],
        lines([w.device_lives for w in writes]),
    )
    births = [
        (w.group_id, w.edge_node_id, w.aliases, w.metrics)
        for w in writes
        if w.aliases is not None and w.metrics is not None
    ]
    if births:
        await conn.executemany(WRITE_BIRTHS, births)


def _joined(values: Sequence[str]) -> str:
    """A node's devices or recent ids as one line (write_nodes splits it at `,`): ids match
    the id grammar, recent ids are hex; a `,` in one is a bug, refused here."""
    if not all(values):  # one empty value alone would be sent as no value
        raise ValueError("an empty value cannot be sent joined by ','")
    return lines(values, separator=",")


async def take_rebirths(
    conn: asyncpg.Connection, retry_s: float, limit: int
) -> list[tuple[str, str, str | None]]:
    records = await conn.fetch(TAKE_REBIRTHS, retry_s, limit)
    return [(r["group_id"], r["edge_node_id"], r["rebirth_reason"]) for r in records]


async def take_unborn(
    conn: asyncpg.Connection, grace_s: float, limit: int
) -> list[tuple[str, str, list[str]]]:
    """The edge nodes whose devices of the session before their NBIRTH were not born again
    within ``grace_s`` of it, locked and emptied (``take_unborn``): (group, node, devices)."""
    records = await conn.fetch(TAKE_UNBORN, grace_s, limit)
    return [(r["group_id"], r["edge_node_id"], list(r["gone"])) for r in records]


async def expire_missing(conn: asyncpg.Connection, window_s: float) -> list[tuple[str, str]]:
    records = await conn.fetch(EXPIRE_MISSING, window_s)
    return [(r["group_id"], r["edge_node_id"]) for r in records]


async def get_node(conn: asyncpg.Connection, group_id: str, edge_node_id: str) -> StoredNode | None:
    record = await conn.fetchrow(GET_NODE, group_id, edge_node_id)
    return None if record is None else StoredNode(*record.values())


async def db_epoch(conn: asyncpg.Connection) -> float:
    return float(await conn.fetchval(DB_EPOCH))


async def metric_definition(
    conn: asyncpg.Connection | asyncpg.Pool, group: str, node: str, device: str, name: str
) -> tuple[bool, int | None]:
    """Whether the node (and device, '' for the node) is born, and the metric's datatype from
    its birth (None: no birth names it)."""
    record = await conn.fetchrow(METRIC_DEFINITION, group, node, device, name)
    if record is None:
        return False, None
    return bool(record["born"]), record["datatype"]


@dataclass(frozen=True, slots=True)
class OpenWrite:
    """An open command of a Sparkplug device: what it wrote, to confirm."""

    id: int
    device_id: str
    claim_generation: int
    claimed_node_id: str | None
    name: str
    params: str


async def open_writes(
    conn: asyncpg.Connection, device_ids: Sequence[str], received_at: datetime | None = None
) -> list[OpenWrite]:
    """The open writes of these devices claimed by ``received_at`` (None: now)."""
    if not device_ids:
        return []
    records = await conn.fetch(OPEN_WRITES, sorted(set(device_ids)), received_at)
    return [OpenWrite(*record.values()) for record in records]
