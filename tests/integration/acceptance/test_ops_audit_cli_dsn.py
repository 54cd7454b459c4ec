"""A `[database] dsn` that does not parse, given to the commands run beside the daemon: one
line naming the setting and exit 2, as `gateway run` says it, never a traceback reported as a
bug, and never the DSN's password (a libpq key=value DSN, which the gateway does not take, is
no URL: its password was printed whole as the database's "name")."""

from __future__ import annotations

from pathlib import Path

from storage.pool import describe
from tests.support.gateway_cli import gateway_run

PASSWORD = "s3cretpassw0rd"  # the secret the output must not carry


async def test_a_dsn_that_does_not_parse_is_one_line_and_no_password(tmp_path: Path) -> None:
    for dsn in (
        f"postgresql://postgres:{PASSWORD}@127.0.0.1:notaport/gw",
        f"host=127.0.0.1 port=5432 dbname=gw user=postgres password={PASSWORD}",
    ):
        config = tmp_path / "gateway.toml"
        config.write_text(f'[database]\ndsn = "{dsn}"\n[log]\nformat = "json"\n')
        for command in (("dead-letters", "list"), ("rules", "check"), ("migrate",)):
            done = await gateway_run(config, command=command)
            done.assert_no_traceback()
            assert PASSWORD not in done.output, done.output
            line = done.the("startup_failed")
            assert "does not parse" in line["error"], done.output
            assert line["setting"] == "[database] dsn (or GATEWAY_DATABASE_DSN)"
            assert done.returncode == 2, done.output


def test_where_a_dsn_that_is_no_url_points_carries_no_password() -> None:
    """What `gateway run` shows while it connects (its /health reason, the service manager's
    status line) is ``describe``'s."""
    assert PASSWORD not in describe(f"host=db1 password={PASSWORD} dbname=gw")
