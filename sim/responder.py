"""Simulated devices answering downlink commands: many devices over one MQTT connection.

The responder subscribes to ``{prefix}/devices/+/commands`` (QoS 1), takes the device id from
the topic and answers on ``{prefix}/devices/{device_id}/acks`` (QoS 1) as a `Script` says:
correctly, with a failure code, not at all, late, twice, or with the faults the gateway's
receipt guards exist for (stale generation, wrong node, no generation).

The session is persistent (MQTT 3.1.1 ``clean_session=False``; MQTT 5 ``clean_start=False``
with a session expiry), like a real device's: commands published while the responder is
reconnecting are queued by the broker and answered once it is back. Reuse a client id only
for the same simulated fleet, or the new run answers the old run's leftovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final, Literal, assert_never

import aiomqtt
import msgspec
import structlog
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

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
from sim.publisher import no_delay

log = structlog.get_logger("sim.responder")

PUBLISH_TIMEOUT_S: Final = 10.0
SESSION_EXPIRY_S: Final = 300
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


def _payload_bytes(message: aiomqtt.Message) -> bytes:
    payload = message.payload
    if not isinstance(payload, bytes | bytearray):
        raise DecodeError("MALFORMED", f"payload of type {type(payload).__name__}")
    return bytes(payload)


def _refused(code: int | ReasonCode) -> bool:
    # MQTT 3.1.1 SUBACK return code 0x80 / MQTT 5 reason codes >= 0x80 are failures.
    return code >= 0x80 if isinstance(code, int) else code.is_failure


class Responder:
    """Answers downlink commands for every device id seen on the command topics.

    ``received`` holds every decoded command in arrival order, ``answered`` counts commands
    whose receipts were all published, ``errors`` counts undecodable commands (bad topic or
    payload, otherwise ignored) and receipts that could not be published (dropped, as a device
    whose uplink failed would). ``connections`` counts successful subscriptions.

    Answers run as tasks, at most ``max_pending`` at once (late ones included): when all are
    taken, reading waits for one to finish. Stopping cancels the unfinished ones.
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
        self._rng = random.Random(script.seed)
        self._backoff_rng = random.Random()
        self._subscribed = asyncio.Event()
        self._client: aiomqtt.Client | None = None
        self._slots: asyncio.Semaphore | None = None
        self._answers: set[asyncio.Task[None]] = set()

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
        self._slots = asyncio.Semaphore(self.max_pending)
        attempt = 0
        try:
            while not stop.is_set():
                try:
                    await self._connection(stop)
                except aiomqtt.MqttError as exc:
                    if self._subscribed.is_set():
                        attempt = 0
                    self._went_offline()
                    delay = reconnect_delay_s(attempt, self._backoff_rng)
                    attempt += 1
                    log.warning(
                        "responder_connection_lost",
                        error=str(exc),
                        attempt=attempt,
                        retry_in_s=round(delay, 3),
                    )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await stop.wait()
        finally:
            self._went_offline()
            await self._cancel_answers()

    def _went_offline(self) -> None:
        self._subscribed.clear()
        self._client = None

    def _new_client(self) -> aiomqtt.Client:
        if self.protocol == "5":
            properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho is untyped
            properties.SessionExpiryInterval = SESSION_EXPIRY_S
            client = aiomqtt.Client(
                self.host,
                self.port,
                identifier=self.client_id,
                protocol=aiomqtt.ProtocolVersion.V5,
                clean_start=False,
                properties=properties,
                timeout=PUBLISH_TIMEOUT_S,
            )
        else:
            client = aiomqtt.Client(
                self.host,
                self.port,
                identifier=self.client_id,
                protocol=aiomqtt.ProtocolVersion.V311,
                clean_session=False,
                timeout=PUBLISH_TIMEOUT_S,
            )
        # aiomqtt logs a warning past this many publishes awaiting PUBACK; we bound them.
        client.pending_calls_threshold = self.max_pending * 2 + 1
        return client

    async def _connection(self, stop: asyncio.Event) -> None:
        """One connection: returns when ``stop`` is set, raises MqttError when it is lost."""
        async with self._new_client() as client:
            no_delay(client)
            granted = await client.subscribe(self.topics.subscription(TopicKind.COMMANDS), qos=1)
            if any(_refused(code) for code in granted):
                raise aiomqtt.MqttError(f"subscription refused: {granted}")
            self._client = client
            self.connections += 1
            self._subscribed.set()
            log.info("responder_subscribed", client_id=self.client_id, connections=self.connections)
            reader = asyncio.create_task(self._read(client), name="sim-responder-read")
            stopping = asyncio.create_task(stop.wait(), name="sim-responder-stop")
            try:
                await asyncio.wait((reader, stopping), return_when=asyncio.FIRST_COMPLETED)
            finally:
                reader.cancel()
                stopping.cancel()
                await asyncio.gather(reader, stopping, return_exceptions=True)
            if stop.is_set():
                # Before DISCONNECT, so no answer publishes on a closing connection.
                self._went_offline()
                await self._cancel_answers()
                return
            reader.result()  # the MqttError that ended the message stream
            raise aiomqtt.MqttError("message stream ended")

    async def _read(self, client: aiomqtt.Client) -> None:
        assert self._slots is not None
        async for message in client.messages:
            command = self._decode(message)
            if command is None:
                continue
            device_id, decoded = command
            self.received.append(decoded)
            behaviour = self.choose(device_id, decoded)
            if behaviour is Behaviour.NO_ANSWER:
                continue
            await self._slots.acquire()
            task = asyncio.create_task(
                self._answer(device_id, decoded, behaviour),
                name=f"sim-responder-answer-{device_id}-{decoded.command_id}",
            )
            self._answers.add(task)
            task.add_done_callback(self._answer_done)

    def _decode(self, message: aiomqtt.Message) -> tuple[str, DownlinkCommand] | None:
        topic = message.topic.value
        try:
            device_id = self.topics.parse_device_topic(topic).device_id
            return device_id, decode_command(_payload_bytes(message), self.encoding)
        except (TopicError, DecodeError) as exc:
            self.errors += 1
            log.warning("responder_command_undecodable", topic=topic, error=str(exc))
            return None

    async def _answer(self, device_id: str, command: DownlinkCommand, behaviour: Behaviour) -> None:
        if behaviour is Behaviour.LATE:
            await asyncio.sleep(self.script.late_s)
        topic = self.topics.acks(device_id)
        for receipt in receipts_for(command, behaviour, self.script):
            payload = _encode(receipt, behaviour, self.encoding)
            # Waits out a reconnect: a late answer due meanwhile goes out on the next connection.
            while (client := self._client) is None:
                await self._subscribed.wait()
            try:
                await client.publish(topic, payload, qos=1)
            except aiomqtt.MqttError as exc:
                self.errors += 1
                log.warning(
                    "responder_receipt_lost",
                    device_id=device_id,
                    command_id=command.command_id,
                    error=str(exc),
                )
                return
        self.answered += 1

    def _answer_done(self, task: asyncio.Task[None]) -> None:
        self._answers.discard(task)
        assert self._slots is not None
        self._slots.release()
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.errors += 1
            log.error("responder_answer_failed", task=task.get_name(), error=repr(exc))

    async def _cancel_answers(self) -> None:
        pending = list(self._answers)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
