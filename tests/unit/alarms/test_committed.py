"""What a committed batch leaves behind outside PostgreSQL: one log line per alarm created, the
created counter per rule (added once per rule and batch, not once per alarm)."""

from __future__ import annotations

import structlog

from gateway.alarms.engine import AlarmEngine, BatchAlarms
from gateway.domain.rules import RuleSet
from gateway.support.metrics import Metrics


def _created(metrics: Metrics, rule_key: str) -> float | None:
    return metrics.registry.get_sample_value("gateway_alarms_created_total", {"rule_key": rule_key})


def test_a_committed_batch_logs_each_alarm_and_counts_them_by_rule() -> None:
    metrics = Metrics()
    engine = AlarmEngine(rules=RuleSet(), node_id="node-a", metrics=metrics)
    batch = BatchAlarms(created=[("overheat", 11), ("smoke", 12), ("overheat", 13)])
    with structlog.testing.capture_logs() as lines:
        engine.committed(batch)
        engine.committed(BatchAlarms(created=[("smoke", 14)]))
        engine.committed(BatchAlarms())
    created = [(line["rule_key"], line["alarm_id"]) for line in lines]
    assert created == [("overheat", 11), ("smoke", 12), ("overheat", 13), ("smoke", 14)]
    assert all(line["event"] == "alarm_created" for line in lines)
    assert all(line["log_level"] == "info" for line in lines)
    assert _created(metrics, "overheat") == 2
    assert _created(metrics, "smoke") == 2
