"""A message that killed the process twice and was quarantined comes back: the same bytes on
the same topic again (a retained message at every subscribe, a device repeating itself), or on
another node of the fleet. It is the same message (docs/behaviour.md §2, the event id), and it
is "processed twice, never a third time" (docs/architecture.md, "Poison messages"): quarantined
at once, never a third death, on whichever node it reaches.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiomqtt

from protocol import Topics
from tests.integration.acceptance.test_poison import (
    DEADLY,
    _fetchval,
    _wait_healthy,
    _write_config,
)
from tests.support.daemon import DaemonProcess, scrape
from tests.support.dying_gateway import DEATH_CODE
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
KILLER = TOPICS.telemetry("killer")
DEADLY_BYTES = DEADLY["judging"]  # a valid message: replayed once the cause is fixed


async def _quarantined_arrivals(dsn: str) -> int:
    return await _fetchval(
        dsn,
        "SELECT coalesce(sum(seen_count), 0) FROM dead_letter WHERE reason = 'QUARANTINED'",
    )


async def _two_deaths_then_quarantine(
    process: DaemonProcess, http_port: int, dsn: str, *, arrivals: int = 1
) -> None:
    """The daemon dies on the deadly message twice, then quarantines it at its third start."""
    for death in ("first death", "second death"):
        await wait_until(lambda: not process.alive(), timeout=60, message=death)
        assert process.exit_code() == DEATH_CODE
        process.start()
    await _wait_healthy(process, http_port)

    async def quarantined() -> bool:
        assert process.alive(), (
            f"the node died again (exit {process.exit_code()}) after quarantining the "
            f"message: processed a third time\n{process.log_tail(8)}"
        )
        return await _quarantined_arrivals(dsn) >= arrivals

    await wait_until(quarantined, timeout=60, message="the killer quarantined")


async def test_a_retained_killer_quarantined_once_is_quarantined_at_every_later_start(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    """A device publishes its telemetry retained (a Tasmota-style setting), and one message
    kills the decoder. After two deaths it is quarantined; then the node is restarted (a
    deploy, a reboot): the broker sends the retained message again at the subscription, and
    the node must quarantine it, not die on it a third and fourth time."""
    http_port = free_port()
    config = tmp_path / "gateway.toml"
    _write_config(config, db_dsn, mosquitto.port, http_port, "retained-node")
    process = DaemonProcess(config, tmp_path / "daemon.log", module="tests.support.dying_gateway")
    try:
        process.start()
        await _wait_healthy(process, http_port)
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(KILLER, DEADLY_BYTES, qos=1, retain=True)
        # The third start: the broker redelivers the copy of the session, and sends the
        # retained message again at the subscription: both quarantined.
        await _two_deaths_then_quarantine(process, http_port, db_dsn, arrivals=2)
        await _wait_healthy(process, http_port)

        # A deploy: a clean stop and a start. The retained message arrives again.
        code = process.terminate()
        assert code == 0, f"the node died after the quarantine (exit {code}): processed again"
        before = await _quarantined_arrivals(db_dsn)
        process.start()

        async def seen_again_or_dead() -> bool:
            return not process.alive() or await _quarantined_arrivals(db_dsn) > before

        await wait_until(seen_again_or_dead, timeout=60, message="the retained killer again")
        assert process.alive(), (
            f"the quarantined message killed the node again (exit {process.exit_code()}): "
            "processed a third time"
        )
        await _wait_healthy(process, http_port)
        assert process.terminate() == 0

        # The cause is fixed (the plain gateway: nothing kills it) and the letter replayed:
        # the breaker forgets the message, and the retained copy at the next start is
        # stored as any message (a duplicate of the replay), not quarantined again.
        replay = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "gateway", "dead-letters", "replay", "--config", str(config)),
            *("--all", "--reason", "QUARANTINED"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(replay.communicate(), timeout=120)
        assert replay.returncode == 0, err.decode()
        assert b"stored" in out, out.decode()
        assert await _fetchval(db_dsn, "SELECT count(*) FROM ingest_suspect") == 0
        fixed = DaemonProcess(config, tmp_path / "fixed.log")
        quarantined = await _quarantined_arrivals(db_dsn)
        try:
            fixed.start()
            await _wait_healthy(fixed, http_port)

            async def duplicate_counted() -> bool:
                assert fixed.alive(), fixed.log_tail()
                series = await scrape(http_port)
                return series.get("gateway_telemetry_duplicates_total", 0) >= 1

            await wait_until(duplicate_counted, timeout=60, message="the retained copy stored")
            assert await _quarantined_arrivals(db_dsn) == quarantined
            assert (
                await _fetchval(db_dsn, "SELECT count(*) FROM telemetry WHERE device_id = 'killer'")
                == 1
            )
            assert fixed.terminate() == 0
        finally:
            fixed.cleanup()
    finally:
        process.cleanup()
