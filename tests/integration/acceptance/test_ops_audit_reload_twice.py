"""Two reloads in a row, the second putting back what the first changed (`systemctl reload`
run twice, the file fixed in between): the node follows the last one. The first had asked the
session to move to new filters; the second, equal to what the session runs, left that move
pending, and the node went to the topics its file no longer named."""

from __future__ import annotations

import aiomqtt
import asyncpg

from gateway.config import Config
from gateway.runtime.components import subscriptions
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def test_a_reload_undone_by_the_next_leaves_the_node_on_the_last_files_topics(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    def config(prefix: str) -> Config:
        return make_config(
            dsn=db_dsn, mqtt_port=mosquitto.port, mqtt_extra=f'topic_prefix = "{prefix}"'
        )

    site_a, site_b = config("site-a"), config("site-b")
    async with running_daemon(site_a) as daemon:
        session = daemon.session
        assert session is not None
        # Two SIGHUPs the event loop handles one after the other: site-b, then site-a again.
        daemon.reload(site_b)
        daemon.reload(site_a)
        # The first asked for a new connection: wait until it was made again and subscribed.
        await wait_until(
            lambda: session.connections >= 2 and session.subscribed,
            timeout=30,
            message="the connection made again",
        )
        assert session.subscriptions == tuple(subscriptions(site_a, session.settings.protocol))
        assert session.presence_topic == "site-a/gateways/test-node/status"
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
            await device.publish(
                "site-a/devices/dev-1/telemetry",
                b'{"ts": 1767225600000, "metrics": {"t": 1}}',
                qos=1,
            )

        async def stored() -> bool:
            return bool(await db.fetchval("SELECT count(*) FROM telemetry") == 1)

        await wait_until(stored, timeout=30, message="the site-a reading stored")
        assert await db.fetchval("SELECT count(*) FROM dead_letter") == 0
