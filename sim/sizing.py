"""``gateway-sim size``: the state tables of a large fleet, filled and then driven.

For each fillfactor asked for (100 and 80 by default), on a fresh database migrated by
``gateway migrate``:

1. **fill** — ``devices`` devices and one ``rule_state`` row per (device, rule) for ``rules``
   threshold rules, with ``INSERT … SELECT generate_series``: rows as the gateway leaves them
   after a steady state (sizes, event ids, versions; see ``sizing.sql``);
2. **load** — ``workers`` connections (gateway nodes sharing a subscription) each run batches
   of ``batch`` samples from random devices of a hot subset of ``hot`` devices, for
   ``seconds``, through the gateway's own statements in its order, one transaction a batch:
   ``insert_telemetry`` (its devices' part, no telemetry), ``create_states``,
   ``lock_states`` (``FOR UPDATE``, where two nodes' batches on the same devices wait for
   each other), ``write_states`` (the conditional write). The samples move the rows as a
   ``> threshold, for 3 samples`` rule would: mostly the last sample's time, now and then a
   pending count, a firing, a clear. Telemetry rows and alarms are not written: their cost
   is ``gateway-sim bench``'s subject; this one is the state a fleet keeps;
3. **report** — table and index sizes before and after, HOT updates among all updates, dead
   rows and autovacuum runs, how long ``lock_states`` took per batch (which is where the lock
   waits are) and how often a worker was seen waiting for a lock (sampled every 20 ms), and
   ``EXPLAIN (ANALYZE, BUFFERS)`` of the inactivity sweep's query (``silent_devices``) over
   the whole fleet.

The gateway's SQL is read from ``storage/queries`` as text (``sim`` imports nothing of
``storage``): the load is exactly what the gateway runs, not a copy that could drift.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import re
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import asyncpg

from protocol import micros
from sim.bench_live import percentile
from sim.sql import blocks


def _lines(values: list[str]) -> str:
    """A text of lines, as the gateway sends ids (storage.sql.lines; sim may not import it)."""
    return "\n".join(values)


Q: Final = blocks("sizing.sql")
PREFIX: Final = "size-"
RULE_KEYS: Final = ("temp-high", "humidity-high", "battery-low")
TABLES: Final = ["device", "rule_state"]
FOR_SAMPLES: Final = 3  # the hold of the simulated rules: pending for 3 samples, then firing
VIOLATING: Final = 0.05  # chance a sample is over a rule's threshold
CLEARING: Final = 0.2  # chance a firing rule's sample clears it
SILENT_S: Final = 3600.0  # the inactivity rule the sweep is explained for
LOCK_SAMPLE_S: Final = 0.02
STORAGE_QUERIES: Final = Path(__file__).resolve().parent.parent / "storage" / "queries"
_NAME_LINE: Final = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@cache
def gateway_sql(filename: str) -> MappingProxyType[str, str]:
    """``{name: sql}`` of the gateway's ``storage/queries/<filename>`` (same format)."""
    text = (STORAGE_QUERIES / filename).read_text()
    matches = list(_NAME_LINE.finditer(text))
    found = {
        match.group(1): text[
            match.end() : matches[i + 1].start() if i + 1 < len(matches) else len(text)
        ].strip()
        for i, match in enumerate(matches)
    }
    return MappingProxyType(found)


@dataclass(frozen=True, slots=True)
class SizingPlan:
    devices: int = 1_000_000
    rules: int = 3
    hot: int = 10_000
    workers: int = 3
    batch: int = 100
    seconds: float = 60.0
    fillfactors: tuple[int, ...] = (100, 80)

    def __post_init__(self) -> None:
        if not 1 <= self.rules <= len(RULE_KEYS):
            raise ValueError(f"rules: 1 to {len(RULE_KEYS)}")
        if not 0 < self.hot <= self.devices or self.batch > self.hot:
            raise ValueError("hot: 1 to devices, and at least one batch")
        if any(not 10 <= f <= 100 for f in self.fillfactors):
            raise ValueError("a fillfactor is 10 to 100")

    @property
    def rule_keys(self) -> list[str]:
        return list(RULE_KEYS[: self.rules])


