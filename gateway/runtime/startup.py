"""How a node comes up, before its components are built: the broker (the configured one, or the
embedded one started), the database (likewise), the pool connected and migrated while the
database may still be unreachable, and the broker connection's settings. Each step is said
(``step``: the daemon's ``starting``, /health's 503 reason and the service manager's status)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any, Final, TypeVar

import asyncpg
import structlog

from gateway.config import Config, broker_endpoints
from gateway.domain.errors import StartupError
from gateway.mqtt.session import OFFLINE
from gateway.mqtt.v311_client import ConnectionSettings, TlsSettings
from gateway.runtime.failures import (
    DSN_SETTING,
    REFUSED_AT_CONNECT,
    check_writable,
    refused,
    release_refused,
    session_not_kept,
)
from gateway.support.backoff import Backoff
from gateway.support.loops import sleep_unless_stopped
from gateway.support.metrics import Metrics
from storage.errors import (
    TRANSIENT_DB_ERRORS,
    MigrationChecksumError,
    SchemaTooNewError,
    StorageError,
)
from storage.migrate import migrate
from storage.pool import (
    alive,
    connect,
    create_pool,
    describe,
    keeps_session,
    server_of,
    user_of,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

# While migrating, the service manager is asked every MIGRATION_EXTEND_EVERY_S for
# MIGRATION_EXTEND_S more (a missed message or two does not time the start out).
MIGRATION_EXTEND_EVERY_S: Final = 20.0
MIGRATION_EXTEND_S: Final = 3 * MIGRATION_EXTEND_EVERY_S
# How long a stop waits for the migration to be cancelled before cutting its connection.
MIGRATION_CANCEL_S: Final = 5.0


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None once ``stop`` is set first (``work`` is cancelled)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


class PrimaryWatch:
    """The server the pool's connections reach; one ``database_failover`` line when it changes.

    With a multi-host DSN (``h1:p1,h2:p2/db?target_session_attrs=read-write``) every new
    connection reaches whichever member is the primary: the first connection opened after a
    failover names the new one, and the ones after it the same (so one line per failover).
    """

    def __init__(self) -> None:
        self.server: str | None = None
        self.failovers = 0

    def __call__(self, server: str) -> None:
        if server == self.server:
            return
        if self.server is not None:
            self.failovers += 1
            log.warning("database_failover", old=self.server, new=server)
        self.server = server


class Startup:
    """One node's start-up steps; what they find is kept (``database_dsn``,
    ``broker_address``) for the daemon's health and its LISTEN connections."""

    def __init__(
        self,
        config: Config,
        *,
        node_id: str,
        metrics: Metrics,
        step: Callable[[str], None],
        on_audit_failure: Callable[[str, asyncpg.PostgresError], None],
        extend_start: Callable[[float], object] | None = None,
    ) -> None:
        self.config = config
        # Asks the service manager for more time to start (EXTEND_TIMEOUT_USEC).
        self.extend_start = extend_start
        self._migrating_on: str | None = None  # the server the migration's connection reached
        self.node_id = node_id
        self.metrics = metrics
        self.step = step
        self.on_audit_failure = on_audit_failure
        self.database_dsn: str | None = None
        self.broker_address: tuple[str, int] | None = None
        self.tls: TlsSettings | None = None  # [mqtt.tls] with its context, read by broker()
        self.primary = PrimaryWatch()

    def connection_settings(
        self, host: str, port: int, protocol: str, presence_topic: str
    ) -> ConnectionSettings:
        mqtt = self.config.mqtt
        tls = self.tls or self._tls_settings()
        return ConnectionSettings(
            host=host,
            port=port,
            client_id=mqtt.client_id or f"gateway-{self.node_id}",
            protocol="5" if protocol == "5" else "3.1.1",
            persistent_session=True,
            session_expiry_s=mqtt.session_expiry_s,
            receive_maximum=mqtt.receive_maximum,
            keepalive_s=mqtt.keepalive_s,
            username=mqtt.username,
            password=mqtt.password,
            tls=tls,
            will_topic=presence_topic,
            will_payload=OFFLINE,
            buffer_high=self.config.ingest.read_buffer,
            buffer_high_bytes=self.config.ingest.read_buffer_bytes,
            max_packet_size=mqtt.max_packet_size,
        )

    async def database(self, stack: AsyncExitStack, stop: asyncio.Event) -> str | None:
        """The configured DSN, or the embedded PostgreSQL's once it runs (None: stopped first)."""
        if self.config.database.dsn:
            self.database_dsn = self.config.database.dsn
            return self.database_dsn
        from gateway.embedded.postgres import (
            EmbeddedPostgres,
            EmbeddedPostgresCancelled,
            EmbeddedPostgresError,
        )

        state_dir = self.config.state_dir
        check_writable(state_dir)
        embedded = EmbeddedPostgres(state_dir)
        self.step(f"starting the embedded PostgreSQL in {embedded.data_dir}")
        starting = asyncio.ensure_future(asyncio.to_thread(embedded.start))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not starting.done():
                # The thread cannot be interrupted: cancel() stops initdb, or lets pg_ctl finish
                # and stops its server; either way start() returns soon, leaving nothing behind.
                embedded.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(starting)
        if starting.cancelled():
            return None
        error = starting.exception()
        if isinstance(error, EmbeddedPostgresCancelled):
            return None
        if isinstance(error, EmbeddedPostgresError):
            first, _, rest = str(error).partition("\n")
            raise StartupError(
                first,
                setting="[node] state_dir, or [database] dsn for a PostgreSQL of your own",
                detail=rest,
            ) from None
        if error is not None:
            raise error
        stack.push_async_callback(asyncio.to_thread, embedded.stop)
        dsn = starting.result()
        if stop.is_set():
            return None
        log.info("embedded_postgres_started", data_dir=str(embedded.data_dir), dsn=dsn)
        self.database_dsn = dsn
        return dsn

    def _tls_settings(self) -> TlsSettings | None:
        tls = self.config.mqtt.tls
        if not tls.enabled:
            return None
        return TlsSettings(
            ca_file=tls.ca_file,
            cert_file=tls.cert_file,
            key_file=tls.key_file,
            insecure=tls.insecure,
        )

    async def broker(self, stack: AsyncExitStack) -> tuple[list[tuple[str, int]], str]:
        """The broker's endpoints (``[mqtt] hosts``, or ``host`` and ``port``; the embedded
        broker's one, started, when none is configured) and the protocol version to speak.

        The ``[mqtt.tls]`` files are read here, once, before the database: one that cannot be
        used is a :class:`StartupError` naming its key (exit 2)."""
        settings = self._tls_settings()
        self.tls = settings.load() if settings is not None else None
        mqtt = self.config.mqtt
        endpoints = broker_endpoints(mqtt)
        if endpoints:
            self.broker_address = endpoints[0]
            return endpoints, mqtt.protocol
        from gateway.embedded.broker import EmbeddedBroker, EmbeddedBrokerError

        broker = EmbeddedBroker("127.0.0.1", mqtt.port)
        try:
            await broker.start()
        except EmbeddedBrokerError as exc:
            raise StartupError(str(exc), setting="[mqtt] port, or [mqtt] host") from None
        stack.push_async_callback(broker.stop)
        if mqtt.shared_group:
            log.warning(
                "shared_group_ignored", reason="the embedded broker has no shared subscriptions"
            )
        topic = self.config.topics.telemetry("dev-1")
        log.info(
            "embedded_broker_started",
            host=broker.host,
            port=broker.port,
            protocol="3.1.1",
            try_it=(
                f"mosquitto_pub -h {broker.host} -p {broker.port} -q 1 -t {topic} "
                '-m \'{"ts": 1767225600000, "metrics": {"temp": 21.5}}\''
            ),
        )
        self.broker_address = (broker.host, broker.port)
        return [(broker.host, broker.port)], "3.1.1"

    async def open_database(self, dsn: str, stop: asyncio.Event) -> asyncpg.Pool | None:
        """Connect and migrate, waiting while the database is unreachable.

        A database that refuses the name, the role or the password will not change its mind:
        that is a configuration error (exit 2), not something to wait for.
        """
        db = self.config.database
        where = describe(dsn)
        backoff = Backoff(db.retry_min_s, db.retry_max_s)
        self.step(f"connecting to the database at {where}")
        while not stop.is_set():
            try:
                # A stop does not wait out a connect timeout (a host that drops packets).
                pool = await _unless_stopped(
                    create_pool(
                        dsn,
                        min_size=db.pool_min,
                        max_size=db.pool_max,
                        connect_timeout_s=db.connect_timeout_s,
                        application_name=f"gateway:{self.node_id}",
                        on_audit_failure=self.on_audit_failure,
                        on_server=self.primary,
                    ),
                    stop,
                )
                if pool is None:
                    return None
            except REFUSED_AT_CONNECT as exc:
                raise refused(dsn, exc) from None
            except (ValueError, asyncpg.exceptions.ClientConfigurationError) as exc:
                raise StartupError(
                    f"the database DSN does not parse: {exc}",
                    setting=DSN_SETTING,
                    configuration=True,
                ) from None
            except TRANSIENT_DB_ERRORS as exc:
                await self._database_unavailable(where, exc, backoff, stop)
                continue
            try:
                self.step(f"migrating the database at {where}")
                # A stop does not wait for the migration (another node's, whose lock this one
                # waits for, may take minutes): it is rolled back, and runs at the next start.
                applied = await _unless_stopped(self._migrate_on(pool, dsn), stop)
                if applied is None:
                    # Cut, not closed: a close waits for a silent server to answer it.
                    pool.terminate()
                    return None
            except (SchemaTooNewError, MigrationChecksumError) as exc:
                await pool.close()
                raise release_refused(exc) from None
            except StorageError as exc:
                await pool.close()
                raise StartupError(str(exc)) from exc
            except asyncpg.exceptions.InsufficientPrivilegeError as exc:
                await pool.close()
                raise StartupError(
                    f"the database at {where} refused the migration to role "
                    f"{user_of(dsn) or '(default)'}: {exc}; it must own the schema "
                    "(or be allowed to create in it)",
                    setting=DSN_SETTING,
                    configuration=True,
                ) from None
            except TRANSIENT_DB_ERRORS as exc:
                # Lost between connecting and migrating (a restart, a cut): start over.
                pool.terminate()
                await self._database_unavailable(where, exc, backoff, stop)
                continue
            except BaseException:
                await pool.close()
                raise
            if applied:
                log.info("database_migrated", applied=applied)
            return pool
        return None

    async def _migrate_on(self, pool: asyncpg.Pool, dsn: str) -> list[int]:
        """Migrate, asking the service manager for more time meanwhile: a migration (or the
        wait for another node's) may outlast the unit's TimeoutStartSec (120 s), and a start
        killed there rolled it back, to be killed again at the next start, for ever.

        The migration's calls have no practical time bound (storage.migrate), so the server
        is probed meanwhile on a connection of its own: a server gone silent (a host lost
        without a reset) or no longer the one a new connection reaches (a failover) ends the
        attempt as a lost connection would, and the start tries again.

        First, whether a connection keeps its session: behind a pooler in transaction mode
        every loop would fail, or hear nothing, for as long as the node ran; that is said
        now, once, as a configuration error (the migration's lock would guard nothing)."""
        if not await keeps_session(dsn, timeout=self.config.database.connect_timeout_s):
            raise session_not_kept(describe(dsn))
        self._migrating_on = None
        migrating = asyncio.ensure_future(self._migrate_once(pool))
        try:
            while True:
                if self.extend_start is not None:
                    self.extend_start(MIGRATION_EXTEND_S)
                done, _ = await asyncio.wait({migrating}, timeout=MIGRATION_EXTEND_EVERY_S)
                if done:
                    return migrating.result()
                try:
                    await self._probe(dsn)
                except TRANSIENT_DB_ERRORS:
                    # The migrating connection cannot be told to stop over a dead link.
                    pool.terminate()
                    raise
        finally:
            if not migrating.done():
                # A stop: the migration is cancelled (rolled back, the lock let go); over a
                # dead link neither the cancel request nor the unlock gets through, so the
                # connection is cut if that takes long.
                migrating.cancel()
                done, _ = await asyncio.wait({migrating}, timeout=MIGRATION_CANCEL_S)
                if not done:
                    pool.terminate()
            await asyncio.gather(migrating, return_exceptions=True)

    async def _migrate_once(self, pool: asyncpg.Pool) -> list[int]:
        async with pool.acquire() as conn:
            self._migrating_on = server_of(conn)
            return await migrate(conn)

    async def _probe(self, dsn: str) -> None:
        db = self.config.database
        probe = await connect(dsn, timeout=db.connect_timeout_s)
        try:
            await alive(probe, timeout=db.connect_timeout_s)
            reached = server_of(probe)
        finally:
            probe.terminate()
        if self._migrating_on is not None and reached != self._migrating_on:
            raise ConnectionError(
                f"the migration runs on {self._migrating_on}, a new connection reaches {reached}"
            )

    async def prepare(
        self, work: Callable[[], Coroutine[Any, Any, object]], stop: asyncio.Event
    ) -> bool:
        """Run ``work`` (a component's first database calls, after the migration) until it
        succeeds, waiting while the database is unreachable as the steps before it do: a
        restart or a failover between the migration and the first batch is no reason to
        exit. False once ``stop`` was set first. ``work`` must be safe to run again."""
        db = self.config.database
        where = describe(self.database_dsn or "")
        backoff = Backoff(db.retry_min_s, db.retry_max_s)
        while not stop.is_set():
            try:
                await _unless_stopped(work(), stop)
            except TRANSIENT_DB_ERRORS as exc:
                await self._database_unavailable(where, exc, backoff, stop)
                continue
            return not stop.is_set()
        return False

    async def _database_unavailable(
        self, where: str, exc: BaseException, backoff: Backoff, stop: asyncio.Event
    ) -> None:
        delay = backoff.next_delay()
        self.metrics.db_retries.inc()
        error = str(exc) or type(exc).__name__
        self.step(f"waiting for the database at {where}: {error}")
        log.warning(
            "database_unavailable",
            database=where,
            error=error,
            error_type=type(exc).__name__,
            retry_in_s=round(delay, 3),
            setting=DSN_SETTING,
        )
        await sleep_unless_stopped(stop, delay)
