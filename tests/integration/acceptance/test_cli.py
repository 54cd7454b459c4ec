"""The ``gateway`` command line, run as operators and scripts run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import asyncpg

from storage.migrate import latest_version, shipped_migrations

EXAMPLE = Path(__file__).resolve().parents[3] / "config.example.toml"


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_check_config_accepts_the_example_and_names_the_bad_key(tmp_path: Path) -> None:
    ok = _gateway("check-config", str(EXAMPLE))
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[mqtt]\nport = 'eighty'\n")
    result = _gateway("check-config", str(bad))
    assert result.returncode == 2
    assert "mqtt.port" in result.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[database]\ndns = 'typo'\n")
    result = _gateway("check-config", str(unknown))
    assert result.returncode == 2
    assert "database.dns" in result.stderr
    several = tmp_path / "several.toml"
    several.write_text("[mqtt]\nport = 'eighty'\n[log]\nformat = 'xml'\n[database]\npool_min = 0\n")
    result = _gateway("check-config", str(several))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"invalid configuration: {several}: 3 errors",
        "  mqtt.port: Expected `int`, got `str`",
        "  log.format: Invalid enum value 'xml'; allowed: 'auto', 'json', 'console'",
        "  database.pool_min: Expected `int` >= 1",
    ]


def test_check_config_refuses_url_credentials_beside_an_authorization_header(
    tmp_path: Path,
) -> None:
    """It would pass, and then every attempt would fail: refused up front, naming the
    receiver, with neither secret in the message."""
    config = tmp_path / "hook.toml"
    config.write_text(
        '[[notify.receivers]]\nname = "ops-hook"\nkind = "webhook"\n'
        'url = "https://bob:hunter22@hooks.example/in"\n'
        'headers = { Authorization = "Bearer t0k3n-0123" }\n'
    )
    result = _gateway("check-config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[0] == f"invalid configuration: {config}: 1 error"
    assert "notify.receivers[0].url" in result.stderr
    assert "'ops-hook'" in result.stderr
    assert "hunter22" not in result.stderr + result.stdout
    assert "t0k3n-0123" not in result.stderr + result.stdout


def test_check_config_names_a_bad_grouping_and_a_bad_inhibit_rule(tmp_path: Path) -> None:
    config = tmp_path / "groups.toml"
    config.write_text(
        '[[notify.receivers]]\nname = "ops"\nkind = "webhook"\nurl = "https://h/in"\n'
        '[[notify.routes]]\nreceivers = ["ops"]\ngroup_by = ["rule", "room"]\n'
        '[[notify.inhibit]]\n[notify.inhibit.source]\nseverities = ["MAJOR"]\n'
    )
    result = _gateway("check-config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[1:] == [
        "  notify.routes[0].group_by[1]: unknown label 'room'; known: ['rule', 'device', "
        "'severity', 'site']",
    ]
    config.write_text(
        '[[notify.receivers]]\nname = "ops"\nkind = "webhook"\nurl = "https://h/in"\n'
        '[[notify.inhibit]]\n[notify.inhibit.source]\nseverities = ["MAJOR"]\n'
    )
    result = _gateway("check-config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[1:] == [
        "  notify.inhibit[0].source.rules: required: the rule keys of the source alarms",
    ]


async def test_migrate_is_idempotent_and_dead_letters_can_be_listed(
    empty_db_dsn: str, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{empty_db_dsn}"\n[log]\nformat = "json"\n')
    first = _gateway("migrate", "--config", str(config))
    assert first.returncode == 0, first.stderr
    assert f"applied migrations: {[m.version for m in shipped_migrations()]}" in first.stdout
    second = _gateway("migrate", "--config", str(config))
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout

    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await conn.execute(
            "INSERT INTO dead_letter "
            "(topic, payload, payload_size, payload_sha256, reason, detail, node_id) "
            "VALUES ('iot/devices/d/telemetry', '\\x00ff'::bytea, 2, "
            "encode(sha256('\\x00ff'::bytea), 'hex'), 'MALFORMED', 'bad', 'n1')"
        )
    finally:
        await conn.close()
    listing = _gateway("dead-letters", "list", "--config", str(config), "--json")
    assert listing.returncode == 0, listing.stderr
    (row,) = [json.loads(line) for line in listing.stdout.splitlines()]
    assert row["reason"] == "MALFORMED"
    assert row["payload_base64"] == "AP8="
    replay = _gateway("dead-letters", "replay", "--config", str(config), "--all")
    assert replay.returncode == 0, replay.stderr
    assert "1 still invalid" in replay.stdout


async def test_an_older_release_refuses_a_newer_schema(db_dsn: str, tmp_path: Path) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute(
            "INSERT INTO schema_migration (version, name, checksum) VALUES ($1, 'future', 'x')",
            latest_version() + 1,
        )
    finally:
        await conn.close()
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    result = _gateway("migrate", "--config", str(config))
    # Final: only installing the newer release fixes it (docs/deploying.md#upgrading).
    assert result.returncode == 2
    assert "refusing to start" in result.stderr


async def test_a_command_on_a_database_without_the_schema_says_so_in_one_line(
    empty_db_dsn: str, tmp_path: Path
) -> None:
    """Not a traceback about a missing table: one line naming the database and `gateway
    migrate`, exit 2, for each command that reads the gateway's tables; and the database is
    left as it was (nothing created)."""
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{empty_db_dsn}"\n[log]\nformat = "json"\n')
    for command in (
        ("dead-letters", "list"),
        ("dead-letters", "replay", "--all"),
        ("rules", "check"),
        ("maintenance", "run-once"),
    ):
        result = _gateway(*command, "--config", str(config))
        assert result.returncode == 2, (command, result.stderr)
        assert result.stdout == "", command
        (line,) = result.stderr.splitlines()
        error = json.loads(line)
        assert error["event"] == "startup_failed", line
        assert "has no gateway schema" in error["error"], line
        assert "gateway migrate" in error["error"], line
        assert "Traceback" not in result.stderr
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        tables = await conn.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        )
    finally:
        await conn.close()
    assert tables == 0


async def test_a_command_on_an_older_schema_names_both_versions(
    db_dsn: str, tmp_path: Path
) -> None:
    conn = await asyncpg.connect(db_dsn)
    try:
        await conn.execute("DELETE FROM schema_migration WHERE version = $1", latest_version())
    finally:
        await conn.close()
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n')
    result = _gateway("dead-letters", "list", "--config", str(config))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert (
        f"has the gateway schema of migration {latest_version() - 1}, this gateway needs "
        f"{latest_version()}" in json.loads(line)["error"]
    )


def test_install_systemd_writes_the_units_for_this_installation(tmp_path: Path) -> None:
    executable = tmp_path / "bin" / "gateway"
    executable.parent.mkdir()
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    target = tmp_path / "units"
    target.mkdir()
    # The executable sits under the test's temporary directory, which the units' PrivateTmp
    # would hide: --allow-tmp says the test knows (the refusal is tested in test_systemd_units).
    install = ("install-systemd", "--allow-tmp", "--target", str(target))
    result = _gateway(*install, "--executable", str(executable))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in target.iterdir()) == ["gateway.service", "gateway@.service"]
    unit = (target / "gateway.service").read_text()
    assert f"ExecStart={executable} run" in unit
    assert "Type=notify" in unit
    (target / "gateway.service").write_text("edited by the operator\n")
    refused = _gateway(*install, "--executable", str(executable))
    assert refused.returncode == 1
    assert "gateway.service" in refused.stderr
    assert "--force" in refused.stderr
    forced = _gateway(*install, "--executable", str(executable), "--force")
    assert forced.returncode == 0, forced.stderr
    assert "Type=notify" in (target / "gateway.service").read_text()


def test_embedded_db_refuses_when_a_database_is_configured(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[database]\ndsn = "postgresql://db.example/gateway"\n')
    result = _gateway("embedded-db", "--config", str(config))
    assert result.returncode == 2
    assert "dsn is set" in result.stderr
    assert result.stdout == ""


def test_version_prints_the_release() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--version"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("gateway ")
    assert result.stdout.split()[1][0].isdigit()


async def test_a_replayed_sparkplug_death_is_refused_each_time_and_seen_once(
    db_dsn: str, tmp_path: Path
) -> None:
    """`gateway dead-letters replay --all`, twice, of an edge node's NDEATH dead-lettered
    once: each run says it is still invalid (`INVALID`: a death's moment has passed) and the
    letter stays pending, seen once. Each run used to count it again (`seen_count` 2, 3)."""
    from protocol import sparkplug_b_pb2 as pb
    from protocol.sparkplug import DataType

    death = pb.Payload(timestamp=1767225600000)
    metric = death.metrics.add()
    metric.name, metric.datatype, metric.long_value = "bdSeq", DataType.INT64, 3
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n'
        '[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["G"]\n'
    )
    conn = await asyncpg.connect(db_dsn)
    try:
        letter_id = await conn.fetchval(
            "INSERT INTO dead_letter "
            "(topic, payload, payload_size, payload_sha256, reason, detail, node_id) "
            "VALUES ('spBv1.0/G/NDEATH/N', $1::bytea, length($1::bytea), "
            "encode(sha256($1::bytea), 'hex'), 'QUARANTINED', 'held', 'n1') RETURNING id",
            death.SerializeToString(),
        )
        for _ in range(2):
            replay = _gateway("dead-letters", "replay", "--config", str(config), "--all")
            assert replay.returncode == 0, replay.stderr
            assert f"{letter_id}\tstill_invalid: INVALID" in replay.stdout
            assert "replayed 1: 0 ingested, 1 still invalid" in replay.stdout
        rows = await conn.fetch("SELECT id, seen_count, replay_count FROM dead_letter")
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [(letter_id, 1, 2)]
