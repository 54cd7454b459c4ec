"""The daemon's components, built from the configuration: all of them, none optional.

``build`` takes the configuration sections whole and the node's shared resources (``Node``);
the daemon only starts what it returns, as named tasks of one TaskGroup, and reloads,
reports health and stops through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
import msgspec
import structlog

from gateway.ai.llm import OpenAiCompatibleLlm
from gateway.ai.metrics import AiMetrics
from gateway.ai.worker import SummaryWorker
from gateway.alarms.engine import AlarmEngine
from gateway.alarms.figures import AlarmFigures
from gateway.alarms.holds import HoldTimer
from gateway.alarms.inactivity import InactivityMonitor
from gateway.alarms.metrics import AlarmMetrics
from gateway.alarms.rule_watch import RuleWatch
from gateway.alarms.service import AlarmService
from gateway.alarms.timers import AlarmTimers
from gateway.api.auth import BearerAuth
from gateway.api.metrics import StreamMetrics
from gateway.commands.campaigns import CampaignService, CampaignSettler
from gateway.commands.dispatcher import Dispatcher
from gateway.commands.metrics import CommandMetrics
from gateway.commands.reaper import Reaper
from gateway.commands.service import CommandService
from gateway.config import Config, SparkplugConfig
from gateway.domain.quiet_hours import QuietHours
from gateway.domain.redaction import without_userinfo
from gateway.ingest import live_path
from gateway.ingest.metrics import IngestMetrics
from gateway.ingest.store import set_aside_unbounded_telemetry
from gateway.ingest.writer import IngestWriter
from gateway.maintenance.metrics import MaintenanceMetrics
from gateway.maintenance.runner import Maintenance
from gateway.mqtt.memory import SubscriptionMemory
from gateway.mqtt.metrics import MqttMetrics
from gateway.mqtt.session import BROKER_SETTING, ENDPOINTS_SETTING, MqttSession
from gateway.mqtt.v311_client import ConnectionSettings
from gateway.notify.consumer import NotifyConsumer
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.worker import DeliveryWorker
from gateway.outbox.metrics import OutboxMetrics
from gateway.outbox.publisher import OutboxPublisher
from gateway.sparkplug.metrics import SparkplugMetrics
from gateway.sparkplug.rebirth import RebirthRequester
from gateway.sparkplug.state import HostStateLink
from gateway.support.backoff import Backoff
from gateway.support.db_clock import DatabaseClock
from gateway.support.metrics import Metrics, MetricSet
from gateway.support.node import Node
from protocol import TopicKind
from protocol import sparkplug as sparkplug_wire

log = structlog.get_logger(__name__)

# Each feature's own metrics (a MetricSet beside it), on /metrics whether or not it runs.
FEATURE_METRICS: tuple[type[MetricSet], ...] = (
    IngestMetrics,
    AlarmMetrics,
    StreamMetrics,
    AiMetrics,
    MaintenanceMetrics,
    NotifyMetrics,
    CommandMetrics,
    MqttMetrics,
    OutboxMetrics,
    SparkplugMetrics,
)


def node_metrics(metrics: Metrics | None = None) -> Metrics:
    """``metrics`` (new ones by default) with every feature's set registered on its registry."""
    metrics = metrics or Metrics()
    for feature in FEATURE_METRICS:
        feature.of(metrics.registry)
    return metrics


# A loop the daemon runs until ``stop``: its task name, and how to run it.
Loop = tuple[str, Callable[[asyncio.Event], Coroutine[Any, Any, None]]]


