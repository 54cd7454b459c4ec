"""A node restarted onto a backlog its broker queued while it was away is ready (READY=1, the
start over) once it has subscribed, not once the backlog is delivered, on either protocol
version: a resumed session holding exactly the configured filters, each proven to deliver on
that broker (recorded in the database, migration 0038), is not probed again. Until then an
MQTT 3.1.1 node probed at every connect, and its probe came back only behind the whole queued
backlog: the node said it was starting for as long as the backlog took to store (systemd's
TimeoutStartSec is 120 s in the shipped units).

Forced, not timed: while the node starts, a device of every batch is being registered by a
transaction the test keeps open, so nothing of the backlog can be stored (and acknowledged)
until the test lets it; the probe's message waits behind it. Real mosquitto, both protocol
versions.
"""

from __future__ import annotations

import asyncio

import aiomqtt
import asyncpg
import pytest

from gateway.runtime.daemon import Daemon
from tests.support.daemon import make_config, running_daemon, subscription_proof
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

BACKLOG = 300  # beyond mosquitto's inflight window (100 in the fixture): most of it queued


def _sample(n: int) -> bytes:
    return b'{"ts": %d, "seq": %d, "metrics": {"t": 1.5}}' % (1_767_225_600_000 + n, n)


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
async def test_a_node_restarted_onto_a_backlog_is_ready_before_storing_any_of_it(
    db_dsn: str, mosquitto: Mosquitto, protocol: str
) -> None:
    config = make_config(
        dsn=db_dsn, mqtt_port=mosquitto.port, protocol=protocol, mqtt_extra="probe_timeout_s = 5"
    )
    db = await asyncpg.connect(db_dsn)
    holder = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(config):
            pass  # subscribed and proven (its probe came back), stopped cleanly
        proof = await subscription_proof(db_dsn)
        assert proof
        assert all(proof.values()), proof

        version = aiomqtt.ProtocolVersion.V5 if protocol == "5" else aiomqtt.ProtocolVersion.V311
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, protocol=version) as device:
            for n in range(BACKLOG):
                await device.publish(f"iot/devices/dev-{n % 10}/telemetry", _sample(n), qos=1)

        lock = holder.transaction()
        await lock.start()
        # A device of every batch registered by a transaction left open: each batch's
        # statement waits for it (ON CONFLICT on that device), its telemetry not committed.
        await holder.execute(
            "INSERT INTO device (device_id, first_seen, last_seen) VALUES ('dev-0', now(), now())"
        )
        daemon = Daemon(config)
        stop = asyncio.Event()
        running = asyncio.create_task(daemon.run(stop))
        held = True
        try:
            await wait_until(
                lambda: daemon.ready.is_set() or running.done(),
                timeout=30,
                message="ready while its backlog cannot be stored",
            )
            assert not running.done()
            session = daemon.session
            assert session is not None
            assert session.subscribed
            assert await db.fetchval("SELECT count(*) FROM telemetry") == 0
            await lock.rollback()  # now the backlog can be stored, all of it
            held = False

            async def stored() -> bool:
                return bool(await db.fetchval("SELECT count(*) FROM telemetry") == BACKLOG)

            await wait_until(stored, timeout=60, message="the whole backlog stored")
        finally:
            if held:  # failed before: let the stop store what it holds, not wait on the lock
                await lock.rollback()
            stop.set()
            async with asyncio.timeout(60):
                await running
        assert all((await subscription_proof(db_dsn)).values())
    finally:
        await holder.close()
        await db.close()
