"""`gateway dead-letters replay --all` whose database goes away midway (a failover, a restart,
the session ended by an administrator): the letters replayed before it are replayed (their
transactions committed), and the command said nothing of them. It printed its lines only once
every letter was done: the operator read one line, "cannot reach the database", as though
nothing had happened, while the first letters' telemetry, alarms and replay records were in.
Each letter's line is printed once its replay committed.

The real command against a real PostgreSQL; the second letter's replay is made to wait on its
device's row (held by this test) and its session is then ended."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until

LETTERS = [
    ("dev-1", {"ts": "2026-11-30T12:00:00Z", "metrics": {"temp": 21.5}}),
    ("dev-2", {"ts": "2026-11-30T12:00:00Z", "metrics": {"temp": 22.5}}),
]


async def test_replay_all_cut_midway_prints_the_letters_it_replayed(
    db: asyncpg.Connection, db_dsn: str, tmp_path: Path
) -> None:
    ids = []
    for device, message in LETTERS:
        payload = json.dumps(message).encode()
        ids.append(
            await db.fetchval(
                "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason,"
                " detail, node_id) VALUES ($1, $2, $3, encode(sha256($2), 'hex'),"
                " 'STORAGE_REJECTED', 'refused', 'n1') RETURNING id",
                f"iot/devices/{device}/telemetry", payload, len(payload),
            )
        )  # fmt: skip
    # dev-2 heard from long ago: the replay moves its last_seen, and waits for its row.
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen)"
        " VALUES ('dev-2', '2020-01-01Z', '2020-01-01Z')"
    )
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    holder = await asyncpg.connect(db_dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT 1 FROM device WHERE device_id = 'dev-2' FOR UPDATE")
        command = [sys.executable, "-m", "gateway", "dead-letters", "replay"]
        cli = await asyncio.create_subprocess_exec(
            *command, "--config", str(config), "--all",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await wait_until(
                lambda: lock_waiters(db_dsn), timeout=60, message="dev-2's replay waits"
            )
            waiters = await lock_waiters(db_dsn)
            assert await db.fetchval(
                "SELECT replayed_at IS NOT NULL FROM dead_letter WHERE id = $1", ids[0]
            )
            for pid in waiters:
                await db.execute("SELECT pg_terminate_backend($1)", pid)
            out, err = await asyncio.wait_for(cli.communicate(), timeout=60)
        finally:
            if cli.returncode is None:
                cli.kill()
                await cli.wait()
        await held.rollback()
    finally:
        await holder.close()
    assert cli.returncode != 0
    assert f"{ids[0]}\tstored" in out.decode().splitlines(), (out, err)
    assert await db.fetchval("SELECT replayed_at IS NULL FROM dead_letter WHERE id = $1", ids[1])
