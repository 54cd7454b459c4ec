"""Messages as they come in (``Inbound``), and what a batch of them becomes (``Classified``):
telemetry rows, presence updates, command receipts or dead letters."""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import structlog

from gateway.domain.mappings import MappedPresence, MappedTelemetry, Mappings, Refusal
from gateway.sparkplug.host import SparkplugMessage
from protocol import (
    CommandReceipt,
    DecodeError,
    Encoding,
    Telemetry,
    TopicError,
    TopicKind,
    Topics,
    checked_device_event_id,
    decode_presence,
    decode_receipt,
    decode_telemetry,
    sparkplug,
    telemetry_event_id,
)
from storage.ingest import DeadLetterRow, TelemetryRow

log = structlog.get_logger(__name__)

# Bytes of a payload a dead letter keeps by default ([ingest] dead_letter_max_bytes).
DEAD_LETTER_MAX_BYTES = 65536
# The reason of a dead letter whose processing raised an exception nobody expected (a bug):
# that message alone is set aside, logged once with its traceback.
PROCESSING_FAILED = "PROCESSING_FAILED"


# The kinds of topic zero-length messages are counted by (gateway_empty_messages_total{kind}):
# a reading's topic (native or a mapping's), a presence topic (native status or a mapping's),
# a command receipt's, a Sparkplug B one (data, birth or death), and any other (a topic the
# gateway does not read, a bad device id).
EMPTY_TELEMETRY = "telemetry"
EMPTY_STATUS = "status"
EMPTY_ACKS = "acks"
EMPTY_SPARKPLUG = "sparkplug"
EMPTY_OTHER = "other"
EMPTY_KINDS = (EMPTY_TELEMETRY, EMPTY_STATUS, EMPTY_ACKS, EMPTY_SPARKPLUG, EMPTY_OTHER)
_EMPTY_KIND: dict[TopicKind, str] = {
    TopicKind.TELEMETRY: EMPTY_TELEMETRY,
    TopicKind.STATUS: EMPTY_STATUS,
    TopicKind.ACKS: EMPTY_ACKS,
}


class Acker(Protocol):
    def ack(self, message: Any, /) -> bool: ...


@dataclass(slots=True)
class Inbound:
    """One message from the broker (or a dead letter being replayed, with no acker)."""

    topic: str
    payload: bytes
    received_at: float = 0.0
    acker: Acker | None = None
    message: object = None
    # Set when only the first bytes of a payload no message may have were kept (see
    # MessageDecoder.admit): the size and SHA-256 (hex) of the whole payload as it arrived.
    size: int | None = None
    sha256: str | None = None
    # The crash-loop breaker's digest of topic and payload, computed once (see breaker.py).
    digest: bytes | None = None
    # The native topic as parsed for the message's ordering key (kind, device id), kept for
    # its classification.
    device_topic: tuple[TopicKind, str] | None = None
    # A dead letter being replayed: when it was received (epoch milliseconds), what a mapping
    # without a time in its payload reads it at (``received_at`` is the loop's clock).
    received_ms: int | None = None


