"""The gateway as a Sparkplug B host application, against an edge node nobody here wrote
(Eclipse Tahu's JavaScript ``sparkplug-client`` 3.2.4), through a real mosquitto to a real
daemon and PostgreSQL (docs/sparkplug.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import aiomqtt
import asyncpg
import pytest

from gateway.config import Config
from gateway.domain.command import Delivery
from gateway.ingest.replay import replay_one
from gateway.sparkplug.state import HostStateLink
from gateway.support.backoff import Backoff
from protocol import sparkplug
from storage import sparkplug as repo
from storage.pool import create_pool
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import (
    DaemonProcess,
    config_toml,
    http_healthy,
    make_config,
    metric,
    running_daemon,
)
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.sparkplug_edge import EDGE_DIR, edge_node, pysparkplug_python
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

SPARKPLUG = """
[sparkplug]
enabled = true
host_id = "gw-host"
groups = ["Plant1"]
"""

RULES = """
[[rules]]
key = "oven-hot"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
severity = "CRITICAL"
devices = "Plant1/*"
"""

NODE_METRICS = [{"name": "Uptime", "alias": 1, "type": "Int64", "value": 7}]
OVEN_METRICS = [
    {"name": "temp", "alias": 10, "type": "Double", "value": 20.5},
    {"name": "door", "alias": 11, "type": "Boolean", "value": False},
    {"name": "level", "alias": 12, "type": "Int16", "value": -3},
]


async def _rows(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def _metrics_of(dsn: str, device: str) -> list[dict[str, Any]]:
    rows = await _rows(
        dsn,
        "SELECT metrics::text FROM telemetry WHERE device_id = $1 ORDER BY ts, event_id",
        device,
    )
    return [json.loads(r[0]) for r in rows]


async def _alarms(dsn: str, device: str) -> list[asyncpg.Record]:
    """The device's alarms, with the reason their alarm.created event gives."""
    return await _rows(
        dsn,
        "SELECT a.rule_key, (SELECT e.payload->>'reason' FROM outbox_event e"
        " WHERE e.aggregate_type = 'alarm' AND e.aggregate_id = a.id::text"
        " AND e.event_type = 'alarm.created') AS reason"
        " FROM alarm a WHERE a.device_id = $1 ORDER BY a.id",
        device,
    )


async def _presence(dsn: str, device: str) -> str | None:
    rows = await _rows(dsn, "SELECT presence FROM device WHERE device_id = $1", device)
    return None if not rows else rows[0][0]


async def _node(dsn: str, group: str, node: str) -> repo.StoredNode | None:
    conn = await asyncpg.connect(dsn)
    try:
        return await repo.get_node(conn, group, node)
    finally:
        await conn.close()


async def test_births_and_data_by_alias_are_stored_and_judged_by_the_rules(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG + RULES)
    async with running_daemon(config), edge_node(mosquitto.port, "Plant1", "Line4") as edge:
        # The host's STATE is retained: a late subscriber reads it, JSON per Sparkplug 3.0.
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as watcher:
            await watcher.subscribe(sparkplug.state_topic("gw-host"), qos=1)
            async with asyncio.timeout(30):
                async for message in watcher.messages:
                    state = sparkplug.parse_state(bytes(message.payload))  # type: ignore[arg-type]
                    assert message.retain
                    assert state is not None
                    assert state[0] is True
                    break

        await edge.send("nbirth", metrics=NODE_METRICS)
        await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)
        # By alias only, as an edge node sends after its birth.
        await edge.send(
            "ddata", device="Oven", metrics=[{"alias": 10, "type": "Double", "value": 85.25}]
        )
        await edge.send(
            "ddata", device="Oven", metrics=[{"alias": 12, "type": "Int16", "value": -7}]
        )

        async def judged() -> bool:
            return len(await _alarms(db_dsn, "Plant1/Line4/Oven")) == 1

        await wait_until(judged, timeout=30, message="the temp rule fired on the Sparkplug device")
        oven = await _metrics_of(db_dsn, "Plant1/Line4/Oven")
        # The birth's values (a sample may share its millisecond: no order is assumed).
        assert {"temp": 20.5, "door": False, "level": -3} in oven
        assert {"temp": 85.25} in oven
        assert {"level": -7} in oven  # Int16 signed, by its birth's datatype
        node_rows = await _metrics_of(db_dsn, "Plant1/Line4")
        assert node_rows == [{"Uptime": 7}]  # bdSeq is the host's, not a reading
        assert [a["rule_key"] for a in await _alarms(db_dsn, "Plant1/Line4/Oven")] == ["oven-hot"]
        assert await _presence(db_dsn, "Plant1/Line4") == "online"
        assert await _presence(db_dsn, "Plant1/Line4/Oven") == "online"
        state = await _node(db_dsn, "Plant1", "Line4")
        assert state is not None
        assert state.born
        assert state.trusted
        assert state.seq == 3  # NBIRTH 0, DBIRTH 1, DDATA 2 and 3
        assert state.bdseq == 0
        assert state.rebirth_reason is None
        assert json.loads(state.aliases)["10"] == ["Oven", "temp", sparkplug.DataType.DOUBLE]