@dataclass(slots=True)
class LoadFigures:
    batches: int = 0
    samples: int = 0
    rows_written: int = 0
    refused_writes: int = 0  # conditional writes that found another version (must stay 0)
    # Touching the devices (insert_telemetry with no telemetry): their row locks too.
    device_ms: list[float] = field(default_factory=list)
    lock_ms: list[float] = field(default_factory=list)
    batch_ms: list[float] = field(default_factory=list)
    lock_samples: int = 0
    lock_waiting_samples: int = 0  # samples in which at least one worker waited for a lock
    seconds: float = 0.0


def _device(n: int) -> str:
    return f"{PREFIX}{n:07d}"


def _next_state(row: asyncpg.Record, ts: datetime, rng: random.Random) -> tuple[Any, ...]:
    """The row after one sample, as a ``> threshold`` rule held for ``FOR_SAMPLES`` samples
    moves it: the state's fields of a ``rule_state_write_us2`` record (after the device, the
    rule key and the version read), in its order."""
    firing, pending, since = row["firing"], row["pending_count"], row["pending_since"]
    fired_ts, fired_id = row["fired_ts"], row["fired_event_id"]
    clear_ts, clear_id, violating_ts = row["clear_ts"], row["clear_event_id"], None
    released = row["released_ts"]
    if firing:
        if rng.random() < CLEARING:
            firing, clear_ts, clear_id = False, ts, uuid.uuid4().hex * 2
    elif rng.random() < VIOLATING:
        pending, since, violating_ts = pending + 1, since or ts, ts
        if pending >= FOR_SAMPLES:
            firing, pending, since = True, 0, None
            fired_ts, fired_id = ts, uuid.uuid4().hex * 2
    else:
        pending, since = 0, None
    seq = (row["last_seq"] or 0) + 1
    return (
        row["rule_version"], firing, pending, since, ts, seq, fired_ts, fired_id, released,
        clear_ts, clear_id, violating_ts, None,
    )  # fmt: skip


async def _batch(
    conn: asyncpg.Connection, devices: list[str], rules: list[str], node: str, rng: random.Random
) -> tuple[int, int, float, float]:
    """One ingest batch's state work, as the gateway does it: rows written, refused, and the
    milliseconds the devices (``insert_telemetry``, no telemetry) and ``lock_states`` took
    (each waits for the rows other batches hold: the device rows, the state rows)."""
    ingest, states = gateway_sql("ingest.sql"), gateway_sql("rule_state.sql")
    keys_d = [d for d in devices for _ in rules]
    keys_r = [r for _ in devices for r in rules]
    async with conn.transaction():
        started = time.perf_counter()
        # The devices' part of the telemetry insert, with no telemetry, heard now.
        await conn.execute(ingest["insert_telemetry"], *[""] * 6, node, 0, _lines(devices), None)
        device_ms = (time.perf_counter() - started) * 1000
        await conn.execute(
            states["create_states"],
            _lines(keys_d),
            _lines(keys_r),
            _lines([_rule_version(r) for r in keys_r]),
        )
        started = time.perf_counter()
        # Nothing held between batches (every token empty): each row is read whole.
        rows = await conn.fetch(
            states["lock_states"], _lines(keys_d), _lines(keys_r), _lines([""] * len(keys_d))
        )
        lock_ms = (time.perf_counter() - started) * 1000
        ts = datetime.now(UTC)
        moved = [
            (keys_d[row["n"] - 1], keys_r[row["n"] - 1], row["version"], *_next_state(row, ts, rng))
            for row in rows
        ]
        # rule_state_write_us2 records: times as microseconds since the epoch.
        moved = [tuple(micros(v) if isinstance(v, datetime) else v for v in r) for r in moved]
        # Under the lock just taken: no held rows to check (storage.rule_state.UNDER_LOCK;
        # sim may not import it), every row written whole (none as only "moved").
        answer = await conn.fetchrow(states["write_states"], moved, node, "", "", "", 0, *[""] * 9)
        written = int(answer["written"])
    return written, len(rows) - written, device_ms, lock_ms


