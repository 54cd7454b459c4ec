"""The field simulation's plan: a seeded, deterministic set of device streams and faults.

Every device sends what real devices send in the field (docs/field-simulation.md): a steady
device reports every few seconds, with a duplicate now and then and a pair sent out of order;
an exception device reports a value only when it changes (its holds are judged on the clock);
a glitch device sends one message dated 8 hours ahead; a reset device reboots with its clock
at 1970 and its `seq` at 0; a behind device's clock is months late; a burst device uploads a
store-and-forward buffer from an earlier outage; a silent device stops. The faults: a node
SIGKILLed and restarted, the broker restarted, the database's connections cut, reloads that
add an inactivity rule and a quiet-hours window and take the window away, and a broker
outage with commands pending.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

import msgspec

from protocol import Telemetry, telemetry_event_id

Kind = Literal["steady", "exception", "glitch", "reset", "behind", "burst", "silent"]
# Devices whose samples are judged at their receipt after a clock jump: the order they are
# judged in is their arrival's (docs/rules-and-alarms.md, "Device clocks"), which faults
# reorder, so only which alarms exist is compared for them, not which superseded which.
JUMPY: Final[frozenset[Kind]] = frozenset({"glitch", "reset", "burst"})
KINDS: Final[tuple[Kind, ...]] = (
    "steady",
    "exception",
    "glitch",
    "reset",
    "behind",
    "burst",
    "silent",
)
# Shares of the fleet, at least one device of each kind.
SHARES: Final[dict[Kind, float]] = {
    "steady": 0.4,
    "exception": 0.15,
    "glitch": 0.1,
    "reset": 0.1,
    "behind": 0.1,
    "burst": 0.1,
    "silent": 0.05,
}
HOLD_S: Final = 20.0  # the `held` rule's for_seconds
EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)

FaultKind = Literal[
    "kill_node", "broker_restart", "db_cut", "reload_add", "reload_remove_quiet", "outage"
]


@dataclass
class Sent:
    """One message a device sends: when (seconds after the start), and its bytes."""

    device_id: str
    index: int  # its place in the device's true order
    at: float
    payload: bytes
    event_id: str
    duplicate: bool = False  # sent twice


@dataclass(frozen=True)
class Fault:
    at: float
    kind: FaultKind
    node: int = 0  # kill_node: which node
    seconds: float = 0.0  # outage: how long the broker is away


@dataclass
class Device:
    device_id: str
    kind: Kind
    messages: list[Sent] = field(default_factory=list)


@dataclass
class Plan:
    seed: int
    duration_s: float
    nodes: int
    start: datetime  # wall-clock time the plan's offsets count from (device true time)
    devices: list[Device]
    faults: list[Fault]

    def schedule(self) -> list[Sent]:
        """Every send in the order the devices make them (a swapped pair already swapped)."""
        sends = [m for d in self.devices for m in d.messages]
        return sorted(sends, key=lambda m: (m.at, m.device_id, m.index))

    def unique(self) -> int:
        return sum(len(d.messages) for d in self.devices)

    def duplicates(self) -> int:
        return sum(m.duplicate for d in self.devices for m in d.messages)


def _ms(at: datetime) -> int:
    return int((at - EPOCH).total_seconds() * 1000)


def _encode(device_id: str, ts: datetime, seq: int, **parts: object) -> tuple[bytes, str]:
    events = parts.pop("events", None)
    body: dict[str, object] = {"ts": _ms(ts), "seq": seq}
    metrics = {k: v for k, v in parts.items() if v is not None}
    if metrics:
        body["metrics"] = metrics
    if events:
        body["events"] = events
    payload = json.dumps(body, separators=(",", ":")).encode()
    message = msgspec.json.decode(payload, type=Telemetry)
    return payload, telemetry_event_id(device_id, message)


class _DeviceWriter:
    def __init__(self, device: Device, plan_start: datetime) -> None:
        self.device = device
        self.start = plan_start
        self.seq = 0

    def send(
        self,
        at: float,
        *,
        clock: datetime | None = None,
        duplicate: bool = False,
        **parts: object,
    ) -> None:
        ts = clock if clock is not None else self.start + timedelta(seconds=at)
        payload, event_id = _encode(self.device.device_id, ts, self.seq, **parts)
        self.seq += 1
        index = len(self.device.messages)
        self.device.messages.append(
            Sent(self.device.device_id, index, at, payload, event_id, duplicate)
        )


def _events(rng: random.Random) -> list[dict[str, str]] | None:
    roll = rng.random()
    if roll < 0.05:
        return [{"type": "SOS"}]
    if roll < 0.09:
        return [{"type": "DOOR_OPEN"}]
    return None


class _Temperature:
    """Episodes: normal (70), a run of violations (95), sometimes the hysteresis band (77)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.hot = 0

    def next(self) -> float:
        if self.hot:
            self.hot -= 1
            return 95.0 + self.rng.randint(0, 4)
        if self.rng.random() < 0.12:
            self.hot = self.rng.randint(0, 3)
            return 96.0
        return 77.0 if self.rng.random() < 0.1 else 70.0 + self.rng.randint(0, 3)


