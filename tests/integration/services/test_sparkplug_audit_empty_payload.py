"""Audit: a zero-length message on a Sparkplug B topic (``mosquitto_pub -r -n`` clearing what a
non-conforming edge node left retained there, or a tool's "delete retained" on the topic; the
broker hands the empty message to subscribers even when nothing was retained).

No edge node sends one: Sparkplug 3.0 has every edge message carry a seq (an NDEATH its bdSeq),
and zero bytes are a protobuf payload with neither. The host read it all the same: an empty
``DDEATH`` took the device offline and dead-lettered its next data ``SPARKPLUG_NOT_BORN``; an
empty ``DBIRTH`` was a birth of no metrics, after which the device's data by alias was lost;
and each empty message distrusted the edge node (a rebirth asked) for a clearing that was never
the node speaking. It is now no message of the node: not judged, counted
(``gateway_empty_messages_total{kind="sparkplug"}``).

Real PostgreSQL and the ingest store (as the other Sparkplug audits)."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.ingest.decoder import Inbound
from gateway.sparkplug.host import SparkplugHost
from tests.integration.services.test_sparkplug_host import (
    DECODER,
    DEVICE,
    NODE,
    _batch,
    _births,
    _payload,
    _presence,
    _state,
    _temp,
)


@pytest.mark.parametrize(
    ("kind", "topic"),
    [("DDEATH", DEVICE), ("DBIRTH", DEVICE), ("NDATA", NODE), ("DDATA", DEVICE), ("NDEATH", NODE)],
)
async def test_an_empty_sparkplug_message_changes_nothing_of_the_edge_node(
    pool: asyncpg.Pool, kind: str, topic: str
) -> None:
    host = SparkplugHost(reorder_window_s=0)
    await _batch(pool, host, _births())
    classified = DECODER.classify([Inbound(topic=topic.format(kind), payload=b"")])
    assert classified.empty == {"sparkplug": 1}
    result = await _batch(pool, host, [(kind, topic, b"")])
    assert result.dead_letters == ()
    assert await _presence(pool, "G/N/D") == "online", f"an empty {kind} took the device offline"
    trusted = (await _state(pool)).trusted
    # The device's next data, by the alias its birth gave: read.
    result = await _batch(pool, host, [("DDATA", DEVICE, _payload(2, _temp(5.0)))])
    assert result.dead_letters == ()
    read = "SELECT count(*) FROM telemetry WHERE device_id = 'G/N/D' AND metrics @> $1::jsonb"
    assert await pool.fetchval(read, '{"temp": 5.0}') == 1, f"data after an empty {kind} lost"
    assert trusted, f"an empty {kind} distrusted the edge node (a rebirth asked)"
