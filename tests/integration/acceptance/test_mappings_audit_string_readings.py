"""Audit: a cold-chain LoRaWAN sensor whose codec writes its readings as strings. The Dragino
LHT65's ChirpStack decoder returns ``toFixed(2)`` texts: ``"TempC_DS": "17.12"`` (its output
as the OpenRemote documentation's ChirpStack tutorial prints it, under ``object``; the uplink
around it is ChirpStack v4's documented ``up`` event, tests/fixtures/mappings/). The
``chirpstack-v4`` profile stores every value of ``object`` as read, so the temperature is the
text "17.12", and a threshold rule ``TempC_DS > 8`` judged it as no number at all: a freezer
at 17 °C raised nothing, and nobody was told (the rule looked configured and watched)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

import aiomqtt
import asyncpg
import msgspec

from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
UPLINK: Final = msgspec.json.decode((FIXTURES / "chirpstack-v4-up.json").read_bytes())
DEV_EUI: Final = "a841452101b04161"
TOPIC: Final = f"application/17c82e96-be03-4f38-aef3-f83d48582d97/device/{DEV_EUI}/event/up"
CONFIG: Final = """
[[ingest.mappings]]
name = "lora"
profile = "chirpstack-v4"

[[rules]]
key = "freezer-warm"
kind = "threshold"
metric = "TempC_DS"
op = ">"
value = 8
clear_value = 6
severity = "CRITICAL"

[[rules]]
key = "battery-low"
kind = "threshold"
metric = "BatV"
op = "<"
value = 2.5
severity = "WARNING"
"""


def _uplink(at: datetime, temperature: str, f_cnt: int) -> bytes:
    uplink = dict(UPLINK)
    uplink["time"] = at.isoformat()
    uplink["fCnt"] = f_cnt
    uplink["object"] = {
        "BatV": 3.04,
        "Ext_sensor": "Temperature Sensor",
        "Hum_SHT": "34.5",
        "TempC_DS": temperature,
        "TempC_SHT": "17.67",
    }
    return msgspec.json.encode(uplink)


async def test_a_reading_written_as_a_number_in_a_string_is_judged_as_that_number(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    now = datetime.now(UTC).replace(microsecond=0)
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)):
        async with aiomqtt.Client("127.0.0.1", port, identifier="chirpstack") as chirpstack:
            for number, (seconds, temperature) in enumerate(((-60, "4.10"), (-30, "17.12"))):
                payload = _uplink(now + timedelta(seconds=seconds), temperature, number)
                await chirpstack.publish(TOPIC, payload, qos=1)

        async def stored() -> bool:
            return int(await db.fetchval("SELECT count(*) FROM telemetry")) == 2

        await wait_until(stored, timeout=30, message="the two uplinks stored")
        # Stored as the codec wrote it: the text stays the text.
        newest = await db.fetchval(
            "SELECT metrics->'TempC_DS' FROM telemetry ORDER BY ts DESC LIMIT 1"
        )
        assert newest == '"17.12"'
        alarms = await db.fetch("SELECT device_id, rule_key FROM alarm")
        assert [(a["device_id"], a["rule_key"]) for a in alarms] == [(DEV_EUI, "freezer-warm")], (
            "the freezer at 17.12 °C raised nothing"
        )