def _steady(w: _DeviceWriter, rng: random.Random, *, stop: float) -> None:
    temp = _Temperature(rng)
    at = rng.uniform(0.2, 2.0)
    swapped_last = False
    while at < stop:
        step = rng.uniform(1.5, 3.5)
        if not swapped_last and rng.random() < 0.06 and at + step < stop:
            # Two samples sent out of order: the later one first, the earlier 0.3 s after it.
            later = at + step
            w.send(later + 0.3, clock=w.start + timedelta(seconds=at), temp=temp.next())
            w.send(later, temp=temp.next(), events=_events(rng))
            swapped_last = True
            at = later + rng.uniform(1.5, 3.5)
            continue
        swapped_last = False
        w.send(at, temp=temp.next(), events=_events(rng), duplicate=rng.random() < 0.05)
        at += step


def _exception(w: _DeviceWriter, rng: random.Random, duration: float) -> None:
    """Pressure on change only: a violation either held past the hold (fires on the clock)
    or over well before it."""
    at = rng.uniform(0.2, 2.0)
    violating = False
    while at < duration - 2:
        violating = not violating
        w.send(at, p=15.0 if violating else 5.0, events=_events(rng))
        hold = rng.choice((rng.uniform(3.0, 8.0), rng.uniform(HOLD_S + 8, HOLD_S + 16)))
        at += hold if violating else rng.uniform(3.0, 8.0)


def _glitch(w: _DeviceWriter, rng: random.Random, duration: float) -> None:
    temp = _Temperature(rng)
    at = rng.uniform(0.2, 2.0)
    glitch_at = duration * rng.uniform(0.2, 0.5)
    glitched = False
    while at < duration - 1:
        if not glitched and at >= glitch_at:
            ahead = w.start + timedelta(seconds=at, hours=8)
            w.send(at, clock=ahead, temp=temp.next(), events=[{"type": "SOS"}])
            glitched = True
        else:
            w.send(at, temp=temp.next(), events=_events(rng))
        at += rng.uniform(1.5, 3.5)


def _reset(w: _DeviceWriter, rng: random.Random, duration: float) -> None:
    temp = _Temperature(rng)
    at = rng.uniform(0.2, 2.0)
    reboot_at = duration * rng.uniform(0.3, 0.6)
    booted: float | None = None
    while at < duration - 1:
        if booted is None and at >= reboot_at:
            booted, w.seq = at, 0
        if booted is None:
            w.send(at, temp=temp.next(), events=_events(rng))
        else:
            # After the reboot: the clock counts from 1970, the values stay normal (their
            # order is the arrival's), the events still happen.
            clock = EPOCH + timedelta(seconds=at - booted)
            w.send(at, clock=clock, temp=70.0, events=_events(rng))
        at += rng.uniform(2.0, 3.5)


def _behind(w: _DeviceWriter, rng: random.Random, duration: float) -> None:
    temp = _Temperature(rng)
    late = timedelta(days=rng.randint(45, 120))
    at = rng.uniform(0.2, 2.0)
    while at < duration - 1:
        clock = w.start + timedelta(seconds=at) - late
        w.send(at, clock=clock, temp=temp.next(), events=_events(rng))
        at += rng.uniform(1.5, 3.5)