@dataclass(slots=True)
class Classified:
    """A batch sorted into what each message becomes."""

    # The messages sorted, in order (a batch refused by the database is split by them).
    items: list[Inbound] = field(default_factory=list)
    telemetry: list[TelemetryRow] = field(default_factory=list)
    telemetry_sources: list[Inbound] = field(default_factory=list)
    decoded: list[Telemetry] = field(default_factory=list)
    presence: dict[str, str] = field(default_factory=dict)
    # When the node read each device's presence (the last one in the batch) off the broker, on
    # the loop's clock (``Inbound.received_at``); a device missing here has none known (a
    # replayed dead letter, a Sparkplug birth or death).
    presence_received: dict[str, float] = field(default_factory=dict)
    receipts: list[tuple[str, CommandReceipt]] = field(default_factory=list)
    dead_letters: list[DeadLetterRow] = field(default_factory=list)
    seen_devices: set[str] = field(default_factory=set)
    # Sparkplug B messages ([sparkplug]), judged in the batch's transaction (gateway.sparkplug).
    sparkplug: list[SparkplugMessage] = field(default_factory=list)
    # Devices read through a mapping: its name and the topic wildcards they were seen with
    # (what a command to them is rendered from: docs/devices.md).
    mapped_devices: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)
    # Readings on a mapping's telemetry topic that the broker sent as retained copies (at a
    # subscription, not as published) to a resumed session, left unread: see _redundant_copy.
    retained_copies: int = 0
    # The radio frame of each mapped reading that names one (by its index in ``telemetry``):
    # its device and identity, for the retransmission check (gateway.ingest.store).
    frames: dict[int, tuple[str, str]] = field(default_factory=dict)
    # Zero-length messages (MQTT's clearing of a retained message, or a device sending
    # nothing), by the kind of topic (EMPTY_KINDS): no reading, no statement, no dead letter.
    empty: dict[str, int] = field(default_factory=dict)


