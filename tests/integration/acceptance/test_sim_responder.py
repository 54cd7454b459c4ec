"""The simulated devices' answers to downlink commands, seen from a test "gateway side"
through a real mosquitto."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import aiomqtt
import pytest

from protocol import (
    CommandReceipt,
    DownlinkCommand,
    ReceiptResult,
    ResultCode,
    TopicKind,
    Topics,
    decode_receipt,
    encode_command,
)
from sim.responder import Behaviour, Responder, Script, reconnect_delay_s
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
NODE = "node-a"
WAIT_S = 15.0


@dataclass(frozen=True)
class Arrival:
    device_id: str
    receipt: CommandReceipt
    payload: bytes
    at: float


@dataclass
class GatewaySide:
    """Publishes commands and collects every receipt, in arrival order."""

    client: aiomqtt.Client
    arrivals: list[Arrival] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    next_id: int = 1
    failure: BaseException | None = None

    def receipts(self, device_id: str) -> list[CommandReceipt]:
        return [a.receipt for a in self.arrivals if a.device_id == device_id]

    async def send(
        self, device_id: str, name: str = "open", *, generation: int = 5
    ) -> DownlinkCommand:
        command = DownlinkCommand(
            command_id=self.next_id,
            claim_generation=generation,
            node_id=NODE,
            name=name,
            params={"door": 1},
        )
        self.next_id += 1
        await self.client.publish(TOPICS.commands(device_id), encode_command(command), qos=1)
        return command

    async def wait_receipts(self, device_id: str, count: int) -> list[CommandReceipt]:
        async with asyncio.timeout(WAIT_S), self.changed:
            await self.changed.wait_for(
                lambda: self.failure is not None or len(self.receipts(device_id)) >= count
            )
        if self.failure is not None:
            raise AssertionError("the receipt collector failed") from self.failure
        return self.receipts(device_id)

    async def collect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in self.client.messages:
                assert isinstance(message.payload, bytes)
                device_id = TOPICS.parse_device_topic(message.topic.value).device_id
                arrival = Arrival(
                    device_id, decode_receipt(message.payload), message.payload, loop.time()
                )
                async with self.changed:
                    self.arrivals.append(arrival)
                    self.changed.notify_all()
        except Exception as exc:
            async with self.changed:
                self.failure = exc
                self.changed.notify_all()
            raise


@asynccontextmanager
async def gateway_side(
    broker: Mosquitto, *, persistent: bool = False
) -> AsyncIterator[GatewaySide]:
    """The gateway's end: the receipts as they arrive. ``persistent``: its session outlives it
    (and a broker restart), so receipts published while it is away wait for its next connection."""
    async with aiomqtt.Client(
        broker.host,
        broker.port,
        identifier="test-gateway-persistent" if persistent else "test-gateway",
        clean_session=False if persistent else None,
    ) as client:
        await client.subscribe(TOPICS.subscription(TopicKind.ACKS), qos=1)
        side = GatewaySide(client)
        collector = asyncio.create_task(side.collect(), name="test-gateway-collect")
        try:
            yield side
        finally:
            collector.cancel()
            await asyncio.gather(collector, return_exceptions=True)


@asynccontextmanager
async def running(
    broker: Mosquitto,
    script: Script,
    *,
    protocol: str = "5",
    client_id: str = "sim-responder",
    port: int | None = None,
    max_pending: int = 1024,
) -> AsyncIterator[Responder]:
    """A running responder; ``port`` reaches the broker through something else (a proxy)."""
    responder = Responder(
        host=broker.host,
        port=broker.port if port is None else port,
        topics=TOPICS,
        script=script,
        client_id=client_id,
        protocol="5" if protocol == "5" else "3.1.1",
        max_pending=max_pending,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(responder.run(stop), name="test-responder")
    try:
        async with asyncio.timeout(WAIT_S):
            await responder.wait_subscribed()
        yield responder
    finally:
        stop.set()
        async with asyncio.timeout(WAIT_S):
            await task


def _device(behaviour: Behaviour) -> str:
    return f"dev-{behaviour.value}"


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_each_behaviour_answers_as_scripted(mosquitto: Mosquitto, protocol: str) -> None:
    immediate: list[Behaviour] = [
        b for b in Behaviour if b not in (Behaviour.NO_ANSWER, Behaviour.LATE)
    ]
    script = Script(by_device={_device(b): b for b in immediate}, fail_code=3)
    async with gateway_side(mosquitto) as gw, running(mosquitto, script, protocol=protocol) as sim:
        sent = {b: await gw.send(_device(b), generation=5) for b in immediate}
        expected_counts = {Behaviour.DUPLICATE: 2, Behaviour.SENT_THEN_ACK: 2}
        got = {b: await gw.wait_receipts(_device(b), expected_counts.get(b, 1)) for b in immediate}

        for behaviour, receipts in got.items():
            assert len(receipts) == expected_counts.get(behaviour, 1), behaviour
            assert all(r.command_id == sent[behaviour].command_id for r in receipts)

        def only(behaviour: Behaviour) -> CommandReceipt:
            (receipt,) = got[behaviour]
            return receipt

        ok = CommandReceipt(
            command_id=sent[Behaviour.SUCCESS].command_id,
            claim_generation=5,
            node_id=NODE,
            result=ReceiptResult.ACKED,
            result_code=ResultCode.SUCCESS,
        )
        assert only(Behaviour.SUCCESS) == ok

        failed = only(Behaviour.FAIL_CODE)
        assert (failed.result, failed.result_code) == (ReceiptResult.ACKED, 3)
        assert (failed.claim_generation, failed.node_id) == (5, NODE)
        assert failed.raw_result_code == "E-17"
        assert failed.raw_ack is not None
        assert "E-17" in failed.raw_ack

        first, second = got[Behaviour.DUPLICATE]
        assert first == second
        assert (first.result, first.result_code, first.claim_generation) == (
            ReceiptResult.ACKED,
            0,
            5,
        )

        stale = only(Behaviour.STALE_GENERATION)
        assert (stale.result, stale.result_code, stale.claim_generation, stale.node_id) == (
            ReceiptResult.ACKED,
            0,
            4,
            NODE,
        )

        offline = only(Behaviour.OFFLINE)
        assert (offline.result, offline.result_code, offline.claim_generation) == (
            ReceiptResult.DEVICE_OFFLINE,
            None,
            5,
        )

        sent_receipt, acked = got[Behaviour.SENT_THEN_ACK]
        assert (sent_receipt.result, sent_receipt.result_code) == (ReceiptResult.SENT, None)
        assert (acked.result, acked.result_code, acked.claim_generation) == (
            ReceiptResult.ACKED,
            0,
            5,
        )

        wrong = only(Behaviour.WRONG_NODE)
        assert wrong.node_id not in (None, NODE)
        assert (wrong.result, wrong.result_code, wrong.claim_generation) == (
            ReceiptResult.ACKED,
            0,
            5,
        )

        no_generation = only(Behaviour.NO_GENERATION)
        assert no_generation.claim_generation is None
        assert (no_generation.result, no_generation.result_code) == (ReceiptResult.ACKED, 0)
        (raw,) = [a.payload for a in gw.arrivals if a.device_id == _device(Behaviour.NO_GENERATION)]
        assert b"claimGeneration" not in raw  # omitted, not null

        assert len(sim.received) == len(immediate)
        # Counted once the broker has acknowledged, which may trail the receipt's delivery.
        await wait_until(lambda: sim.answered == len(immediate), timeout=WAIT_S)
        assert sim.errors == 0


async def test_no_answer_stays_silent_while_others_answer(mosquitto: Mosquitto) -> None:
    script = Script(by_device={"dev-mute": Behaviour.NO_ANSWER})
    async with gateway_side(mosquitto) as gw, running(mosquitto, script) as sim:
        muted = await gw.send("dev-mute")
        await gw.send("dev-talks")
        await gw.wait_receipts("dev-talks", 1)
        assert muted in sim.received  # it arrived and was deliberately not answered
        assert gw.receipts("dev-mute") == []
        await wait_until(lambda: sim.answered == 1, timeout=WAIT_S)
        assert sim.answered == 1


async def test_late_answers_after_the_others_without_blocking_them(mosquitto: Mosquitto) -> None:
    late_s = 1.0
    script = Script(by_device={"dev-slow": Behaviour.LATE}, late_s=late_s)
    loop = asyncio.get_running_loop()
    async with gateway_side(mosquitto) as gw, running(mosquitto, script):
        sent_at = loop.time()
        slow = await gw.send("dev-slow")
        quick = [f"dev-quick-{n}" for n in range(5)]
        for device in quick:
            await gw.send(device)
        (late,) = await gw.wait_receipts("dev-slow", 1)

    assert (late.command_id, late.result, late.result_code, late.claim_generation) == (
        slow.command_id,
        ReceiptResult.ACKED,
        0,
        5,
    )
    order = [a.device_id for a in gw.arrivals]
    assert order[-1] == "dev-slow"
    assert sorted(order[:-1]) == quick
    (slow_arrival,) = [a for a in gw.arrivals if a.device_id == "dev-slow"]
    assert slow_arrival.at - sent_at >= late_s


async def test_device_behaviour_wins_over_command_behaviour(mosquitto: Mosquitto) -> None:
    script = Script(
        by_device={"dev-a": Behaviour.FAIL_CODE},
        by_command={"reboot": Behaviour.OFFLINE},
    )
    async with gateway_side(mosquitto) as gw, running(mosquitto, script):
        await gw.send("dev-a", "reboot")
        await gw.send("dev-b", "reboot")
        await gw.send("dev-b", "open")
        (a_reboot,) = await gw.wait_receipts("dev-a", 1)
        b_reboot, b_open = await gw.wait_receipts("dev-b", 2)
    assert (a_reboot.result, a_reboot.result_code) == (ReceiptResult.ACKED, 3)
    by_id = {r.command_id: r for r in (b_reboot, b_open)}
    assert by_id[2].result is ReceiptResult.DEVICE_OFFLINE
    assert (by_id[3].result, by_id[3].result_code) == (ReceiptResult.ACKED, 0)


async def _failed_ids(broker: Mosquitto, script: Script, count: int) -> set[int]:
    async with gateway_side(broker) as gw, running(broker, script):
        for _ in range(count):
            await gw.send("dev-flaky")
        receipts = await gw.wait_receipts("dev-flaky", count)
    assert len(receipts) == count
    return {r.command_id for r in receipts if r.result_code != ResultCode.SUCCESS}


async def test_failure_rate_is_deterministic_for_a_seed(mosquitto: Mosquitto) -> None:
    count, rate, seed = 40, 0.3, 7
    script = Script(failure_rate=rate, seed=seed, fail_code=4)
    draws = random.Random(seed)
    expected = {n for n in range(1, count + 1) if draws.random() < rate}
    assert 0 < len(expected) < count  # the seed exercises both outcomes

    assert await _failed_ids(mosquitto, script, count) == expected
    # A second run, fresh responder with the same seed: the same commands fail.
    assert await _failed_ids(mosquitto, script, count) == expected


async def test_undecodable_commands_are_counted_and_ignored(mosquitto: Mosquitto) -> None:
    async with gateway_side(mosquitto) as gw, running(mosquitto, Script()) as sim:
        await gw.client.publish(TOPICS.commands("dev-1"), b"not json", qos=1)
        await gw.client.publish(TOPICS.commands("dev-1"), b'{"commandId": "x"}', qos=1)
        await gw.client.publish("iot/devices/bad id/commands", encode_command(_command()), qos=1)
        good = await gw.send("dev-1")
        (receipt,) = await gw.wait_receipts("dev-1", 1)
        assert receipt.command_id == good.command_id
        assert sim.errors == 3
        assert sim.received == [good]
        assert [a.device_id for a in gw.arrivals] == ["dev-1"]


def _command() -> DownlinkCommand:
    return DownlinkCommand(command_id=99, claim_generation=1, node_id=NODE, name="open")


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_reconnects_after_broker_restart(mosquitto: Mosquitto, protocol: str) -> None:
    async with running(mosquitto, Script(), protocol=protocol) as sim:
        mosquitto.restart()
        # The session persisted (broker database and clean start off): the command queues
        # for the responder even before it is back, and it answers once reconnected.
        async with gateway_side(mosquitto) as gw:
            command = await gw.send("dev-1")
            (receipt,) = await gw.wait_receipts("dev-1", 1)
        assert receipt.command_id == command.command_id
        # The broker hands the queued command over right after CONNACK, so the receipt can
        # arrive before the SUBACK that counts the second connection.
        await wait_until(lambda: sim.connections >= 2, timeout=WAIT_S)


async def test_answers_commands_queued_while_it_was_away(mosquitto: Mosquitto) -> None:
    async with running(mosquitto, Script(), client_id="sim-fleet"):
        pass
    async with gateway_side(mosquitto) as gw:
        queued = [await gw.send(f"dev-{n}") for n in range(3)]
        async with running(mosquitto, Script(), client_id="sim-fleet") as sim:
            got = [(await gw.wait_receipts(f"dev-{n}", 1))[0] for n in range(3)]
        assert [r.command_id for r in got] == [c.command_id for c in queued]
        assert sim.received == queued


async def test_stop_cancels_pending_late_answers(mosquitto: Mosquitto) -> None:
    script = Script(default=Behaviour.LATE, late_s=600.0)
    stop = asyncio.Event()
    responder = Responder(host=mosquitto.host, port=mosquitto.port, topics=TOPICS, script=script)
    task = asyncio.create_task(responder.run(stop))
    async with asyncio.timeout(WAIT_S):
        await responder.wait_subscribed()
    async with gateway_side(mosquitto) as gw:
        await gw.send("dev-1")
        await wait_until(lambda: len(responder.received) == 1, timeout=WAIT_S)
        stop.set()
        async with asyncio.timeout(WAIT_S):
            await task
    assert responder.answered == 0
    assert gw.arrivals == []


@contextmanager
def _broker_down(broker: Mosquitto) -> Iterator[None]:
    broker.stop()
    try:
        yield
    finally:
        broker.start()


async def test_keeps_retrying_while_the_broker_is_down(mosquitto: Mosquitto) -> None:
    async with running(mosquitto, Script()) as sim:
        with _broker_down(mosquitto):
            await wait_until(lambda: not sim.subscribed, timeout=WAIT_S)
        async with asyncio.timeout(WAIT_S):
            await sim.wait_subscribed()
        async with gateway_side(mosquitto) as gw:
            await gw.send("dev-1")
            await gw.wait_receipts("dev-1", 1)
        assert sim.connections == 2


def test_reconnect_delay_is_capped_and_jittered() -> None:
    rng = random.Random(3)
    delays = [reconnect_delay_s(attempt, rng, base_s=0.1, cap_s=2.0) for attempt in range(50)]
    assert all(0.05 <= d <= 2.0 for d in delays)
    assert max(delays[:1]) <= 0.1
    assert len(set(delays)) == len(delays)
    assert reconnect_delay_s(10_000, rng) <= 2.0


def test_script_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="fail_code"):
        Script(fail_code=0)
    with pytest.raises(ValueError, match="failure_rate"):
        Script(failure_rate=1.5)
    with pytest.raises(ValueError, match="late_s"):
        Script(late_s=-1)
    assert Script(by_command={"x": Behaviour.LATE}).behaviour_for("d", "x") is Behaviour.LATE


def _frames(raw: bytes) -> Iterator[tuple[int, bytes]]:
    """(first byte, whole packet) of each complete MQTT packet in ``raw``, then the rest is
    left out (an incomplete tail)."""
    pos = 0
    while pos + 2 <= len(raw):
        length = shift = 0
        index = pos + 1
        while index < len(raw):
            byte = raw[index]
            index += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        else:
            return
        if index + length > len(raw):
            return
        yield raw[pos], raw[pos : index + length]
        pos = index + length


def _publishes(raw: bytes) -> list[tuple[bool, int]]:
    """(DUP flag, packet id) of every QoS 1 PUBLISH in a client's byte stream."""
    found = []
    for first, packet in _frames(raw):
        if first >> 4 == 3 and (first >> 1) & 3 == 1:
            body = 2 if packet[1] < 0x80 else 3  # receipts are far below 16 KiB
            topic_length = int.from_bytes(packet[body : body + 2], "big")
            packet_id = int.from_bytes(packet[body + 2 + topic_length : body + 4 + topic_length])
            found.append((bool(first & 0x08), packet_id))
    return found


