"""A command beside the daemon on a database that does not answer (a link that drops packets):
it gives up after `[database] connect_timeout_s`, as the daemon's connects do, and says why. It
waited 10 s whatever the file said, and then printed `cannot reach the database at ...: ` with
nothing after the colon (a TimeoutError says nothing of itself)."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.dsn import proxy_for, through
from tests.support.gateway_cli import gateway_run


async def test_a_silent_database_is_given_up_after_the_connect_timeout_and_named(
    db_dsn: str, tmp_path: Path
) -> None:
    async with proxy_for(db_dsn) as proxy:
        proxy.black_hole()
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[database]\ndsn = "{through(db_dsn, proxy)}"\nconnect_timeout_s = 1\n'
            '[log]\nformat = "json"\n'
        )
        started = time.monotonic()
        done = await gateway_run(config, command=("dead-letters", "list"))
        took = time.monotonic() - started
    done.assert_no_traceback()
    assert done.returncode == 1, done.output
    error = done.the("startup_failed")["error"]
    assert error.startswith("cannot reach the database at 127.0.0.1:"), error
    assert not error.endswith(": "), error
    assert "TimeoutError" in error or "timed out" in error, error
    assert took < 8, f"{took:.1f} s with connect_timeout_s = 1"