class MessageDecoder:
    """Turns (topic, payload) into a telemetry row, a presence update or a dead letter."""

    def __init__(
        self,
        topics: Topics,
        encoding: Encoding,
        max_payload_bytes: int,
        dead_letter_max_bytes: int = DEAD_LETTER_MAX_BYTES,
        mappings: Mappings | None = None,
        *,
        sparkplug: bool = False,
        max_birth_bytes: int = 0,
    ) -> None:
        self.topics = topics
        # Topics under `spBv1.0/` are Sparkplug B's ([sparkplug] enabled).
        self.sparkplug = sparkplug
        # Sparkplug's NBIRTH and DBIRTH: [sparkplug] max_birth_bytes, never below the rest's.
        self.max_birth_bytes = max(max_birth_bytes, max_payload_bytes)
        # Swapped whole on reload (``[[ingest.mappings]]``), between batches.
        self.mappings = mappings or Mappings()
        self.encoding = encoding
        self.max_payload_bytes = max_payload_bytes
        self.dead_letter_max_bytes = dead_letter_max_bytes
        # The time of day a reading with no time of its own is dated by (seconds since the
        # epoch): the daemon's is the database's clock as the node estimates it
        # (gateway.support.db_clock), not the node's own clock, which may be minutes off.
        self.wall: Callable[[], float] = time.time

    def admit(self, payload: bytes, topic: str = "") -> tuple[bytes, int | None, str | None]:
        """``(payload, None, None)``, or for a payload that can only become a dead letter
        (longer than any message on its ``topic`` may be) and longer than a dead letter keeps:
        its first bytes, its size and its SHA-256. The rest need not stay in memory while it
        waits."""
        size = len(payload)
        if size <= self.max_payload_bytes or size <= self.dead_letter_max_bytes:
            return payload, None, None
        if size <= self.max_birth_bytes and self._birth(topic):
            return payload, None, None
        digest = hashlib.sha256(payload).hexdigest()
        return payload[: self.dead_letter_max_bytes], len(payload), digest

    def _birth(self, topic: str) -> bool:
        """A Sparkplug NBIRTH or DBIRTH topic ([sparkplug] enabled)."""
        if not self.sparkplug or not topic.startswith(sparkplug.NAMESPACE + "/"):
            return False
        try:
            return sparkplug.parse_topic(topic).type in sparkplug.BIRTHS
        except sparkplug.SparkplugError:
            return False

    def dead_letter(
        self, item: Inbound, reason: str, detail: str, *, whole: bool = False
    ) -> DeadLetterRow:
        """The dead letter of ``item``: at most ``dead_letter_max_bytes`` of its payload (with
        ``whole``, all of it, unless it was cut down on arrival), with the size and SHA-256 of
        all of it."""
        # Received when the node read it off the broker (a replayed letter: when stored).
        received = item.received_at if item.received_at > 0 else None
        if item.size is not None and item.sha256 is not None:  # cut down on arrival
            return DeadLetterRow(
                item.topic, item.payload, reason, detail, item.size, item.sha256, received
            )
        payload = item.payload
        return DeadLetterRow(
            item.topic,
            payload if whole else payload[: self.dead_letter_max_bytes],
            reason,
            detail,
            len(payload),
            hashlib.sha256(payload).hexdigest(),
            received,
        )

    def order_key(self, item: Inbound) -> str | None:
        """What ``item`` must stay in order with, read from its topic alone (no decoding): its
        device id for the gateway's own topics; ``""`` for a topic that can only become a dead
        letter (ordered with nothing); None for a message whose device is only known once
        decoded (a vendor mapping naming it from the payload), which is stored with nothing
        else in flight (see ``gateway.ingest.flights``). A mapping that names the device
        from the topic gives the device id it stores the message under. A Sparkplug B
        message gives its edge node (``group/node``): the node's state is judged with every
        message of it and of its devices, whose ids (``group/node/device``) hold a ``/`` no
        native id holds."""
        topic = item.topic
        if self.sparkplug and sparkplug.is_topic(topic):
            try:
                return sparkplug.parse_topic(topic).node_key
            except sparkplug.SparkplugError:
                return ""  # STATE, or a dead letter
        if self.mappings:
            matched, device = self.mappings.order_key(topic)
            if matched:
                return device
        try:
            item.device_topic = self.topics.split_device_topic(topic)
        except TopicError:
            return ""
        return item.device_topic[1]

    def classify(self, items: Sequence[Inbound]) -> Classified:
        out = Classified(items=list(items))
        for item in items:
            try:
                self._classify_one(out, item)
            except Exception as exc:  # a bug costs one message, never the fleet
                log.exception(
                    "message_processing_failed",
                    stage="decode",
                    topic=item.topic,
                    payload_sha256=item.sha256 or hashlib.sha256(item.payload).hexdigest(),
                )
                out.dead_letters.append(
                    self.dead_letter(item, PROCESSING_FAILED, failure_detail(exc))
                )
        return out

    def _classify_one(self, out: Classified, item: Inbound) -> None:
        """Sorts one message into ``out``; raises only for a bug (after appending nothing
        but its device to ``seen_devices``)."""
        if self.sparkplug and sparkplug.is_topic(item.topic):
            self._classify_sparkplug(out, item)
            return
        if not item.payload and item.size is None:
            # Zero bytes: a retained message cleared (Zigbee2MQTT removing a device, an
            # operator's `mosquitto_pub -r -n`), which the broker hands to subscribers too. Not
            # the device speaking: no reading, no presence, not heard, no dead letter.
            kind = self._empty_kind(item)
            out.empty[kind] = out.empty.get(kind, 0) + 1
            return
        if self.mappings and self._classify_mapped(out, item):
            return
        target = item.device_topic
        if target is None:
            try:
                target = self.topics.split_device_topic(item.topic)
            except TopicError as exc:
                out.dead_letters.append(self.dead_letter(item, exc.code, str(exc)))
                return
        kind, device_id = target
        if item.size is not None:
            if kind is TopicKind.TELEMETRY:
                out.seen_devices.add(device_id)  # as for any other oversized telemetry
            detail = f"payload is {item.size} bytes, the limit is {self.max_payload_bytes}"
            out.dead_letters.append(self.dead_letter(item, "OVERSIZED", detail))
            return
        try:
            if kind is TopicKind.TELEMETRY:
                out.seen_devices.add(device_id)
                message = decode_telemetry(
                    item.payload, self.encoding, max_bytes=self.max_payload_bytes
                )
                # The topic's parse checked the device id.
                row = _row(device_id, message, checked_device_event_id(device_id, message))
                out.telemetry.append(row)
                out.telemetry_sources.append(item)
                out.decoded.append(message)
            elif kind is TopicKind.STATUS:
                out.presence[device_id] = decode_presence(item.payload).value
                _presence_received(out, device_id, item)
            elif kind is TopicKind.ACKS:
                receipt = decode_receipt(
                    item.payload, self.encoding, max_bytes=self.max_payload_bytes
                )
                out.receipts.append((device_id, receipt))
            else:
                out.dead_letters.append(
                    self.dead_letter(
                        item,
                        "UNSUPPORTED_TOPIC",
                        f"the gateway does not consume {kind.value} messages",
                    )
                )
        except DecodeError as exc:
            out.dead_letters.append(self.dead_letter(item, exc.code, exc.detail))

    def _empty_kind(self, item: Inbound) -> str:
        """The kind of topic an empty message came on (one of EMPTY_KINDS)."""
        if self.mappings:
            presence = self.mappings.presence(item.topic)
            if presence is not None:
                return EMPTY_STATUS if presence else EMPTY_TELEMETRY
        kind = item.device_topic
        if kind is None:
            try:
                kind = self.topics.split_device_topic(item.topic)
            except TopicError:
                return EMPTY_OTHER
        return _EMPTY_KIND.get(kind[0], EMPTY_OTHER)

    def _classify_sparkplug(self, out: Classified, item: Inbound) -> None:
        """A Sparkplug B message: parsed here, judged against the edge node's stored state in
        the batch's transaction. STATE and other hosts' commands are not for ingest."""
        parts = item.topic.split("/", 3)
        if len(parts) >= 2 and parts[1] == sparkplug.STATE:
            return
        if not item.payload and item.size is None:
            # Zero bytes: no edge node's (Sparkplug 3.0: each of its messages carries a seq, an
            # NDEATH its bdSeq), a tool clearing a retained topic. Read, it was a birth of no
            # metrics, a death, or data without a seq (the node distrusted, a rebirth asked).
            out.empty[EMPTY_SPARKPLUG] = out.empty.get(EMPTY_SPARKPLUG, 0) + 1
            return
        try:
            target = sparkplug.parse_topic(item.topic)
        except sparkplug.SparkplugError as exc:
            out.dead_letters.append(self.dead_letter(item, exc.code, exc.detail))
            return
        if target.type not in sparkplug.CONSUMED:
            return  # NCMD/DCMD: commands to edge nodes, ours or another host's
        size = item.size if item.size is not None else len(item.payload)
        if size > self.max_payload_bytes:
            if target.type not in sparkplug.BIRTHS:
                limit = f"the limit is {self.max_payload_bytes} ([mqtt] max_payload_bytes)"
            elif size > self.max_birth_bytes:
                limit = (
                    f"the limit for births is {self.max_birth_bytes} ([sparkplug] max_birth_bytes)"
                )
            else:
                limit = None
            if limit is not None:
                detail = f"payload is {size} bytes, {limit}"
                out.dead_letters.append(self.dead_letter(item, "OVERSIZED", detail))
                return
        try:
            payload = sparkplug.decode_payload(item.payload)
        except sparkplug.SparkplugError as exc:
            out.dead_letters.append(self.dead_letter(item, exc.code, exc.detail))
            return
        out.sparkplug.append(
            SparkplugMessage(
                topic=target,
                payload=payload,
                message_id=sparkplug.message_id(item.topic, item.payload),
                letter=functools.partial(self.dead_letter, item),
                # The broker's delivery (a replayed dead letter has none): its QoS.
                at_most_once=getattr(item.message, "qos", None) == 0,
            )
        )

    def _classify_mapped(self, out: Classified, item: Inbound) -> bool:
        """A message on a topic of ``[[ingest.mappings]]``, read into the native shapes: a
        telemetry row of its device, a presence update, or a dead letter with the mapping's
        reason. False when no mapping's topic matches (the native parse follows)."""
        # Over [mqtt] max_payload_bytes, as on native and Sparkplug topics: cut down on
        # arrival (beyond what a dead letter keeps too) or kept whole, never read.
        size = item.size if item.size is not None else len(item.payload)
        if size > self.max_payload_bytes:
            if not self.mappings.matches(item.topic):
                return False
            detail = f"payload is {size} bytes, the limit is {self.max_payload_bytes}"
            out.dead_letters.append(self.dead_letter(item, "OVERSIZED", detail))
            return True
        received_ms = item.received_ms
        if received_ms is None:
            received_ms = _wall_ms(item.received_at, self.wall())
        mapped = self.mappings.read(item.topic, item.payload, received_ms)
        if mapped is None:
            return False
        if isinstance(mapped, Refusal):
            out.dead_letters.append(self.dead_letter(item, mapped.code, mapped.detail))
        elif isinstance(mapped, MappedTelemetry):
            if _redundant_copy(item):
                out.retained_copies += 1
                return True
            message = mapped.message
            out.seen_devices.add(mapped.device_id)
            out.mapped_devices[mapped.device_id] = (mapped.mapping, mapped.captures)
            if mapped.frame is not None:
                out.frames[len(out.telemetry)] = (mapped.device_id, mapped.frame)
            out.telemetry.append(_row(mapped.device_id, message, mapped.event_id))
            out.telemetry_sources.append(item)
            out.decoded.append(message)
        elif isinstance(mapped, MappedPresence):
            if mapped.records:
                out.mapped_devices[mapped.device_id] = (mapped.mapping, mapped.captures)
            out.presence[mapped.device_id] = mapped.value
            _presence_received(out, mapped.device_id, item)
        return True


