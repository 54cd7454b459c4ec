"""How the writer gathers a batch (``IngestWriter._next_batch``): it waits up to
``[ingest] linger_ms`` for more messages, but never while the database has nothing to do and
the batch holds ``START_AT`` messages, and beside a transaction in flight it waits for that
one to land. The queue and the flights are the writer's own; no database is reached.

Every linger here is an hour unless the case is the linger's end, so that "still waiting" is
decided by the code, not by how fast the machine runs."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.flights import Flight
from gateway.ingest.writer import START_AT, IngestWriter
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics

TOPICS = Topics("iot")
HOUR = 3600.0
BATCH = 100


def _writer(linger_s: float = HOUR) -> IngestWriter:
    return IngestWriter(
        pool=None,  # type: ignore[arg-type]  # gathering a batch never reaches the database
        decoder=MessageDecoder(TOPICS, Encoding.JSON, 65536),
        node_id="node-a",
        metrics=Metrics(),
        batch_size=BATCH,
        linger_s=linger_s,
        queue_max=1000,
        retry=Backoff(0.01, 0.1),
    )


def _messages(count: int, first: int = 0) -> list[Inbound]:
    return [
        Inbound(
            topic=TOPICS.telemetry(f"dev-{n}"),
            payload=msgspec.json.encode({"ts": 1767225600000 + n, "metrics": {"t": 1}}),
        )
        for n in range(first, first + count)
    ]


def _in_flight(writer: IngestWriter) -> Flight[Inbound]:
    """A transaction the writer counts as in flight (what it holds does not matter here)."""
    flight = Flight[Inbound](_messages(1, first=10_000), frozenset({"dev-10000"}))
    writer._flights.append(flight)
    return flight


async def _settle() -> None:
    """Let every task that can run, run (a yield to the loop, not a wait for time)."""
    for _ in range(50):
        await asyncio.sleep(0)


async def _lingering(writer: IngestWriter, count: int, why: str) -> asyncio.Task[list[Inbound]]:
    """The writer gathering a batch, ``count`` messages queued, and still waiting."""
    task = asyncio.create_task(writer._next_batch())
    await writer.put_many(_messages(count))
    await _settle()
    assert not task.done(), why
    return task


async def _gathered(task: asyncio.Task[list[Inbound]]) -> list[Inbound]:
    async with asyncio.timeout(10):
        return await task


async def test_with_nothing_in_flight_a_batch_starts_once_it_holds_start_at_messages() -> None:
    writer = _writer()
    task = await _lingering(writer, START_AT - 1, "a batch under START_AT messages lingers")
    await writer.put_many(_messages(1, first=START_AT - 1))
    assert len(await _gathered(task)) == START_AT


async def test_beside_a_flight_a_batch_waits_for_it_to_land_then_starts() -> None:
    writer = _writer()
    flight = _in_flight(writer)
    task = await _lingering(writer, 40, "beside a transaction in flight, a batch lingers")
    await writer.put_many(_messages(5, first=40))
    writer._land(flight)
    batch = await _gathered(task)
    assert [m.topic for m in batch] == [m.topic for m in _messages(45)]


async def test_a_flight_landing_under_start_at_messages_leaves_the_batch_lingering() -> None:
    writer = _writer()
    flight = _in_flight(writer)
    task = await _lingering(writer, 3, "beside a transaction in flight, a batch lingers")
    writer._land(flight)
    await _settle()
    assert not task.done(), "3 messages and nothing in flight: the linger goes on"
    await writer.put_many(_messages(START_AT - 3, first=3))
    assert len(await _gathered(task)) == START_AT


async def test_beside_a_flight_a_full_batch_starts_at_once() -> None:
    writer = _writer()
    _in_flight(writer)
    task = await _lingering(writer, START_AT, "beside a transaction in flight, a batch lingers")
    await writer.put_many(_messages(BATCH + 7 - START_AT, first=START_AT))
    batch = await _gathered(task)
    assert len(batch) == BATCH
    assert writer.queue.qsize() == 7


@pytest.mark.parametrize("in_flight", [False, True])
async def test_the_linger_still_ends_a_small_batch(in_flight: bool) -> None:
    writer = _writer(linger_s=0.02)
    if in_flight:
        _in_flight(writer)
    await writer.put_many(_messages(3))
    assert len(await _gathered(asyncio.create_task(writer._next_batch()))) == 3


async def test_with_no_linger_a_batch_is_what_is_queued() -> None:
    writer = _writer(linger_s=0.0)
    _in_flight(writer)
    await writer.put_many(_messages(2))
    assert len(await _gathered(asyncio.create_task(writer._next_batch()))) == 2