def _burst(w: _DeviceWriter, rng: random.Random, duration: float) -> None:
    temp = _Temperature(rng)
    at = rng.uniform(0.2, 2.0)
    upload_at = duration * rng.uniform(0.3, 0.7)
    uploaded = False
    while at < duration - 1:
        if not uploaded and at >= upload_at:
            # A buffer recorded during an outage 20 minutes ago, uploaded at once: judged at
            # its receipt, values normal, its events raised.
            buffered_from = w.start + timedelta(seconds=at, minutes=-20)
            for n in range(rng.randint(5, 12)):
                clock = buffered_from + timedelta(seconds=10 * n)
                w.send(at + 0.01 * n, clock=clock, temp=70.0, events=_events(rng))
            uploaded = True
            at += 0.5
            continue
        w.send(at, temp=temp.next(), events=_events(rng))
        at += rng.uniform(1.5, 3.5)


def _fleet(rng: random.Random, count: int) -> list[Device]:
    kinds: list[Kind] = list(KINDS)
    while len(kinds) < count:
        roll, acc = rng.random(), 0.0
        for kind, share in SHARES.items():
            acc += share
            if roll < acc:
                kinds.append(kind)
                break
        else:
            kinds.append("steady")
    numbers: dict[Kind, int] = {}
    devices = []
    for kind in kinds[:count]:
        numbers[kind] = numbers.get(kind, 0) + 1
        devices.append(Device(f"{kind}-{numbers[kind]:03d}", kind))
    return devices


def silent_seconds(duration: float) -> float:
    """The reload-added inactivity rule's silence: longer than any gap of a talking device
    (a broker outage plus a period), shorter than a silent device's silence."""
    return max(30.0, duration * 0.3)


def outage_seconds(duration: float) -> float:
    return min(8.0 + duration * 0.05, 20.0)


def make_plan(
    seed: int, *, minutes: float, nodes: int, devices: int, start: datetime | None = None
) -> Plan:
    """The plan of one seed: the same seed, minutes, nodes and devices give the same plan
    (the device times count from `start`, the run's start)."""
    rng = random.Random(seed)
    duration = max(45.0, minutes * 60)
    began = start or datetime.now(UTC)
    fleet = _fleet(rng, max(devices, len(KINDS)))
    for device in fleet:
        writer = _DeviceWriter(device, began)
        device_rng = random.Random(f"{seed}:{device.device_id}")
        if device.kind == "steady":
            _steady(writer, device_rng, stop=duration - 1)
        elif device.kind == "silent":
            _steady(writer, device_rng, stop=duration * device_rng.uniform(0.1, 0.2))
        elif device.kind == "exception":
            _exception(writer, device_rng, duration)
        elif device.kind == "glitch":
            _glitch(writer, device_rng, duration)
        elif device.kind == "reset":
            _reset(writer, device_rng, duration)
        elif device.kind == "behind":
            _behind(writer, device_rng, duration)
        else:
            _burst(writer, device_rng, duration)
    return Plan(seed, duration, nodes, began, fleet, _faults(rng, duration, nodes))


def _faults(rng: random.Random, duration: float, nodes: int) -> list[Fault]:
    def at(low: float, high: float) -> float:
        return round(duration * rng.uniform(low, high), 1)

    faults = [
        Fault(at(0.1, 0.2), "kill_node", node=rng.randrange(nodes)),
        Fault(at(0.22, 0.3), "reload_add"),
        Fault(at(0.32, 0.4), "broker_restart"),
        Fault(at(0.42, 0.5), "db_cut"),
        Fault(at(0.52, 0.6), "outage", seconds=outage_seconds(duration)),
        Fault(at(0.7, 0.78), "reload_remove_quiet"),
        Fault(at(0.8, 0.88), "kill_node", node=rng.randrange(nodes)),
    ]
    return sorted(faults, key=lambda f: f.at)


def describe(plan: Plan) -> Iterator[str]:
    kinds: dict[str, int] = {}
    for device in plan.devices:
        kinds[device.kind] = kinds.get(device.kind, 0) + 1
    yield f"seed {plan.seed}: {len(plan.devices)} devices " + ", ".join(
        f"{n} {k}" for k, n in kinds.items()
    )
    yield (
        f"{plan.unique()} messages ({plan.duplicates()} sent twice) over {plan.duration_s:.0f} s"
    )
    yield "faults: " + ", ".join(f"{f.kind}@{f.at:g}s" for f in plan.faults)
