"""Connection pool setup."""

from __future__ import annotations

import asyncio
import inspect
import secrets
from collections.abc import Callable
from typing import Any, ClassVar, Final
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit, urlunsplit

import asyncpg
import asyncpg.connect_utils

from storage.audit import AuditedConnection, AuditFailureHook
from storage.errors import TRANSIENT_DB_ERRORS
from storage.sql import load_queries

_Q = load_queries("pool.sql")
IDLE_IN_TRANSACTION = _Q["idle_in_transaction"]
LOCK_WAIT = _Q["lock_wait"]
# How long a pooled session may sit inside a transaction without a statement before PostgreSQL
# ends it (rolling its transaction back). The gateway's transactions run their statements back
# to back (no transaction waits on the broker, a receiver or a model); one idle this long
# belongs to a node that stopped in the middle of it. Left to PostgreSQL's TCP keepalive (or
# forever, for a stopped process whose kernel still answers), its row locks stopped every
# person's change of those rows, and every node's live stream stood still: a stream sends an
# event only once every older transaction has ended (docs/api.md).
IDLE_IN_TRANSACTION_S: Final = 30.0
# How long a person's change (over the API) waits for a row another transaction holds: a node
# stopped in the middle of a change holds it until PostgreSQL ends that session (above), and
# each request waiting holds a pooled connection, which the node's ingest shares: a few clicks
# on that row took every connection, and the whole API and the ingest stood still.
CHANGE_LOCK_WAIT_S: Final = 5.0
SESSION_PROBE: Final = _Q["session_probe"]
ALIVE: Final = _Q["alive"]


class PoolConnection(AuditedConnection):
    """A pool's connection: refused audit rows reported (:class:`AuditedConnection`), cut
    when its server refuses a write as read-only, and a call's cancel request bounded by
    :attr:`cancel_timeout_s`.

    A call that outlives the command timeout is cancelled by asyncpg through a cancel request,
    sent on a new connection to the same server, and the connection is let go only once that
    is answered, which asyncpg bounds by the command timeout again. A server gone silent
    (power, a partition: nothing reset) answers neither, so every call in flight there held
    its connection, and its caller, for twice the command timeout (120 s: an ingest batch,
    each loop's pass). A cancel request not answered within ``cancel_timeout_s`` (the connect
    timeout: it is a connect and 16 bytes) cuts the connection instead.
    """

    cancel_timeout_s: ClassVar[float] = 10.0

    def _refused(self, query: str, exc: asyncpg.PostgresError) -> None:
        super()._refused(query, exc)
        if isinstance(exc, asyncpg.exceptions.ReadOnlySQLTransactionError) and not self.is_closed():
            # A server that takes no writes: a standby, reached through a router that follows
            # the primary (HAProxy, a virtual address) in the moment after a switchover, before
            # its check noticed. The caller retries, and the pool kept handing it this same
            # connection; a router that does not cut what it routed there left the node on the
            # standby for good. Cut: the retry's connection goes where the router sends it now.
            self.terminate()

    async def _cancel(self, waiter: Any, cancel_waiter: Any = None) -> None:
        # asyncpg's own (private): it runs as a task of the connection's cancellations, and
        # swallows its cancellation, so the bound's expiry is asked of the bound itself.
        async with asyncio.timeout(self.cancel_timeout_s) as bound:
            await super()._cancel(waiter, cancel_waiter)
        if bound.expired() and not self.is_closed():
            self.terminate()


def pool_connection_class(
    *hooks: AuditFailureHook, cancel_timeout_s: float
) -> type[PoolConnection]:
    """The connection class of one pool: its refused audit rows go to ``hooks``."""
    bound = cancel_timeout_s

    class OnePoolsConnection(PoolConnection):
        audit_hooks = hooks
        cancel_timeout_s = bound

    return OnePoolsConnection


async def create_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    connect_timeout_s: float = 10.0,
    command_timeout_s: float | None = 60.0,
    application_name: str = "gateway",
    on_audit_failure: AuditFailureHook | None = None,
    on_server: Callable[[str], None] | None = None,
    idle_in_transaction_s: float = IDLE_IN_TRANSACTION_S,
) -> asyncpg.Pool:
    """A pool whose connections are named after the node (visible in pg_stat_activity).

    Its connections notice audit rows PostgreSQL refuses (:mod:`storage.audit`) and report
    them to ``on_audit_failure``. ``on_server`` is told the server (``host:port``) each new
    connection reached: with a multi-host DSN, which member of the pair is the primary now.
    PostgreSQL ends a connection left idle in a transaction for ``idle_in_transaction_s``
    (see ``IDLE_IN_TRANSACTION_S``; set when it connects, not as a startup parameter, which
    PgBouncer would refuse).
    """
    idle_timeout = f"{round(idle_in_transaction_s * 1000)}ms"
    hooks = () if on_audit_failure is None else (on_audit_failure,)

    async def init(conn: asyncpg.Connection) -> None:
        await conn.fetchval(IDLE_IN_TRANSACTION, idle_timeout)
        if on_server is not None:
            on_server(server_of(conn))

    pool = await asyncpg.create_pool(
        dsn,
        connect=connect,
        min_size=min_size,
        max_size=max_size,
        timeout=connect_timeout_s,
        command_timeout=command_timeout_s,
        server_settings={"application_name": application_name},
        reset=_keep_session,
        connection_class=pool_connection_class(*hooks, cancel_timeout_s=connect_timeout_s),
        init=init,
    )
    assert pool is not None
    return pool


