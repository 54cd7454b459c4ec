"""``[ingest] transactions_in_flight`` left at 0 chooses 2 for a node alone and 1 in a ``$share``
group (``[mqtt] shared_group``). A reload follows a changed ``shared_group`` (docs/configuration.md,
Reloading: the broker connection is made again with the new filters), and no warning says that
anything of it needs a restart; yet the writer kept the number of transactions chosen at the
start. A node reloaded out of its group stored one transaction at a time for good (a lone node
drains 19 to 30 % slower so: docs/performance.md); one reloaded into a group kept two, putting
a device's samples further out of order across the nodes. A number set in the file is read at
start (a change of it is reported as needing a restart) and is kept whatever the group.

A real daemon and mosquitto; the interleaving is forced, not timed: a row lock the test holds
keeps one flight inside its transaction, and a message of another device is stored beside it
only where two transactions may be open at once."""

from __future__ import annotations

import aiomqtt
import asyncpg
import msgspec

from protocol import TopicKind, Topics
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1767225600000
SOS_RULE = """
[[rules]]
key = "sos"
kind = "event"
event = "SOS"
severity = "CRITICAL"
"""


def _sos(seq: int) -> bytes:
    return msgspec.json.encode({"ts": T0 + seq, "seq": seq, "events": [{"type": "SOS"}]})


async def _stored(db: asyncpg.Connection) -> set[tuple[str, int]]:
    rows = await db.fetch("SELECT device_id, seq FROM telemetry")
    return {(r["device_id"], r["seq"]) for r in rows}


async def test_a_node_reloaded_out_of_its_group_stores_two_transactions_at_once_again(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    grouped = make_config(
        dsn=db_dsn, mqtt_port=port, extra=SOS_RULE, mqtt_extra='shared_group = "gw"'
    )
    alone = make_config(dsn=db_dsn, mqtt_port=port, extra=SOS_RULE)
    telemetry = TOPICS.subscription(TopicKind.TELEMETRY, None)
    async with running_daemon(grouped) as daemon:
        session, writer = daemon.session, daemon.writer
        assert session is not None
        assert writer is not None
        assert writer.in_flight == 1  # chosen in a group
        daemon.reload(alone)
        await wait_until(
            lambda: session.subscribed and telemetry in session.subscriptions,
            timeout=30,
            message="the telemetry filter unshared after the reload",
        )
        locker = await asyncpg.connect(db_dsn)
        try:
            async with aiomqtt.Client("127.0.0.1", port, identifier="dev-sender") as device:
                await device.publish(TOPICS.telemetry("dev-a"), _sos(0), qos=1)

                async def first_stored() -> bool:
                    return ("dev-a", 0) in await _stored(db)

                await wait_until(first_stored, timeout=30, message="dev-a's first SOS stored")
                lock = locker.transaction()
                await lock.start()
                assert await locker.fetchval(
                    "SELECT count(*) FROM"
                    " (SELECT FROM rule_state WHERE device_id = 'dev-a' FOR UPDATE) s"
                )
                await device.publish(TOPICS.telemetry("dev-a"), _sos(1), qos=1)

                async def held() -> bool:
                    return bool(
                        await db.fetchval(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                        )
                    )

                await wait_until(held, timeout=30, message="dev-a's flight held on its row")
                await device.publish(TOPICS.telemetry("dev-b"), _sos(1), qos=1)

                async def beside() -> bool:
                    return ("dev-b", 1) in await _stored(db)

                # Red before the fix: "dev-b stored beside the held flight" timed out (one
                # transaction at a time, as chosen at the start in the group).
                await wait_until(beside, timeout=30, message="dev-b stored beside the held flight")
                await lock.rollback()

                async def all_stored() -> bool:
                    return await _stored(db) >= {("dev-a", 0), ("dev-a", 1), ("dev-b", 1)}

                await wait_until(all_stored, timeout=30, message="every SOS stored")
        finally:
            await locker.close()
        assert writer.in_flight == 2


async def test_a_node_reloaded_into_a_group_takes_one_and_a_number_set_is_kept(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    alone = make_config(dsn=db_dsn, mqtt_port=port)
    grouped = make_config(dsn=db_dsn, mqtt_port=port, mqtt_extra='shared_group = "gw"')
    async with running_daemon(alone) as daemon:
        writer = daemon.writer
        assert writer is not None
        assert writer.in_flight == 2
        daemon.reload(grouped)
        assert writer.in_flight == 1
        daemon.reload(alone)
        assert writer.in_flight == 2
    # Set in the file: read at start, kept across a reload that changes the group or the number.
    three = make_config(dsn=db_dsn, mqtt_port=port, ingest_extra="transactions_in_flight = 3")
    three_grouped = make_config(
        dsn=db_dsn,
        mqtt_port=port,
        ingest_extra="transactions_in_flight = 1",
        mqtt_extra='shared_group = "gw"',
    )
    async with running_daemon(three) as daemon:
        writer = daemon.writer
        assert writer is not None
        assert writer.in_flight == 3
        daemon.reload(three_grouped)
        assert writer.in_flight == 3