async def test_a_seq_gap_asks_for_a_rebirth_on_the_wire_and_data_until_it_is_not_judged(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG + RULES)
    async with (
        running_daemon(config) as daemon,
        edge_node(mosquitto.port, "Plant1", "Line4") as edge,
    ):
        await edge.send("nbirth", metrics=NODE_METRICS)
        await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)
        await edge.send("skip", count=3)  # three messages the host never sees
        await edge.send(
            "ddata", device="Oven", metrics=[{"alias": 10, "type": "Double", "value": 95.0}]
        )

        # The edge node receives NCMD Node Control/Rebirth = true, and publishes its births again.
        await edge.wait_for(lambda: edge.count("rebirth") >= 1, "a rebirth request", timeout=30)
        ncmd = next(e for e in edge.events if e.get("event") == "ncmd")
        assert {
            "name": "Node Control/Rebirth",
            "alias": None,
            "type": "Boolean",
            "value": True,
        } in [{**m, "alias": m.get("alias")} for m in ncmd["metrics"]]

        async def trusted_again() -> bool:
            state = await _node(db_dsn, "Plant1", "Line4")
            return state is not None and state.trusted and state.rebirth_reason is None

        await wait_until(trusted_again, timeout=30, message="the rebirth taken")
        # The reading that came through the gap is stored, not judged: no alarm for it.
        assert {"temp": 95.0} in await _metrics_of(db_dsn, "Plant1/Line4/Oven")
        assert await _alarms(db_dsn, "Plant1/Line4/Oven") == []
        assert metric(daemon, "gateway_sparkplug_rebirth_requests_total") >= 1
        assert metric(daemon, "gateway_sparkplug_untrusted_total") >= 1

        # After the rebirth the node is followed again, and its data judged.
        await edge.send(
            "ddata", device="Oven", metrics=[{"alias": 10, "type": "Double", "value": 96.0}]
        )

        async def judged() -> bool:
            return len(await _alarms(db_dsn, "Plant1/Line4/Oven")) == 1

        await wait_until(judged, timeout=30, message="the rule judged the data after the rebirth")


async def test_data_before_any_birth_is_a_dead_letter_and_replayed_after_the_birth(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG)
    async with (
        running_daemon(config) as daemon,
        edge_node(mosquitto.port, "Plant1", "Press") as edge,
    ):
        await edge.send("ndata", metrics=[{"alias": 1, "type": "Int64", "value": 5}])
        # A rebirth request: the edge node (edge.js) answers with its births, none yet here.
        await edge.wait_for(lambda: edge.count("ncmd") >= 1, "a rebirth request", timeout=30)

        async def lettered() -> bool:
            rows = await _rows(db_dsn, "SELECT reason, topic FROM dead_letter")
            return [tuple(r) for r in rows] == [
                ("SPARKPLUG_NOT_BORN", "spBv1.0/Plant1/NDATA/Press")
            ]

        await wait_until(lettered, timeout=30, message="the data before birth dead-lettered")
        await edge.send("nbirth", metrics=NODE_METRICS)

        async def trusted() -> bool:
            state = await _node(db_dsn, "Plant1", "Press")
            return state is not None and state.born and state.trusted

        await wait_until(trusted, timeout=30, message="the birth taken")
        [letter] = await _rows(db_dsn, "SELECT id FROM dead_letter")
        path = daemon.services.replay_path
        assert path is not None
        pool = await create_pool(db_dsn, min_size=1, max_size=2)
        try:
            outcome = await replay_one(pool, path, letter["id"])
        finally:
            await pool.close()
        assert outcome is not None
        assert (outcome.outcome, outcome.succeeded) == ("stored", True)
        # Read with today's aliases, stored; the stream it came from is left as it is.
        assert {"Uptime": 5} in await _metrics_of(db_dsn, "Plant1/Press")
        state = await _node(db_dsn, "Plant1", "Press")
        assert state is not None
        assert state.trusted
        assert state.rebirth_reason is None


