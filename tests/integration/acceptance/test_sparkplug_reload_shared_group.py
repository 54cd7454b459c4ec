"""A node that joins a ``$share`` group by a reload (``[mqtt] shared_group`` added, SIGHUP: the
documented way to scale out without a restart) takes the Sparkplug reorder window of a group.

``[sparkplug] reorder_window_s`` left unset is 5 s in a shared group and 0 for a node alone
(docs/sparkplug.md). The window was fixed when the node started: a node started alone and
reloaded into a group shared the Sparkplug topics with its siblings but kept 0, so every
reorder between the nodes (a seq committed before the one that precedes it) was a gap at
once: the edge node untrusted (its data not judged by the rules) and asked for a rebirth, again
at the next reorder after the rebirth.

A real daemon and mosquitto; the reorder a sibling makes is forced (seq 3 reaches the node
before seq 2), as the node alone in the group receives all of the edge node's messages."""

from __future__ import annotations

import aiomqtt
import asyncpg

from protocol.sparkplug import DataType
from storage import sparkplug as repo
from tests.integration.services.test_sparkplug_share_default_window import SPARKPLUG, _payload
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def test_a_node_reloaded_into_a_share_group_takes_a_reorder_for_no_gap(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    alone = make_config(dsn=db_dsn, mqtt_port=port, extra=SPARKPLUG)
    grouped = make_config(
        dsn=db_dsn, mqtt_port=port, extra=SPARKPLUG, mqtt_extra='shared_group = "sp"'
    )
    async with running_daemon(alone) as daemon:
        session = daemon.session
        assert session is not None
        daemon.reload(grouped)
        await wait_until(
            lambda: session.subscribed and "$share/sp/spBv1.0/G/#" in session.subscriptions,
            timeout=30,
            message="the Sparkplug topics shared after the reload",
        )
        bdseq = {"name": "bdSeq", "datatype": DataType.INT64, "long_value": 1}
        temp = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
        async with aiomqtt.Client("127.0.0.1", port, identifier="edge-G-N") as edge:
            for topic, body in [
                ("spBv1.0/G/NBIRTH/N", _payload(0, bdseq)),
                ("spBv1.0/G/DBIRTH/N/D", _payload(1, temp)),
                # A sibling of the group still commits seq 2 when seq 3 reaches this node.
                ("spBv1.0/G/DDATA/N/D", _payload(3, {"alias": 1, "double_value": 3.0})),
                ("spBv1.0/G/DDATA/N/D", _payload(2, {"alias": 1, "double_value": 2.0})),
            ]:
                await edge.publish(topic, body, qos=1)

        async def all_stored() -> bool:
            count = await db.fetchval("SELECT count(*) FROM telemetry WHERE device_id = 'G/N/D'")
            return int(count) == 3

        await wait_until(all_stored, timeout=30, message="the births and both samples stored")
        node = await repo.get_node(db, "G", "N")
        assert node is not None
        assert node.trusted, f"untrusted after a reorder in a share group: {node.rebirth_reason}"
        assert node.seq == 3
        assert node.rebirth_wanted_at is None
