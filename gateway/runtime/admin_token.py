"""The zero-setup admin token: on the embedded-database path with no ``[api] tokens``, the
first start creates one, stores it in ``state_dir/admin-token`` (mode 0600) and says where.

Every later start (and every reload) reads the same file, so the README's
``curl -H "Authorization: Bearer $(cat .gateway-state/admin-token)" ...`` works as written.
A configuration with its own ``[api] tokens`` or its own database never gets one: those are
set up deliberately, and a token nobody asked for would be a hole.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Final

import msgspec
import structlog

from gateway.config import Config, TokenConfig

log = structlog.get_logger(__name__)

TOKEN_FILE: Final = "admin-token"  # noqa: S105 - a file name, not a secret
TOKEN_NAME: Final = "admin"  # noqa: S105 - the name shown in audit rows, not a secret
_TOKEN_BYTES: Final = 32


def token_path(config: Config) -> Path:
    return config.state_dir / TOKEN_FILE


def wants_zero_setup_token(config: Config) -> bool:
    return not config.database.dsn and not config.api.tokens


def with_zero_setup_token(config: Config, *, announce: bool = False) -> Config:
    """``config`` with the zero-setup admin token added, when it applies (else unchanged).

    ``announce``: log where the token is (never the token itself).
    """
    if not wants_zero_setup_token(config):
        return config
    path = token_path(config)
    token, created = _read_or_create(path)
    if announce:
        # With `[http] port = 0` the port is known once the server listens: `try_it` then
        # comes in its own line (`announce_try_it`); a curl to port 0 reaches nothing.
        port = config.http.port
        log.info(
            "admin_token_created" if created else "admin_token",
            path=str(path),
            **({"try_it": try_it(config, port)} if port else {}),
        )
    entry = TokenConfig(token=token, role="admin", name=TOKEN_NAME)
    api = msgspec.structs.replace(config.api, tokens=[entry])
    return msgspec.structs.replace(config, api=api)


def try_it(config: Config, port: int) -> str:
    """The curl line that tries the zero-setup token against the node listening on ``port``."""
    return (
        f'curl -H "Authorization: Bearer $(cat {token_path(config)})" '
        f"http://{config.http.host}:{port}/alarms"
    )


def announce_try_it(config: Config, port: int) -> None:
    """The curl line, once the HTTP server listens on ``port`` (`[http] port = 0`)."""
    log.info("admin_token_try_it", path=str(token_path(config)), try_it=try_it(config, port))


def _read_or_create(path: Path) -> tuple[str, bool]:
    try:
        # Read first: a start or a reload whose token exists writes nothing (every one used to
        # write a fresh token to a temporary file first, which a full disk refused: the reload
        # escaped its handler, unanswered).
        return path.read_text(encoding="utf-8").strip(), False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(_TOKEN_BYTES)
    # Written whole to a private temporary file, then linked into place: link() fails if the
    # file exists, so of two processes starting at once one creates it, and nobody ever reads
    # a half-written or empty token.
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(token + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            return path.read_text(encoding="utf-8").strip(), False
        return token, True
    finally:
        Path(temporary).unlink(missing_ok=True)