async def test_a_killed_edge_node_sets_its_devices_offline_and_raises_inactivity_alarms(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    rules = """
[[rules]]
key = "line-gone"
kind = "inactivity"
silent_seconds = 600
severity = "MAJOR"
devices = "Plant1/Line4*"
"""
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG + rules)
    async with running_daemon(config), edge_node(mosquitto.port, "Plant1", "Line4") as edge:
        await edge.send("nbirth", metrics=NODE_METRICS)
        await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)

        async def online() -> bool:
            return await _presence(db_dsn, "Plant1/Line4/Oven") == "online"

        await wait_until(online, timeout=30, message="the device born")
        edge.kill()  # no DISCONNECT: the broker publishes the client's Will, the NDEATH

        async def offline() -> bool:
            node = await _presence(db_dsn, "Plant1/Line4")
            device = await _presence(db_dsn, "Plant1/Line4/Oven")
            return node == device == "offline"

        await wait_until(offline, timeout=60, message="NDEATH set the node and its device offline")

        async def alarmed() -> bool:
            node = await _alarms(db_dsn, "Plant1/Line4")
            device = await _alarms(db_dsn, "Plant1/Line4/Oven")
            return len(node) == len(device) == 1

        await wait_until(alarmed, timeout=60, message="the inactivity rule raised both alarms")
        for device in ("Plant1/Line4", "Plant1/Line4/Oven"):
            [alarm] = await _alarms(db_dsn, device)
            assert alarm["rule_key"] == "line-gone"
            assert alarm["reason"] == "presence offline"
        state = await _node(db_dsn, "Plant1", "Line4")
        assert state is not None
        assert not state.born
        assert state.rebirth_reason is None  # nobody asks a dead node for a birth


def _share_group(dsn: str, mqtt_port: int, extra: str = "") -> list[Config]:
    """Two gateway nodes' configurations in one $share group. Each node sees part of an edge
    node's stream, out of order between them: the reorder window keeps that from passing for
    a gap."""
    return [
        make_config(
            dsn=dsn,
            mqtt_port=mqtt_port,
            node_id=f"node-{n}",
            extra=SPARKPLUG + "reorder_window_s = 10\n" + extra,
            mqtt_extra='shared_group = "sp"',
        )
        for n in (1, 2)
    ]


async def test_two_gateway_nodes_in_a_share_group_store_each_message_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = _share_group(db_dsn, mosquitto.port, RULES)
    async with (
        running_daemon(configs[0]) as one,
        running_daemon(configs[1]) as two,
        edge_node(mosquitto.port, "Plant1", "Line4") as edge,
    ):
        await edge.send("nbirth", metrics=NODE_METRICS)

        async def born() -> bool:
            state = await _node(db_dsn, "Plant1", "Line4")
            return state is not None and state.born

        # Births split between the nodes could race (docs/sparkplug.md): each is taken first.
        await wait_until(born, timeout=30, message="the NBIRTH stored")
        await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)

        async def device_born() -> bool:
            state = await _node(db_dsn, "Plant1", "Line4")
            return state is not None and state.devices == ["Oven"]

        await wait_until(device_born, timeout=30, message="the DBIRTH stored")
        for n in range(300):
            await edge.send(
                "ddata", device="Oven", metrics=[{"alias": 12, "type": "Int16", "value": n}]
            )

        async def all_stored() -> bool:
            return len(await _metrics_of(db_dsn, "Plant1/Line4/Oven")) == 301

        await wait_until(all_stored, timeout=60, message="every DDATA stored")
        rows = await _metrics_of(db_dsn, "Plant1/Line4/Oven")
        # Every DDATA (the birth's sample is the one with a temp), each once.
        assert sorted(r["level"] for r in rows if "temp" not in r) == list(range(300))
        taken = [
            metric(d, "gateway_sparkplug_messages_total", {"type": "DDATA"}) for d in (one, two)
        ]
        assert sum(taken) == 300
        assert all(t > 0 for t in taken), f"one node took everything: {taken}"
        state = await _node(db_dsn, "Plant1", "Line4")
        assert state is not None
        assert state.trusted
        assert state.rebirth_reason is None
        assert await _rows(db_dsn, "SELECT 1 FROM dead_letter") == []