def _rule_version(rule_key: str) -> str:
    """The fill's rule version of ``rule_key`` (``left(md5(key), 16)`` in ``fill_states``):
    the load runs the same rules, so it drops no pending count."""
    return hashlib.md5(rule_key.encode(), usedforsecurity=False).hexdigest()[:16]


async def drive_load(dsn: str, plan: SizingPlan, *, seed: int = 1) -> LoadFigures:
    """``plan.workers`` connections running batches over the hot devices for ``plan.seconds``
    (each at least one batch), and a watcher counting lock waits among them."""
    figures = LoadFigures()
    conns = [await asyncpg.connect(dsn) for _ in range(plan.workers)]
    watcher = await asyncpg.connect(dsn)
    pids = [conn.get_server_pid() for conn in conns]
    rules = plan.rule_keys
    # The hot devices spread over the whole fleet (every stride-th): which devices talk most
    # has nothing to do with where their rows were filled.
    stride = plan.devices // plan.hot
    done = asyncio.Event()

    async def work(index: int, conn: asyncpg.Connection) -> None:
        rng = random.Random(seed * 1000 + index)
        deadline = time.perf_counter() + plan.seconds
        first = True
        while first or time.perf_counter() < deadline:
            first = False
            devices = sorted({_device(rng.randrange(plan.hot) * stride) for _ in range(plan.batch)})
            started = time.perf_counter()
            written, refused, device_ms, lock_ms = await _batch(
                conn, devices, rules, f"node-{index}", rng
            )
            figures.device_ms.append(device_ms)
            figures.batch_ms.append((time.perf_counter() - started) * 1000)
            figures.lock_ms.append(lock_ms)
            figures.batches += 1
            figures.samples += len(devices)
            figures.rows_written += written
            figures.refused_writes += refused

    async def watch() -> None:
        while not done.is_set():
            waiting = await watcher.fetchval(Q["lock_waiters"], pids)
            figures.lock_samples += 1
            figures.lock_waiting_samples += int(waiting > 0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), LOCK_SAMPLE_S)  # the sampling period

    started = time.perf_counter()
    try:
        watching = asyncio.create_task(watch(), name="sizing-lock-watch")
        try:
            async with asyncio.TaskGroup() as tasks:
                for index, conn in enumerate(conns):
                    tasks.create_task(work(index, conn))
        finally:
            figures.seconds = time.perf_counter() - started
            done.set()
            await watching
    finally:
        for conn in [*conns, watcher]:
            await conn.close()
    return figures


async def _tables(conn: asyncpg.Connection) -> dict[str, dict[str, Any]]:
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    tables: dict[str, dict[str, Any]] = {}
    for row in await conn.fetch(Q["table_figures"], TABLES):
        figures = dict(row)
        last = figures.pop("last_autovacuum")
        figures["last_autovacuum"] = None if last is None else last.isoformat()
        figures["options"] = list(figures["options"] or [])
        figures["hot_ratio"] = (
            round(row["hot_updates"] / row["updates"], 3) if row["updates"] else None
        )
        tables[row["name"]] = figures
    for row in await conn.fetch(Q["index_sizes"], TABLES):
        tables[row["table_name"]].setdefault("indexes", {})[row["name"]] = row["bytes"]
    return tables


async def _stats_settled(conn: asyncpg.Connection, updates: int) -> None:
    """The statistics the load's backends flushed as they closed, visible (deadline 10 s):
    they reach the cumulative statistics a moment after the connections end."""
    deadline = time.monotonic() + 10
    while True:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        seen = await conn.fetchval(
            "SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_user_tables"
            " WHERE relname = 'rule_state'"
        )
        if seen >= updates or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)  # polling the statistics until the deadline


# The inactivity monitor's page (storage.alarms.SILENT_PAGE, which sim may not import: the
# layers); a pass reads the silent devices that many at a time, by id.
SILENT_PAGE: Final = 1000


