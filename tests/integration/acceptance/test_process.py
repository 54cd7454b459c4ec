"""The daemon as a real process: SIGKILL mid-stream, SIGTERM drain, the zero-setup default,
rules reloaded by SIGHUP."""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiomqtt
import asyncpg
import pytest

from gateway.domain.rules import hold_event_id
from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream
from tests.support.daemon import DaemonProcess, config_toml, count_rows, http_healthy
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")


async def _wait_healthy(process: DaemonProcess, port: int) -> None:
    async def ready() -> bool:
        assert process.alive(), f"daemon exited:\n{process.log_tail()}"
        return await http_healthy(port)

    await wait_until(ready, timeout=60, message="daemon healthy")


async def _retained(port: int, topic: str) -> bytes:
    async with aiomqtt.Client("127.0.0.1", port) as client:
        await client.subscribe(topic, qos=1)
        async with asyncio.timeout(10):
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                return message.payload
    raise AssertionError("no retained message")


async def test_sigkill_mid_stream_then_restart_stores_every_message_exactly_once(
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
        )
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    stream = list(telemetry_stream(TOPICS, device_ids(50), 5000))
    blocker = await asyncpg.connect(db_dsn)
    try:
        process.start()
        await _wait_healthy(process, http_port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port, max_inflight_messages=500) as pub:
            await publish_many(pub, stream[:1000], window=500)

            async def first_stored() -> bool:
                return await count_rows(db_dsn) >= 1000

            await wait_until(first_stored, timeout=60, message="the first 1,000 stored")
            # Hold inserts back: the daemon's next batch waits on this lock inside its
            # transaction, so the kill lands with messages received and not yet committed,
            # whatever the machine's speed.
            blocker_tx = blocker.transaction()
            await blocker_tx.start()
            await blocker.execute("LOCK TABLE telemetry IN EXCLUSIVE MODE")
            await publish_many(pub, stream[1000:], window=500)

        async def writer_blocked() -> bool:
            waiting = await blocker.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            return bool(waiting)

        await wait_until(writer_blocked, timeout=60, message="a batch waiting on the lock")
        process.kill()
        at_kill = await count_rows(db_dsn)
        await blocker_tx.rollback()
        assert at_kill == 1000, "the kill lands with the second part received, none committed"

        process.start()
        await _wait_healthy(process, http_port)

        async def all_stored() -> bool:
            return await count_rows(db_dsn) >= 5000

        await wait_until(all_stored, timeout=90, message="every message stored after restart")
        assert process.terminate() == 0
        assert await _retained(mosquitto.port, TOPICS.gateway_status("crash-node")) == b"offline"
    finally:
        await blocker.close()
        process.cleanup()

    conn = await asyncpg.connect(db_dsn)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM telemetry")
        seqs = await conn.fetchval("SELECT count(DISTINCT seq) FROM telemetry")
        span = await conn.fetchrow("SELECT min(seq), max(seq) FROM telemetry")
    finally:
        await conn.close()
    assert rows == seqs == 5000
    assert tuple(span) == (0, 4999)