async def test_a_rebirth_taken_by_one_node_reaches_the_other_holding_the_old_births(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Two nodes in a $share group both hold an edge node's births (each judged DDATA by
    them); the edge node is born again with alias 12 naming another metric, and both births go
    to one node. The other still holds the old births: the row's births version has moved, so
    its next batch reads them again instead of storing the new metric's readings under the old
    name. Which node takes a message is the broker's round: the test watches it (each node's
    count of each message type) and sends another edge node's NDATA between the births until
    it lands on the other node, so that the DBIRTH comes back to the NBIRTH's; a round whose
    births still split is born again, eight rounds at most."""
    configs = _share_group(db_dsn, mosquitto.port)
    oven = "Plant1/Line4/Oven"
    rounds = 8

    async def alias_12() -> str | None:
        state = await _node(db_dsn, "Plant1", "Line4")
        found = {} if state is None else json.loads(state.aliases)
        return found.get("12", [None, None])[1]  # type: ignore[no-any-return]

    async def rows_of(name: str) -> list[Any]:
        return [r[name] for r in await _metrics_of(db_dsn, oven) if set(r) == {name}]

    def taken(kind: str) -> list[float]:
        return [metric(d, "gateway_sparkplug_messages_total", {"type": kind}) for d in (one, two)]

    async def taker(kind: str, before: list[float]) -> int:
        """The node (0 or 1) whose count of ``kind`` moved past ``before``."""
        moved: list[int] = []

        def one_moved() -> bool:
            moved[:] = [i for i, n in enumerate(taken(kind)) if n > before[i]]
            return bool(moved)

        await wait_until(one_moved, timeout=30, message=f"a node took the {kind}")
        assert len(moved) == 1, f"both nodes took a {kind}"
        return moved[0]

    async with (
        running_daemon(configs[0]) as one,
        running_daemon(configs[1]) as two,
        edge_node(mosquitto.port, "Plant1", "Line4") as edge,
        edge_node(mosquitto.port, "Plant1", "Line5") as other,
    ):
        await other.send("nbirth", metrics=NODE_METRICS)
        await wait_until(
            lambda: _node(db_dsn, "Plant1", "Line5"), timeout=30, message="Line5's NBIRTH stored"
        )
        await edge.send("nbirth", metrics=NODE_METRICS)
        await wait_until(
            lambda: _node(db_dsn, "Plant1", "Line4"), timeout=30, message="the NBIRTH stored"
        )
        await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)

        async def named(name: str) -> None:
            async def stored() -> bool:
                return await alias_12() == name

            await wait_until(stored, timeout=30, message=f"a DBIRTH naming alias 12 {name!r}")

        await named("level")
        for n in range(100):
            await edge.send(
                "ddata", device="Oven", metrics=[{"alias": 12, "type": "Int16", "value": n}]
            )

        async def levels_stored() -> bool:
            return len(await rows_of("level")) == 100

        await wait_until(levels_stored, timeout=60, message="the first DDATA stored")
        assert all(t > 0 for t in taken("DDATA")), f"one node took every DDATA: {taken('DDATA')}"

        for round_ in range(rounds):
            # Born again: NBIRTH, another edge node's NDATA until one lands on the other node,
            # then a DBIRTH naming alias 12 anew (a Double).
            name = f"r{round_}"
            births = taken("NBIRTH")
            await edge.send("nbirth", metrics=NODE_METRICS)
            first = await taker("NBIRTH", births)
            for _ in range(6):
                ndata = taken("NDATA")
                await other.send("ndata", metrics=[{"alias": 1, "type": "Int64", "value": 8}])
                if await taker("NDATA", ndata) != first:
                    break
            births = taken("DBIRTH")
            await edge.send(
                "dbirth",
                device="Oven",
                metrics=[
                    {"name": name, "alias": 12, "type": "Double", "value": 20.5},
                    {"name": "door", "alias": 11, "type": "Boolean", "value": False},
                ],
            )
            second = await taker("DBIRTH", births)
            await named(name)
            if second == first:
                break  # the case this test is for: one node took both births, the other none
        else:
            pytest.fail(f"the births split between the nodes in each of {rounds} rounds")
        stale = 1 - first
        ddata = taken("DDATA")
        for n in range(200):
            await edge.send(
                "ddata", device="Oven", metrics=[{"alias": 12, "type": "Double", "value": n / 4}]
            )

        async def new_stored() -> bool:
            return len(await rows_of(name)) == 200

        await wait_until(new_stored, timeout=60, message="the DDATA after the rebirth stored")
        after = [a - b for a, b in zip(taken("DDATA"), ddata, strict=True)]
        assert sum(after) == 200
        # The node that took no birth held the old ones, and judged DDATA by the new.
        assert after[stale] > 0, f"DDATA taken by each node: {after}"
        assert sorted(await rows_of(name)) == [n / 4 for n in range(200)]
        assert sorted(await rows_of("level")) == list(range(100))
        state = await _node(db_dsn, "Plant1", "Line4")
        assert state is not None
        assert state.trusted, state
        assert await _rows(db_dsn, "SELECT 1 FROM dead_letter") == []


async def test_sigkill_of_a_gateway_node_mid_stream_loses_no_qos1_sparkplug_message(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            node_id="crash-node",
            http_port=http_port,
            ingest_extra="batch_max = 20\nlinger_ms = 0",
            extra=SPARKPLUG,
        )
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    blocker = await asyncpg.connect(db_dsn)
    oven = "Plant1/Line4/Oven"

    async def healthy() -> bool:
        assert process.alive(), f"daemon exited:\n{process.log_tail()}"
        return await http_healthy(http_port)

    try:
        process.start()
        await wait_until(healthy, timeout=60, message="daemon healthy")
        async with edge_node(mosquitto.port, "Plant1", "Line4", qos1=True) as edge:
            await edge.send("nbirth", metrics=NODE_METRICS)
            await edge.send("dbirth", device="Oven", metrics=OVEN_METRICS)
            for n in range(200):
                await edge.send(
                    "ddata", device="Oven", metrics=[{"alias": 12, "type": "Int16", "value": n}]
                )

            async def first_stored() -> bool:
                return len(await _metrics_of(db_dsn, oven)) == 201

            await wait_until(first_stored, timeout=60, message="the first 200 stored")
            # The next batch waits on this lock inside its transaction (after its edge node's
            # row is locked and judged): the kill lands with messages received, not committed.
            blocker_tx = blocker.transaction()
            await blocker_tx.start()
            await blocker.execute("LOCK TABLE telemetry IN EXCLUSIVE MODE")
            for n in range(200, 400):
                await edge.send(
                    "ddata", device="Oven", metrics=[{"alias": 12, "type": "Int16", "value": n}]
                )

            async def writer_blocked() -> bool:
                waiting = await blocker.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
                return bool(waiting)

            await wait_until(writer_blocked, timeout=60, message="a batch waiting on the lock")
            process.kill()
            await blocker_tx.rollback()
            assert len(await _metrics_of(db_dsn, oven)) == 201, (
                "nothing of the second part committed"
            )

            process.start()
            await wait_until(healthy, timeout=60, message="daemon healthy again")

            async def all_stored() -> bool:
                return len(await _metrics_of(db_dsn, oven)) >= 401

            await wait_until(all_stored, timeout=90, message="every message stored after restart")
            state = await _node(db_dsn, "Plant1", "Line4")
            assert state is not None
            # The killed batch's judgement rolled back with it: redelivered, the stream is whole.
            assert state.trusted
            assert state.rebirth_reason is None
            assert state.seq == 401 % 256
        assert process.terminate() == 0
    finally:
        await blocker.close()
        process.cleanup()

    rows = await _metrics_of(db_dsn, oven)
    # Every DDATA once, none lost (the birth's sample is the one with a temp).
    assert sorted(r["level"] for r in rows if "temp" not in r) == list(range(400))


COMMANDS = f"""
[commands]
ack_window_s = 3
reaper_interval_s = 0.2

