"""A lean MQTT 3.1.1 QoS 1 publisher for load generation.

The benchmark runs its simulated devices on the same two cores as the gateway it measures.
aiomqtt costs about 300 µs of CPU per QoS 1 publish here (a future, paho's packet building,
a task per message): a 10,000-device storm took the publisher 4 s, most of it stolen from the
gateway. This writes PUBLISH packets straight to the socket, many in flight, and counts the
PUBACKs: real devices on real networks cost the gateway's host nothing at all.

Only what load generation needs: clean session, QoS 1, no retain, no TLS, no reconnect.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Coroutine, Iterable
from types import TracebackType
from typing import Any, Final, Self

CONNECT: Final = 0x10
CONNACK: Final = 0x20
PUBLISH_QOS1: Final = 0x32
PUBACK: Final = 0x40
DISCONNECT: Final = b"\xe0\x00"
MAX_PACKET_ID: Final = 65535
# A PUBACK of MQTT 3.1.1 (what this client speaks): type, remaining length 2, packet id.
PUBACK_SIZE: Final = 4
# Messages written to the socket at once, and bytes of PUBACKs read at once.
CHUNK: Final = 64
ACK_READ: Final = 65536


class WireError(Exception):
    """The broker refused the connection or broke the protocol."""


def remaining_length(length: int) -> bytes:
    """MQTT's variable-length integer (1 to 4 bytes, 7 bits each, low first)."""
    if not 0 <= length <= 268_435_455:
        raise ValueError(f"remaining length out of range: {length}")
    out = bytearray()
    while True:
        byte, length = length % 128, length // 128
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out)


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("!H", len(raw)) + raw


def connect_packet(client_id: str, keepalive_s: int = 60) -> bytes:
    body = _string("MQTT") + bytes([4, 0x02]) + struct.pack("!H", keepalive_s) + _string(client_id)
    return bytes([CONNECT]) + remaining_length(len(body)) + body


def publish_packet(topic: str, payload: bytes, packet_id: int) -> bytes:
    head = _string(topic) + struct.pack("!H", packet_id)
    return bytes([PUBLISH_QOS1]) + remaining_length(len(head) + len(payload)) + head + payload


class WirePublisher:
    """``async with WirePublisher(host, port, client_id) as p: await p.publish_all(msgs)``."""

    def __init__(self, host: str, port: int, client_id: str, *, window: int = 1000) -> None:
        if not 1 <= window < MAX_PACKET_ID:
            raise ValueError(f"window must be within [1, {MAX_PACKET_ID - 1}]")
        self.host, self.port, self.client_id, self.window = host, port, client_id, window
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> Self:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._writer.write(connect_packet(self.client_id))
        ack = await self._reader.readexactly(4)
        if ack[0] != CONNACK or ack[3] != 0:
            raise WireError(f"connection refused: CONNACK {ack.hex()}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._writer is not None:
            if exc_type is None:
                self._writer.write(DISCONNECT)
            self._writer.close()
            await self._writer.wait_closed()

    async def publish_all(self, messages: Iterable[tuple[str, bytes]]) -> int:
        """Publish every (topic, payload) at QoS 1; return once all are acknowledged.

        At most ``window`` messages are unacknowledged at once. Packets go out in one write
        per ``CHUNK`` messages (or fewer, when the window is full or ``messages`` is done),
        and PUBACKs are read as whatever the socket holds: a write and a read per packet,
        and a semaphore slot per message of the window at the end of every call, cost the
        latency phase's publisher (paced calls of ~22 messages) a quarter of its CPU, on the
        cores it shares with what it measures.

        A broken connection raises (``WireError`` or ``OSError``); bound the wait with
        ``asyncio.timeout`` if the broker may stall.
        """
        assert self._reader is not None
        assert self._writer is not None
        reader, writer, window = self._reader, self._writer, self.window
        acked = asyncio.Event()
        unacked = 0

        async def read_acks() -> None:
            nonlocal unacked
            pending = b""
            while True:
                data = await reader.read(ACK_READ)
                if not data:
                    raise WireError("the broker closed the connection")
                pending += data
                whole = len(pending) - len(pending) % PUBACK_SIZE
                for at in range(0, whole, PUBACK_SIZE):
                    if pending[at] != PUBACK:
                        raise WireError(f"expected PUBACK, got packet type {pending[at] >> 4}")
                unacked -= whole // PUBACK_SIZE
                pending = pending[whole:]
                acked.set()

        async def wait_for_acks(most: int) -> None:
            """Until at most ``most`` messages are unacknowledged."""
            while unacked > most:
                acked.clear()
                await _first(acked.wait(), acks)

        acks = asyncio.create_task(read_acks(), name="wire-publisher-acks")
        sent = 0
        chunk: list[bytes] = []
        try:
            for topic, payload in messages:
                if unacked >= window:
                    writer.write(b"".join(chunk))
                    chunk.clear()
                    await writer.drain()
                    await wait_for_acks(window - 1)
                chunk.append(publish_packet(topic, payload, sent % MAX_PACKET_ID + 1))
                unacked += 1
                sent += 1
                if len(chunk) >= CHUNK:
                    writer.write(b"".join(chunk))
                    chunk.clear()
            writer.write(b"".join(chunk))
            await writer.drain()
            await wait_for_acks(0)
        finally:
            acks.cancel()
        return sent


async def _first(wanted: Coroutine[Any, Any, Any], reader: asyncio.Task[None]) -> None:
    """Await ``wanted`` unless the PUBACK reader fails first (then raise its error)."""
    task = asyncio.ensure_future(wanted)
    done, _ = await asyncio.wait({task, reader}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
        return
    task.cancel()
    error = reader.exception() if not reader.cancelled() else None
    raise WireError("the connection ended before every PUBACK") from error
