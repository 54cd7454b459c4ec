"""The demo's Tasmota devices, as Tasmota publishes (https://tasmota.github.io/docs/MQTT/), read
by the demo's ``[[ingest.mappings]] profile = "tasmota"`` (docs/devices.md):

- ``tasmota-plug-1``, a smart plug with energy monitoring (a Sonoff POW feeding a lab fridge):
  ``tele/tasmota-plug-1/SENSOR`` with ``ENERGY`` (``Power``, ``Voltage``, ``Current``, ``Today``
  …); it takes ``cmnd/tasmota-plug-1/POWER`` (``ON``, ``OFF``, ``TOGGLE``; empty: the state),
  answers on ``stat/tasmota-plug-1/RESULT`` (``{"POWER":"OFF"}``) and ``stat/…/POWER``, which
  the gateway does not read — the command stays ``SENT`` by design — and its next reading
  shows the effect (``ENERGY.Power`` 0 while off);
- ``tasmota-climate-1``, a temperature and humidity sensor (an AM2301 in a server room):
  ``{"AM2301":{"Temperature":…,"Humidity":…,"DewPoint":…},"TempUnit":"C"}``; any command is
  answered ``{"Command":"Unknown"}``, as Tasmota does.

Each has its own MQTT connection with Tasmota's Will (``tele/{device}/LWT`` ``Offline``,
retained) and its retained ``Online`` once connected, and reports every `TELE_PERIOD_S` (the
shortest ``TelePeriod`` Tasmota allows) with ``Time`` in UTC without an offset (the profile
reads it in UTC: a real device's zone goes in the mapping's ``timezone``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import aiomqtt
import structlog

log = structlog.get_logger(__name__)

PLUG: Final = "tasmota-plug-1"
CLIMATE: Final = "tasmota-climate-1"
DEVICES: Final = (PLUG, CLIMATE)
TELE_PERIOD_S: Final = 10.0
RETRY_S: Final = 2.0
FRIDGE_W: Final = 85.0
MAINS_V: Final = 230.0
ROOM_C: Final = 22.5


def tasmota_time(now: datetime) -> str:
    """Tasmota's ``Time``: the device's local time to the second, without an offset."""
    return now.astimezone(UTC).replace(tzinfo=None, microsecond=0).isoformat()


@dataclass
class TasmotaDevice:
    """One device's state and the payloads Tasmota would publish for it."""

    name: str
    rng: random.Random = field(default_factory=random.Random)
    power_on: bool = True
    today_kwh: float = 0.412
    readings: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def has_relay(self) -> bool:
        return self.name == PLUG

    def sensor(self, now: datetime) -> dict[str, Any]:
        n = next(self.readings)
        if self.has_relay:
            return {"Time": tasmota_time(now), "ENERGY": self._energy()}
        # A slow daily-like swing of about a degree, and sensor noise.
        temp = ROOM_C + 0.8 * math.sin(n / 40) + self.rng.gauss(0, 0.1)
        humidity = 45.0 + 3 * math.cos(n / 55) + self.rng.gauss(0, 0.3)
        return {
            "Time": tasmota_time(now),
            "AM2301": {
                "Temperature": round(temp, 1),
                "Humidity": round(humidity, 1),
                "DewPoint": round(_dew_point(temp, humidity), 1),
            },
            "TempUnit": "C",
        }

    def _energy(self) -> dict[str, Any]:
        voltage = round(MAINS_V + self.rng.gauss(0, 1.0))
        power = round(FRIDGE_W + self.rng.gauss(0, 3.0)) if self.power_on else 0
        factor = 0.91 if power else 0.0
        apparent = round(power / factor) if power else 0
        self.today_kwh += power * TELE_PERIOD_S / 3_600_000
        return {
            "TotalStartTime": "2026-01-12T09:41:07",
            "Total": round(118.204 + self.today_kwh, 3),
            "Yesterday": 2.037,
            "Today": round(self.today_kwh, 3),
            "Period": round(power * TELE_PERIOD_S / 3600),
            "Power": power,
            "ApparentPower": apparent,
            "ReactivePower": round(math.sqrt(max(apparent**2 - power**2, 0))),
            "Factor": factor,
            "Voltage": voltage,
            "Current": round(apparent / voltage, 3),
        }

    def command(self, name: str, payload: str) -> list[tuple[str, str]]:
        """What Tasmota publishes in answer to ``cmnd/{device}/{name}``: (topic, payload)s."""
        if name.upper() != "POWER" or not self.has_relay:
            return [(f"stat/{self.name}/RESULT", _json({"Command": "Unknown"}))]
        asked = payload.strip().upper()
        if asked in ("ON", "1"):
            self.power_on = True
        elif asked in ("OFF", "0"):
            self.power_on = False
        elif asked in ("TOGGLE", "2"):
            self.power_on = not self.power_on
        elif asked:
            return [(f"stat/{self.name}/RESULT", _json({"Command": "Error"}))]
        state = "ON" if self.power_on else "OFF"
        return [
            (f"stat/{self.name}/RESULT", _json({"POWER": state})),
            (f"stat/{self.name}/POWER", state),
        ]


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))  # as compact as Tasmota's