async def _rule_states(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT rule_key, count(*) AS n FROM rule_state GROUP BY 1")
    finally:
        await conn.close()
    return {row["rule_key"]: row["n"] for row in rows}


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path (see conftest): the embedded server's user must reach it.
    path = Path(tempfile.mkdtemp(prefix="gw-state-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.embedded
async def test_zero_setup_default_ingests_on_embedded_broker_and_database(
    state_dir: Path, tmp_path: Path
) -> None:
    mqtt_port, http_port = free_port(), free_port()
    config = tmp_path / "gateway.toml"
    # No [database] dsn and no [mqtt] host: both embedded. Ports only, to stay off the
    # machine's own broker on 1883.
    config.write_text(
        f'[node]\nstate_dir = "{state_dir}"\n'
        f"[mqtt]\nport = {mqtt_port}\n[http]\nport = {http_port}\n"
        # The sample below is dated 2026-01-01: kept, whatever today is.
        "[retention]\ntelemetry_days = 0\n"
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        process.start()
        await _wait_healthy(process, http_port)
        async with aiomqtt.Client("127.0.0.1", mqtt_port) as pub:
            await pub.publish(
                TOPICS.telemetry("dev-1"),
                b'{"ts": 1767225600000, "metrics": {"temp": 21.5}}',
                qos=1,
            )
        from gateway.embedded.postgres import EmbeddedPostgres

        dsn = EmbeddedPostgres(state_dir).dsn

        async def stored() -> bool:
            return await count_rows(dsn) == 1

        await wait_until(stored, timeout=30, message="stored in the embedded PostgreSQL")
        assert process.terminate() == 0
    finally:
        process.cleanup()
    assert not (state_dir / "pgdata" / "postmaster.pid").exists(), "embedded server left running"
    log = process.log_tail(200)
    assert "embedded_broker_started" in log
    assert "embedded_postgres_started" in log


async def test_sighup_reloads_rules_and_a_broken_config_keeps_the_old_ones(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    config = tmp_path / "gateway.toml"

    def write(rules: str) -> None:
        config.write_text(
            config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port,
                        log_level="info", extra=rules)
        )  # fmt: skip

    door = '[[rules]]\nkey = "door"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'
    sos = '[[rules]]\nkey = "sos"\nkind = "event"\nevent = "SOS"\nseverity = "CRITICAL"\n'
    write(door)
    process = DaemonProcess(config, tmp_path / "daemon.log")

    async def send(n: int, event: str) -> None:
        payload = f'{{"ts": {1767225600000 + n}, "events": [{{"type": "{event}"}}]}}'.encode()
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(TOPICS.telemetry("flat-1"), payload, qos=1)

    async def alarms(rule: str, count: int) -> bool:
        conn = await asyncpg.connect(db_dsn)
        try:
            found = await conn.fetchval("SELECT count(*) FROM alarm WHERE rule_key = $1", rule)
        finally:
            await conn.close()
        return bool(found == count)

    try:
        process.start()
        await _wait_healthy(process, http_port)
        write('[[rules]]\nkey = "broken"\nkind = "nope"\nseverity = "INFO"\n')
        process.signal(signal.SIGHUP)
        await wait_until(lambda: "config_reload_refused" in process.log_text(), timeout=30)
        assert "rules[0].kind" in process.log_text()
        await send(1, "DOOR_OPEN")  # the old rules still run
        await wait_until(lambda: alarms("door", 1), timeout=30)
        assert await _rule_states(db_dsn) == {"door": 1}

        write(sos)
        process.signal(signal.SIGHUP)
        await wait_until(lambda: "config_reloaded" in process.log_text(), timeout=30)
        await send(2, "SOS")
        await send(3, "DOOR_OPEN")  # no such rule any more
        await wait_until(lambda: alarms("sos", 1), timeout=30)

        async def door_state_dropped() -> bool:
            return await _rule_states(db_dsn) == {"sos": 1}

        await wait_until(door_state_dropped, timeout=30, message="removed rule's state dropped")
        assert process.alive()
        assert process.terminate() == 0
    finally:
        process.cleanup()
    assert await alarms("door", 1)
    conn = await asyncpg.connect(db_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM telemetry") == 3  # nothing dropped
    finally:
        await conn.close()


def _write_shared(
    paths: list[Path], ports: list[int], db_dsn: str, mosquitto: Mosquitto, rules: str
) -> None:
    """Each node's configuration (node-0, node-1, …), one shared group, with ``rules``."""
    for n, (path, port) in enumerate(zip(paths, ports, strict=True)):
        path.write_text(
            config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=f"node-{n}",
                        http_port=port, log_level="info", extra=rules,
                        mqtt_extra='shared_group = "alarms"')
        )  # fmt: skip


async def test_sighup_adding_the_first_inactivity_rule_makes_it_fire_on_two_nodes(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Started without inactivity rules, two processes sharing the devices are given one by
    SIGHUP: it fires (the monitor existed only if such rules were there at start)."""
    silent = (
        '[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = 3\nseverity = "WARNING"\n'
    )
    ports = [free_port(), free_port()]
    paths = [tmp_path / f"node-{n}.toml" for n in range(2)]

    def write(rules: str) -> None:
        _write_shared(paths, ports, db_dsn, mosquitto, rules)

    async def count(query: str) -> int:
        conn = await asyncpg.connect(db_dsn)
        try:
            return int(await conn.fetchval(query))
        finally:
            await conn.close()

    write("")
    processes = [DaemonProcess(path, tmp_path / f"{path.stem}.log") for path in paths]
    try:
        for process, port in zip(processes, ports, strict=True):
            process.start()
            await _wait_healthy(process, port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            for device in ("quiet-1", "quiet-2"):
                await pub.publish(
                    TOPICS.telemetry(device), b'{"ts": 1767225600000, "metrics": {"t": 1}}', qos=1
                )

        async def stored() -> bool:
            return await count("SELECT count(*) FROM telemetry") == 2

        await wait_until(stored, timeout=30, message="stored")
        # A real silence, heard by both nodes (a last_seen moved back would be a silence from
        # before they listened, which they do not judge).
        write(silent)
        for process in processes:
            process.signal(signal.SIGHUP)

        async def alarmed() -> bool:
            return await count("SELECT count(*) FROM alarm WHERE rule_key = 'silent'") == 2

        await wait_until(alarmed, timeout=30, message="the rule added by SIGHUP fired")
        for process in processes:
            assert "config_reloaded" in process.log_text()
            assert process.terminate() == 0
    finally:
        for process in processes:
            process.cleanup()
    assert await count("SELECT count(DISTINCT device_id) FROM alarm") == 2


async def test_a_hold_a_sighup_changes_mid_hold_is_judged_again_on_two_nodes(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """Two devices report by exception under `temp > 90 for 600 s`: 95 and 92 once, then
    nothing. Five minutes into the hold (the rows' clock moved back), SIGHUP gives both
    processes `temp > 93 for 60 s`. The rows were written under the old definition, and no
    sample comes to bring them up to date: the 95 must still fire (once, whichever node's timer
    judges it), from its own sample's hold, and the 92, no longer a violation, must not."""

    def rule(value: int, for_seconds: int) -> str:
        return (
            "[alarms]\ntimer_interval_s = 0.5\n"
            '[[rules]]\nkey = "hot"\nkind = "threshold"\nmetric = "temp"\nop = ">"\n'
            f'value = {value}\nfor_seconds = {for_seconds}\nseverity = "MAJOR"\n'
        )

    ports = [free_port(), free_port()]
    paths = [tmp_path / f"node-{n}.toml" for n in range(2)]

    def write(rules: str) -> None:
        _write_shared(paths, ports, db_dsn, mosquitto, rules)

    async def fetch(query: str) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(db_dsn)
        try:
            return list(await conn.fetch(query))
        finally:
            await conn.close()

    write(rule(90, 600))
    processes = [DaemonProcess(path, tmp_path / f"{path.stem}.log") for path in paths]
    ts = int(time.time() * 1000)
    try:
        for process, port in zip(processes, ports, strict=True):
            process.start()
            await _wait_healthy(process, port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            for device, temp in (("boiler-1", 95), ("boiler-2", 92)):
                payload = f'{{"ts": {ts}, "metrics": {{"temp": {temp}}}}}'.encode()
                await pub.publish(TOPICS.telemetry(device), payload, qos=1)

        async def pending() -> bool:
            rows = await fetch("SELECT pending_count FROM rule_state WHERE pending_count = 1")
            return len(rows) == 2

        await wait_until(pending, timeout=30, message="both holds pending")
        await fetch("UPDATE rule_state SET updated_at = updated_at - interval '300 seconds'")
        write(rule(93, 60))
        for process in processes:
            process.signal(signal.SIGHUP)

        async def judged() -> bool:
            rows = await fetch(
                "SELECT device_id, firing, pending_count FROM rule_state ORDER BY device_id"
            )
            return [tuple(r) for r in rows] == [("boiler-1", True, 0), ("boiler-2", False, 0)]

        await wait_until(judged, timeout=30, message="the 95 fired, the 92 re-armed")
        alarms = await fetch("SELECT device_id, telemetry_event_id FROM alarm")
        for process in processes:
            assert "config_reloaded" in process.log_text()
            assert process.terminate() == 0
    finally:
        for process in processes:
            process.cleanup()
    since = datetime.fromtimestamp(ts // 1000, UTC) + timedelta(milliseconds=ts % 1000)
    assert [tuple(a) for a in alarms] == [("boiler-1", hold_event_id("hot", "boiler-1", since))]


async def test_a_sighup_clears_what_the_new_rule_no_longer_sees_and_fires_what_it_sees(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """A device reporting by exception sends 85 once, then nothing. Two processes run `hot`
    (`temp > 80`: it fires) and `warm` (`temp > 90`: normal). SIGHUP gives both `hot > 90`
    and `warm > 80`. Under the rules in force the device is not hot and is warm: `hot`'s
    alarm clears (once, saying the rule changed), `warm` fires (once, whichever node's timer
    judges it), with no sample after the reload."""

    def rules(hot: int, warm: int) -> str:
        return "[alarms]\ntimer_interval_s = 0.5\n" + "".join(
            f'[[rules]]\nkey = "{key}"\nkind = "threshold"\nmetric = "temp"\nop = ">"\n'
            f'value = {value}\nseverity = "MAJOR"\n'
            for key, value in (("hot", hot), ("warm", warm))
        )

    ports = [free_port(), free_port()]
    paths = [tmp_path / f"node-{n}.toml" for n in range(2)]

    def write(text: str) -> None:
        _write_shared(paths, ports, db_dsn, mosquitto, text)

    async def fetch(query: str) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(db_dsn)
        try:
            return list(await conn.fetch(query))
        finally:
            await conn.close()

    async def alarms() -> list[tuple[str, bool]]:
        rows = await fetch("SELECT rule_key, cleared_at IS NULL AS active FROM alarm ORDER BY id")
        return [(row["rule_key"], row["active"]) for row in rows]

    write(rules(80, 90))
    processes = [DaemonProcess(path, tmp_path / f"{path.stem}.log") for path in paths]
    try:
        for process, port in zip(processes, ports, strict=True):
            process.start()
            await _wait_healthy(process, port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            payload = f'{{"ts": {int(time.time() * 1000)}, "metrics": {{"temp": 85}}}}'.encode()
            await pub.publish(TOPICS.telemetry("boiler-1"), payload, qos=1)

        async def hot_fired() -> bool:
            return await alarms() == [("hot", True)]

        await wait_until(hot_fired, timeout=30, message="hot fired on the 85")
        write(rules(90, 80))
        for process in processes:
            process.signal(signal.SIGHUP)

        async def judged() -> bool:
            return await alarms() == [("hot", False), ("warm", True)]

        await wait_until(judged, timeout=30, message="hot cleared and warm fired after SIGHUP")
        for process in processes:
            assert "config_reloaded" in process.log_text()
            assert process.terminate() == 0
        cleared = await fetch(
            "SELECT payload ->> 'reason' AS reason FROM outbox_event"
            " WHERE event_type = 'alarm.cleared'"
        )
        created = await fetch(
            "SELECT count(*) AS n FROM outbox_event WHERE event_type = 'alarm.created'"
        )
    finally:
        for process in processes:
            process.cleanup()
    assert await alarms() == [("hot", False), ("warm", True)]
    assert len(cleared) == 1
    assert "rule changed" in cleared[0]["reason"]
    assert created[0]["n"] == 2
    assert await fetch("SELECT count(*) FROM telemetry") == [(1,)]  # no sample after the reload


def _catches_sighup(pid: int) -> bool:
    """Whether the process has a handler for SIGHUP (its SigCgt mask, /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


async def test_a_sighup_while_the_gateway_starts_is_a_reload_not_the_end(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """A `systemctl reload` racing a start: the SIGHUP comes as soon as the process catches it,
    which is now while Python is still importing the gateway (before, only once the daemon's
    handler existed, and one sent earlier ended the process: Python's default action). It is
    held and applied once the daemon's handler exists. (How soon it comes depends on the
    machine; the hold itself is tested in tests/unit/runtime/test_entry.py.)"""
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(
        config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port, log_level="info")
    )
    process = DaemonProcess(config, tmp_path / "daemon.log")
    try:
        process.start()
        assert process.process is not None
        pid = process.process.pid
        await wait_until(lambda: _catches_sighup(pid), timeout=30, interval=0.001)
        process.signal(signal.SIGHUP)
        await _wait_healthy(process, http_port)
        await wait_until(lambda: "config_reloaded" in process.log_text(), timeout=30)
        assert process.alive()
        assert process.terminate() == 0
    finally:
        process.cleanup()
