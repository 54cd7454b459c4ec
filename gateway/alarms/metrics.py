"""The alarm engine's and the alarm timers' metrics; alarm transitions, which the alarm
service, the outbox and the stream count too, are in :class:`gateway.support.metrics.Metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.support.metrics import MetricSet


class AlarmMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.alarms_created = Counter(
            "gateway_alarms_created", "Alarms raised, by rule", ["rule_key"], registry=r
        )
        self.alarms_deduplicated = Counter(
            "gateway_alarms_deduplicated", "Firings that hit an existing dedup key", registry=r
        )
        self.alarms_superseded = Counter(
            "gateway_alarms_superseded", "Alarms superseded by a newer one", registry=r
        )
        self.alarms_cleared = Counter(
            "gateway_alarms_cleared", "Alarms marked cleared by recovery", registry=r
        )
        self.alarms_late = Counter(
            "gateway_alarms_late",
            "Alarms raised by a sample committed after a newer one (created already cleared "
            "or superseded)",
            registry=r,
        )
        self.late_runs = Counter(
            "gateway_rule_late_runs",
            "Late samples of for_samples rules the rule state could not place, by outcome: "
            "judged (their rule replayed from the stored samples), raised (a run's alarm the "
            "ordering rule had missed), unjudged (a run longer or further behind than the "
            "replay reads)",
            ["outcome"],
            registry=r,
        )
        self.clock_adjustments = Counter(
            "gateway_clock_adjustments",
            "Samples judged at another time than their device time, or ordered by seq against "
            "it, by why: ahead (dated past max_future_skew_s), behind (back past "
            "reorder_window_s: a reset or an upload), state_ahead (a rule state held times from "
            "a clock ahead), stepped_back (seq above, time before the newest judged), seq_reset "
            "(seq below, time after: a new epoch), corrected (no seq; before the newest judged "
            "but after its own time: a clock corrected while its samples waited)",
            ["reason"],
            registry=r,
        )
        self.rule_states_written = Counter(
            "gateway_rule_states_written",
            "Rule state rows written back by ingest batches",
            registry=r,
        )
        self.held_batches = Counter(
            "gateway_rule_state_held_batches",
            "Ingest batches judged from the rule-state rows the node held, without locking "
            "them first: written (nobody wrote them since) or contended (someone had: the "
            "batch was judged again under lock)",
            ["outcome"],
            registry=r,
        )
        self.alarms_unreached = Counter(
            "gateway_alarms_unreached",
            "Alarms still NEW after [alarms] unreached_after_s: no subscriber, no receiver "
            "reached a person",
            registry=r,
        )
        # The alarm system's own figures (gateway/alarms/figures.py), sampled by every node's
        # figures loop from the database ([alarms.figures] interval_s), never at scrape.
        self.figures_last_10min = Gauge(
            "gateway_alarm_figures_last_10min",
            "Alarms raised (by trigger time) in the last 10 minutes, every node's",
            registry=r,
        )
        self.figures_flood = Gauge(
            "gateway_alarm_figures_flood",
            "1 while the last 10 minutes hold more alarms than [alarms.figures] flood_alarms",
            registry=r,
        )
        self.figures_chattering = Gauge(
            "gateway_alarm_figures_chattering",
            "(rule, device) pairs chattering within the last chatter_lookback_s: "
            "chatter_raises alarms or more within chatter_window_s",
            registry=r,
        )
        self.figures_stale = Gauge(
            "gateway_alarm_figures_stale",
            "Open alarms older than [alarms.figures] stale_after_s",
            registry=r,
        )
        self.figures_open = Gauge(
            "gateway_alarm_figures_open", "Open alarms (NEW to ESCALATED)", registry=r
        )
        self.figures_sampled = Gauge(
            "gateway_alarm_figures_sampled_timestamp_seconds",
            "When this node last sampled the alarm figures (its clock)",
            registry=r,
        )
