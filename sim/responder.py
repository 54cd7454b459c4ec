"""Simulated devices answering downlink commands: many devices over one MQTT connection.

The responder subscribes to ``{prefix}/devices/+/commands`` (QoS 1), takes the device id from
the topic and answers on ``{prefix}/devices/{device_id}/acks`` (QoS 1) as a `Script` says:
correctly, with a failure code, not at all, late, twice, or with the faults the gateway's
receipt guards exist for (stale generation, wrong node, no generation).

The session is persistent (MQTT 3.1.1 ``clean_session=False``; MQTT 5 ``clean_start=False``
with a session expiry), like a real device's: commands published while the responder is
reconnecting are queued by the broker and answered once it is back. Reuse a client id only
for the same simulated fleet, or the new run answers the old run's leftovers.

Why a transport of its own. The benchmark runs the simulated devices on the same two cores as
the gateway it measures. On aiomqtt/paho every answered command cost about 450 µs of CPU (a
task, a future and paho's packet handling per message and per receipt), which at campaign
rates took a third of a core from the gateway. Here one ``asyncio.Protocol`` frames the byte
stream and answers each command where its PUBLISH is parsed: no task, future or log line per
command, receipts written straight to the transport (all of one chunk's in one write), their
PUBACKs counted in a dict. The hot packets (PUBLISH and PUBACK, both directions) are built and
read by hand because they are a few bytes and differ between 3.1.1 and 5 only by MQTT 5's
properties, which the responder skips; the ``mqtt5`` codec builds MQTT 5's CONNECT and SUBSCRIBE
and reads its CONNACK, SUBACK and DISCONNECT, whose properties (the broker's Receive Maximum,
reason codes) matter. ``mqtt5`` has no MQTT 3.1.1, whose control packets are fixed layouts.
This is the only transport: every behaviour and every caller works on it unchanged.

Delivery. A command is PUBACKed once its receipts are handed to the publish path (queued to be
sent, or a LATE answer's timer set), as before, where paho acknowledged on arrival. At most
``max_pending`` commands are being answered at once (late ones included, until their last
receipt is PUBACKed); further commands wait unacknowledged, in arrival order, so the broker's
in-flight window (and the Receive Maximum we announce in MQTT 5) bounds them. Receipts go out
QoS 1 with as many in flight as the broker's Receive Maximum allows (MQTT 5) or the pending
commands produce (3.1.1). A receipt not PUBACKed when the connection is lost is resent on the
next connection with its packet id and the DUP flag, as MQTT requires for a persistent session;
the old transport dropped it and counted an error. A command that was waiting unacknowledged
when the connection was lost is redelivered by the broker. A receipt the broker refuses (MQTT 5
PUBACK reason code 0x80 or above) is counted in ``errors`` and not resent.

Deliberately not done: QoS 2, TLS, authentication, topic aliases, unsubscribing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final, Literal, assert_never, cast

import mqtt5
import msgspec
import structlog

from protocol import (
    CommandReceipt,
    DecodeError,
    DownlinkCommand,
    Encoding,
    ReceiptResult,
    ResultCode,
    TopicError,
    TopicKind,
    Topics,
    decode_command,
    encode_receipt,
)
from sim.wire import remaining_length

log = structlog.get_logger("sim.responder")

CONNECT_TIMEOUT_S: Final = 10.0
"""Connecting, CONNACK and SUBACK together: a broker slower than this is retried."""
SESSION_EXPIRY_S: Final = 300
KEEPALIVE_S: Final = 60
RECONNECT_BASE_S: Final = 0.1
RECONNECT_CAP_S: Final = 2.0


class Behaviour(StrEnum):
    SUCCESS = "success"
    """ACKED, resultCode 0."""
    FAIL_CODE = "fail_code"
    """ACKED with `Script.fail_code`, the vendor code `Script.vendor_code` and a raw ack."""
    NO_ANSWER = "no_answer"
    LATE = "late"
    """ACKED 0 after `Script.late_s`."""
    DUPLICATE = "duplicate"
    """ACKED 0, published twice."""
    STALE_GENERATION = "stale_generation"
    """ACKED 0 with claimGeneration - 1."""
    OFFLINE = "offline"
    """DEVICE_OFFLINE, no resultCode."""
    SENT_THEN_ACK = "sent_then_ack"
    """SENT, then ACKED 0."""
    WRONG_NODE = "wrong_node"
    """ACKED 0 naming a node other than the one that sent the command."""
    NO_GENERATION = "no_generation"
    """ACKED 0 with the claimGeneration field left out of the payload."""


def _frozen(mapping: Mapping[str, Behaviour]) -> Mapping[str, Behaviour]:
    return MappingProxyType({key: Behaviour(value) for key, value in mapping.items()})


@dataclass(frozen=True)
class Script:
    """How each command is answered: the device's behaviour wins over the command name's.

    With ``failure_rate`` > 0, a command whose behaviour is SUCCESS becomes FAIL_CODE when the
    next draw of ``random.Random(seed).random()`` (one draw per SUCCESS command, in arrival
    order) is below the rate: the same commands in the same order fail the same way each run.
    """

    default: Behaviour = Behaviour.SUCCESS
    by_device: Mapping[str, Behaviour] = field(default_factory=dict)
    by_command: Mapping[str, Behaviour] = field(default_factory=dict)
    fail_code: int = ResultCode.EXECUTION_FAILED
    vendor_code: str = "E-17"
    late_s: float = 1.0
    failure_rate: float = 0.0
    seed: int = 1

    def __post_init__(self) -> None:
        if self.fail_code == ResultCode.SUCCESS:
            raise ValueError("fail_code must not be 0 (0 is success)")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be within [0, 1], got {self.failure_rate}")
        if self.late_s < 0:
            raise ValueError(f"late_s must not be negative, got {self.late_s}")
        object.__setattr__(self, "default", Behaviour(self.default))
        object.__setattr__(self, "by_device", _frozen(self.by_device))
        object.__setattr__(self, "by_command", _frozen(self.by_command))

    def behaviour_for(self, device_id: str, command_name: str) -> Behaviour:
        """The scripted behaviour, before ``failure_rate`` is applied."""
        return self.by_device.get(device_id) or self.by_command.get(command_name) or self.default


def reconnect_delay_s(
    attempt: int,
    rng: random.Random,
    *,
    base_s: float = RECONNECT_BASE_S,
    cap_s: float = RECONNECT_CAP_S,
) -> float:
    """Capped exponential backoff with full jitter: ``uniform(base/2, min(cap, base * 2**n))``."""
    ceiling = min(cap_s, base_s * 2.0 ** min(attempt, 32))
    return rng.uniform(min(base_s, ceiling) / 2, ceiling)


def _receipt(
    command: DownlinkCommand,
    result: ReceiptResult,
    result_code: int | None,
    *,
    claim_generation: int | None = None,
    node_id: str | None = None,
    raw_result_code: str | None = None,
    raw_ack: str | None = None,
) -> CommandReceipt:
    return CommandReceipt(
        command_id=command.command_id,
        claim_generation=(
            command.claim_generation if claim_generation is None else claim_generation
        ),
        node_id=command.node_id if node_id is None else node_id,
        result=result,
        result_code=result_code,
        raw_result_code=raw_result_code,
        raw_ack=raw_ack,
    )


def receipts_for(
    command: DownlinkCommand, behaviour: Behaviour, script: Script
) -> list[CommandReceipt]:
    """The receipts a device answers ``command`` with, in publishing order (pure)."""
    acked = _receipt(command, ReceiptResult.ACKED, ResultCode.SUCCESS)
    receipts: list[CommandReceipt]
    match behaviour:
        case Behaviour.SUCCESS | Behaviour.LATE | Behaviour.NO_GENERATION:
            # NO_GENERATION drops the field when encoding: None here would mean "echo".
            receipts = [acked]
        case Behaviour.NO_ANSWER:
            receipts = []
        case Behaviour.DUPLICATE:
            receipts = [acked, acked]
        case Behaviour.FAIL_CODE:
            raw = f"NAK {script.vendor_code} cmd={command.command_id} op={command.name}"
            receipts = [
                _receipt(
                    command,
                    ReceiptResult.ACKED,
                    script.fail_code,
                    raw_result_code=script.vendor_code,
                    raw_ack=raw,
                )
            ]
        case Behaviour.STALE_GENERATION:
            generation = command.claim_generation - 1
            receipts = [
                _receipt(
                    command, ReceiptResult.ACKED, ResultCode.SUCCESS, claim_generation=generation
                )
            ]
        case Behaviour.OFFLINE:
            receipts = [_receipt(command, ReceiptResult.DEVICE_OFFLINE, None)]
        case Behaviour.SENT_THEN_ACK:
            receipts = [_receipt(command, ReceiptResult.SENT, None), acked]
        case Behaviour.WRONG_NODE:
            other = f"{command.node_id}-other"
            receipts = [_receipt(command, ReceiptResult.ACKED, ResultCode.SUCCESS, node_id=other)]
        case _:
            assert_never(behaviour)
    return receipts


def _encode(receipt: CommandReceipt, behaviour: Behaviour, encoding: Encoding) -> bytes:
    if behaviour is not Behaviour.NO_GENERATION:
        return encode_receipt(receipt, encoding)
    # Absent, not null: the gateway must cope with devices that never send the field.
    fields = msgspec.to_builtins(receipt)
    del fields["claimGeneration"]
    if encoding is Encoding.MSGPACK:
        return msgspec.msgpack.encode(fields)
    return msgspec.json.encode(fields)


_CONNACK: Final = 0x2
_PUBLISH: Final = 0x3
_PUBACK: Final = 0x4
_SUBACK: Final = 0x9
_PINGRESP: Final = 0xD
_DISCONNECT: Final = 0xE
_PUBLISH_QOS1: Final = 0x32
_DUP: Final = 0x08
_U16: Final = struct.Struct("!H")
_PUBACK_PACKET: Final = struct.Struct("!BBH")  # fixed header 0x40, remaining length 2, packet id
_PINGREQ: Final = b"\xc0\x00"
# MQTT 5 lets a DISCONNECT leave out reason code 0 and the properties: the same two bytes.
_DISCONNECT_PACKET: Final = b"\xe0\x00"
_MAX_PACKET_ID: Final = 65535
_SUBSCRIBE_ID: Final = 1
_REFUSED: Final = 0x80  # SUBACK, CONNACK and MQTT 5 PUBACK codes from here up are failures


class _LinkError(Exception):
    """The connection was refused or lost, or the broker broke the protocol."""


def _string(text: str) -> bytes:
    raw = text.encode()
    return _U16.pack(len(raw)) + raw


def _connect_packet(client_id: str, v5: bool, receive_max: int) -> bytes:
    if v5:
        return mqtt5.ConnectPacket(
            client_id,
            clean_start=False,
            keep_alive=KEEPALIVE_S,
            session_expiry_interval=SESSION_EXPIRY_S,
            receive_max=receive_max,
        ).write()
    # Protocol level 4 (3.1.1), connect flags 0: clean session off, no will, no credentials.
    body = _string("MQTT") + bytes([4, 0]) + _U16.pack(KEEPALIVE_S) + _string(client_id)
    return b"\x10" + remaining_length(len(body)) + body


def _subscribe_packet(topic_filter: str, v5: bool) -> bytes:
    if v5:
        wanted = mqtt5.TopicFilter(topic_filter, max_qos=mqtt5.QoS.AT_LEAST_ONCE)
        return mqtt5.SubscribePacket(_SUBSCRIBE_ID, [wanted]).write()
    body = _U16.pack(_SUBSCRIBE_ID) + _string(topic_filter) + b"\x01"
    return b"\x82" + remaining_length(len(body)) + body


def _publish_packet(topic: bytes, payload: bytes, packet_id: int, v5: bool) -> bytes:
    """A QoS 1 PUBLISH; ``topic`` is already length-prefixed. MQTT 5 adds empty properties."""
    head = topic + _U16.pack(packet_id) + (b"\x00" if v5 else b"")
    return bytes([_PUBLISH_QOS1]) + remaining_length(len(head) + len(payload)) + head + payload


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """MQTT's variable byte integer at ``pos``: (value, position after it); None if the bytes
    end first. More than four bytes is malformed."""
    value = shift = 0
    for index in range(pos, min(pos + 4, end)):
        byte = buf[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    if end - pos >= 4:
        raise _LinkError("malformed packet: variable byte integer over four bytes")
    return None


def _settle(future: asyncio.Future[object], error: _LinkError) -> None:
    """Fail ``future`` if still waiting, without asyncio's "exception never retrieved"
    warning when nobody awaits it (the connection died before anyone asked)."""
    if not future.done():
        future.set_exception(error)
        future.exception()


class _Answer:
    """One command being answered: counts its receipts not yet PUBACKed."""

    __slots__ = ("command_id", "device_id", "left", "refused")

    def __init__(self, device_id: str, command_id: int) -> None:
        self.device_id = device_id
        self.command_id = command_id
        self.left = 0
        self.refused = False


class _Receipt:
    """One receipt to publish; ``packet`` is the PUBLISH as first written (None until then)."""

    __slots__ = ("answer", "packet", "payload", "topic")

    def __init__(self, answer: _Answer, topic: bytes, payload: bytes) -> None:
        self.answer = answer
        self.topic = topic
        self.payload = payload
        self.packet: bytes | None = None


class _Link(asyncio.Protocol):
    """One connection's bytes: frames packets and hands them to the responder; everything
    sent while one chunk is handled goes out in one write."""

    def __init__(self, responder: Responder, loop: asyncio.AbstractEventLoop) -> None:
        self.responder = responder
        self.loop = loop
        self.v5 = responder.protocol == "5"
        self.transport: asyncio.Transport | None = None
        self.rest = b""
        self.out = bytearray()
        self.flush_handle: asyncio.Handle | None = None
        self.in_chunk = False
        self.connack: asyncio.Future[None] = loop.create_future()
        self.suback: asyncio.Future[list[int]] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.reason = "connection lost"
        # Commands that arrived while max_pending were being answered: not acknowledged yet,
        # so the broker redelivers them if this connection is lost.
        self.backlog: collections.deque[tuple[bytes, bytes, int | None]] = collections.deque()
        self.last_read = self.last_write = loop.time()

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Nagle would hold a receipt back until the broker's delayed ACK (40 ms).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.reason = f"connection lost: {exc}"
        self.transport = None
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        error = _LinkError(self.reason)
        _settle(cast("asyncio.Future[object]", self.connack), error)
        _settle(cast("asyncio.Future[object]", self.suback), error)
        if not self.lost.done():
            self.lost.set_result(None)
        self.responder._link_lost(self)

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        buf = self.rest + data if self.rest else data
        end = len(buf)
        pos = 0
        responder = self.responder
        self.in_chunk = True
        try:
            while pos < end:
                if end - pos < 2:
                    break
                header = _varint(buf, pos + 1, end)
                if header is None:
                    break
                length, start = header
                stop = start + length
                if stop > end:
                    break
                first = buf[pos]
                kind = first >> 4
                if kind == _PUBLISH:
                    responder._on_publish(self, first, buf, start, stop)
                elif kind == _PUBACK:
                    responder._on_puback(buf, start, stop)
                else:
                    self._on_control(kind, buf[pos:stop])
                pos = stop
                if self.transport is None:
                    return
            self.rest = buf[pos:]
        except _LinkError as exc:
            self.abort(str(exc))
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # bad bytes (IndexError) or the codec's PanicException
            self.abort(f"malformed packet from the broker: {exc!r}")
            return
        finally:
            self.in_chunk = False
        self.flush()

    # ------------------------------------------------------------------ control packets

    def _on_control(self, kind: int, packet: bytes) -> None:
        if kind == _PINGRESP:
            return
        if kind == _CONNACK:
            self._on_connack(packet)
        elif kind == _SUBACK:
            self._on_suback(packet)
        elif kind == _DISCONNECT:
            raise _LinkError(f"disconnected by the broker: {self._disconnect_reason(packet)}")
        else:
            raise _LinkError(f"unexpected packet type {kind} from the broker")

    def _on_connack(self, packet: bytes) -> None:
        if self.connack.done():
            raise _LinkError("a second CONNACK")
        receive_max = _MAX_PACKET_ID
        if self.v5:
            parsed, _ = mqtt5.read(memoryview(packet))
            if not isinstance(parsed, mqtt5.ConnAckPacket):
                raise _LinkError(f"expected CONNACK, got {type(parsed).__name__}")
            code = int(parsed.reason_code)
            receive_max = parsed.receive_max
        elif len(packet) == 4:
            code = packet[3]
        else:
            raise _LinkError(f"malformed CONNACK {packet.hex()}")
        if code != 0:
            raise _LinkError(f"connection refused: CONNACK code {code:#04x}")
        self.connack.set_result(None)
        self.responder._on_open(self, receive_max)

    def _on_suback(self, packet: bytes) -> None:
        if self.v5:
            parsed, _ = mqtt5.read(memoryview(packet))
            if not isinstance(parsed, mqtt5.SubAckPacket):
                raise _LinkError(f"expected SUBACK, got {type(parsed).__name__}")
            packet_id, codes = parsed.packet_id, [int(code) for code in parsed.reason_codes]
        else:
            _, body = cast("tuple[int, int]", _varint(packet, 1, len(packet)))
            packet_id, codes = _U16.unpack_from(packet, body)[0], list(packet[body + 2 :])
        if packet_id != _SUBSCRIBE_ID or self.suback.done():
            raise _LinkError(f"unexpected SUBACK for packet id {packet_id}")
        self.suback.set_result(codes)

    def _disconnect_reason(self, packet: bytes) -> str:
        if not self.v5 or len(packet) < 3:
            return "normal disconnection"
        parsed, _ = mqtt5.read(memoryview(packet))
        code = getattr(parsed, "reason_code", None)
        return getattr(code, "name", str(code))

    # ------------------------------------------------------------------ writing

    def send(self, data: bytes) -> None:
        """Queue bytes: written at the end of the chunk being handled, or on the next turn
        of the loop."""
        self.out += data
        if not self.in_chunk and self.flush_handle is None:
            self.flush_handle = self.loop.call_soon(self.flush)

    def flush(self) -> None:
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        transport = self.transport
        if not self.out or transport is None or transport.is_closing():
            return
        out, self.out = self.out, bytearray()  # the transport may keep ``out``: never reuse it
        transport.write(out)
        self.last_write = self.loop.time()

    def keepalive(self) -> None:
        """Ping when either direction was quiet for half the keep-alive; abort a connection
        silent for one and a half (the broker's own limit for us)."""
        now = self.loop.time()
        if now - self.last_read >= 1.5 * KEEPALIVE_S:
            self.abort("no packet from the broker within the keep-alive")
        elif min(now - self.last_read, now - self.last_write) >= KEEPALIVE_S / 2:
            self.send(_PINGREQ)

    def abort(self, reason: str) -> None:
        self.reason = reason
        if self.transport is not None:
            self.transport.abort()

    async def close(self) -> None:
        """DISCONNECT (the session stays: it has an expiry) and wait for the socket to close."""
        self.send(_DISCONNECT_PACKET)
        self.flush()
        if self.transport is not None:
            self.transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await self.lost


class Responder:
    """Answers downlink commands for every device id seen on the command topics.

    ``received`` holds every decoded command in arrival order, ``answered`` counts commands
    whose receipts were all acknowledged by the broker, ``errors`` counts undecodable commands
    (bad topic or payload, otherwise ignored), answers that raised and receipts the broker
    refused. ``connections`` counts successful subscriptions.

    At most ``max_pending`` commands are answered at once (late ones included); further
    commands wait, unacknowledged, until one finishes. Stopping drops the unfinished ones.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        topics: Topics,
        script: Script,
        client_id: str = "sim-responder",
        protocol: Literal["3.1.1", "5"] = "5",
        encoding: Encoding = Encoding.JSON,
        max_pending: int = 1024,
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        self.host = host
        self.port = port
        self.topics = topics
        self.script = script
        self.client_id = client_id
        self.protocol: Literal["3.1.1", "5"] = protocol
        self.encoding = encoding
        self.max_pending = max_pending
        self.received: list[DownlinkCommand] = []
        self.answered = 0
        self.errors = 0
        self.connections = 0
        self._v5 = protocol == "5"
        self._rng = random.Random(script.seed)
        self._backoff_rng = random.Random()
        self._subscribed = asyncio.Event()
        self._link: _Link | None = None
        self._pending = 0
        self._late: dict[_Answer, asyncio.TimerHandle] = {}
        self._queued: collections.deque[_Receipt] = collections.deque()
        # Written and not yet PUBACKed, by packet id, in the order written (resent so).
        self._inflight: dict[int, _Receipt] = {}
        self._window = _MAX_PACKET_ID - 1
        self._last_id = 0

    @property
    def subscribed(self) -> bool:
        """Whether the current connection holds the command subscription."""
        return self._subscribed.is_set()

    async def wait_subscribed(self) -> None:
        """Return once subscribed on the current connection (again after a reconnect)."""
        await self._subscribed.wait()

    def choose(self, device_id: str, command: DownlinkCommand) -> Behaviour:
        """The behaviour for the next command; draws from the seeded rng for SUCCESS ones."""
        behaviour = self.script.behaviour_for(device_id, command.name)
        if (
            behaviour is Behaviour.SUCCESS
            and self.script.failure_rate > 0
            and self._rng.random() < self.script.failure_rate
        ):
            return Behaviour.FAIL_CODE
        return behaviour

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, subscribe and answer until ``stop`` is set; reconnect after broker loss."""
        attempt = 0
        try:
            while not stop.is_set():
                connections = self.connections
                try:
                    await self._connection(stop)
                except (OSError, _LinkError) as exc:  # OSError includes TimeoutError
                    if self.connections > connections:
                        attempt = 0
                    delay = reconnect_delay_s(attempt, self._backoff_rng)
                    attempt += 1
                    log.warning(
                        "responder_connection_lost",
                        error=str(exc) or type(exc).__name__,
                        attempt=attempt,
                        retry_in_s=round(delay, 3),
                    )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await stop.wait()
        finally:
            self._went_offline()
            self._cancel_answers()

    async def _connection(self, stop: asyncio.Event) -> None:
        """One connection: returns when ``stop`` is set, raises when it is lost or refused."""
        loop = asyncio.get_running_loop()
        link: _Link | None = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, link = await loop.create_connection(
                    lambda: _Link(self, loop), self.host, self.port
                )
                link.send(_connect_packet(self.client_id, self._v5, min(self.max_pending, 65535)))
                await link.connack
                link.send(_subscribe_packet(self.topics.subscription(TopicKind.COMMANDS), self._v5))
                granted = await link.suback
            if not granted or any(code >= _REFUSED for code in granted):
                raise _LinkError(f"subscription refused: {granted}")
            self.connections += 1
            self._subscribed.set()
            log.info("responder_subscribed", client_id=self.client_id, connections=self.connections)
            await self._hold(link, stop)
            # Before DISCONNECT, so no answer publishes on a closing connection.
            self._went_offline()
            self._cancel_answers()
            await link.close()
        finally:
            # Failed, timed out or cancelled part way: no DISCONNECT, the session stays.
            if link is not None and link.transport is not None and not link.transport.is_closing():
                link.abort("connection abandoned")

    async def _hold(self, link: _Link, stop: asyncio.Event) -> None:
        """Keep the connection alive until ``stop`` is set; raise once it is lost."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while True:
                done, _ = await asyncio.wait(
                    (stopping, link.lost),
                    timeout=KEEPALIVE_S / 4,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if stopping in done:
                    return
                if link.lost.done():
                    raise _LinkError(link.reason)
                link.keepalive()
        finally:
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping

    def _went_offline(self) -> None:
        self._subscribed.clear()
        self._link = None

    def _cancel_answers(self) -> None:
        for handle in self._late.values():
            handle.cancel()
        self._late.clear()
        self._queued.clear()
        self._inflight.clear()
        self._pending = 0

    # ------------------------------------------------------------------ called by _Link

    def _on_open(self, link: _Link, receive_max: int) -> None:
        """CONNACK accepted: resend what the last connection left unacknowledged, then go on."""
        self._link = link
        self._window = min(receive_max, _MAX_PACKET_ID - 1)
        # All of them, as MQTT requires, even past a Receive Maximum smaller than the last
        # connection's (the window only holds back new receipts).
        for receipt in self._inflight.values():
            packet = cast("bytes", receipt.packet)
            link.send(bytes([packet[0] | _DUP]) + packet[1:])
        self._pump()

    def _link_lost(self, link: _Link) -> None:
        if self._link is link:
            self._went_offline()

    def _on_publish(self, link: _Link, first: int, buf: bytes, start: int, stop: int) -> None:
        """One inbound PUBLISH, parsed by hand: this runs once per command."""
        qos = (first >> 1) & 3
        topic_end = start + 2 + ((buf[start] << 8) | buf[start + 1])
        topic = buf[start + 2 : topic_end]
        pos = topic_end
        packet_id: int | None = None
        if qos:
            if qos > 1:
                raise _LinkError("QoS 2 PUBLISH from the broker (we subscribed with QoS 1)")
            packet_id = (buf[pos] << 8) | buf[pos + 1]
            pos += 2
        if self._v5:
            properties = _varint(buf, pos, stop)
            if properties is None:
                raise _LinkError("malformed PUBLISH properties")
            pos = properties[1] + properties[0]
        if pos > stop:
            raise _LinkError("PUBLISH shorter than its headers")
        payload = buf[pos:stop]
        if self._pending >= self.max_pending:
            link.backlog.append((topic, payload, packet_id))
        else:
            self._take(link, topic, payload, packet_id)

    def _take(self, link: _Link, topic: bytes, payload: bytes, packet_id: int | None) -> None:
        """Answer one command, then acknowledge it: its receipts are queued or scheduled."""
        try:
            self._answer(topic, payload)
        except Exception as exc:  # a bug in answering one command must not end the connection
            self.errors += 1
            log.error(
                "responder_answer_failed", topic=topic.decode(errors="replace"), error=repr(exc)
            )
        if packet_id is not None:
            link.send(_PUBACK_PACKET.pack(0x40, 2, packet_id))

    def _answer(self, raw_topic: bytes, payload: bytes) -> None:
        topic = raw_topic.decode(errors="replace")
        if not topic.startswith(f"{self.topics.prefix}/devices/"):
            # Outside the subscription's prefix (as below): another client's retained message
            # that the embedded broker handed this connection (a Sparkplug host's STATE, a
            # Tasmota LWT). Not a command, and not ours to judge.
            return
        try:
            parsed = self.topics.parse_device_topic(topic)
            if parsed.kind is not TopicKind.COMMANDS:
                # Outside the subscription: the embedded broker (amqtt 0.12) sometimes hands
                # this connection retained messages of another client's subscription (devices'
                # status). Not a command, and not ours to judge.
                return
            device_id = parsed.device_id
            command = decode_command(payload, self.encoding)
        except (TopicError, DecodeError) as exc:
            self.errors += 1
            log.warning("responder_command_undecodable", topic=topic, error=str(exc))
            return
        self.received.append(command)
        behaviour = self.choose(device_id, command)
        if behaviour is Behaviour.NO_ANSWER:
            return
        answer = _Answer(device_id, command.command_id)
        if behaviour is Behaviour.LATE:
            loop = asyncio.get_running_loop()
            self._late[answer] = loop.call_later(
                self.script.late_s, self._late_due, answer, command, behaviour
            )
            self._pending += 1
        else:
            self._emit(answer, command, behaviour)
            self._pending += 1

    def _late_due(self, answer: _Answer, command: DownlinkCommand, behaviour: Behaviour) -> None:
        del self._late[answer]
        try:
            self._emit(answer, command, behaviour)
        except Exception as exc:  # a timer callback must never raise into the loop
            self.errors += 1
            log.error("responder_answer_failed", command_id=command.command_id, error=repr(exc))
            self._finish(answer)

    def _emit(self, answer: _Answer, command: DownlinkCommand, behaviour: Behaviour) -> None:
        """Queue the receipts (a connection that is down sends them once back)."""
        topic = _string(self.topics.acks(answer.device_id))
        payloads = [
            _encode(receipt, behaviour, self.encoding)
            for receipt in receipts_for(command, behaviour, self.script)
        ]
        answer.left = len(payloads)
        self._queued.extend(_Receipt(answer, topic, payload) for payload in payloads)
        self._pump()

    def _pump(self) -> None:
        """Write queued receipts while the window has room."""
        link = self._link
        queued = self._queued
        if link is None or not queued:
            return
        inflight = self._inflight
        v5 = self._v5
        while queued and len(inflight) < self._window:
            receipt = queued.popleft()
            packet_id = self._last_id
            while True:  # the window is below 65535, so a free id exists
                packet_id = packet_id % _MAX_PACKET_ID + 1
                if packet_id not in inflight:
                    break
            self._last_id = packet_id
            receipt.packet = _publish_packet(receipt.topic, receipt.payload, packet_id, v5)
            inflight[packet_id] = receipt
            link.send(receipt.packet)

    def _on_puback(self, buf: bytes, start: int, stop: int) -> None:
        packet_id = (buf[start] << 8) | buf[start + 1]
        receipt = self._inflight.pop(packet_id, None)
        if receipt is None:
            return  # a receipt dropped by a stop; nothing waits for it
        answer = receipt.answer
        if stop - start > 2 and buf[start + 2] >= _REFUSED:
            self.errors += 1
            answer.refused = True
            log.warning(
                "responder_receipt_lost",
                device_id=answer.device_id,
                command_id=answer.command_id,
                error=f"PUBACK reason code {buf[start + 2]:#04x}",
            )
        answer.left -= 1
        if answer.left == 0:
            self._finish(answer)
        self._pump()

    def _finish(self, answer: _Answer) -> None:
        if not answer.refused:
            self.answered += 1
        self._pending -= 1
        link = self._link
        if link is None:
            return
        backlog = link.backlog
        while backlog and self._pending < self.max_pending:
            self._take(link, *backlog.popleft())
