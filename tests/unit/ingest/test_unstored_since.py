"""What the writer holds unstored (``IngestWriter.unstored_since``): the receipt of the oldest
message handed over by the reader and not yet released (stored and acknowledged, or given
back), whether it waits for room in the queue, in the queue, or in a flight. The queue and the
acknowledgement sequencer are the writer's own; no database is reached."""

from __future__ import annotations

import asyncio

import msgspec

from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.writer import IngestWriter
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics

TOPICS = Topics("iot")


def _writer(queue_max: int = 1000) -> IngestWriter:
    return IngestWriter(
        pool=None,  # type: ignore[arg-type]  # holding and releasing never reach the database
        decoder=MessageDecoder(TOPICS, Encoding.JSON, 65536),
        node_id="node-a",
        metrics=Metrics(),
        batch_size=100,
        linger_s=3600.0,
        queue_max=queue_max,
        retry=Backoff(0.01, 0.1),
    )


def _chunk(count: int, received_at: float) -> list[Inbound]:
    """What the reader hands over at once: one arrival time."""
    return [
        Inbound(
            topic=TOPICS.telemetry(f"dev-{n}"),
            payload=msgspec.json.encode({"ts": 1767225600000 + n, "metrics": {"t": 1}}),
            received_at=received_at,
        )
        for n in range(count)
    ]


def _stored(writer: IngestWriter, count: int) -> None:
    """The next ``count`` queued messages taken, their flight landed, stored: released."""
    taken = writer._take_now(count)
    writer._order.extend(taken)
    for item in taken:
        writer._settled[id(item)] = True
    writer._release()


async def test_the_oldest_receipt_held_moves_on_only_as_messages_are_released() -> None:
    writer = _writer()
    assert writer.unstored_since is None
    await writer.put_many(_chunk(3, received_at=5.0))
    await writer.put_many(_chunk(2, received_at=7.0))
    await writer.put_many([])
    assert writer.unstored_since == 5.0
    _stored(writer, 2)
    assert writer.unstored_since == 5.0, "one message of the first chunk is still held"
    _stored(writer, 2)
    assert writer.unstored_since == 7.0
    _stored(writer, 1)
    assert writer.unstored_since is None


async def test_a_message_released_unstored_is_no_longer_held() -> None:
    """A flight that failed is given back to the broker (unacknowledged): not the node's."""
    writer = _writer()
    await writer.put_many(_chunk(1, received_at=5.0))
    taken = writer._take_now(1)
    writer._order.extend(taken)
    writer._settled[id(taken[0])] = False
    writer._release()
    assert writer.unstored_since is None


async def test_what_waits_for_room_in_the_queue_is_held_and_given_back_on_cancel() -> None:
    writer = _writer(queue_max=2)
    await writer.put_many(_chunk(2, received_at=5.0))
    handing = asyncio.create_task(writer.put_many(_chunk(3, received_at=7.0)))
    for _ in range(10):
        await asyncio.sleep(0)  # a yield to the loop: the reader blocks on the full queue
    assert not handing.done()
    _stored(writer, 2)
    for _ in range(10):
        await asyncio.sleep(0)
    assert writer.unstored_since == 7.0, "the reader holds the second chunk"
    assert writer.queue.qsize() == 2
    handing.cancel()  # the connection ended: the third message was never queued
    await asyncio.gather(handing, return_exceptions=True)
    _stored(writer, 2)
    assert writer.unstored_since is None
