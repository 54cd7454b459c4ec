"""A node whose connections landed on a standby gets off it once new ones reach the primary.

Behind a router that follows the primary (HAProxy with Patroni's ``GET /primary`` check, a
virtual address, a DNS name), a switchover or a failover leaves a window, until the router's
check notices, in which new connections still reach the old primary, restarted as a standby:
it accepts them and answers every write "cannot execute … in a read-only transaction". The node
retried, rightly, but on the same pool connections, which nothing ever let go: a router that
does not cut the sessions it routed there (HAProxy without ``on-marked-down shutdown-sessions``)
left the node writing to the standby for good, nothing stored, nothing acknowledged, no alarm
raised, while new connections would have reached the primary. A connection that answers
"read-only" is now cut, and the retry opens another.

A real PostgreSQL pair under Patroni (tests/support/ha_postgres.py); a TCP proxy plays the
router: its connections are cut and new ones sent to the standby, then new ones to the primary
again, the ones on the standby left open.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg
import msgspec
import pytest

from gateway.runtime.daemon import Daemon
from protocol import Telemetry, Topics, telemetry_event_id
from tests.support import ha_postgres
from tests.support.daemon import make_config
from tests.support.ha_postgres import HaPair
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(
    ha_postgres.available() is not None, reason=str(ha_postgres.available())
)

TOPICS = Topics("iot")
DEVICE = "ro-1"


async def _stored(dsn: str, event_id: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(
            await conn.fetchval("SELECT count(*) FROM telemetry WHERE event_id = $1", event_id)
        )
    finally:
        await conn.close()


async def _gateway_backends(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'gateway:%'"
            )
        )
    finally:
        await conn.close()


async def test_a_node_writing_to_a_standby_moves_to_the_primary_once_the_router_does(
    mosquitto: Mosquitto,
) -> None:
    pair = HaPair.create()
    try:
        await asyncio.to_thread(pair.start)
        primary = pair.primary()
        assert primary is not None
        standby = next(m for m in pair.members if m is not primary)
        router = TcpProxy("127.0.0.1", primary.port)
        await router.start()
        config = make_config(
            dsn=f"postgresql://postgres@127.0.0.1:{router.port}/{pair.database}",
            mqtt_port=mosquitto.port,
            node_id="ro",
        )
        daemon = Daemon(config)
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop), name="daemon")
        try:
            ready = asyncio.ensure_future(daemon.ready.wait())
            await asyncio.wait({task, ready}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert daemon.ready.is_set(), f"not ready: {daemon.starting}"
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
                seq = 0

                async def send() -> str:
                    nonlocal seq
                    seq += 1
                    message = msgspec.convert(
                        {"ts": 1_767_225_600_000 + seq, "seq": seq, "metrics": {"t": seq}},
                        Telemetry,
                    )
                    await device.publish(
                        TOPICS.telemetry(DEVICE), msgspec.json.encode(message), qos=1
                    )
                    return telemetry_event_id(DEVICE, message)

                primary_dsn = pair.member_dsn(primary)
                first = await send()
                await wait_until(lambda: _stored(primary_dsn, first), timeout=30, message="stored")

                # The switchover as the router saw it: every connection cut, new ones routed to
                # the old primary, now a standby, for a while.
                router.target_port = standby.port
                await router.cut()
                await router.resume()
                on_standby = await send()

                async def writing_to_the_standby() -> bool:
                    assert not task.done(), repr(task.exception())
                    return await _gateway_backends(pair.member_dsn(standby)) >= 1

                await wait_until(writing_to_the_standby, timeout=30, message="on the standby")
                # The router's check caught up: new connections reach the primary; those it
                # routed to the standby stay open (no shutdown-sessions).
                router.target_port = primary.port
                after = await send()

                async def both_stored() -> bool:
                    assert not task.done(), repr(task.exception())
                    return await _stored(primary_dsn, on_standby) and await _stored(
                        primary_dsn, after
                    )

                await wait_until(
                    both_stored,
                    timeout=30,
                    interval=0.2,
                    message="the messages sent meanwhile stored on the primary",
                )
        finally:
            stop.set()
            await asyncio.wait({task}, timeout=60)
            await router.stop()
    finally:
        await asyncio.to_thread(pair.cleanup)
