"""`gateway dead-letters` given what an operator mistypes: a negative `--limit`, an id past
PostgreSQL's bigint, an id no letter has. Each is one clear line and a failing exit status, never
a traceback reported as a bug, nor a silent success."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from tests.support.gateway_cli import gateway_run


async def _letter(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval(
                "INSERT INTO dead_letter "
                "(topic, payload, payload_size, payload_sha256, reason, detail, node_id) "
                "VALUES ('iot/devices/d/telemetry', '\\x00ff'::bytea, 2, "
                "encode(sha256('\\x00ff'::bytea), 'hex'), 'MALFORMED', 'bad', 'n1') RETURNING id"
            )
        )
    finally:
        await conn.close()


async def test_mistyped_arguments_are_refused_in_one_line_without_a_traceback(
    db_dsn: str, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    for command in (
        ("dead-letters", "list", "--limit", "-1"),
        ("dead-letters", "list", "--after", "-1"),
        ("dead-letters", "replay", "--id", str(2**63)),
        ("dead-letters", "replay", "--id", "0"),
    ):
        done = await gateway_run(config, command=command)
        done.assert_no_traceback()
        assert done.returncode == 2, (command, done.output)
        assert "command_failed" not in done.output, done.output


async def test_replaying_an_id_no_letter_has_names_it_and_fails(
    db_dsn: str, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    letter = await _letter(db_dsn)
    missing = letter + 1000
    done = await gateway_run(
        config, command=("dead-letters", "replay", "--id", str(letter), "--id", str(missing))
    )
    done.assert_no_traceback()
    assert f"{letter}\tstill_invalid: MALFORMED" in done.output, done.output
    assert f"{missing}\tnot found" in done.output, done.output
    assert done.returncode == 1, done.output
