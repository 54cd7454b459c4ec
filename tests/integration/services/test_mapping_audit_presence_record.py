"""Audit: a mapped device's record (device_mapping, what its commands are rendered from) must
keep the topic wildcards its commands need. A presence topic may name the device with fewer
wildcards than the telemetry topic (``avail/{device}`` beside ``sites/{site}/{device}/state``:
check-config takes it); each presence message recorded its own wildcards over the telemetry's,
and every command sent until the device's next reading failed (``MAPPING_TEMPLATE``: no
``{site}``)."""

from __future__ import annotations

import asyncpg
import msgspec

from gateway.config import parse_config
from gateway.domain.mappings import DownlinkError
from gateway.ingest.decoder import Inbound, MessageDecoder
from storage import ingest as repo
from tests.integration.services.test_mapping_records import (
    TOPICS,
    Clock,
    _running,
    _stored,
    _writer,
)

SITES = """
[[ingest.mappings]]
name = "sites"
topic = "sites/{site}/{device}/state"
device = "{device}"
flatten = "$"
timestamp_path = "$.ts"
timestamp_format = "epoch_ms"
presence_topic = "avail/{device}"
command_topic = "sites/{site}/{device}/set/{command}"
command_payload = "{params}"
"""


def _reading(site: str, device: str, ts: int) -> Inbound:
    payload = msgspec.json.encode({"ts": ts, "temp": 21.5})
    return Inbound(topic=f"sites/{site}/{device}/state", payload=payload)


def _presence(device: str, value: bytes) -> Inbound:
    return Inbound(topic=f"avail/{device}", payload=value)


async def _downlink_topic(pool: asyncpg.Pool, device: str) -> str:
    """What the dispatcher would send a command to ``device`` on, from its record."""
    mappings = parse_config(SITES).mappings()
    recorded = (await repo.device_mappings(pool, [device]))[device]
    try:
        downlink = mappings.downlink(
            recorded[0],
            recorded[1],
            device_id=device,
            command="reboot",
            command_id=1,
            params={},
        )
    except DownlinkError as exc:
        raise AssertionError(f"record {recorded}: command refused {exc.code}: {exc}") from None
    assert downlink is not None
    return downlink.topic


async def test_a_presence_topic_with_fewer_wildcards_keeps_the_record_commands_need(
    pool: asyncpg.Pool,
) -> None:
    writer = _writer(pool, Clock())
    writer.decoder = MessageDecoder(
        TOPICS, writer.decoder.encoding, 65536, mappings=parse_config(SITES).mappings()
    )
    async with _running(writer):
        await _stored(writer, _reading("north", "boiler-1", 1_767_225_600_000))
        assert await _downlink_topic(pool, "boiler-1") == "sites/north/boiler-1/set/reboot"

        # Its Will, then its birth: presence stored, and its commands still go to its site.
        await _stored(writer, _presence("boiler-1", b"offline"))
        assert await _downlink_topic(pool, "boiler-1") == "sites/north/boiler-1/set/reboot"
        await _stored(writer, _presence("boiler-1", b"online"))
        assert await _downlink_topic(pool, "boiler-1") == "sites/north/boiler-1/set/reboot"
        presence = await pool.fetchval("SELECT presence FROM device WHERE device_id = 'boiler-1'")
        assert presence == "online"
