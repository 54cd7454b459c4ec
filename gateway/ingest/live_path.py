"""The ingest path as the daemon builds it from its configuration.

Everything that stores messages must take exactly this path — the daemon's writer, and the
replay of dead letters — so that a message raises the same alarms and applies the same
receipts whichever way it comes in. Both build their parts here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.alarms.engine import AlarmEngine
from gateway.alarms.lifecycle import SummarySpec
from gateway.commands.receipts import ReceiptApplier
from gateway.config import Config
from gateway.ingest.decoder import MessageDecoder
from gateway.sparkplug.host import SparkplugHost
from gateway.support.metrics import Metrics
from protocol import Encoding


@dataclass(frozen=True, slots=True)
class LivePath:
    """What the daemon's writer stores a batch with (replay takes the same)."""

    decoder: MessageDecoder
    node_id: str
    engine: AlarmEngine
    receipts: ReceiptApplier
    sparkplug: SparkplugHost | None = None


def message_decoder(config: Config) -> MessageDecoder:
    return MessageDecoder(
        config.topics,
        Encoding(config.mqtt.encoding),
        config.mqtt.max_payload_bytes,
        config.ingest.dead_letter_max_bytes,
        config.mappings(),
        sparkplug=config.sparkplug.enabled,
        max_birth_bytes=config.sparkplug.max_birth_bytes,
    )


def sparkplug_host(config: Config, *, replay: bool = False) -> SparkplugHost | None:
    """The Sparkplug host's judgement of a batch ([sparkplug] enabled), or None; ``replay``:
    of a replayed dead letter (see SparkplugHost)."""
    if not config.sparkplug.enabled:
        return None
    return SparkplugHost(reorder_window_s=config.sparkplug_reorder_window_s(), replay=replay)


def alarm_engine(config: Config, metrics: Metrics) -> AlarmEngine:
    """The configured rules (their state is read from the database by every batch)."""
    engine = AlarmEngine(
        rules=config.rule_set(),
        node_id=config.node_id,
        metrics=metrics,
        clock=config.device_clock(),
    )
    if config.ai.enabled:
        # Every alarm created gets its summary task, however its telemetry arrived.
        engine.summary = SummarySpec(config.ai.model, config.ai.prompt_version)
    return engine


def receipt_applier(config: Config, metrics: Metrics | None) -> ReceiptApplier:
    return ReceiptApplier(
        node_id=config.node_id, sent_timeout_s=config.commands.sent_timeout_s, metrics=metrics
    )


def for_replay(config: Config, metrics: Metrics) -> LivePath:
    """Decoder, rules and receipts as the daemon of ``config`` has them."""
    return LivePath(
        decoder=message_decoder(config),
        node_id=config.node_id,
        engine=alarm_engine(config, metrics),
        receipts=receipt_applier(config, metrics),
        sparkplug=sparkplug_host(config, replay=True),
    )