def _redundant_copy(item: Inbound) -> bool:
    """Whether ``item`` is the broker's copy of a retained message (Zigbee2MQTT's `retain:
    true`, Tasmota's SensorRetain), sent because the node subscribed (each start and
    reconnection: MQTT flags only those as retained, never a message as published), on a
    connection that resumed the node's session: the message itself reached that session when
    it was published, so the copy is no report of the device. Read, it was dated at its
    arrival where the payload carries no time (a button pressed once was pressed again at
    each start), and counted the device heard then (a dead device's last_seen moved past its
    Will `offline`). Without a session (the first start, one expired), the copy may be all
    that is left of a reading the node never got: it is read."""
    return bool(getattr(item.message, "retain", False)) and bool(
        getattr(item.acker, "session_present", False)
    )


def _presence_received(out: Classified, device_id: str, item: Inbound) -> None:
    """Note when ``item``, the device's latest presence in the batch, was received (a message
    with no receive time, a replayed dead letter, has none)."""
    if item.received_at > 0:
        out.presence_received[device_id] = item.received_at
    else:
        out.presence_received.pop(device_id, None)


def _wall_ms(received_at: float, now: float) -> int:
    """Epoch milliseconds of a delivery timed on the event loop's (monotonic) clock, ``now``
    being the time of day now (seconds); now for a message with no receive time."""
    age = time.monotonic() - received_at
    # The loop's clock is the monotonic one (asyncio's and uvloop's alike); an age outside
    # these bounds means it is not, and then the time of reading stands in for it.
    if received_at > 0 and 0.0 <= age < _MAX_QUEUED_S:
        now -= age
    return int(now * 1000)


# No age a message reaches in the node: the queue is bounded in messages, not in time, and
# what it holds waits as long as the database is away (an hour and more). An age dropped at an
# hour dated a reading held through a longer outage when it was decoded after it, hours late
# (the presence receipts' bound in storage/ingest.py is the same, for the same reason).
_MAX_QUEUED_S = 1000.0 * 86400.0


def failure_detail(exc: BaseException) -> str:
    """What a dead letter says of an unexpected exception: its type and message, bounded."""
    text = f"processing raised {type(exc).__name__}: {exc}"
    return text if len(text) <= 1000 else text[:1000] + "..."


def _row(device_id: str, message: Telemetry, event_id: str | None = None) -> TelemetryRow:
    return TelemetryRow(
        event_id=event_id or telemetry_event_id(device_id, message),
        device_id=device_id,
        ts_us=message.micros(),
        seq=message.seq,
        metrics_json=None
        if message.metrics is None
        else msgspec.json.encode(message.metrics).decode(),
        events_json=None
        if message.events is None
        else msgspec.json.encode(message.events).decode(),
    )