def _dew_point(temp: float, humidity: float) -> float:
    # Magnus formula, as Tasmota's own.
    gamma = math.log(humidity / 100) + 17.62 * temp / (243.12 + temp)
    return 243.12 * gamma / (17.62 - gamma)


async def run_tasmota(
    host: str,
    port: int,
    device: TasmotaDevice,
    stop: asyncio.Event,
    subscribed: asyncio.Event | None = None,
) -> None:
    """One Tasmota device until ``stop``; a lost broker is retried, never fatal.
    ``subscribed`` is set once it has subscribed to its commands (the first time)."""
    lwt = f"tele/{device.name}/LWT"
    while not stop.is_set():
        try:
            async with aiomqtt.Client(
                host,
                port,
                identifier=f"gateway-demo-{device.name}",
                protocol=aiomqtt.ProtocolVersion.V311,  # the embedded broker's
                will=aiomqtt.Will(lwt, b"Offline", qos=1, retain=True),
            ) as client:
                await client.subscribe(f"cmnd/{device.name}/+", qos=1)
                if subscribed is not None:
                    subscribed.set()
                await client.publish(lwt, b"Online", qos=1, retain=True)
                async with asyncio.TaskGroup() as tasks:
                    reader = tasks.create_task(_commands(client, device))
                    await _telemetry(client, device, stop)
                    reader.cancel()
                # A clean stop: Tasmota says Offline itself before it goes.
                await client.publish(lwt, b"Offline", qos=1, retain=True)
        except aiomqtt.MqttError as exc:
            log.warning("demo_device_connection_lost", device=device.name, error=str(exc))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RETRY_S):
                await stop.wait()


async def _telemetry(client: aiomqtt.Client, device: TasmotaDevice, stop: asyncio.Event) -> None:
    while not stop.is_set():
        reading = device.sensor(datetime.now(UTC))
        await client.publish(
            f"tele/{device.name}/SENSOR",
            _json(reading).encode(),
            qos=1,
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TELE_PERIOD_S):
                await stop.wait()


async def _commands(client: aiomqtt.Client, device: TasmotaDevice) -> None:
    commands = f"cmnd/{device.name}/+"
    async for message in client.messages:
        # The embedded broker (amqtt 0.12) sometimes hands a connection retained messages of
        # another client's subscription: only our command topic is read.
        if not message.topic.matches(commands):
            continue
        name = message.topic.value.rsplit("/", 1)[1]
        payload = message.payload.decode(errors="replace")
        for topic, answer in device.command(name, payload):
            await client.publish(topic, answer.encode(), qos=1)