class PubackTap:
    """Forwards MQTT connections to a broker, recording what each client wrote; while
    ``swallow_pubacks`` is set, the broker's PUBACKs never reach the client (so the client's
    publishes stay unacknowledged though the broker has them). ``drop()`` resets every
    connection; new ones are accepted as before."""

    def __init__(self, broker: Mosquitto) -> None:
        self.broker = broker
        self.swallow_pubacks = False
        self.written: list[bytearray] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._transports: list[asyncio.WriteTransport] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> PubackTap:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.drop()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def drop(self) -> None:
        for transport in self._transports:
            transport.abort()
        self._transports.clear()

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._forward(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.broker.host, self.broker.port)
        self._transports += [writer.transport, up_writer.transport]
        written = bytearray()
        self.written.append(written)

        async def upstream() -> None:
            while data := await reader.read(65536):
                written.extend(data)
                up_writer.write(data)
            up_writer.close()

        async def downstream() -> None:
            pending = b""
            while data := await up_reader.read(65536):
                pending += data
                used = 0
                for first, packet in _frames(pending):
                    used += len(packet)
                    if not (self.swallow_pubacks and first >> 4 == 4):
                        writer.write(packet)
                pending = pending[used:]
            writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_resends_unacknowledged_receipts_with_dup_after_a_reconnect(
    mosquitto: Mosquitto, protocol: str
) -> None:
    async with (
        PubackTap(mosquitto) as tap,
        gateway_side(mosquitto) as gw,
        running(mosquitto, Script(), protocol=protocol, port=tap.port) as sim,
    ):
        tap.swallow_pubacks = True
        command = await gw.send("dev-1")
        # The broker has the receipt (it reached the gateway side), the responder no PUBACK.
        (first,) = await gw.wait_receipts("dev-1", 1)
        assert first.command_id == command.command_id
        assert sim.answered == 0
        [(dup, packet_id)] = _publishes(bytes(tap.written[0]))
        assert not dup

        tap.swallow_pubacks = False
        tap.drop()
        # The resend's PUBACK can come before the new connection is counted (once subscribed).
        await wait_until(
            lambda: sim.answered == 1 and sim.connections == 2,
            timeout=WAIT_S,
            message="receipt acknowledged on the second connection",
        )
        # The same receipt again, marked as a duplicate, under its original packet id.
        assert _publishes(bytes(tap.written[1])) == [(True, packet_id)]
        receipts = await gw.wait_receipts("dev-1", 1)
        assert {r.command_id for r in receipts} == {command.command_id}
        assert sim.errors == 0


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_broker_restart_mid_run_loses_no_answer(
    mosquitto: Mosquitto, protocol: str
) -> None:
    count = 200
    # Late answers fall due while the broker is down or reconnecting: none may be lost.
    late = {f"dev-{n}": Behaviour.LATE for n in range(0, count, 2)}
    script = Script(by_device=late, late_s=0.3)
    # Subscribed and gone: every receipt queues in the broker, across the restart, for the
    # check below.
    async with gateway_side(mosquitto, persistent=True):
        pass
    async with running(mosquitto, script, protocol=protocol) as sim:
        async with gateway_side(mosquitto) as gw:
            sent = [await gw.send(f"dev-{n}") for n in range(count)]
            await wait_until(
                lambda: len(sim.received) == count, timeout=WAIT_S, message="all received"
            )
        with _broker_down(mosquitto):
            await wait_until(lambda: not sim.subscribed, timeout=WAIT_S)

        async with gateway_side(mosquitto, persistent=True) as check:

            def answered_ids() -> set[int]:
                return {a.receipt.command_id for a in check.arrivals}

            wanted = {c.command_id for c in sent}
            await wait_until(
                lambda: answered_ids() == wanted,
                timeout=WAIT_S,
                message="every command's receipt reached the gateway side",
            )
        assert all(a.receipt.result is ReceiptResult.ACKED for a in check.arrivals)
        # Counted on the broker's PUBACK, which may trail the delivery; more than ``count`` when
        # the broker redelivered a command whose PUBACK the restart cut off (answered again).
        await wait_until(lambda: sim.answered >= count, timeout=WAIT_S, message="all answered")
        assert sim.connections >= 2
        assert sim.errors == 0


