"""Audit: a LoRaWAN uplink heard by two gateways whose clocks disagree. ChirpStack v4 dates
its ``up`` event (`time`) by the first gateway of ``rxInfo`` that has a time of its own (a
GNSS time, else the gateway's clock: chirpstack/src/uplink/helpers.rs get_rx_timestamp),
and ``rxInfo`` comes in no order (its deduplication set, a Redis set). A gateway whose clock
is an hour ahead (no GNSS fix, NTP unreachable) dated one uplink an hour late, the next (the
other gateway listed first) on time: the device's readings jumped back and forth by an hour,
and a reading dated an hour ahead is the device's newest for that hour. Every ``rxInfo``
item also carries ``nsTime``, when ChirpStack itself received that gateway's copy: one clock,
the network server's, for every gateway. The profile now reads the middle one of those."""

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
DEV_EUI: Final = "0101010101010101"
TOPIC: Final = f"application/17c82e96-be03-4f38-aef3-f83d48582d97/device/{DEV_EUI}/event/up"
CONFIG: Final = """
[[ingest.mappings]]
name = "lora"
profile = "chirpstack-v4"
"""


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def _uplink(at: datetime, f_cnt: int, *, ahead_first: bool) -> bytes:
    """As ChirpStack publishes it: each gateway's copy received by the network server a few
    milliseconds after the radio frame (nsTime), each dated by its gateway's clock (gwTime),
    the event dated by the first gateway listed."""
    on_time = {
        **UPLINK["rxInfo"][0],
        "gwTime": _iso(at),
        "nsTime": _iso(at + timedelta(milliseconds=40)),
    }
    ahead = {
        **UPLINK["rxInfo"][0],
        "gatewayId": "0016c001f1500812",
        "gwTime": _iso(at + timedelta(hours=1)),
        "nsTime": _iso(at + timedelta(milliseconds=55)),
    }
    rx_info = [ahead, on_time] if ahead_first else [on_time, ahead]
    return msgspec.json.encode(
        {
            **UPLINK,
            "time": rx_info[0]["gwTime"],
            "fCnt": f_cnt,
            "data": f"f{f_cnt}",
            "object": {"temperature": 20.0 + f_cnt},
            "rxInfo": rx_info,
        }
    )


async def test_gateways_whose_clocks_disagree_date_no_reading(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    sent = [start + timedelta(minutes=n) for n in range(4)]
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)):
        async with aiomqtt.Client("127.0.0.1", port, identifier="chirpstack") as chirpstack:
            for n, at in enumerate(sent):
                await chirpstack.publish(TOPIC, _uplink(at, n, ahead_first=n % 2 == 0), qos=1)

        async def stored() -> bool:
            return int(await db.fetchval("SELECT count(*) FROM telemetry")) == len(sent)

        await wait_until(stored, timeout=30, message="the uplinks stored")
        rows = await db.fetch(
            "SELECT ts, (metrics->>'f_cnt')::int AS f_cnt FROM telemetry ORDER BY f_cnt"
        )
        dated = [r["ts"] for r in rows]
        assert dated == [at + timedelta(milliseconds=40) for at in sent], (
            "a reading dated by the gateway whose clock is an hour ahead"
        )