def dsn_problem(dsn: str) -> str | None:
    """Why ``dsn`` would be refused before any connection is tried (None: it parses), said
    without its password: not a ``postgresql://`` URL, a port that is no number, an
    ``sslmode`` or ``target_session_attrs`` the driver does not know, a URL Python cannot
    split (``[::1`` without its ``]``). asyncpg's own parser decides, as at a connect, so
    ``gateway check-config`` and a reload refuse what ``gateway run`` would."""
    if not dsn:
        return None  # the embedded server's
    try:
        parts = urlsplit(dsn)  # what describe() and the log's redaction read
        if "@" in parts.netloc.rpartition("@")[0]:
            # Python's parser ends the userinfo at the last `@`, the driver's (as libpq's) at
            # the first: the rest of the password was its host and port, and its error
            # ("invalid literal for int() ...: 'w0rd@db:5432'") quoted it; none quoted here.
            return (
                "an '@' in its user name or password must be written %40 (the driver takes "
                "the first '@' for the end of the password)"
            )
        if _cut_userinfo(parts):
            # `gw:2024/Secret@db/gw`: the host ended at the `/` (port 2024 of a host named
            # `gw`), and the rest of the password was the database's name, which every log
            # line and /health showed; none quoted here.
            return (
                "a '/', '?' or '#' in its user name or password must be written %2F, %3F or "
                "%23 (the host part of the URL ends at the first of them)"
            )
        parse = asyncpg.connect_utils._parse_connect_dsn_and_args
        arguments: dict[str, Any] = dict.fromkeys(inspect.signature(parse).parameters)
        parse(**{**arguments, "dsn": dsn})
    except (ValueError, asyncpg.exceptions.ClientConfigurationError) as exc:
        message = str(exc) or type(exc).__name__
        password = dsn_password(dsn)
        return message.replace(password, "[redacted]") if password else message
    return None


def _cut_userinfo(parts: SplitResult) -> bool:
    """Whether an ``@`` comes after the URL's host part: in the path (the database's name,
    which may hold one only written %40), in the fragment, or in a query item with no ``=``.
    Then a ``/``, ``?`` or ``#`` of the password ended the host part early."""
    items = parts.query.split("&") if parts.query else []
    return (
        "@" in parts.path
        or "@" in parts.fragment
        or any("@" in item and "=" not in item for item in items)
    )


def dsn_password(dsn: str) -> str:
    """The password of a URL DSN as written (``""``: none), read even from one
    ``urlsplit`` refuses: a secret to keep out of every line either way."""
    try:
        return urlsplit(dsn).password or ""
    except ValueError:
        _, sep, rest = dsn.partition("://")
        return rest.rpartition("@")[0].partition(":")[2] if sep else ""


async def bound_lock_wait(conn: asyncpg.Connection, seconds: float = CHANGE_LOCK_WAIT_S) -> None:
    """The rest of the caller's transaction waits at most ``seconds`` for any lock, then fails
    with ``asyncpg.exceptions.LockNotAvailableError`` (and rolls back): a person's change."""
    await conn.fetchval(LOCK_WAIT, f"{round(seconds * 1000)}ms")


def one_dsn_per_host(dsn: str) -> list[str]:
    """A multi-host URL DSN (``postgresql://u@h1:p1,h2:p2/db?...``) as one DSN per host, in
    its order, each with the rest of the DSN; any other DSN as itself."""
    parts = urlsplit(dsn)
    if parts.scheme not in {"postgres", "postgresql"}:
        return [dsn]
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return [dsn]
    return [urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}")) for host in hosts.split(",")]


async def connect(dsn: str, *, timeout: float, **kwargs: Any) -> asyncpg.Connection:  # noqa: ASYNC109 - the name asyncpg's pool passes it under
    """``asyncpg.connect``, the ``timeout`` given to each host of a multi-host DSN in turn
    (libpq's ``connect_timeout`` does so). asyncpg's own bounds all the hosts together: a
    first host that answers nothing (a primary's host gone without a reset: power, a
    partition) took the whole timeout, and the promoted second one was never tried. A host
    that fails (unreachable, silent, a standby for ``target_session_attrs=read-write``)
    passes to the next; the last one's error is raised."""
    hosts = one_dsn_per_host(dsn)
    if len(hosts) == 1:
        return await asyncpg.connect(dsn, timeout=timeout, **kwargs)
    last: BaseException | None = None
    for one in hosts:
        try:
            return await asyncpg.connect(one, timeout=timeout, **kwargs)
        except TRANSIENT_DB_ERRORS as exc:
            last = exc
    assert last is not None
    raise last


