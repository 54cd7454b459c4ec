"""A database password holding an '@' written as is in ``[database] dsn``
(``postgresql://gw:P@ss:w0rd!2024@db:5432/gw``) is refused as a DSN that does not parse,
saying to write it ``%40``, and no part of the password is shown.

Python's URL parser (what the log's redaction and ``describe`` read) ends the userinfo at the
last '@', asyncpg's (as libpq's) at the first: the rest of the password was the driver's host
and port. ``gateway check-config``, ``gateway run`` and every command beside it then printed
``invalid literal for int() with base 10: 'w0rd!2024@db:5432'``: most of the password, which
the redaction (knowing the whole password only) left in the journal. Without a ':' after the
'@' (``P@ssw0rd``) the file was "ok", and the daemon waited for ever for a database at the
right address ("Name or service not known") while it was asking a host named after the
password.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from tests.support.gateway_cli import gateway_run

EXIT_CONFIG: Final = 2
DSN_SETTING: Final = "[database] dsn (or GATEWAY_DATABASE_DSN)"


async def _check_config(config: Path) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "gateway", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _refused_unshown(
    tmp_path: Path, dsn: str, secret: str, advice: str, commands: tuple[tuple[str, ...], ...]
) -> None:
    """``dsn`` refused by each of ``commands`` (``startup_failed`` naming the setting, with
    ``advice``: how to write the character, exit 2, no traceback) and by ``check-config``,
    and ``secret`` shown by none of them."""
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{dsn}"\n[log]\nformat = "json"\n')
    for command in commands:
        done = await gateway_run(config, command=command)
        assert secret not in done.output, done.output
        done.assert_no_traceback()
        line = done.the("startup_failed")
        assert line["setting"] == DSN_SETTING, line
        assert advice in line["error"], line
        assert done.returncode == EXIT_CONFIG, done.output
    checked = await _check_config(config)
    assert secret not in checked.stdout + checked.stderr, checked
    assert checked.returncode == EXIT_CONFIG, checked


async def test_a_password_with_an_at_sign_and_a_colon_is_refused_and_not_shown(
    tmp_path: Path,
) -> None:
    tail = "w0rd-Secret-2024"  # the part after the password's '@' and ':'
    dsn = f"postgresql://gw:P@ss:{tail}@127.0.0.1:5432/gw"
    await _refused_unshown(tmp_path, dsn, tail, "%40", (("run",), ("migrate",)))


@pytest.mark.parametrize(
    "password", ["P@ssw0rd-4711", "gw@corp:S3cret"], ids=["at-sign", "at-sign-then-colon"]
)
async def test_check_config_refuses_a_password_with_an_at_sign(
    tmp_path: Path, password: str
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "postgresql://gw:{password}@127.0.0.1:5432/gw"\n')
    checked = await _check_config(config)
    assert checked.returncode == EXIT_CONFIG, checked
    assert "database.dsn" in checked.stderr, checked
    assert "%40" in checked.stderr, checked
    for part in (p for p in password.replace("@", ":").split(":") if len(p) >= 4):
        assert part not in checked.stdout + checked.stderr.replace("database.dsn", ""), checked


@pytest.mark.parametrize(
    "password",
    [
        "2024/Secret-pass-0815",
        "/Secret-pass-0815",
        "4711?Secret-pass-0815",
        "4711#Secret-pass-0815",
    ],
    ids=["slash-after-digits", "leading-slash", "question-mark", "hash"],
)
async def test_a_password_with_a_slash_question_mark_or_hash_is_refused_and_not_shown(
    tmp_path: Path, password: str
) -> None:
    """``gw:2024/Secret@db/gw`` parsed, as a host ``gw`` on port 2024 and a database named
    ``Secret@db/gw``: every log line, the service status and the unauthenticated /health
    showed "waiting for the database at gw:2024/Secret@db:5432/gw", while the node waited for
    ever on a host named ``gw``. (After a '?' the driver refused "bad query field:
    'Secret...@db:5432/gw'"; after a '#' the node waited for ever on ``gw:4711``.)"""
    dsn = f"postgresql://gw:{password}@127.0.0.1:5432/gw"
    await _refused_unshown(tmp_path, dsn, "Secret-pass-0815", "%2F", (("migrate",),))


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://gw:pw@127.0.0.1:5432/gw?sslrootcert=/home/john@corp/ca.pem",
        "postgresql:///gw?host=/run/postgresql&user=john@corp",
        "postgresql://gw:p%2Fw%3F%23x%40y@127.0.0.1:5432/gw",
    ],
    ids=["at-in-a-query-value", "user-in-the-query", "all-encoded"],
)
async def test_an_at_sign_where_it_may_be_is_no_error(tmp_path: Path, dsn: str) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(f'[database]\ndsn = "{dsn}"\n')
    checked = await _check_config(config)
    assert checked.returncode == 0, checked