[[api.tokens]]
token = "{OPERATOR}"
role = "operator"
name = "ops"
"""


async def _command(dsn: str, command_id: int) -> asyncpg.Record:
    [row] = await _rows(
        dsn,
        "SELECT status, result, result_code, raw_result_code FROM command WHERE id = $1",
        command_id,
    )
    return row


async def test_a_dcmd_write_is_acked_by_the_value_reported_back_and_fails_unconfirmed(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=SPARKPLUG + COMMANDS)
    oven_metrics = [
        *OVEN_METRICS,
        {"name": "setpoint", "alias": 13, "type": "Float", "value": 20.0},
    ]
    async with (
        running_daemon(config) as daemon,
        edge_node(mosquitto.port, "Plant1", "Line4") as edge,
    ):
        await edge.send("nbirth", metrics=NODE_METRICS)
        await edge.send("dbirth", device="Oven", metrics=oven_metrics)

        async def born() -> bool:
            state = await _node(db_dsn, "Plant1", "Line4")
            return state is not None and state.devices == ["Oven"]

        await wait_until(born, timeout=30, message="the device born")
        await edge.send("echo", on=True)
        async with aiohttp.ClientSession() as http:
            # Through the HTTP API, the device in the body: a Sparkplug id cannot be in a path.
            api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)
            reply = await api.call(
                "POST",
                "/commands",
                token=OPERATOR,
                json={
                    "device_id": "Plant1/Line4/Oven",
                    "name": "setpoint",
                    "params": {"value": 42.5},
                    "delivery": "realtime",
                    "idempotency_key": "sp-1",
                },
            )
        assert reply.status == 201, reply.body
        assert reply.body["command"]["device_id"] == "Plant1/Line4/Oven"
        assert reply.body["command"]["created_by"] == "ops"
        command_id = reply.body["command"]["id"]

        async def acked() -> bool:
            return (await _command(db_dsn, command_id))["status"] == "ACKED"

        await wait_until(acked, timeout=30, message="the write confirmed by the DDATA echo")
        dcmd = next(e for e in edge.events if e.get("event") == "dcmd")
        assert dcmd["device"] == "Oven"
        assert dcmd["metrics"] == [{"name": "setpoint", "type": "Float", "value": 42.5}]
        assert {"setpoint": 42.5} in await _metrics_of(db_dsn, "Plant1/Line4/Oven")

        # A device that does not apply the write: no confirmation within the ack window.
        await edge.send("echo", on=False)
        service = daemon.services.commands
        assert service is not None
        unconfirmed = await service.create(
            device_id="Plant1/Line4/Oven",
            name="setpoint",
            params={"value": 50},
            delivery=Delivery.REALTIME,
            idempotency_key="sp-2",
            actor="test",
        )

        async def failed() -> bool:
            return (await _command(db_dsn, unconfirmed.command.id))["status"] == "FAILED"

        await wait_until(failed, timeout=30, message="the unconfirmed write failed")
        assert edge.count("dcmd") == 2

        # A metric no birth names cannot be written: FAILED at once, nothing sent.
        unknown = await service.create(
            device_id="Plant1/Line4/Oven",
            name="speed",
            params={"value": 3},
            delivery=Delivery.REALTIME,
            idempotency_key="sp-3",
            actor="test",
        )

        async def refused() -> bool:
            return (await _command(db_dsn, unknown.command.id))["status"] == "FAILED"

        await wait_until(refused, timeout=30, message="the unknown metric refused")
        assert (await _command(db_dsn, unknown.command.id))[
            "raw_result_code"
        ] == "SPARKPLUG_UNKNOWN_METRIC"
        assert edge.count("dcmd") == 2


async def test_an_edge_node_of_pysparkplug_is_stored_judged_and_its_will_sets_it_offline(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    python = pysparkplug_python()
    rules = """