async def test_answers_commands_published_while_the_network_was_cut(
    mosquitto: Mosquitto,
) -> None:
    async with (
        TcpProxy(mosquitto.host, mosquitto.port) as proxy,
        gateway_side(mosquitto) as gw,
        running(mosquitto, Script(), port=proxy.port) as sim,
    ):
        before = await gw.send("dev-0")
        await gw.wait_receipts("dev-0", 1)
        await proxy.cut()
        await wait_until(lambda: not sim.subscribed, timeout=WAIT_S)
        # The broker holds the responder's session: these queue for it.
        queued = [await gw.send(f"dev-{n}") for n in range(1, 4)]
        await proxy.resume()
        got = [(await gw.wait_receipts(f"dev-{n}", 1))[0] for n in range(1, 4)]
        assert [r.command_id for r in got] == [c.command_id for c in queued]
        assert sim.received == [before, *queued]
        # The broker sends a session's queued messages right after its CONNACK, before the
        # SUBACK the responder counts a connection at: the answers may come back first.
        await wait_until(lambda: sim.connections >= 2, timeout=WAIT_S)
        assert sim.connections == 2


async def test_commands_past_max_pending_wait_their_turn_in_order(mosquitto: Mosquitto) -> None:
    count = 30
    async with gateway_side(mosquitto) as gw, running(mosquitto, Script(), max_pending=2) as sim:
        sent = [await gw.send(f"dev-{n % 3}") for n in range(count)]
        await wait_until(lambda: sim.answered == count, timeout=WAIT_S)
        assert sim.received == sent
        for device in range(3):
            receipts = await gw.wait_receipts(f"dev-{device}", count // 3)
            ids = [r.command_id for r in receipts]
            assert ids == sorted(ids)  # one device's receipts keep the commands' order