@dataclass(frozen=True, slots=True)
class Components:
    engine: AlarmEngine
    writer: IngestWriter
    session: MqttSession
    dispatcher: Dispatcher
    reaper: Reaper
    outbox: OutboxPublisher
    timers: AlarmTimers
    auth: BearerAuth
    alarm_service: AlarmService
    command_service: CommandService
    notify_consumer: NotifyConsumer
    notify_worker: DeliveryWorker
    inactivity: InactivityMonitor
    rule_watch: RuleWatch
    figures: AlarmFigures
    maintenance: Maintenance
    # Besides the session and the writer: the outbox, timers, dispatcher, reaper, rule-state
    # janitor, retention maintenance, inactivity monitor and rule watch, and the AI workers
    # where configured. The loops a reload may switch on or off (inactivity, rule watch, the
    # timers' quiet-hours wake) run on every node, the first two idle while nothing is
    # configured for them: a reload needs to start or stop no task.
    loops: tuple[Loop, ...]
    # The [sparkplug] section the node started with: read at start only (docs/sparkplug.md).
    sparkplug: SparkplugConfig = field(default_factory=SparkplugConfig)
    # The rebirth requests' loop ([sparkplug] enabled), which expires seqs missing longer than
    # the reorder window.
    rebirth: RebirthRequester | None = None
    # [ingest] transactions_in_flight as the node started (read at start; 0: chosen by
    # [mqtt] shared_group, which a reload changes).
    transactions_in_flight: int = 0

    def reload(self, config: Config) -> None:
        """Swap what may change at run time, between batches; messages keep flowing."""
        self.engine.replace_rules(config.rule_set())
        self.engine.clock = config.device_clock()
        self.inactivity.rules_replaced()
        self.rule_watch.reconfigure(config.alarms.rule_check_after_s)
        self.figures.reconfigure(config.alarms.figures)
        self.auth.replace(config.api.tokens)
        quiet = config.quiet_hours()
        self.outbox.quiet = quiet
        self.timers.quiet = quiet
        self.timers.escalate_after_s = config.alarms.escalate_after_s
        self.timers.repeat_interval_s = config.alarms.repeat_interval_s
        self.timers.unreached_after_s = config.alarms.unreached_after_s
        notify = config.notify_rules()
        self.notify_consumer.rules = notify
        self.notify_consumer.public_url = config.http.public_url
        self.notify_consumer.quiet = quiet
        # [notify] batch and poll_s, as the worker's settings below: the consumer's next pass.
        self.notify_consumer.reconfigure(batch=config.notify.batch, poll_s=config.notify.poll_s)
        self.notify_worker.replace(config.notify, notify)
        # [retention]: the next maintenance pass (and the wait before the one after) takes it;
        # a pass under way finishes with the settings it started with.
        self.maintenance.retention = config.retention
        # [sparkplug] reorder_window_s left unset follows [mqtt] shared_group, which a reload
        # changes (the Sparkplug filters shared, or no more): with the section the node started
        # with. Kept at its start value, a node reloaded into a group judged every reorder
        # between the nodes a gap (window 0): its edge nodes untrusted, a rebirth each time.
        window = msgspec.structs.replace(
            config, sparkplug=self.sparkplug
        ).sparkplug_reorder_window_s()
        if self.writer.sparkplug is not None:
            self.writer.sparkplug.reorder_window_s = window
        if self.rebirth is not None:
            self.rebirth.reorder_window_s = window
        # [ingest] transactions_in_flight left 0 follows [mqtt] shared_group too (2 alone, 1 in
        # a group), from the writer's next batch; a number set in the file is read at start.
        # Kept at its start value, a node reloaded out of its group stored one transaction at
        # a time for good, and one reloaded into a group kept two.
        started = msgspec.structs.replace(
            config.ingest, transactions_in_flight=self.transactions_in_flight
        )
        self.writer.in_flight = msgspec.structs.replace(
            config, ingest=started
        ).transactions_in_flight()


