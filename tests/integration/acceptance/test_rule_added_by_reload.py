"""A threshold rule added by a reload (or by a restart with a new file) judges the devices that
already report a violation and then say nothing more (reporting by exception: a Zigbee
thermometer sends a value when it changes). It used to judge only the next sample: a freezer at
-5 °C when the operator adds `temp > -10` raised nothing until its temperature changed again."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import aiomqtt
import asyncpg

from protocol import Topics
from tests.integration.acceptance.test_process import _wait_healthy, _write_shared
from tests.support.daemon import DaemonProcess
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")


def _rules(*rules: tuple[str, int, int]) -> str:
    """`[alarms]` with a quick timer, then threshold rules `temp > value` (key, value,
    for_seconds)."""
    return "[alarms]\ntimer_interval_s = 0.5\n" + "".join(
        f'[[rules]]\nkey = "{key}"\nkind = "threshold"\nmetric = "temp"\nop = ">"\n'
        f'value = {value}\nfor_seconds = {hold}\nseverity = "MAJOR"\n'
        for key, value, hold in rules
    )


async def _fetch(db_dsn: str, query: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(db_dsn)
    try:
        return list(await conn.fetch(query))
    finally:
        await conn.close()


async def _alarms(db_dsn: str) -> list[tuple[str, str, bool]]:
    rows = await _fetch(
        db_dsn,
        "SELECT rule_key, device_id, cleared_at IS NULL AS active FROM alarm ORDER BY id",
    )
    return [(row["rule_key"], row["device_id"], row["active"]) for row in rows]


async def _publish(mosquitto: Mosquitto, values: dict[str, int]) -> None:
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
        for device, value in values.items():
            payload = f'{{"ts": {int(time.time() * 1000)}, "metrics": {{"temp": {value}}}}}'
            await pub.publish(TOPICS.telemetry(device), payload.encode(), qos=1)


async def test_a_rule_a_sighup_adds_fires_for_a_device_already_violating_on_two_nodes(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Two nodes run `warm` (`temp > 90`). freezer-1 reports 85 once, freezer-2 reports 70
    once; then nothing. SIGHUP adds `hot` (`temp > 80`): it fires for freezer-1 (once,
    whichever node judges it), not for freezer-2, with no sample after the reload."""
    ports = [free_port(), free_port()]
    paths = [tmp_path / f"node-{n}.toml" for n in range(2)]
    _write_shared(paths, ports, db_dsn, mosquitto, _rules(("warm", 90, 0)))
    processes = [DaemonProcess(path, tmp_path / f"{path.stem}.log") for path in paths]
    try:
        for process, port in zip(processes, ports, strict=True):
            process.start()
            await _wait_healthy(process, port)
        await _publish(mosquitto, {"freezer-1": 85, "freezer-2": 70})

        async def stored() -> bool:
            return await _fetch(db_dsn, "SELECT count(*) FROM telemetry") == [(2,)]

        await wait_until(stored, timeout=30, message="both samples stored")
        assert await _alarms(db_dsn) == []
        _write_shared(paths, ports, db_dsn, mosquitto, _rules(("warm", 90, 0), ("hot", 80, 0)))
        for process in processes:
            process.signal(signal.SIGHUP)

        async def fired() -> bool:
            return await _alarms(db_dsn) == [("hot", "freezer-1", True)]

        await wait_until(fired, timeout=30, message="the added rule fired for freezer-1")
        for process in processes:
            assert "config_reloaded" in process.log_text()
            assert process.terminate() == 0
        created = await _fetch(
            db_dsn,
            "SELECT payload ->> 'reason' AS reason FROM outbox_event"
            " WHERE event_type = 'alarm.created'",
        )
    finally:
        for process in processes:
            process.cleanup()
    assert await _alarms(db_dsn) == [("hot", "freezer-1", True)]
    assert len(created) == 1
    assert "rule was added" in created[0]["reason"]
    assert await _fetch(db_dsn, "SELECT count(*) FROM telemetry") == [(2,)]


async def test_a_hold_rule_added_by_a_restart_holds_from_then_and_fires_when_due(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """One node runs `warm`; freezer-1 reports 85 once. The node is stopped, its file gains
    `hot` (`temp > 80 for 3 s`), and it starts again: the rule is taken up at the start (its
    last registration did not run it), holds from then and fires once its 3 s have passed."""
    ports = [free_port()]
    paths = [tmp_path / "node-0.toml"]
    _write_shared(paths, ports, db_dsn, mosquitto, _rules(("warm", 90, 0)))
    first = DaemonProcess(paths[0], tmp_path / "first.log")
    second = DaemonProcess(paths[0], tmp_path / "second.log")
    try:
        first.start()
        await _wait_healthy(first, ports[0])
        await _publish(mosquitto, {"freezer-1": 85})

        async def stored() -> bool:
            return await _fetch(db_dsn, "SELECT count(*) FROM telemetry") == [(1,)]

        await wait_until(stored, timeout=30, message="the sample stored")
        assert first.terminate() == 0
        _write_shared(paths, ports, db_dsn, mosquitto, _rules(("warm", 90, 0), ("hot", 80, 3)))
        second.start()
        await _wait_healthy(second, ports[0])

        async def fired() -> bool:
            return await _alarms(db_dsn) == [("hot", "freezer-1", True)]

        await wait_until(fired, timeout=30, message="the added hold rule fired")
        (row,) = await _fetch(
            db_dsn,
            "SELECT a.created_at - s.registered_at >= interval '3 s' AS held"
            " FROM alarm a, node_rule_set s",
        )
        assert row["held"], "fired before its hold of 3 s from the rule's start had passed"
        assert second.terminate() == 0
    finally:
        first.cleanup()
        second.cleanup()