[[rules]]
key = "pump-hot"
kind = "threshold"
metric = "temp"
op = ">"
value = 80
severity = "MAJOR"
devices = "Plant2/*"

[[rules]]
key = "cell-gone"
kind = "inactivity"
silent_seconds = 600
severity = "MAJOR"
devices = "Plant2/Cell1/Pump"
"""
    extra = SPARKPLUG.replace('groups = ["Plant1"]', 'groups = ["Plant2"]') + rules
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=extra)
    async with running_daemon(config):
        process = await asyncio.create_subprocess_exec(
            str(python),
            str(EDGE_DIR / "pysparkplug_edge.py"),
            "127.0.0.1",
            str(mosquitto.port),
            "Plant2",
            "Cell1",
            "Pump",
            "21.5",
            "85.5",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            async with asyncio.timeout(60):
                assert (await process.stdout.readline()).strip() == b"published"

            seen: list[dict[str, Any]] = []

            async def stored() -> bool:
                seen[:] = await _metrics_of(db_dsn, "Plant2/Cell1/Pump")
                return len(seen) == 3

            try:
                await wait_until(stored, timeout=30, message="the DBIRTH and two DDATA stored")
            except AssertionError:
                # What was stored, and what became of the rest. (This showed, 2026-12-03, a
                # fourth sample: the edge script's late DBIRTH, a race in the script, mended.)
                letters = await _rows(db_dsn, "SELECT topic, reason, detail FROM dead_letter")
                print(f"stored for the pump: {seen}; dead letters: {[tuple(r) for r in letters]}")
                raise
            pump = await _metrics_of(db_dsn, "Plant2/Cell1/Pump")
            # (Its samples may share a millisecond: no order between them is assumed.)
            assert {"temp": 20.0, "running": True} in pump  # the DBIRTH's values
            assert {"temp": 85.5} in pump
            assert await _metrics_of(db_dsn, "Plant2/Cell1") == [{"Firmware": "1.2"}]

            async def fired() -> bool:
                return [a["rule_key"] for a in await _alarms(db_dsn, "Plant2/Cell1/Pump")] == [
                    "pump-hot"
                ]

            await wait_until(fired, timeout=30, message="the temp rule fired")
            state = await _node(db_dsn, "Plant2", "Cell1")
            assert state is not None
            assert state.trusted
            assert state.bdseq == 0
            # Its Will: stdin closed, it leaves with no DISCONNECT.
            assert process.stdin is not None
            process.stdin.close()
            await process.wait()

            async def offline() -> bool:
                return await _presence(db_dsn, "Plant2/Cell1/Pump") == "offline"

            await wait_until(offline, timeout=60, message="its NDEATH set the device offline")

            async def gone() -> bool:
                alarms = await _alarms(db_dsn, "Plant2/Cell1/Pump")
                return ("cell-gone", "presence offline") in [tuple(a) for a in alarms]

            await wait_until(gone, timeout=60, message="the inactivity alarm raised")
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


class SpecEdge:
    """What an edge node following Sparkplug 3.0 with this primary host concludes from its
    STATE (the bundled edge nodes do not read it): an online STATE counts only if its
    timestamp is at least the last one counted (tck-id-message-flow-edge-node-birth-publish-
    phid-wait-timestamp); an offline one takes the host offline if its timestamp is at least
    that of the last online one (tck-id-operational-behavior-edge-node-termination-host-
    offline), and once reconnected the edge waits for an online STATE again."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, int]] = []
        # Births older than the last STATE counted: a spec edge ignores them.
        self.ignored: list[int] = []
        self.latest: int | None = None
        self.online_at: int | None = None
        self.host_online = False

    def on_state(self, online: bool, ts: int) -> None:
        self.seen.append((online, ts))
        if online:
            if self.latest is not None and ts < self.latest:
                self.ignored.append(ts)
                return
            self.latest = self.online_at = ts
            self.host_online = True
        elif self.online_at is None or ts >= self.online_at:
            self.host_online = False
            self.latest = ts if self.latest is None else max(self.latest, ts)

    def reconnected(self) -> None:
        self.host_online = False

    def births(self) -> list[int]:
        return [ts for online, ts in self.seen if online]


