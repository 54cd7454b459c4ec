"""Expected failures, said the way an operator acts on them: what is wrong, which setting to
change (a :class:`StartupError`), and whether only a change of configuration can fix it."""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path
from typing import Final

import asyncpg

from gateway.domain.errors import StartupError
from storage.errors import MigrationChecksumError, SchemaTooNewError
from storage.pool import describe, user_of

DSN_SETTING: Final = "[database] dsn (or GATEWAY_DATABASE_DSN)"
# What a database answers when it will not accept this DSN however long we wait: an unknown
# database, an unknown role, a wrong password, no pg_hba.conf entry, no CONNECT privilege.
REFUSED_AT_CONNECT: Final = (
    asyncpg.exceptions.InvalidCatalogNameError,
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
    asyncpg.exceptions.InsufficientPrivilegeError,
)


def refused(dsn: str, exc: Exception) -> StartupError:
    """``dsn`` empty: the embedded PostgreSQL's."""
    where = describe(dsn) if dsn else "the embedded PostgreSQL"
    if isinstance(exc, asyncpg.exceptions.InvalidCatalogNameError):
        what = f"the database server at {where.rsplit('/', 1)[0]} has no such database ({exc})"
    elif isinstance(exc, asyncpg.exceptions.InvalidPasswordError):
        what = f"the database at {where} refused the password of role {user_of(dsn)!r} ({exc})"
    else:
        what = f"the database at {where} refused role {user_of(dsn) or '(default)'!r} ({exc})"
    return StartupError(what, setting=DSN_SETTING, configuration=True)


# What a node of an older release does about a schema a newer one migrated: nothing but be
# replaced by the new release (docs/deploying.md#upgrading).
SCHEMA_SETTING: Final = "the gateway release installed on this node (upgrade it)"


def schema_too_new(exc: SchemaTooNewError) -> StartupError:
    """A start against a schema a newer release migrated: final (exit 2). Restarted, the same
    release refuses again: as exit 1 it was restarted every ``RestartSec`` for as long as the
    node was not upgraded, one ``startup_failed`` line each time (systemd's start limit, 5
    starts in 10 s, is not reached at one start every 2 s plus the start's own time)."""
    return StartupError(str(exc), setting=SCHEMA_SETTING, configuration=True)


def release_refused(exc: SchemaTooNewError | MigrationChecksumError) -> StartupError:
    """What the installed release cannot run against: a schema a newer one migrated, or a
    migration applied other than the one it ships (a release built from edited migrations,
    an install patched by hand). Final (exit 2) either way: every start refuses it alike, and
    as exit 1 it was restarted every ``RestartSec`` for good."""
    if isinstance(exc, SchemaTooNewError):
        return schema_too_new(exc)
    return StartupError(
        f"{exc}: install the release whose migrations built this database (or a newer one)",
        setting="the gateway release installed on this node (reinstall it)",
        configuration=True,
    )


def session_not_kept(where: str) -> StartupError:
    """A connection to ``where`` does not keep its server session (storage.pool.keeps_session)."""
    return StartupError(
        f"the database connection to {where} does not keep its session: a NOTIFY from one "
        "connection never reached another that LISTENs on it. A connection pooler in "
        "transaction or statement mode (PgBouncer's pool_mode = transaction) sits between the "
        "gateway and PostgreSQL: the gateway's LISTEN connections, prepared statements and "
        "migration lock need a whole session; set pool_mode = session, or connect to "
        "PostgreSQL directly (docs/deploying.md#pgbouncer)",
        setting=DSN_SETTING,
        configuration=True,
    )


def http_error(host: str, port: int, exc: OSError) -> StartupError:
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"port {port} on {host} is already in use (another gateway, or another server)",
            setting="[http] port (0: any free port), or [http] enabled = false",
        )
    if exc.errno == errno.EACCES:
        return StartupError(
            f"no permission to listen on {host}:{port} (ports below 1024 need privileges)",
            setting="[http] port",
        )
    return StartupError(
        f"cannot listen on {host}:{port}: {exc.strerror or exc}", setting="[http] host"
    )


def check_writable(state_dir: Path) -> None:
    """The state directory (the embedded PostgreSQL's data and lock) exists and is writable."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=state_dir):
            pass
    except OSError as exc:
        raise StartupError(
            f"the state directory {state_dir} is not writable: {exc.strerror or exc}",
            setting="[node] state_dir (or give this user write access to it)",
        ) from None