async def alive(conn: asyncpg.Connection, *, timeout: float) -> None:  # noqa: ASYNC109 - asyncpg's own bound on the call
    """Ask the server one trivial question on ``conn``; raises ``TimeoutError`` when it does not
    answer within ``timeout`` (a host gone silent), or the connection's error."""
    await conn.fetchval(ALIVE, timeout=timeout)


async def keeps_session(dsn: str, *, timeout: float) -> bool:  # noqa: ASYNC109 - a bound on the probe's connects and its wait, as connect's
    """Whether a connection to ``dsn`` keeps its server session from one statement to the next,
    as the gateway needs (its LISTEN connections, asyncpg's prepared statements, the
    migration's session-level advisory lock): a NOTIFY from a second connection reaches one
    that LISTENs. Behind a pooler in transaction or statement mode (PgBouncer's
    ``pool_mode = transaction``) the LISTEN stays on a server connection handed back to the
    pool after that one statement: nothing reaches the listener (False), and a statement
    prepared on one server connection may be missing on the next (False too).

    The two connections must reach the same server (a multi-host DSN during a failover may
    not): otherwise :class:`ConnectionError`, transient, for the caller to try again. A lost
    or silent server raises as :func:`connect` does."""
    channel = f"gateway_session_probe_{secrets.token_hex(8)}"
    heard: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_notify(*_: object) -> None:
        if not heard.done():
            heard.set_result(None)

    listener = await connect(dsn, timeout=timeout)
    try:
        await listener.add_listener(channel, on_notify)
        sender = await connect(dsn, timeout=timeout)
        try:
            if server_of(sender) != server_of(listener):
                raise ConnectionError(
                    f"two connections reached two servers ({server_of(listener)}, "
                    f"{server_of(sender)}): a failover under way"
                )
            try:
                await sender.execute(SESSION_PROBE, channel, timeout=timeout)
            except asyncpg.exceptions.InvalidSQLStatementNameError:
                return False  # prepared on one server connection, bound on another
        finally:
            sender.terminate()
        try:
            await asyncio.wait_for(heard, timeout)
        except TimeoutError:
            return False
        return True
    finally:
        listener.terminate()


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Return a connection to the pool without asyncpg's reset query.

    asyncpg still rolls back a transaction left open; its default reset adds a round trip
    (UNLISTEN, RESET ALL, CLOSE ALL, advisory unlock) to every release, for session state
    this code never leaves behind: LISTEN runs on dedicated connections, nothing SETs
    session settings, and the migration lock is released in a ``finally``.
    """


def server_of(conn: asyncpg.Connection) -> str:
    """The server a connection reached: ``host:port``, or the socket's path."""
    # asyncpg keeps the address it connected to (one of a multi-host DSN's) on the connection.
    addr = getattr(conn, "_addr", None)
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    return str(addr) if addr is not None else "?"


def describe(dsn: str) -> str:
    """Where a DSN points, for log lines and errors: ``host:port/database``, never credentials.

    A unix socket (``?host=/dir``) reads ``/dir/database``; parts the DSN leaves out are
    libpq's defaults (port 5432, the database named after the user). A multi-host DSN
    (``h1:p1,h2:p2``, a failover pair) reads ``h1:p1,h2:p2/database``.
    """
    parts = urlsplit(dsn)
    if parts.scheme not in {"postgresql", "postgres"}:
        # Not a URL (a libpq key=value DSN, which asyncpg does not take): read as one, its
        # whole text, the password with it, was the "database" every line and status showed.
        return "(a DSN that is not a postgresql:// URL)"
    query = parse_qs(parts.query)
    socket_dir = next((h for h in query.get("host", []) if h.startswith("/")), None)
    database = parts.path.lstrip("/") or query.get("dbname", [""])[0] or parts.username or ""
    if socket_dir is not None:
        return f"{socket_dir}/{unquote(database)}"
    hosts = parts.netloc.rpartition("@")[2]
    if "," in hosts:
        members = [
            h if ":" in h.lstrip("[").rpartition("]")[2] else f"{h}:5432" for h in hosts.split(",")
        ]
        return f"{','.join(members)}/{unquote(database)}"
    host = parts.hostname or query.get("host", ["localhost"])[0]
    try:
        port = parts.port or int(query.get("port", ["5432"])[0])
    except ValueError:
        port = 5432
    return f"{host}:{port}/{unquote(database)}"


def user_of(dsn: str) -> str:
    """The role a DSN logs in as (libpq's default, the OS user, left to the caller)."""
    parts = urlsplit(dsn)
    return unquote(parts.username or parse_qs(parts.query).get("user", [""])[0])