@contextlib.asynccontextmanager
async def _spec_edge(port: int) -> AsyncIterator[SpecEdge]:
    """A SpecEdge fed by its own subscription to the host's STATE, connected again (with its
    memory) when the broker goes away."""
    edge = SpecEdge()
    subscribed = asyncio.Event()

    async def watch() -> None:
        while True:
            try:
                async with aiomqtt.Client("127.0.0.1", port) as client:
                    await client.subscribe(sparkplug.state_topic("gw-host"), qos=1)
                    subscribed.set()
                    async for message in client.messages:
                        state = sparkplug.parse_state(bytes(message.payload))  # type: ignore[arg-type]
                        assert state is not None, message.payload
                        edge.on_state(*state)
            except aiomqtt.MqttError:
                edge.reconnected()
                await asyncio.sleep(0.05)  # the broker is away: the next attempt's pace

    watching = asyncio.create_task(watch())
    try:
        await wait_until(subscribed.is_set, message="the edge subscribed to the host's STATE")
        yield edge
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)


def _state_link(port: int, client_id: str, clock: Callable[[], float] = time.time) -> HostStateLink:
    def client(will: aiomqtt.Will) -> aiomqtt.Client:
        return aiomqtt.Client("127.0.0.1", port, identifier=client_id, will=will)

    return HostStateLink(host_id="gw-host", client=client, backoff=Backoff(0.05, 0.2), clock=clock)


async def test_the_host_state_stays_online_while_one_node_of_the_host_serves(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """The node that connected last stops: its offline STATE takes the host offline for a spec
    edge (its timestamp is the latest birth's), and the node still serving connects again with a
    later birth, which the edge takes."""
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}", extra=SPARKPLUG)
        for n in (1, 2)
    ]
    async with _spec_edge(mosquitto.port) as edge:
        async with running_daemon(configs[0]):
            await wait_until(lambda: edge.host_online, message="node-1's birth")
            async with running_daemon(configs[1]):
                await wait_until(lambda: len(edge.births()) >= 2, message="two births")
                first, second = edge.births()
                assert second >= first  # node-2's birth is the one edge nodes hold
            await wait_until(lambda: (False, second) in edge.seen, message="node-2's offline STATE")
            await wait_until(
                lambda: edge.host_online,
                timeout=10,
                message="node-1 serves: a spec edge holds the host online",
            )
            assert edge.births()[-1] > second
            assert edge.ignored == []
        # The last node stops: the host is offline.
        await wait_until(lambda: not edge.host_online, message="the host offline at the end")


async def test_the_will_of_the_node_that_connected_last_leaves_the_host_online_while_another_serves(
    mosquitto: Mosquitto,
) -> None:
    """Node-2's STATE link dies (its connection reset: the broker sends its Will, the latest
    timestamp); node-1's connects again above it, once, and the host is online for a spec edge.
    Node-2's birth before did not make node-1 connect again."""
    async with (
        _spec_edge(mosquitto.port) as edge,
        TcpProxy("127.0.0.1", mosquitto.port) as proxy,
    ):
        one, two = _state_link(mosquitto.port, "node-1"), _state_link(proxy.port, "node-2")
        stop_one, stop_two = asyncio.Event(), asyncio.Event()
        runs = [asyncio.create_task(one.run(stop_one))]
        try:
            await wait_until(lambda: edge.host_online, message="node-1's birth")
            runs.append(asyncio.create_task(two.run(stop_two)))
            await wait_until(lambda: len(edge.births()) >= 2, message="node-2's birth")
            died = two.timestamp
            assert died is not None
            assert died >= edge.births()[0]
            await proxy.cut()  # node-2 dies
            await wait_until(lambda: (False, died) in edge.seen, message="node-2's Will")
            await wait_until(
                lambda: edge.host_online,
                timeout=10,
                message="node-1 serves: a spec edge holds the host online",
            )
            assert edge.births()[-1] == one.timestamp
            assert edge.births()[-1] > died
            assert one.births == 2
            assert edge.ignored == []
        finally:
            stop_one.set()
            stop_two.set()
            await asyncio.gather(*runs)