async def explain_sweep(conn: asyncpg.Connection) -> dict[str, Any]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of the inactivity sweep's query over the whole fleet: its
    first page (``SILENT_PAGE`` devices at most, by id; a pass reads the next ones after it)."""
    query = gateway_sql("alarms.sql")["silent_devices"]
    # A node up for an hour: one break, from before its first subscribe to then; the Wills read
    # about it (its start's subscribe and the 10 s after) say nothing of a death (will_windows).
    plan = await conn.fetchval(
        f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}",
        SILENT_S,
        "device-silent",
        [math.inf],
        [3600.0],
        ["device-silent"],
        [3600.0],
        [3590.0],
        "",  # the pass's first page (by device id), as large as the monitor's
        SILENT_PAGE,
    )
    top = json.loads(plan)[0]
    node = top["Plan"]
    return {
        "ms": round(top["Execution Time"], 1),
        "plan_node": node["Node Type"],
        "rows": node["Actual Rows"],
        "shared_hit": node.get("Shared Hit Blocks", 0),
        "shared_read": node.get("Shared Read Blocks", 0),
    }


async def explain_drop_removed(conn: asyncpg.Connection, rules: list[str]) -> dict[str, Any]:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of removing the last rule's state (``drop_removed`` with
    the others kept), rolled back: the one statement that reads rule_state by rule key."""
    query = gateway_sql("rule_state.sql")["drop_removed"]
    tx = conn.transaction()
    await tx.start()
    try:
        plan = await conn.fetchval(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}", rules[:-1] or ["none"], 30.0
        )
    finally:
        await tx.rollback()
    top = json.loads(plan)[0]
    scans = sorted(set(re.findall(r'"Node Type": "([^"]*Scan)"', plan)))
    indexes = sorted(set(re.findall(r'"Index Name": "([^"]+)"', plan)))
    return {
        "ms": round(top["Execution Time"], 1),
        "scans": scans,
        "indexes_used": indexes,
        "rows_deleted": _deleted(top["Plan"]),
    }


def _deleted(node: dict[str, Any]) -> int:
    """Rows the plan's DELETE removed (its ModifyTable node's actual rows' input)."""
    if node.get("Node Type") == "ModifyTable":
        return int(sum(child.get("Actual Rows", 0) for child in node.get("Plans", [])))
    return max((_deleted(child) for child in node.get("Plans", [])), default=0)


async def _migrate(dsn: str, workdir: Path) -> None:
    config = workdir / "migrate.toml"
    config.write_text(f'[database]\ndsn = "{dsn}"\n')
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "migrate", "--config", str(config)
    )
    if await process.wait() != 0:
        raise RuntimeError(f"gateway migrate exited with {process.returncode}")


async def size_once(admin_dsn: str, plan: SizingPlan, fillfactor: int) -> dict[str, Any]:
    """One fillfactor: a fresh database, filled, loaded, measured, dropped."""
    from sim.bench import _with_database

    database = f"gw_size_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'CREATE DATABASE "{database}"')
    dsn = _with_database(admin_dsn, database)
    try:
        with tempfile.TemporaryDirectory(prefix="gw-size-") as tmp:
            await _migrate(dsn, Path(tmp))
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(Q["set_fillfactor"].format(fillfactor=int(fillfactor)))
            started = time.perf_counter()
            await conn.execute(Q["fill_devices"], plan.devices, PREFIX)
            await conn.execute(Q["fill_states"], plan.devices, PREFIX, plan.rule_keys)
            fill_s = time.perf_counter() - started
            await conn.execute("VACUUM (ANALYZE) device")
            await conn.execute("VACUUM (ANALYZE) rule_state")
            before = await _tables(conn)
            load = await drive_load(dsn, plan)
            await _stats_settled(conn, before["rule_state"]["updates"] + load.rows_written)
            after = await _tables(conn)
            sweep = await explain_sweep(conn)
            drop = await explain_drop_removed(conn, plan.rule_keys)
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()
    return {
        "fillfactor": fillfactor,
        "fill_seconds": round(fill_s, 1),
        "before": before,
        "after": after,
        "load": _load_fields(load),
        "sweep": sweep,
        "drop_removed": drop,
    }


