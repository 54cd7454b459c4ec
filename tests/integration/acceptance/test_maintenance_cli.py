"""``gateway maintenance run-once``: one retention pass from the command line."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_run_once_makes_partitions_ahead_and_prunes(db_dsn: str, tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n'
        "[retention]\npartitions_ahead_days = 12\ndead_letter_days = 1\n"
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO dead_letter "
            "(topic, payload, payload_size, payload_sha256, reason, detail, node_id, "
            "received_at, last_seen_at) "
            "VALUES ('iot/devices/d/telemetry', 'x', 1, encode(sha256('x'), 'hex'), "
            "'MALFORMED', 'bad', 'n1', now() - interval '3 days', now() - interval '2 days')"
        )
        result = _gateway("maintenance", "run-once", "--config", str(config))
        assert result.returncode == 0, result.stderr
        ahead = datetime.now(UTC).date() + timedelta(days=12)
        assert ahead.isoformat() in result.stdout
        assert "dead_letter: 1 pruned" in result.stdout
        assert await conn.fetchval(
            "SELECT to_regclass($1) IS NOT NULL", f"telemetry_p{ahead:%Y%m%d}"
        )
        assert await conn.fetchval("SELECT count(*) FROM dead_letter") == 0

        again = _gateway("maintenance", "run-once", "--config", str(config))
        assert again.returncode == 0, again.stderr
        assert "partitions created: none" in again.stdout
    finally:
        await conn.close()