async def build(
    config: Config,
    node: Node,
    *,
    auth: BearerAuth,
    connection: ConnectionSettings,
    endpoints: list[tuple[str, int]],
    protocol: str,
    stack: AsyncExitStack,
    stop: asyncio.Event,
    on_connected: Callable[[], None],
    prepare: Callable[[Callable[[], Coroutine[Any, Any, object]]], Awaitable[bool]],
) -> Components | None:
    """Every component of the node, wired; ``stack`` closes what needs closing. ``auth`` is
    the HTTP server's, which runs before the rest (it is reloaded with the components).

    The database calls made here go through ``prepare``, which runs them again while the
    database is unreachable (:meth:`Startup.prepare`); None when ``stop`` came first."""
    node_metrics(node.metrics)  # a no-op where the daemon was given them (gateway run)
    engine = live_path.alarm_engine(config, node.metrics)
    # What the readings without a time of their own are dated by: measured before the first.
    clock = DatabaseClock(node.pool)

    async def first_calls() -> None:
        async with node.pool.acquire() as conn:
            await engine.forget_removed_rules(conn)
            await set_aside_unbounded_telemetry(conn, node.topics, node.node_id)
        await clock.sync()

    if not await prepare(first_calls):
        return None
    decoder = live_path.message_decoder(config)
    decoder.wall = clock.time
    writer = IngestWriter.from_config(
        node,
        config.ingest,
        config.database,
        decoder=decoder,
        engine=engine,
        receipts=live_path.receipt_applier(config, node.metrics),
        batch_size=config.batch_size(protocol),
        sparkplug=live_path.sparkplug_host(config),
        in_flight=config.transactions_in_flight(),
    )
    # Before the first message: what this node was storing when it last died.
    if not await prepare(writer.recover):
        return None
    session = MqttSession(
        settings=connection,
        subscriptions=subscriptions(config, protocol),
        presence_topic=node.topics.gateway_status(node.node_id),
        writer=writer,
        metrics=node.metrics,
        backoff=Backoff(config.mqtt.reconnect_min_s, config.mqtt.reconnect_max_s),
        drain_timeout_s=config.ingest.drain_timeout_s,
        on_connected=on_connected,
        # Each subscription is proven on both versions: 3.1.1 cannot say whether it works, and
        # MQTT 5 cannot when the broker grants SUBSCRIBE and filters at delivery (an ACL).
        probe_timeout_s=config.mqtt.probe_timeout_s,
        memory=SubscriptionMemory(
            node.pool,
            client_id=connection.client_id,
            broker=f"{connection.host}:{connection.port}",
        ),
        resubscribe_stale=config.mqtt.broker_family == "rabbitmq",
        endpoints=endpoints,
        broker_setting=ENDPOINTS_SETTING if config.mqtt.hosts else BROKER_SETTING,
    )
    quiet = config.quiet_hours()
    dispatcher = Dispatcher.from_config(node, config.commands, mappings=writer.decoder.mappings)
    reaper = Reaper.from_config(
        node,
        config.commands,
        mappings=writer.decoder.mappings,
        # A receipt received and not yet stored is not heard yet (the writer's lag).
        unstored_since=lambda: writer.unstored_since,
        # What the broker keeps for the session while it is down waits that long at most.
        session_expiry_s=config.mqtt.session_expiry_s,
    )
    outbox = OutboxPublisher.from_config(node, config.outbox, quiet=quiet)
    notify_metrics = NotifyMetrics.of(node.metrics.registry)

    def count_suppressed(receiver: str) -> None:
        notify_metrics.deliveries.labels(receiver, "SUPPRESSED").inc()

    timers = AlarmTimers.from_config(
        node, config.alarms, quiet=quiet, count_suppressed=count_suppressed
    )
    notify_consumer, notify_worker = _notifications(config, node, quiet)
    maintenance = Maintenance.from_config(node, config.retention)
    loops: list[Loop] = [
        ("outbox-publisher", outbox.run),
        ("notify-consumer", notify_consumer.run),
        ("notify-delivery", notify_worker.run),
        ("alarm-timers", timers.run),
        ("command-dispatcher", dispatcher.run),
        ("command-reaper", reaper.run),
        ("campaign-settler", _settler(config, node).run),
        ("rule-state-janitor", lambda stop: engine.forget_loop(node.pool, stop)),
        ("maintenance", maintenance.run),
        ("database-clock", clock.run),
    ]
    if config.ai.enabled:
        summaries = await _summaries(config, node, stack)
        loops.append(("ai-summaries", summaries.run))
    rebirth = None
    if config.sparkplug.enabled:
        rebirth, sparkplug_loops = _sparkplug_loops(config, node, session, clock)
        loops.extend(sparkplug_loops)
    inactivity = InactivityMonitor(
        pool=node.pool,
        engine=engine,
        hearing=session.hearing,
        confirm=session.confirm_hearing,
    )
    loops.append(("inactivity-monitor", inactivity.run))
    # Reads the engine's rules on every pass: a reload needs nothing of its own here.
    holds = HoldTimer(pool=node.pool, engine=engine, interval_s=config.alarms.timer_interval_s)
    loops.append(("hold-timer", holds.run))
    watch = RuleWatch(
        pool=node.pool, rules=lambda: engine.rules, after_s=config.alarms.rule_check_after_s
    )
    loops.append(("rule-watch", watch.run))
    # Every node samples the figures' gauges (a few indexed counts each interval_s).
    figures = AlarmFigures(
        node.pool, config.alarms.figures, metrics=AlarmMetrics.of(node.metrics.registry)
    )
    loops.append(("alarm-figures", figures.run))
    return Components(
        engine=engine,
        writer=writer,
        session=session,
        dispatcher=dispatcher,
        reaper=reaper,
        outbox=outbox,
        timers=timers,
        auth=auth,
        alarm_service=AlarmService(
            node.pool,
            node.node_id,
            node.metrics,
            figures=figures,
            shelve_max_s=config.alarms.shelve_max_s,
            bulk_max=config.alarms.bulk_max,
            count_suppressed=count_suppressed,
        ),
        command_service=CommandService(
            node.pool,
            node.node_id,
            config.commands.expire_after_s,
            stop=stop,
            metrics=node.metrics,
            topics=node.topics,
            max_packet_size=config.mqtt.max_packet_size,
            mqtt5=protocol == "5",
        ),
        notify_consumer=notify_consumer,
        notify_worker=notify_worker,
        inactivity=inactivity,
        rule_watch=watch,
        figures=figures,
        maintenance=maintenance,
        loops=tuple(loops),
        sparkplug=config.sparkplug,
        rebirth=rebirth,
        transactions_in_flight=config.ingest.transactions_in_flight,
    )


