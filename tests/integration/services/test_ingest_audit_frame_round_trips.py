"""Audit: what the LoRaWAN retransmission check (a mapping's `frame_paths`, the device's last
frame kept on its `device_mapping` record) costs a batch in statements, each a round trip
to PostgreSQL on the batch's connection. It took three of its own (insert the records
missing, lock them, write the last frames) besides the batch's record of its due mappings:
now one, which also records them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import asyncpg
import msgspec

from gateway.config import parse_config
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.mapping_memory import MappingMemory
from gateway.ingest.store import store
from protocol import Encoding, Topics
from storage import ingest as repo
from tests.support.waiting import wait_until

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
UPLINK: Final = msgspec.json.decode((FIXTURES / "chirpstack-v4-up.json").read_bytes())
TOPIC: Final = "application/17c82e96-be03-4f38-aef3-f83d48582d97/device/{dev_eui}/event/up"
DEVICES: Final = [f"01010101010101{n:02d}" for n in range(4)]


def _decoder() -> MessageDecoder:
    toml = '[[ingest.mappings]]\nname = "lora"\nprofile = "chirpstack-v4"\n'
    return MessageDecoder(
        Topics("iot"), Encoding.JSON, 65536, mappings=parse_config(toml).mappings()
    )


def _uplink(dev_eui: str, at: datetime, f_cnt: int) -> Inbound:
    payload: dict[str, Any] = {
        **UPLINK,
        "time": at.isoformat(),
        "fCnt": f_cnt,
        "data": f"t{f_cnt}",
        "object": {"temperature": 20.0 + f_cnt},
    }
    return Inbound(topic=TOPIC.format(dev_eui=dev_eui), payload=msgspec.json.encode(payload))


async def _statements(
    conn: asyncpg.Connection, memory: MappingMemory, items: list[Inbound]
) -> tuple[int, int, int]:
    """One batch stored and committed: its statements, those on device_mapping, and how many
    of its readings were stored."""
    sent: list[str] = []
    batch = _decoder().classify(items)

    def logged(record: asyncpg.LoggedQuery) -> None:
        sent.append(record.query)

    conn.add_query_logger(logged)
    try:
        async with conn.transaction():
            result = await store(conn, batch, "node-a", mappings=memory)
    finally:
        conn.remove_query_logger(logged)
    memory.recorded(result.mapped)
    on_mappings = sum("device_mapping" in query for query in sent)
    return len(sent), on_mappings, result.stored


async def test_the_retransmission_check_costs_a_batch_one_statement(
    db: asyncpg.Connection,
) -> None:
    memory = MappingMemory()
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    # Devices new to the node: their mappings are recorded by the same statement.
    first = [_uplink(device, at, 7) for device in DEVICES]
    total, on_mappings, stored = await _statements(db, memory, first)
    assert stored == len(DEVICES)
    assert on_mappings == 1, f"{on_mappings} statements on device_mapping of {total}"

    # Their next frames, each with a retransmission in the batch, and FCnt 7 again: the
    # usual batch, every mapping recorded already.
    later = [
        uplink
        for device in DEVICES
        for uplink in (
            _uplink(device, at + timedelta(seconds=30), 7),
            _uplink(device, at + timedelta(seconds=60), 8),
            _uplink(device, at + timedelta(seconds=62), 8),
        )
    ]
    total, on_mappings, stored = await _statements(db, memory, later)
    assert stored == len(DEVICES), "FCnt 8 once per device, FCnt 7 and 8 again not"
    assert on_mappings == 1, f"{on_mappings} statements on device_mapping of {total}"
    rows = await db.fetch("SELECT device_id, mapping, frame IS NOT NULL AS f FROM device_mapping")
    assert {(r["device_id"], r["mapping"], r["f"]) for r in rows} == {
        (device, "lora", True) for device in DEVICES
    }


async def test_a_first_frame_another_batch_records_meanwhile_is_compared_with_it(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """Two nodes read a device's first frame and its retransmission at once: the batch that
    finds the other's record not yet committed waits for it, then compares with its frame
    (the statement's insert found the record taken: asked again once it is committed)."""
    device = DEVICES[0]
    mapped = {device: ("lora", {"application_id": "app", "dev_eui": device})}
    one, other = await asyncpg.connect(db_dsn), await asyncpg.connect(db_dsn)
    try:
        first = one.transaction()
        await first.start()
        again, _ = await repo.record_mapped_frames(one, [(device, "f7")], 600, mapped, mapped)
        assert again == set()

        async def second() -> set[int]:
            async with other.transaction():
                found, _ = await repo.record_mapped_frames(
                    other, [(device, "f7")], 600, mapped, mapped
                )
                return found

        task = asyncio.create_task(second())
        pid = other.get_server_pid()

        async def waiting() -> bool:
            return bool(
                await db.fetchval(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
                )
            )

        await wait_until(waiting, timeout=10, message="the second batch waits for the first")
        await first.commit()
        assert await asyncio.wait_for(task, 10) == {0}, "the retransmission taken for a reading"
    finally:
        await one.close()
        await other.close()