@pytest.mark.parametrize("gone", ["stopped", "broker restarted empty"])
async def test_a_clock_stepped_back_does_not_make_the_hosts_next_birth_older(
    mosquitto: Mosquitto, gone: str
) -> None:
    """The gateway's clock steps back a minute (NTP) while its STATE link is away: stopped (the
    offline STATE retained), or its broker killed and started again without the retained STATE
    (the edge node remembers the last timestamp, the broker does not). The link's next birth is
    above the last STATE all the same: a spec edge takes it, and ignores none."""
    now = [2_000_000.0]
    link = _state_link(mosquitto.port, "node-1", clock=lambda: now[0])
    async with _spec_edge(mosquitto.port) as edge:
        stop = asyncio.Event()
        run = asyncio.create_task(link.run(stop))
        try:
            await wait_until(lambda: edge.host_online, message="the first birth")
            before = link.timestamp
            assert before is not None
            now[0] -= 60
            if gone == "stopped":
                stop.set()
                await run
                await wait_until(lambda: not edge.host_online, message="the offline STATE")
                stop = asyncio.Event()
                run = asyncio.create_task(link.run(stop))
            else:
                mosquitto.kill()
                mosquitto.start()
            await wait_until(
                lambda: link.births >= 2 and link.timestamp in edge.births()[1:],
                timeout=10,
                message="the birth after the step",
            )
            assert edge.host_online
            assert edge.ignored == []
            assert edge.births()[-1] > before
        finally:
            stop.set()
            await run


async def test_gateway_sim_publishes_sparkplug_and_every_message_is_stored_once(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """`gateway-sim publish --format sparkplug` against a daemon with `[sparkplug]` enabled:
    births, then data by alias past a seq wrap; every message stored once, no dead letter, every
    edge node trusted with nothing to ask again. Published again (`--start-seq`: a new
    session, its births first), every message is a new sample."""
    config = make_config(
        dsn=db_dsn,
        mqtt_port=mosquitto.port,
        extra='[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["sim-plant"]\n',
    )
    devices, per_run = 25, 900  # three edge nodes (10, 10, 5 devices), ~300 messages each

    async def publish(start_seq: int) -> None:
        published = await asyncio.to_thread(
            subprocess.run,
            [
                *(sys.executable, "-m", "sim", "publish", "--format", "sparkplug"),
                *("--sparkplug-group", "sim-plant", "--start-seq", str(start_seq)),
                *("--host", "127.0.0.1", "--port", str(mosquitto.port)),
                *("--devices", str(devices), "--messages", str(per_run)),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert published.returncode == 0, published.stderr
        assert f"published {per_run} messages (sparkplug) from {devices} devices" in (
            published.stdout
        )

    async def stored(count: int) -> None:
        async def done() -> bool:
            [row] = await _rows(db_dsn, "SELECT count(*) FROM telemetry")
            return bool(row[0] == count)

        await wait_until(done, timeout=90, message=f"{count} Sparkplug samples stored")

    async with running_daemon(config) as daemon:
        await publish(0)
        await stored(per_run)
        await publish(per_run)
        await stored(2 * per_run)
        assert metric(daemon, "gateway_sparkplug_untrusted_total") == 0
    assert await _rows(db_dsn, "SELECT reason FROM dead_letter") == []
    for node in ("edge-00000", "edge-00001", "edge-00002"):
        state = await _node(db_dsn, "sim-plant", node)
        assert state is not None
        assert (state.born, state.trusted, state.rebirth_wanted_at) == (True, True, None), node
    listed = await _rows(
        db_dsn, "SELECT device_id, presence FROM device WHERE device_id LIKE 'sim-plant/%'"
    )
    assert len(listed) == 3 + devices
    assert {r["presence"] for r in listed} == {"online"}
    # Each device's samples: its birth's and its data, by alias, read by the birth's names.
    samples = await _metrics_of(db_dsn, "sim-plant/edge-00002/pub-00024")
    assert len(samples) == 2 * (1 + (per_run - 3 - devices) // devices)
    assert all(set(s) == {"temp", "humidity", "count"} for s in samples)