def _load_fields(load: LoadFigures) -> dict[str, Any]:
    return {
        "seconds": round(load.seconds, 1),
        "batches": load.batches,
        "samples": load.samples,
        "samples_per_s": round(load.samples / load.seconds) if load.seconds else 0,
        "rows_written": load.rows_written,
        "refused_writes": load.refused_writes,
        "batch_p50_ms": round(percentile(load.batch_ms, 50), 2),
        "batch_p99_ms": round(percentile(load.batch_ms, 99), 2),
        "devices_p50_ms": round(percentile(load.device_ms, 50), 2),
        "devices_p99_ms": round(percentile(load.device_ms, 99), 2),
        "lock_p50_ms": round(percentile(load.lock_ms, 50), 2),
        "lock_p99_ms": round(percentile(load.lock_ms, 99), 2),
        "lock_max_ms": round(max(load.lock_ms, default=0.0), 2),
        "lock_waiting_share": (
            round(load.lock_waiting_samples / load.lock_samples, 3) if load.lock_samples else 0.0
        ),
    }


async def run_sizing(admin_dsn: str, plan: SizingPlan) -> dict[str, Any]:
    runs = []
    for fillfactor in plan.fillfactors:
        _note(f"fillfactor {fillfactor}: filling {plan.devices:,} devices ...")
        run = await size_once(admin_dsn, plan, fillfactor)
        runs.append(run)
    return {
        "devices": plan.devices,
        "rules": plan.rules,
        "rule_state_rows": plan.devices * plan.rules,
        "hot": plan.hot,
        "workers": plan.workers,
        "batch": plan.batch,
        "runs": runs,
    }


def _mb(value: int) -> str:
    return f"{value / 1048576:,.1f} MB"


def render_run(plan: SizingPlan, run: dict[str, Any]) -> str:
    load, sweep = run["load"], run["sweep"]
    lines = [
        f"fillfactor {run['fillfactor']}: {plan.devices:,} devices x {plan.rules} rules,"
        f" filled in {run['fill_seconds']} s"
    ]
    for name in TABLES:
        b, a = run["before"][name], run["after"][name]
        indexes = ", ".join(f"{k} {_mb(v)}" for k, v in a.get("indexes", {}).items())
        lines.append(
            f"  {name}: heap {_mb(b['heap_bytes'])} -> {_mb(a['heap_bytes'])},"
            f" indexes {_mb(b['index_bytes'])} -> {_mb(a['index_bytes'])} ({indexes})"
        )
        lines.append(
            f"  {name}: {a['updates']:,} updates, HOT {a['hot_ratio']}, dead {a['dead_rows']:,},"
            f" autovacuums {a['autovacuums']} (last {a['last_autovacuum']})"
        )
    lines.append(
        f"  load: {load['samples_per_s']:,} samples/s over {plan.hot:,} hot devices,"
        f" {plan.workers} workers; batch p50/p99 {load['batch_p50_ms']}/{load['batch_p99_ms']}"
        f" ms; devices p50/p99 {load['devices_p50_ms']}/{load['devices_p99_ms']} ms;"
        f" lock_states p50/p99/max {load['lock_p50_ms']}/{load['lock_p99_ms']}/"
        f"{load['lock_max_ms']} ms; a worker waiting for a lock in"
        f" {load['lock_waiting_share']:.1%} of samples; refused writes {load['refused_writes']}"
    )
    lines.append(
        f"  inactivity sweep: {sweep['ms']} ms ({sweep['plan_node']}, {sweep['rows']} rows,"
        f" {sweep['shared_hit']:,} blocks hit, {sweep['shared_read']:,} read)"
    )
    drop = run["drop_removed"]
    lines.append(
        f"  removing a rule's state (rolled back): {drop['ms']} ms, {drop['rows_deleted']:,}"
        f" rows, scans {', '.join(drop['scans'])}, indexes {', '.join(drop['indexes_used'])}"
    )
    return "\n".join(lines)


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
