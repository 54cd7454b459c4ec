"""Telemetry of vendor devices, on their own topics and in their own JSON: what the built-in
mapping profiles read (docs/devices.md). ``gateway-sim publish --format tasmota`` sends these,
so that ingest can be measured on mapped traffic beside the native format.

Every message is a distinct reading (its own time, or for Zigbee2MQTT, which sends none, its
own values), so each must be stored exactly once.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Final

from sim.telemetry import EPOCH_MS

FORMATS: Final = ("native", "tasmota", "zigbee2mqtt", "shelly-gen2", "chirpstack-v4")
_APPLICATION: Final = "5f1e9a3c-7d1b-4c55-9a2e-0c6f1d2b3a40"
_NAMESPACE: Final = uuid.UUID("0b6f0c9e-3c1e-4a7b-9f51-6e1b9c2d7a11")


def _at(epoch_ms: int, offset_ms: int) -> datetime:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC) + timedelta(milliseconds=offset_ms)


def _tasmota(device: str, n: int, temp: float, epoch_ms: int, round_: int) -> tuple[str, bytes]:
    # Tasmota's Time has whole seconds and no offset: a device's k-th reading k seconds on.
    at = _at(epoch_ms, round_ * 1000).replace(tzinfo=None, microsecond=0).isoformat()
    body = {
        "Time": at,
        "SI7021": {"Temperature": temp, "Humidity": round(40 + (n % 200) / 10, 1)},
        "TempUnit": "C",
    }
    return f"tele/{device}/SENSOR", json.dumps(body).encode()


def _zigbee2mqtt(
    device: str, n: int, _temp: float, _epoch_ms: int, _round: int
) -> tuple[str, bytes]:
    # No time in the payload: the values differ from one message to the next instead.
    body = {
        "temperature": round(20 + (n % 1000) / 100, 2),
        "humidity": round(30 + (n // 1000 % 1000) / 20, 2),
        "battery": 100 - n % 100,
        "linkquality": 40 + n % 200,
    }
    return f"zigbee2mqtt/{device}", json.dumps(body).encode()


def _shelly(device: str, n: int, temp: float, epoch_ms: int, _round: int) -> tuple[str, bytes]:
    body = {
        "src": device,
        "dst": f"{device}/events",
        "method": "NotifyStatus",
        "params": {
            "ts": (epoch_ms + n) / 1000,
            "switch:0": {"id": 0, "apower": round(temp * 10, 1), "temperature": {"tC": temp}},
        },
    }
    return f"{device}/events/rpc", json.dumps(body).encode()


def _chirpstack(device: str, n: int, temp: float, epoch_ms: int, _round: int) -> tuple[str, bytes]:
    eui = device_eui(device)
    at = _at(epoch_ms, n)
    body = {
        "deduplicationId": str(uuid.uuid5(_NAMESPACE, f"{eui}/{n}")),
        "time": at.isoformat(),
        "deviceInfo": {"applicationId": _APPLICATION, "deviceName": device, "devEui": eui},
        "fCnt": n,
        "fPort": 1,
        "dr": 5,
        "object": {"temperature": temp, "battery": 100 - n % 100},
        "rxInfo": [{"gatewayId": "0016c001f153a14c", "rssi": -60 - n % 40, "snr": 7.5}],
    }
    return f"application/{_APPLICATION}/device/{eui}/event/up", json.dumps(body).encode()


def device_eui(device: str) -> str:
    """The DevEUI of a simulated device (`sim-00042` → `0000000000000042`)."""
    return f"{int(device.rsplit('-', 1)[1]):016d}"


_ENCODERS: Final[dict[str, Callable[[str, int, float, int, int], tuple[str, bytes]]]] = {
    "tasmota": _tasmota,
    "zigbee2mqtt": _zigbee2mqtt,
    "shelly-gen2": _shelly,
    "chirpstack-v4": _chirpstack,
}


def span_ms(fmt: str, devices: int, messages: int) -> int:
    """How long after its first time a stream's last reading is dated (0 for Zigbee2MQTT,
    whose readings carry no time: the gateway dates them when it receives them)."""
    last = max(messages - 1, 0)
    if fmt == "tasmota":
        return (last // max(devices, 1)) * 1000
    if fmt == "zigbee2mqtt":
        return 0
    return last


def vendor_stream(
    fmt: str,
    devices: list[str],
    messages: int,
    *,
    seed: int = 1,
    start_seq: int = 0,
    epoch_ms: int = EPOCH_MS,
) -> Iterator[tuple[str, bytes]]:
    """``messages`` distinct readings in vendor format ``fmt``, round-robin over ``devices``,
    dated from ``epoch_ms`` (the default, a fixed time: the same run, the same event ids)."""
    encode = _ENCODERS[fmt]
    rng = random.Random(seed)
    temps = {device: 20.0 + rng.random() * 5 for device in devices}
    for n in range(start_seq, start_seq + messages):
        device = devices[n % len(devices)]
        temps[device] += rng.uniform(-0.5, 0.5)
        yield encode(device, n, round(temps[device], 2), epoch_ms, n // len(devices))