def _notifications(
    config: Config, node: Node, quiet: QuietHours | None
) -> tuple[NotifyConsumer, DeliveryWorker]:
    """The outbox's notification consumer and the delivery worker it wakes."""
    metrics = NotifyMetrics.of(node.metrics.registry)
    rules = config.notify_rules()
    worker = DeliveryWorker(
        pool=node.pool,
        node_id=node.node_id,
        metrics=metrics,
        settings=config.notify,
        rules=rules,
        dsn=node.dsn,
        alarm_metrics=node.metrics,
    )
    consumer = NotifyConsumer(
        pool=node.pool,
        dsn=node.dsn,
        metrics=metrics,
        rules=rules,
        public_url=config.http.public_url,
        quiet=quiet,
        batch=config.notify.batch,
        poll_s=config.notify.poll_s,
        on_created=worker.wakeup.set,
        node_id=node.node_id,
    )
    return consumer, worker


def _settler(config: Config, node: Node) -> CampaignSettler:
    service = CampaignService(
        node.pool, node.node_id, config.commands.expire_after_s, metrics=node.metrics
    )
    return CampaignSettler(service, dsn=node.dsn)


def subscriptions(
    config: Config, protocol: str, sparkplug: SparkplugConfig | None = None
) -> list[str]:
    """The node's filters; ``sparkplug``: the [sparkplug] section the node started with (it is
    read at start only), ``config``'s by default."""
    topics = config.topics
    group = config.mqtt.shared_group if protocol == config.mqtt.protocol else ""
    # Presence is retained, and retained messages are not sent to shared subscriptions: every
    # node subscribes to it directly (applying it twice is harmless). So for the topics of
    # [[ingest.mappings]]: their telemetry shared, their presence direct.
    mapped, mapped_presence = config.mappings().filters()
    filters = [
        topics.subscription(TopicKind.TELEMETRY, group or None),
        topics.subscription(TopicKind.ACKS, group or None),
        topics.subscription(TopicKind.STATUS),
        *(f"$share/{group}/{mqtt_filter}" if group else mqtt_filter for mqtt_filter in mapped),
        *mapped_presence,
    ]
    sparkplug = config.sparkplug if sparkplug is None else sparkplug
    if sparkplug.enabled:
        # Sparkplug has nothing retained a host needs (births are asked for again): shared
        # like telemetry, each message goes to one node of the group.
        share = f"$share/{group}/" if group else ""
        filters.extend(share + f for f in sparkplug_wire.subscriptions(sparkplug.groups))
    return list(dict.fromkeys(filters))  # one mapping's telemetry topic may be another's presence


