"""Audit: a SIGHUP reload that changes a mapping (not its topics) together with the broker
endpoint list, keeping the endpoint in use (a failover host added to ``[mqtt] hosts``). The
session took the new list without a reconnection and said it had changed something, so the
daemon left the mappings to a reconnection that never came: the node went on reading with
the old mappings (and rendering commands with them) until restarted, though it logged
``config_reloaded``."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import aiomqtt
import asyncpg

from gateway.runtime.components import subscriptions
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

FIXTURES: Final = Path(__file__).resolve().parents[2] / "fixtures" / "mappings"
Z2M: Final = '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'
DEVICE: Final = "0x00158d0001d8e1d2"


async def _publish(port: int, payload: bytes) -> None:
    async with aiomqtt.Client("127.0.0.1", port, identifier="z2m-bridge") as bridge:
        await bridge.publish(f"zigbee2mqtt/{DEVICE}", payload, qos=1)


async def test_a_reload_changing_a_mapping_and_the_endpoints_reads_with_the_new_mapping(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    before = make_config(dsn=db_dsn, mqtt_port=port, extra=Z2M)
    async with running_daemon(before) as daemon:
        session = daemon.session
        assert session is not None
        connections = session.connections
        # The same broker first, a failover host after it; the mapping leaves humidity out.
        after = make_config(
            dsn=db_dsn,
            mqtt_port=port,
            mqtt_hosts=[f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"],
            extra=Z2M + 'exclude = ["humidity"]\n',
        )
        daemon.reload(after)
        await _publish(port, b'{"temperature": 30.5, "humidity": 50}')

        async def stored() -> bool:
            return int(await db.fetchval("SELECT count(*) FROM telemetry")) == 1

        await wait_until(stored, timeout=30, message="the reading stored")
        metrics = await db.fetchval("SELECT metrics::text FROM telemetry")
        assert metrics == '{"temperature": 30.5}', "read with the mapping before the reload"
        assert session.connections == connections
        writer = daemon.writer
        assert writer is not None
        assert writer.decoder.mappings.by_name["z2m"].exclude == frozenset({"humidity"})


async def test_a_second_reload_before_the_first_reconnected_is_the_one_that_holds(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """A reload adding a mapping (new topics: the connection is made again) and a second
    one taking it back out before that reconnection was made (an operator's quick fix, two
    SIGHUPs in a row; a drain waiting on the database makes the gap long). The second found
    the session's filters unchanged and swapped its mappings in at once, and the first's
    pending reconnection then subscribed the first's topics and applied the first's mappings:
    the node read with a mapping its file no longer had, until the next reload."""
    port = mosquitto.port
    before = make_config(dsn=db_dsn, mqtt_port=port)
    async with running_daemon(before) as daemon:
        session = daemon.session
        writer = daemon.writer
        assert session is not None
        assert writer is not None
        connections = session.connections
        wanted = tuple(subscriptions(before, session.settings.protocol))
        daemon.reload(make_config(dsn=db_dsn, mqtt_port=port, extra=Z2M))
        daemon.reload(before)
        await wait_until(
            lambda: session.connections > connections and session.subscribed,
            timeout=30,
            message="the connection made again",
        )
        assert session.subscriptions == wanted
        assert not writer.decoder.mappings, "a mapping the configuration no longer has"
