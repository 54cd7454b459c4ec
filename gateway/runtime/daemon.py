"""The daemon: wires storage, the broker session, the pipeline and the HTTP server."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import asyncpg
import msgspec
import structlog
from msgspec import UNSET

from gateway.api.app import build_app
from gateway.api.auth import BearerAuth
from gateway.api.health import BrokerHealth, DatabaseHealth, Health, IngestHealth, OutboxHealth
from gateway.api.server import ApiServer
from gateway.api.services import Services
from gateway.api.stream import StreamHub
from gateway.config import Config, broker_endpoints, endpoint_label
from gateway.domain.errors import StartupError
from gateway.ingest import live_path
from gateway.ingest.live_path import LivePath
from gateway.ingest.replay_process import DEFAULT_PROGRAM, ProcessReplay
from gateway.ingest.writer import IngestWriter
from gateway.mqtt.publisher import SessionPublisher
from gateway.mqtt.session import OFFLINE, MqttSession
from gateway.notify.service import NotifyService
from gateway.outbox.metrics import OutboxMetrics
from gateway.outbox.publisher import OutboxPublisher
from gateway.runtime.components import Components, build, subscriptions
from gateway.runtime.failures import (
    http_error,
)
from gateway.runtime.logging import set_secrets
from gateway.runtime.schema_watch import EXIT_SCHEMA_UPGRADED, SchemaWatch
from gateway.runtime.sdnotify import Notifier
from gateway.runtime.startup import Startup
from gateway.runtime.supervision import Watchdog
from gateway.support.broker_link import BrokerLink
from gateway.support.metrics import Metrics
from gateway.support.node import Node
from gateway.support.version import gateway_version
from storage import ingest as repo
from storage import outbox
from storage.errors import DB_ERRORS

log = structlog.get_logger(__name__)

HEALTH_DB_TIMEOUT_S = 2.0
# Once the session has drained, what is left of a stop (the writer's cancellation, the
# clean-stop journal, the loops' passes under way) has this long before the pool's connections
# are cut. A database whose host went silent (power, network) answers nothing: a call on it
# would wait out the command timeout (60 s), and the pool's release then asyncpg's cancel
# request, past the service manager's stop timeout (TimeoutStopSec=45).
STOP_GRACE_S = 10.0


class Daemon:
    """One node. ``await Daemon(config).run(stop)`` returns after a clean drain."""

    def __init__(
        self,
        config: Config,
        *,
        metrics: Metrics | None = None,
        notifier: Notifier | None = None,
        config_path: Path | None = None,
        program: Sequence[str] = DEFAULT_PROGRAM,
    ) -> None:
        """``config_path``: the file ``config`` was read from (None: every default), and
        ``program`` how to start this gateway again: a QUARANTINED dead letter is replayed
        over HTTP by ``program dead-letters replay --id N --config config_path``, in a
        process of its own."""
        self.config = config
        self.config_path = config_path
        self.program = tuple(program)
        self.notifier = notifier or Notifier()
        self.node_id = config.node_id
        self.metrics = metrics or Metrics()
        self.ready = asyncio.Event()
        self.http_port: int | None = None
        # Called with the port once the HTTP server listens (the zero-setup token's curl line).
        self.on_http_listening: Callable[[int], None] | None = None
        self.pool: asyncpg.Pool | None = None
        self.components: Components | None = None
        self.auth = BearerAuth(config.api.tokens)
        self.services = Services()
        # Downlinks and outbox events go out on the session (gateway.mqtt.publisher); the
        # dispatcher and the outbox claim only while it is up, and a reconnect wakes them.
        self.publisher = SessionPublisher(lambda: self.session)
        self.broker = BrokerLink(self.publisher.up)
        self._starting: str | None = "starting"
        # The schema's version once a newer release migrated it while this node ran (it stops;
        # `gateway run` exits EXIT_SCHEMA_UPGRADED): see runtime/schema_watch.
        self.schema_upgraded: int | None = None
        self.schema_watch: SchemaWatch | None = None
        # The broker and the database found (or started), the pool migrated (runtime/startup).
        self.startup = Startup(
            config,
            node_id=self.node_id,
            metrics=self.metrics,
            step=self._step,
            on_audit_failure=self._audit_failed,
            extend_start=self.notifier.extend_timeout,
        )

    def _step(self, step: str) -> None:
        self.starting = step

    @property
    def database_dsn(self) -> str | None:
        """The DSN the node uses: the configured one, or the embedded server's once started."""
        return self.startup.database_dsn

    @property
    def broker_address(self) -> tuple[str, int] | None:
        """The broker endpoint in use (connected to, or tried next); the first configured
        before the session exists."""
        session = self.session
        return session.endpoint if session is not None else self.startup.broker_address

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``; a stop at any moment of the start (even during the embedded
        initdb) returns cleanly, with nothing left running.

        Raises :class:`StartupError` for a start that cannot succeed as configured.
        """
        set_secrets(self.config.secrets())
        try:
            async with AsyncExitStack() as stack:
                # HTTP first: /health answers (503, with the reason) while the rest starts.
                if self.config.http.enabled:
                    await self._http(stack)
                # The embedded broker before the embedded database: a taken port is found at
                # once, not after a first start's initdb.
                endpoints, protocol = await self.startup.broker(stack)
                dsn = await self.startup.database(stack, stop)
                if dsn is None:
                    return  # stopped while the embedded PostgreSQL was starting
                pool = await self.startup.open_database(dsn, stop)
                if pool is None:
                    return  # stopped while waiting for the database
                stack.push_async_callback(_close_pool, pool)
                self.pool = pool
                # Read at every scrape, not only when /health is asked.
                self.metrics.db_pool_size.set_function(pool.get_size)
                self.metrics.db_pool_idle.set_function(pool.get_idle_size)
                await self._serve(
                    stack=stack, pool=pool, endpoints=endpoints, protocol=protocol, stop=stop
                )
        except* StartupError as group:
            # From a task of the TaskGroup (the broker refusing the credentials): the first.
            raise group.exceptions[0] from None

    async def _http(self, stack: AsyncExitStack) -> None:
        http = self.config.http
        app = build_app(
            health_check=self.health, metrics=self.metrics, auth=self.auth, services=self.services
        )
        try:
            server = await stack.enter_async_context(ApiServer(app, http.host, http.port))
        except OSError as exc:
            raise http_error(http.host, http.port, exc) from None
        self.http_port = server.port
        log.info("http_listening", host=http.host, port=server.port)
        if self.on_http_listening is not None:
            self.on_http_listening(server.port)

    async def _serve(
        self,
        *,
        stack: AsyncExitStack,
        pool: asyncpg.Pool,
        endpoints: list[tuple[str, int]],
        protocol: str,
        stop: asyncio.Event,
    ) -> None:
        cfg = self.config
        node = Node(
            node_id=self.node_id,
            pool=pool,
            dsn=self.database_dsn or "",
            topics=cfg.topics,
            metrics=self.metrics,
            publish=self.publisher.publish,
            broker=self.broker,
        )
        self.starting = "loading the rules"
        built = await build(
            cfg,
            node,
            auth=self.auth,
            connection=self.startup.connection_settings(
                *endpoints[0], protocol, cfg.topics.gateway_status(self.node_id)
            ),
            endpoints=endpoints,
            protocol=protocol,
            stack=stack,
            stop=stop,
            on_connected=self._on_connected,
            prepare=lambda work: self.startup.prepare(work, stop),
        )
        if built is None:
            return  # stopped while waiting for the database
        parts = self.components = built
        hub: StreamHub | None = None
        if cfg.http.enabled:
            hub = StreamHub(
                pool,
                node.dsn,
                max_streams=cfg.http.max_streams,
                max_streams_per_token=cfg.http.max_streams_per_token,
                metrics=self.metrics,
                node_id=self.node_id,
                quiet=cfg.quiet_hours(),
            )
        self.services.pool = pool
        # Dead letters replayed over HTTP take the writer's own rules engine.
        self.services.replay_path = LivePath(
            decoder=live_path.message_decoder(cfg),
            node_id=self.node_id,
            engine=parts.engine,
            receipts=live_path.receipt_applier(cfg, self.metrics),
            sparkplug=live_path.sparkplug_host(cfg, replay=True),
        )
        self.services.replay_process = ProcessReplay(
            self.program, self.config_path, self.database_dsn
        )
        self.services.stream_hub = hub
        self.services.notifications = NotifyService(pool)
        self.services.alarms = parts.alarm_service
        self.services.commands = parts.command_service
        if self.config is not cfg:
            # A reload came while the parts were built from the file as it was (the rules
            # loading, say): they take it now, whole. (Dropped, it left the node on its old
            # rules until the next SIGHUP, its log saying `config_reloaded`.)
            self.reload(self.config)
        self.starting = f"connecting to the broker at {_addresses(endpoints)}"
        watch = self.schema_watch = SchemaWatch(
            pool, node.dsn, on_newer=lambda version: self._schema_upgraded(version, stop)
        )
        deadline: asyncio.Task[None] | None = None
        try:
            async with asyncio.TaskGroup() as tasks:
                writer_task = tasks.create_task(parts.writer.run(), name="ingest-writer")
                tasks.create_task(watch.run(stop), name="schema-watch")
                for name, loop in parts.loops:
                    tasks.create_task(loop(stop), name=name)
                if hub is not None:
                    tasks.create_task(hub.run(stop), name="stream-hub")
                if self.notifier.enabled:
                    interval = self.notifier.watchdog_interval_s()
                    watchdog = Watchdog(
                        notifier=self.notifier,
                        writer=parts.writer,
                        status=self.status_line,
                        interval_s=interval or 10.0,
                        # WATCHDOG_USEC itself: a call hanging that long has missed a ping.
                        stall_s=2 * interval if interval else float("inf"),
                    )
                    tasks.create_task(watchdog.run(stop), name="watchdog")
                await tasks.create_task(parts.session.run(stop), name="mqtt-session")
                # The session returns after draining (or giving up on) the queue: the rest
                # of the stop is bounded from here.
                deadline = asyncio.create_task(_cut_when_late(pool), name="stop-deadline")
                writer_task.cancel()
                await self._journal_clean_stop(parts.writer)
        finally:
            if deadline is not None:
                deadline.cancel()
        log.info("daemon_stopped", offline_published=OFFLINE.decode())

    def _schema_upgraded(self, version: int, stop: asyncio.Event) -> None:
        """A newer release migrated the schema under this node: it stops as at SIGTERM (the
        batches under way committed and acknowledged, the rest left to the broker for the
        nodes that know the schema; the offline status published)."""
        if self.schema_upgraded is not None:
            return
        self.schema_upgraded = version
        known = self.schema_watch.known if self.schema_watch is not None else 0
        log.critical(
            "schema_upgraded_by_newer_release",
            database_version=version,
            known_version=known,
            release=gateway_version(),
            action="install the new release on this node and restart it; stopping now "
            "(as at SIGTERM) rather than run against a schema this release does not understand",
            exit_status=EXIT_SCHEMA_UPGRADED,
        )
        self.notifier.stopping()
        self.notifier.status(
            f"node {self.node_id}: stopping, the schema was migrated to {version} by a newer "
            f"release (this one knows {known}): install it and restart"
        )
        stop.set()

    async def _journal_clean_stop(self, writer: IngestWriter) -> None:
        """Tell the crash-loop breaker this stop was no death: whatever was in flight did not
        kill the process. (With the database away this cannot be written, and the next start
        counts one death for the batch then in flight: see breaker.py.)"""
        try:
            async with asyncio.timeout(5):
                await writer.stopped_cleanly()
        except DB_ERRORS as exc:
            log.warning("clean_stop_not_recorded", error=repr(exc))

    @property
    def starting(self) -> str | None:
        """What the start is doing or waiting for (the 503's reason on /health, and the
        service manager's status line); None once ready."""
        return self._starting

    @starting.setter
    def starting(self, step: str | None) -> None:
        self._starting = step
        if step is not None:
            self.notifier.status(f"node {self.node_id}: {step}")

    # What the tests and the health check look at, once the daemon is built.
    @property
    def session(self) -> MqttSession | None:
        return None if self.components is None else self.components.session

    @property
    def writer(self) -> IngestWriter | None:
        return None if self.components is None else self.components.writer

    @property
    def outbox(self) -> OutboxPublisher | None:
        return None if self.components is None else self.components.outbox

    def reload(self, config: Config) -> None:
        """Swap what may change at run time (rules; quiet hours, escalation and tokens with
        their sections; the stream limits) atomically between batches; messages keep flowing
        meanwhile. The streams of a token the new configuration lacks are cut.

        During the start too: the tokens (the HTTP server answers from the first second) and
        the secrets now, the rest by the parts the start builds (from this configuration, or
        brought to it once built: see ``_serve``). A reload while the node waited for its
        database used to keep the old tokens for good: a token the operator removed was
        still let in, the new one refused."""
        set_secrets(config.secrets())
        self.auth.replace(config.api.tokens)
        if self.components is not None:
            self.components.reload(config)
            self._follow_topics(self.components, config)
        hub = self.services.stream_hub
        if hub is not None:
            hub.max_streams = config.http.max_streams
            hub.max_streams_per_token = config.http.max_streams_per_token
            hub.quiet = config.quiet_hours()
            # The tokens are swapped: what a removed (or rotated) one opened ends now.
            hub.revoke(self.auth.holds)
        self.config = config
        ignored = start_only_changes(self.startup.config, config)
        if ignored:
            # By key, never by value (a password is one of them).
            log.warning(
                "config_change_needs_restart",
                keys=ignored,
                note="read at start: the node keeps the values it started with",
            )
        log.info("config_reloaded", rules=len(config.rules), mappings=len(config.ingest.mappings))

    def _follow_topics(self, parts: Components, config: Config) -> None:
        """A changed ``[mqtt] topic_prefix`` or ``shared_group``: the session makes its
        connection again with the new filters (the old ones are unsubscribed there), and
        between the two connections every part that names a topic takes the new ones. A
        changed endpoint list (``[mqtt] hosts``, ``host``, ``port``) is followed by the
        session (:meth:`MqttSession.reconfigure`); to or from the embedded broker, not."""
        session = parts.session
        presence = config.topics.gateway_status(self.node_id)
        topics = config.topics
        mappings = config.mappings()

        def apply_mappings() -> None:
            # [[ingest.mappings]]: what reads vendor topics, and what renders their commands.
            parts.writer.decoder.mappings = mappings
            parts.dispatcher.mappings = mappings
            parts.reaper.mappings = mappings
            if self.services.replay_path is not None:
                self.services.replay_path.decoder.mappings = mappings

        def apply() -> None:
            apply_mappings()
            parts.writer.decoder.topics = topics
            parts.dispatcher.topics = topics
            parts.outbox.topics = topics
            parts.command_service.topics = topics
            if self.services.replay_path is not None:
                self.services.replay_path.decoder.topics = topics

        endpoints = broker_endpoints(config.mqtt)
        # What the node started with decides: the embedded broker runs for its whole life.
        embedded = not broker_endpoints(self.startup.config.mqtt)
        if embedded or not endpoints:
            # The embedded broker is started (or not) at start only.
            if embedded != (not endpoints):
                log.warning(
                    "mqtt_endpoints_not_reloaded",
                    reason="a move between the embedded broker and a broker of your own"
                    " ([mqtt] host, hosts) takes a restart",
                    setting="[mqtt] host, [mqtt] hosts",
                )
            endpoints = list(session.endpoints)
        if config.sparkplug != parts.sparkplug:
            log.warning(
                "sparkplug_change_needs_restart",
                note="[sparkplug] is read at start: the node keeps the section it started with",
            )
        # The filters as the node started: its protocol is read at start, and subscriptions()
        # keeps the shared group only where the session speaks the file's protocol. Taken from
        # the new file, a changed `protocol` dropped the `$share` group from every filter:
        # each node of the group then received every message.
        started = self.startup.config.mqtt.protocol
        if config.mqtt.protocol != started:
            log.warning(
                "mqtt_protocol_change_needs_restart",
                note="[mqtt] protocol is read at start: the node keeps the one it started with",
                protocol=started,
            )
            config = msgspec.structs.replace(
                config, mqtt=msgspec.structs.replace(config.mqtt, protocol=started)
            )
        changed = session.reconfigure(
            subscriptions=subscriptions(config, session.settings.protocol, parts.sparkplug),
            settings=dataclasses.replace(session.settings, will_topic=presence),
            presence_topic=presence,
            apply=apply,
            endpoints=endpoints,
        )
        if not changed:
            # The same topics: the new mappings read the next batch on (a batch is classified
            # at once, so none is read half by the old ones).
            apply_mappings()

    def status_line(self) -> str:
        writer, session = self.writer, self.session
        stored = 0 if writer is None else writer.stored_total
        queued = 0 if writer is None else writer.queue.qsize()
        broker = "up" if session is not None and session.connected else "down"
        return f"node {self.node_id}: {stored} stored, {queued} queued, broker {broker}"

    def _on_connected(self) -> None:
        # Every time: what waited for the broker (downlinks, outbox events) goes out now.
        self.broker.connected()
        if not self.ready.is_set():
            # Migrated, subscribed, HTTP listening: the daemon can really ingest now.
            self.ready.set()
            self._starting = None
            self.notifier.ready(self.status_line())
            log.info("daemon_ready", http_port=self.http_port)

    async def health(self) -> tuple[bool, Health]:
        database = await self._database_health()
        session = self.session
        broker = session is not None and session.connected and session.problem is None
        subscribed = broker and session is not None and session.subscribed
        healthy = database.ok and subscribed and self.starting is None
        writer = self.writer
        body = Health(
            status="ok" if healthy else "unhealthy",
            reason=UNSET if healthy else self._unhealthy_because(database, broker=broker),
            node_id=self.node_id,
            version=gateway_version(),
            database=database,
            broker=BrokerHealth(
                ok=subscribed,
                subscribed=subscribed,
                address=self.broker_address,
                endpoint=(
                    endpoint_label(*session.endpoint)
                    if session is not None and session.connected
                    else None
                ),
                endpoints=[endpoint_label(*e) for e in self._endpoints()],
                connections=0 if self.session is None else self.session.connections,
            ),
            # Every audit row is written in the transaction of its change, so a refused one
            # rolled its change back: nothing went unaudited, but something did not happen.
            audit_failures=self.audit_failures(),
            ingest=IngestHealth(
                queued=0 if writer is None else writer.queue.qsize(),
                seconds_since_progress=(
                    None
                    if writer is None or not writer.last_progress
                    else round(asyncio.get_running_loop().time() - writer.last_progress, 3)
                ),
            ),
        )
        return healthy, body

    def _unhealthy_because(self, database: DatabaseHealth, *, broker: bool) -> str:
        if self.starting is not None:
            return self.starting
        if not database.ok:
            return f"database: {database.error}"
        session = self.session
        if session is not None and session.problem is not None:
            return session.problem
        address = endpoint_label(*self.broker_address) if self.broker_address else "?"
        if broker:
            return f"connected to the broker at {address}, subscriptions not acknowledged yet"
        return f"not connected to the broker at {_addresses(self._endpoints()) or '?'}"

    def _endpoints(self) -> list[tuple[str, int]]:
        """The broker endpoints configured (the embedded broker's, once started)."""
        session = self.session
        if session is not None:
            return list(session.endpoints)
        address = self.startup.broker_address
        return [address] if address is not None else []

    def _audit_failed(self, table: str, exc: asyncpg.PostgresError) -> None:
        self.metrics.audit_failures.inc()
        # The statement failed inside its change's transaction, which cannot commit now.
        log.error("audit_write_failed", table=table, sqlstate=exc.sqlstate, error=repr(exc))

    def audit_failures(self) -> int:
        """Audit rows refused since the daemon started (``gateway_audit_failures_total``)."""
        value = self.metrics.registry.get_sample_value("gateway_audit_failures_total")
        return 0 if value is None else int(value)

    async def _database_health(self) -> DatabaseHealth:
        pool = self.pool
        if pool is None:
            return DatabaseHealth(ok=False, error=self.starting or "not connected")
        try:
            async with asyncio.timeout(HEALTH_DB_TIMEOUT_S), pool.acquire() as conn:
                try:
                    await repo.ping(conn)
                    backlog, oldest_age_s = await outbox.backlog(conn)
                except asyncio.CancelledError:
                    # The bound ran out on a server that does not answer: the connection is
                    # cut, not released through a cancel request that a silent server never
                    # answers either (the release would wait for it, and the answer with it).
                    conn.terminate()
                    raise
        except DB_ERRORS as exc:
            return DatabaseHealth(ok=False, error=repr(exc))
        OutboxMetrics.of(self.metrics.registry).outbox_backlog.set(backlog)
        OutboxMetrics.of(self.metrics.registry).outbox_oldest_age.set(oldest_age_s)
        return DatabaseHealth(
            ok=True,
            server=self.startup.primary.server or UNSET,
            pool_size=pool.get_size(),
            pool_idle=pool.get_idle_size(),
            outbox=OutboxHealth(backlog=backlog, oldest_age_s=round(oldest_age_s, 3)),
        )


# What a reload applies (docs/configuration.md#reloading), as key paths and their prefixes.
# [sparkplug] and [mqtt] protocol, read at start too, have warnings of their own.
RELOADED: tuple[str, ...] = (
    "rules",
    "api",
    "notify",
    "retention",
    "ingest.mappings",
    "alarms.escalate_after_s",
    "alarms.repeat_interval_s",
    "alarms.unreached_after_s",
    "alarms.rule_check_after_s",
    "alarms.max_future_skew_s",
    "alarms.reorder_window_s",
    "alarms.quiet_hours",
    "alarms.figures",
    "http.public_url",
    "http.max_streams",
    "http.max_streams_per_token",
    "mqtt.topic_prefix",
    "mqtt.shared_group",
    "mqtt.hosts",
    "mqtt.host",
    "mqtt.port",
    "mqtt.protocol",
    "sparkplug",
)


def start_only_changes(running: Config, new: Config) -> list[str]:
    """The keys read at start only whose value ``new`` changes from ``running``'s, sorted.
    Without it a reload ignored them without a word: moved to another broker by a reload
    (``[mqtt] host``, followed), the node kept the old broker's credentials, and the log said
    ``config_reloaded`` only."""
    changed: list[str] = []

    def walk(old: object, fresh: object, path: str) -> None:
        if path and any(path == key or path.startswith(key + ".") for key in RELOADED):
            return
        if isinstance(old, dict) and isinstance(fresh, dict):
            for key in sorted(old.keys() | fresh.keys()):
                walk(old.get(key), fresh.get(key), f"{path}.{key}" if path else key)
        elif old != fresh:
            changed.append(path)

    walk(msgspec.to_builtins(running), msgspec.to_builtins(new), "")
    return changed


def _addresses(endpoints: list[tuple[str, int]]) -> str:
    """``host:port``, or ``any of a:1, b:2`` for an endpoint list."""
    labels = [endpoint_label(*e) for e in endpoints]
    return labels[0] if len(labels) == 1 else "any of " + ", ".join(labels)


async def _cut_when_late(pool: asyncpg.Pool) -> None:
    """After ``STOP_GRACE_S``, every pool connection cut: the calls still waiting on them
    fail at once (the loops, seeing the stop, end) instead of waiting for a silent server."""
    await asyncio.sleep(STOP_GRACE_S)
    log.warning(
        "database_calls_cut",
        after_s=STOP_GRACE_S,
        reason="stopping, and the database did not answer the calls under way",
    )
    pool.terminate()


async def _close_pool(pool: asyncpg.Pool) -> None:
    """Close the pool gracefully, or cut its connections once ``STOP_GRACE_S`` has passed
    (a graceful close waits for a silent server to acknowledge)."""
    try:
        async with asyncio.timeout(STOP_GRACE_S):
            await pool.close()
    except TimeoutError:
        pool.terminate()
