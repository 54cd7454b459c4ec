"""Per-device clock figures on `GET /devices/{id}`: every clock adjustment is counted per
device and reason in PostgreSQL by the batch that judged the sample, on whichever node, and
the last one is shown with the device time it was sent with and the time it was judged at."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg
import pytest

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.config import TokenConfig
from gateway.domain.rules import DeviceClock, RuleConfig, compile_rules
from gateway.support.metrics import Metrics
from protocol import Telemetry, telemetry_event_id
from storage import device_clock as clock_repo
from storage.ingest import touch_devices
from tests.support.api_client import VIEWER, ApiClient
from tests.support.api_server import serve_api

RULES = compile_rules(
    [
        RuleConfig(key="sos", kind="event", event="SOS", severity="CRITICAL"),
        RuleConfig(key="hot", kind="threshold", metric="temp", op=">", value=50, severity="MAJOR"),
    ]
)
EPOCH_REBOOT = datetime(1970, 1, 1, 0, 0, 7, tzinfo=UTC)


@pytest.fixture
async def api(db_dsn: str) -> AsyncIterator[ApiClient]:
    tokens = [TokenConfig(token=VIEWER, role="viewer", name="wall-screen")]
    async with serve_api(db_dsn, tokens) as served, aiohttp.ClientSession() as http:
        yield ApiClient(served.base, http)


def _node(name: str) -> AlarmEngine:
    return AlarmEngine(rules=RULES, node_id=name, metrics=Metrics(), clock=DeviceClock())


async def _store(
    engine: AlarmEngine, conn: asyncpg.Connection, device_id: str, *messages: Telemetry
) -> BatchAlarms:
    rows = [(device_id, telemetry_event_id(device_id, m), m) for m in messages]
    async with conn.transaction():
        await touch_devices(conn, {device_id})
        batch = await engine.on_stored(conn, rows)
    engine.committed(batch)
    return batch


async def _db_now(db: asyncpg.Connection) -> datetime:
    now = await db.fetchval("SELECT now()")
    assert isinstance(now, datetime)
    return now.astimezone(UTC)


async def test_a_device_shows_its_clock_adjustments_counted_by_every_node(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    await _store(node_a, db, "pendant-1", Telemetry(ts=now, events=[{"type": "SOS"}]))
    # A clock 8 hours ahead, seen by both nodes: one count per sample, added up.
    ahead = now + timedelta(hours=8)
    await _store(node_a, db, "pendant-1", Telemetry(ts=ahead, events=[{"type": "SOS"}]))
    two = await _store(
        node_b,
        db,
        "pendant-1",
        Telemetry(ts=ahead + timedelta(seconds=1), metrics={"temp": 20}),
        Telemetry(ts=ahead + timedelta(seconds=2), metrics={"temp": 21}),
    )
    assert two.clock_adjustments == {"ahead": 2}
    # Then it reboots with its clock at 1970.
    rebooted = await _store(
        node_b, db, "pendant-1", Telemetry(ts=EPOCH_REBOOT, events=[{"type": "SOS"}])
    )
    assert rebooted.clock_adjustments == {"behind": 1}
    received = await db.fetchval(
        "SELECT last_received_at FROM device_clock WHERE device_id = 'pendant-1' "
        "AND reason = 'behind'"
    )

    reply = await api.get("/devices/pendant-1")
    assert reply.status == 200, reply.body
    clock = reply.body["device"]["clock"]
    assert clock["adjustments"] == {"ahead": 3, "behind": 1}
    last = clock["last"]
    assert last["reason"] == "behind"
    assert last["device_ts"] == "1970-01-01T00:00:07Z"
    assert datetime.fromisoformat(last["received_at"]) == received
    # Judged at its receipt: the skew is the whole way back to 1970.
    assert datetime.fromisoformat(last["judged_ts"]) == received
    assert last["skew_s"] == (EPOCH_REBOOT - received).total_seconds()


async def test_a_device_whose_clock_was_never_adjusted_shows_no_figures(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    now = await _db_now(db)
    batch = await _store(
        _node("node-a"), db, "meter-1", Telemetry(ts=now, seq=1, metrics={"temp": 20})
    )
    assert batch.clock_adjustments == {}
    assert await db.fetchval("SELECT count(*) FROM device_clock") == 0
    reply = await api.get("/devices/meter-1")
    assert reply.status == 200, reply.body
    assert reply.body["device"]["clock"] == {"adjustments": {}, "last": None}


async def test_a_stepped_back_clock_and_a_reboot_by_seq_are_shown(
    api: ApiClient, db: asyncpg.Connection
) -> None:
    node_a, node_b = _node("node-a"), _node("node-b")
    now = await _db_now(db)
    base = now - timedelta(minutes=1)
    await _store(node_a, db, "meter-2", Telemetry(ts=base, seq=100, metrics={"temp": 20}))
    stepped = base - timedelta(minutes=2)
    back = await _store(node_b, db, "meter-2", Telemetry(ts=stepped, seq=101, metrics={"temp": 60}))
    assert back.clock_adjustments == {"stepped_back": 1}
    assert [rule for rule, _ in back.created] == ["hot"]
    (alarm,) = await db.fetch("SELECT trigger FROM alarm WHERE device_id = 'meter-2'")
    assert '"device_ts"' in alarm["trigger"]
    figures = await clock_repo.device_adjustments(db, "meter-2")
    assert [(f.reason, f.count, f.last_device_ts, f.last_judged_ts) for f in figures] == [
        ("stepped_back", 1, stepped, base)
    ]
    reset = await _store(
        node_a,
        db,
        "meter-2",
        Telemetry(ts=base + timedelta(seconds=30), seq=0, metrics={"temp": 20}),
    )
    assert reset.clock_adjustments == {"seq_reset": 1}
    reply = await api.get("/devices/meter-2")
    clock = reply.body["device"]["clock"]
    assert clock["adjustments"] == {"stepped_back": 1, "seq_reset": 1}
    # A new epoch is judged at its own time: no skew.
    assert (clock["last"]["reason"], clock["last"]["skew_s"]) == ("seq_reset", 0.0)


async def test_counts_written_by_two_nodes_at_once_add_up(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Each node adds its own count in SQL: concurrent batches never overwrite each other."""
    now = await _db_now(db)
    ahead = now + timedelta(hours=8)
    conns = [await asyncpg.connect(db_dsn) for _ in range(2)]
    try:
        nodes = [_node("node-a"), _node("node-b")]

        async def send(index: int) -> None:
            for n in range(5):
                message = Telemetry(
                    ts=ahead + timedelta(seconds=10 * n + index), metrics={"temp": 20 + n}
                )
                await _store(nodes[index], conns[index], "pump-9", message)

        await asyncio.gather(send(0), send(1))
    finally:
        for conn in conns:
            await conn.close()
    (figure,) = await clock_repo.device_adjustments(db, "pump-9")
    assert (figure.reason, figure.count) == ("ahead", 10)
