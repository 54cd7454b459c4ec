"""The commands' output read by another program that stops early (`| head`), and `rules
replay` given a file it cannot read. Neither is the database's fault: the commands said
`cannot reach the database at ...: [Errno 32] Broken pipe` (and `... No such file or
directory: 'x.jsonl'` for a command that uses no database), naming `[database] dsn` as the
setting to check, because an OSError was taken for a database that is away."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import asyncpg


async def _letters(dsn: str, count: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO dead_letter "
            "(topic, payload, payload_size, payload_sha256, reason, detail, node_id) "
            "SELECT 'iot/devices/d' || g || '/telemetry', '\\x00ff'::bytea, 2, "
            "encode(sha256('\\x00ff'::bytea), 'hex'), 'MALFORMED', 'bad', 'n1' "
            "FROM generate_series(1, $1) g",
            count,
        )
    finally:
        await conn.close()


def _first_line_then_close(config: Path) -> tuple[bytes, int, str]:
    """``gateway dead-letters list | head -1``: one line read, then the pipe closed."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "dead-letters",
            "list",
            "--limit",
            "5000",
            "--config",
            str(config),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read().decode()
    return first, process.wait(timeout=60), stderr


async def test_a_listing_whose_reader_stops_early_ends_quietly(db_dsn: str, tmp_path: Path) -> None:
    await _letters(db_dsn, 5000)  # far more than a pipe's buffer
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    first, returncode, stderr = await asyncio.to_thread(_first_line_then_close, config)
    assert b"MALFORMED" in first
    assert "database" not in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert returncode == 0, stderr


def test_rules_replay_of_a_file_it_cannot_read_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "recorded.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "rules", "replay", "--input", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "database" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert str(missing) in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
