"""`gateway dead-letters replay --all` over a QUARANTINED letter whose cause is not fixed.

Such a letter is a message the process died of twice (the crash-loop breaker). Replayed in the
command's own process, one whose cause is not fixed ended the command there: every run of
`--all` died at the same letter, and the letters after it (by id) were never replayed, however
often it ran. Each QUARANTINED letter is replayed in a process of its own, as the daemon does
over HTTP: its death is that letter's line (`crashed: exited with code 86`), the letter is
unchanged, and the run goes on to the others (exit 1, one letter not replayed).

The real command (the gateway with a decoder that dies on one marker, tests.support.
dying_gateway) against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.support.dying_gateway import DEADLY_WHILE_DECODING, DEATH_CODE

T = "2026-11-30T12:00:00Z"
DEADLY = DEADLY_WHILE_DECODING.decode()
LETTERS = [
    ("dev-killer", "QUARANTINED", {"ts": T, "metrics": {"t": 1, "note": DEADLY}}),
    ("dev-quarantined", "QUARANTINED", {"ts": T, "metrics": {"t": 2}}),
    ("dev-refused", "STORAGE_REJECTED", {"ts": T, "metrics": {"t": 3}}),
]  # fmt: skip


async def test_replay_all_goes_past_a_quarantined_letter_that_still_kills(
    db: asyncpg.Connection, db_dsn: str, tmp_path: Path
) -> None:
    ids = []
    for device, reason, message in LETTERS:
        payload = json.dumps(message).encode()
        ids.append(
            await db.fetchval(
                "INSERT INTO dead_letter (topic, payload, payload_size, payload_sha256, reason,"
                " detail, node_id) VALUES ($1, $2, $3, encode(sha256($2), 'hex'), $4,"
                " 'letter', 'n1') RETURNING id",
                f"iot/devices/{device}/telemetry", payload, len(payload), reason,
            )
        )  # fmt: skip
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    command = [sys.executable, "-m", "tests.support.dying_gateway", "dead-letters", "replay"]
    cli = await asyncio.create_subprocess_exec(
        *command, "--config", str(config), "--all",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(cli.communicate(), timeout=120)
    finally:
        if cli.returncode is None:
            cli.kill()
            await cli.wait()
    lines = out.decode().splitlines()
    assert cli.returncode != DEATH_CODE, (
        f"the killer ended the run: {lines}\n{err.decode()[-2000:]}"
    )
    killer, quarantined, refused = ids
    assert f"{killer}\tcrashed: exited with code {DEATH_CODE}" in lines, (lines, err)
    assert f"{quarantined}\tstored" in lines, (lines, err)
    assert f"{refused}\tstored" in lines, (lines, err)
    assert (
        lines[-1] == "replayed 2: 2 ingested, 0 still invalid, 1 crashed the process replaying them"
    )
    assert cli.returncode == 1
    # The killer's letter is as it was: not replayed, nothing recorded of the attempt.
    row = await db.fetchrow(
        "SELECT replayed_at, replay_count, reason FROM dead_letter WHERE id = $1", killer
    )
    assert (row["replayed_at"], row["replay_count"], row["reason"]) == (None, 0, "QUARANTINED")
    stored = await db.fetch(
        "SELECT device_id FROM telemetry WHERE device_id LIKE 'dev-%' ORDER BY device_id"
    )
    assert [r["device_id"] for r in stored] == ["dev-quarantined", "dev-refused"]