def _sparkplug_loops(
    config: Config, node: Node, session: MqttSession, clock: DatabaseClock
) -> tuple[RebirthRequester, list[Loop]]:
    """[sparkplug] enabled: the rebirth requests (their requester, which a reload gives the
    reorder window), and the host's STATE on its own connection.

    The STATE link connects where the session is: its settings follow the session's endpoint
    (``[mqtt] hosts``), so when the session moves to the next broker, the link goes there too
    (its broker dead, or still up: a reload that no longer lists it), and edge nodes on that
    broker see the host's birth. Its timestamps are on the database's clock (``clock``): a
    node back from a power cut with its clock at 1970 (no RTC, NTP not synced yet) stated a
    birth older than the one the edge nodes took last, which they ignore."""
    settings = config.sparkplug
    requester = RebirthRequester(
        pool=node.pool,
        publish=node.publish,
        metrics=SparkplugMetrics.of(node.metrics.registry),
        retry_s=settings.rebirth_retry_s,
        interval_s=settings.interval_s,
        reorder_window_s=config.sparkplug_reorder_window_s(),
        up=node.broker.up,
        node_id=config.node_id,
    )
    link = HostStateLink(
        host_id=settings.host_id,
        client=lambda will: _state_client(session.settings, will),
        backoff=Backoff(config.mqtt.reconnect_min_s, config.mqtt.reconnect_max_s),
        clock=clock.time,
        ingest_subscribed=session.subscribed_now,
        session=session,
    )
    return requester, [("sparkplug-rebirth", requester.run), ("sparkplug-state", link.run)]


def _state_client(settings: ConnectionSettings, will: aiomqtt.Will) -> aiomqtt.Client:
    """The STATE link's client: the node's broker and credentials, a clean session of its own
    client id, and the STATE Will."""
    v5 = settings.protocol == "5"
    return aiomqtt.Client(
        settings.host,
        settings.port,
        identifier=f"{settings.client_id}-spstate",
        protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
        clean_session=None if v5 else True,
        keepalive=settings.keepalive_s,
        username=settings.username or None,
        password=settings.password or None,
        tls_context=settings.tls.context() if settings.tls else None,
        will=will,
        timeout=settings.timeout_s,
    )


async def _summaries(config: Config, node: Node, stack: AsyncExitStack) -> SummaryWorker:
    """The AI summary worker (``[ai] enabled``) and its LLM client, closed with ``stack``."""
    ai = config.ai
    llm = OpenAiCompatibleLlm(
        base_url=ai.base_url,
        model=ai.model,
        api_key=ai.api_key or None,  # read from api_key_env by apply_secrets
        timeout_s=ai.timeout_s,
        json_mode=ai.json_mode,
    )
    stack.push_async_callback(llm.close)
    log.info(
        "ai_summaries_enabled",
        base_url=without_userinfo(ai.base_url),
        model=ai.model,
        prompt_version=ai.prompt_version,
    )
    return SummaryWorker.from_config(node, ai, llm=llm)
