"""A message on a topic too long for an index: MQTT allows topics up to 65,535 bytes, and the
`+` of `{prefix}/devices/+/telemetry` matches a level of any length. Such a message is a dead
letter (BAD_DEVICE_ID) with its topic — and the messages behind it, of every other device,
must be stored and acknowledged as ever (docs/behaviour.md §14: "a bad device id in the topic:
dead letter with a reason; acknowledged; counted; the daemon keeps going").
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import aiomqtt

from protocol import Topics
from tests.integration.acceptance.test_poison import _fetchval, _wait_healthy, _write_config
from tests.support.daemon import DaemonProcess
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1767225600000


def _incompressible(chars: int) -> str:
    """Hex of a hash chain: nothing PostgreSQL's compression of an index entry can shrink."""
    out, block = [], b"seed"
    while sum(map(len, out)) < chars:
        block = hashlib.sha256(block).digest()
        out.append(block.hex())
    return "".join(out)[:chars]


async def test_a_message_on_a_topic_too_long_for_an_index_does_not_stop_ingest(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    _write_config(config, db_dsn, mosquitto.port, http_port, "long-topic-node")
    process = DaemonProcess(config, tmp_path / "daemon.log")
    long_topic = f"iot/devices/{_incompressible(20_000)}/telemetry"
    try:
        process.start()
        await _wait_healthy(process, http_port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(long_topic, b'{"ts":1767225600000,"metrics":{"t":1}}', qos=1)
            for n in range(20):
                await pub.publish(
                    TOPICS.telemetry(f"dev-{n}"),
                    b'{"ts":%d,"metrics":{"t":%d}}' % (T0 + n, n),
                    qos=1,
                )

        async def stored() -> bool:
            assert process.alive(), process.log_tail()
            return await _fetchval(db_dsn, "SELECT count(*) FROM telemetry") == 20

        await wait_until(
            stored, timeout=30, message=f"the other devices' messages stored\n{process.log_tail(6)}"
        )
        letter = await _fetchval(
            db_dsn, "SELECT count(*) FROM dead_letter WHERE reason = 'BAD_DEVICE_ID'"
        )
        assert letter == 1, "the long topic's message is a dead letter with its reason"
        assert process.terminate() == 0
    finally:
        process.cleanup()
