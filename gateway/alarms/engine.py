"""Rules applied to freshly stored telemetry, inside the ingest transaction.

The rule state of every (device, rule) the batch touches is read from `rule_state` under
lock, the messages are judged in order against it, the alarms written, and the rows written
back — all in the batch's transaction. A batch whose rows the node holds from its own
committed batches is judged from those copies first; they are locked and written in one
statement only if each is still the row held, else the batch is judged again under the
lock. Nothing that decides stays in the process between batches, so any node, a restarted
one, or several taking turns on one device decide alike; and a rolled-back batch leaves
nothing behind. The hold timer (`fire_due_holds`) fires pending `for_seconds` violations on
the clock under the same locks and conditional writes.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import asyncpg
import msgspec
import structlog

from gateway.alarms.lifecycle import (
    AlarmRequest,
    ClearRequest,
    Creation,
    SummarySpec,
    clear_alarm,
    clear_alarms,
    clear_created,
    create_alarms,
    create_late_alarm,
    record_cleared_many,
)
from gateway.alarms.metrics import AlarmMetrics
from gateway.domain.alarm import active_key, dedup_key
from gateway.domain.errors import ConcurrentWriteError
from gateway.domain.rules import (
    IDLE,
    Clearing,
    DeviceClock,
    Evaluation,
    Firing,
    InactivityRule,
    Rule,
    RuleSet,
    RuleState,
    RuleStates,
    SlotKey,
    StoredAlarm,
    StoredSample,
    ThresholdRule,
    current_run,
    evaluate,
    fire_held,
    judged_again,
    judged_from_samples,
    merged_state,
    newest_clearing,
    rejudged_event_id,
    replay_samples,
    rule_version,
    state_keys,
    uncovered,
    violates,
)
from gateway.support.loops import RETRYABLE, sleep_unless_stopped, wait_event_or_stop
from gateway.support.metrics import Metrics
from protocol import Telemetry
from storage import alarms as repo
from storage import device_clock as clock_repo
from storage import rule_runs as runs_repo
from storage import rule_state as state_repo
from storage.device_clock import ClockFigure
from storage.rule_state import HoldRule, LockedRow, RuleStateRow, StateWriteConflictError

log = structlog.get_logger(__name__)

# Each node records the rule keys it runs in `node_rule_set`, at start, on every reload, and
# as a heartbeat this often; a node whose heartbeat is older than NODE_LIVE_S no longer keeps
# its rules' state from being dropped by another node (it is stopped, dead, or cut off from the
# database for that long). Six heartbeats: a slow pass or two never make a node look gone.
HEARTBEAT_S = 10.0
NODE_LIVE_S = 60.0
# Pending rows the hold timer locks and judges per transaction.
HOLD_PAGE = 200
# Keys of rows a reload left under another definition read per statement (each reads every
# row of the node's threshold rules): judged HOLD_PAGE per transaction.
STALE_PAGE = 10_000
# A late sample's run judged from the stored samples: how far back its start is looked for,
# and how many samples from there on are read at most (gateway.domain.rules.runs).
RUN_LOOKBACK = 1000
# A threshold rule a node takes up (a reload added it) is placed on the devices that report its
# metric: devices read per statement, and how many of each one's newest stored samples are
# looked at for the metric (`seed_added_rules`).
ADDED_PAGE = 1000
ADDED_LOOKBACK = 32
RUN_REPLAY_MAX = 5000
# Later than any stored sample: the newest ones are read from there back.
_END_OF_TIME = datetime.max.replace(tzinfo=UTC)


class _Held(LockedRow, frozen=True, gc=False):
    """A rule-state row as locked or held, with its state as the rules read it (converted
    once: a row held from batch to batch is not converted again)."""

    state: RuleState


@dataclass(slots=True)
class BatchAlarms:
    """What one batch did to alarms, counted in metrics after the commit."""

    created: list[tuple[str, int]] = field(default_factory=list)
    superseded: int = 0
    deduplicated: int = 0
    cleared: int = 0
    late: int = 0  # alarms raised by samples committed out of order (already cleared/superseded)
    # Late samples' runs judged again from the stored samples (gateway.domain.rules.runs),
    # the alarms that raised, and the runs too long or too far behind to judge that way.
    runs_judged: int = 0
    runs_raised: int = 0
    runs_unjudged: int = 0
    states_written: int = 0
    clock_adjustments: dict[str, int] = field(default_factory=dict)
    # The same per (device, reason), with the batch's last adjustment of each: written in
    # the batch's transaction (storage.device_clock), only when there is one.
    device_clocks: dict[tuple[str, str], ClockFigure] = field(default_factory=dict)
    # The rule-state rows as this batch leaves them, with their tokens: the node holds them
    # for its next batches once the batch has committed (AlarmEngine.committed).
    held: dict[SlotKey, _Held] = field(default_factory=dict)
    # Judged from the rows the node held: written so, or contended (someone else had written
    # one since: judged again under lock). Neither when the batch locked its rows first.
    held_written: bool = False
    held_contended: bool = False


@dataclass(slots=True)
class _Step:
    """Outcomes written together: each of a distinct (device, rule), none of them late."""

    firings: list[Firing] = field(default_factory=list)
    clearings: list[Clearing] = field(default_factory=list)
    keys: set[SlotKey] = field(default_factory=set)

    def add(self, key: SlotKey, outcome: Firing | Clearing) -> None:
        self.keys.add(key)
        if isinstance(outcome, Firing):
            self.firings.append(outcome)
        else:
            self.clearings.append(outcome)


@dataclass(slots=True)
class _LoadedStates:
    """The batch's rule states as read (to write back only what changed) and as judged."""

    read: dict[SlotKey, _Held]  # each row as read (or held), its token and its state
    versions: dict[str, str]
    states: RuleStates
    touched: list[set[SlotKey]]  # per message of the batch, the keys it reads and writes
    missed: bool = False  # a row the node held was found written by someone else since


class _Touched:
    """The (device, rule) rows a batch reads and writes: all of them, each message's, and
    the version of each rule they belong to."""

    __slots__ = ("keys", "per_message", "rules", "versions")

    def __init__(self, rules: RuleSet, messages: Sequence[tuple[str, str, Telemetry]]) -> None:
        keys: set[SlotKey] = set()
        per_message = []  # each message's keys, for its evaluation
        for device_id, _, message in messages:
            per_message.append(mine := state_keys(rules, device_id, message))
            keys |= mine
        versions: dict[str, str] = {}
        by_key: dict[str, Rule] = {}
        for _, rule_key in keys:
            if rule_key not in versions:
                rule = rules.by_key(rule_key)
                assert rule is not None
                versions[rule_key] = rule_version(rule)
                by_key[rule_key] = rule
        self.keys = keys
        self.per_message = per_message
        self.rules = by_key
        self.versions = versions


def _loaded(
    read: dict[SlotKey, _Held], touched: _Touched, *, missed: bool = False
) -> _LoadedStates:
    """The batch's states from its rows (a row of an older rule version starts over)."""
    versions = touched.versions
    states: RuleStates = {}
    for key, entry in read.items():
        state = entry.state
        if entry.row.rule_version != versions[key[1]]:
            state = state.redefined(touched.rules[key[1]])
        states[key] = state
    return _LoadedStates(
        read=read, versions=versions, states=states, touched=touched.per_message, missed=missed
    )


class _SeenRows:
    """Which (device, rule) rule-state rows a node has seen, as one bit each of a fixed bitmap
    indexed by the pair's hash (128 KiB, however many devices): a batch whose rows were all
    seen skips creating them (storage.rule_state.lock_states). A hint only: two pairs may share
    a bit, and the lock's answer decides then, as for a row gone meanwhile."""

    BITS = 1 << 20

    def __init__(self) -> None:
        self._bits = bytearray(self.BITS // 8)

    def all_seen(self, keys: Iterable[SlotKey]) -> bool:
        bits = self._bits
        return all(bits[(bit := hash(key) % self.BITS) >> 3] >> (bit & 7) & 1 for key in keys)

    def add(self, keys: Iterable[SlotKey]) -> None:
        bits = self._bits
        for key in keys:
            bit = hash(key) % self.BITS
            bits[bit >> 3] |= 1 << (bit & 7)


# How many rule-state rows a node holds between batches (with their tokens, so that a batch
# whose rows nobody else wrote since reads only their versions: storage.rule_state.lock_states).
# About 0.65 KB each (the row, its token, the key): 2,048 cost the storm of 10,000 devices
# +1.3 MB of peak RSS (4,096 cost +3-4 MB, too near the bench's 100 MB bound). The least
# recently committed go first; a row not held is read whole, as before.
HELD_ROWS = 2048
# A node that finds rows it held written by someone else (another node on the same devices)
# locks and reads its batches' rows first for the next 1, 2, 4, ... batches, at most this
# many, before it judges a batch from what it holds again (AlarmEngine._held_states).
HELD_SKIP_MAX = 256


class AlarmEngine:
    def __init__(
        self,
        *,
        rules: RuleSet,
        node_id: str,
        metrics: Metrics,
        clock: DeviceClock | None = None,
    ) -> None:
        self.rules = rules
        self.clock = DeviceClock() if clock is None else clock
        self.node_id = node_id
        self.metrics = metrics
        self.alarm_metrics = AlarmMetrics.of(metrics.registry)
        self.summary: SummarySpec | None = None  # set when AI summaries are enabled
        self._rules_replaced = asyncio.Event()
        self._seen_rows = _SeenRows()
        self._held: dict[SlotKey, _Held] = {}  # see HELD_ROWS
        self._held_skip = 0  # batches left to lock first (see HELD_SKIP_MAX)
        self._held_backoff = 1
        # The keys of rules not configured as inactivity rules here that hold an uncleared
        # inactivity alarm (a reload removed or renamed them): a device's next message clears
        # those too. Found at start, at each reload and with each heartbeat (another node's
        # reload); a rule a reload takes away joins at once. Empty, the usual case, a batch
        # of a node without inactivity rules clears nothing and asks nothing.
        self._unconfigured_inactivity: frozenset[str] = frozenset()
        # Counts the changes of the rule sets in force: this node's (its start, each reload)
        # and the other live nodes' (what they run, as the heartbeat reads it). The hold
        # timer judges the rows of a definition no live node runs again after each change
        # (`rejudge_stale_rows`), until a pass has judged every one it found.
        self.rule_sets_changed = 1
        self._others_run: frozenset[tuple[str, str]] | None = None
        # The keys of the rules that keep state this node took up since it last dropped the
        # state of rules (a reload added them); None until its first registration, which
        # compares with what its last one recorded (`forget_removed_rules`).
        self._taken_up: set[str] | None = None
        # When this node last recorded its rule set (database time; None: not yet), right
        # after its start or a reload: a row written before was written under rules this
        # node no longer runs, or by a node that ran them too (`fire_due_holds`).
        self._rules_recorded_at: datetime | None = None

    def replace_rules(self, rules: RuleSet) -> None:
        """A reload: the next batch uses `rules`; `forget_loop` records them for the other
        nodes and drops the state of the rules no live node runs any more."""
        removed = _inactivity_keys(self.rules) - _inactivity_keys(rules)
        before = set(self.stateful_rule_keys())
        self.rules = rules
        if self._taken_up is not None:
            self._taken_up |= set(self.stateful_rule_keys()) - before
        self._unconfigured_inactivity = (
            self._unconfigured_inactivity | removed
        ) - _inactivity_keys(rules)
        self.rule_sets_changed += 1
        self._rules_replaced.set()

    async def watch_rule_sets(self, conn: asyncpg.Connection) -> bool:
        """Read what the other live nodes run (their rule keys and definitions); whether it
        changed since the last look (then `rule_sets_changed` counts it: a rolling reload
        went on, a node stopped or came). With the heartbeat, every HEARTBEAT_S."""
        others = await state_repo.live_definitions(conn, self.node_id, NODE_LIVE_S)
        changed = self._others_run is not None and others != self._others_run
        self._others_run = others
        if changed:
            self.rule_sets_changed += 1
        return changed

    @property
    def clears_inactivity(self) -> bool:
        """Whether a device's message may clear an inactivity alarm (a rule configured, or an
        uncleared alarm of one a reload removed): only then are its receipts asked for."""
        return bool(self.rules.inactivity_rules or self._unconfigured_inactivity)

    async def find_unconfigured_inactivity(self, conn: asyncpg.Connection) -> frozenset[str]:
        """Look again for the rules, not configured as inactivity rules here, that hold an
        uncleared inactivity alarm (see `_unconfigured_inactivity`)."""
        rules = self.rules
        found = await repo.uncleared_inactivity_rules(conn, sorted(_inactivity_keys(rules)))
        if self.rules is not rules:  # a reload meanwhile: keep what it added
            found |= self._unconfigured_inactivity
        self._unconfigured_inactivity = found - _inactivity_keys(self.rules)
        return self._unconfigured_inactivity

    def stateful_rule_keys(self) -> list[str]:
        """The keys of the rules that keep rule state (inactivity rules keep none)."""
        return [rule.key for rule in self.rules if not isinstance(rule, InactivityRule)]

    def stateful_rules(self) -> dict[str, str]:
        """The rules that keep rule state, key -> definition (`rule_version`), as recorded."""
        return {
            rule.key: rule_version(rule)
            for rule in self.rules
            if not isinstance(rule, InactivityRule)
        }

    async def forget_loop(self, pool: asyncpg.Pool, stop: asyncio.Event) -> None:
        """The node's heartbeat with its rule keys; after each reload, also drop the state of
        the rules no live node runs (own transactions).

        Unchanged rules keep their state; a changed rule keeps its facts and drops its
        pending count, per row, when a batch next reads it (`rule_version`), unless the hold
        timer judged the row again first from the stored samples (`rejudge_stale_holds`,
        `rejudge_stale_rows`). The definitions recorded here tell the timer which rows
        another live node still runs, and the heartbeat reads the others' (`watch_rule_sets`).
        """
        while not stop.is_set():
            await wait_event_or_stop(self._rules_replaced, stop, timeout_s=HEARTBEAT_S)
            if stop.is_set():
                break
            replaced = self._rules_replaced.is_set()
            self._rules_replaced.clear()
            try:
                async with pool.acquire() as conn:
                    if replaced:
                        await self.forget_removed_rules(conn)
                    else:
                        await state_repo.register_rule_set(
                            conn, self.node_id, self.stateful_rules()
                        )
                        await self.find_unconfigured_inactivity(conn)
                        await self.watch_rule_sets(conn)
            except RETRYABLE as exc:
                if replaced:
                    log.warning("rule_state_drop_failed", error=repr(exc))
                    self._rules_replaced.set()
                else:
                    # Six in a row and other nodes take this one for gone (NODE_LIVE_S).
                    log.warning("rule_set_heartbeat_failed", error=repr(exc))
                await sleep_unless_stopped(stop, 5.0)

    async def forget_removed_rules(self, conn: asyncpg.Connection) -> int:
        """Record the rules this node runs, then drop the state of the rules no live node
        runs (at start and on reload): a node started or reloaded with fewer rules than the
        others leaves theirs alone."""
        running = self.stateful_rules()
        kept = list(running)
        previous = await state_repo.registered_keys(conn, self.node_id)
        if self._taken_up is None:  # this process's first: against its previous life's
            self._taken_up = set() if previous is None else set(kept) - set(previous[0])
        taken_up = self._taken_up & set(kept)
        recorded_at = await repo.db_now(conn)
        await state_repo.register_rule_set(conn, self.node_id, running)
        live = await state_repo.live_rule_sets(conn, NODE_LIVE_S)
        others_only = sorted({key for keys in live.values() for key in keys} - set(kept))
        if others_only:
            # Legitimate during a rolling reload; for long, a node with a stale file.
            log.warning(
                "rule_sets_differ",
                kept_for_other_nodes=others_only,
                nodes=sorted(node for node, keys in live.items() if set(keys) - set(kept)),
            )
        dropped = await state_repo.drop_removed(conn, kept, NODE_LIVE_S)
        # The state of a rule taken up again that no other live node runs was kept up to date
        # by nobody: a node that still ran the rule when it was removed (so it was kept), then
        # stopped for good, left it behind. It would stand for the rule taken up: dropped.
        dropped += await state_repo.drop_leftovers(
            conn,
            sorted(taken_up),
            self.node_id,
            NODE_LIVE_S,
            last_heartbeat=None if previous is None else previous[1],
        )
        try:
            await self.seed_added_rules(conn, taken_up)
        except RETRYABLE:
            raise  # the database away: the whole step again (the rules stay taken up)
        except Exception:
            # A correction: what breaks it (a bug of ours, a row the database refuses) must
            # never stop the node (its start, and so ingest for every device), nor every
            # restart after it. The rules judge the devices' next samples, as before.
            log.exception("rule_added_placing_failed", rule_keys=sorted(taken_up))
        self._taken_up = set()
        self._rules_recorded_at = recorded_at
        if dropped:
            log.info("rule_state_dropped", rows=dropped)
        await self.find_unconfigured_inactivity(conn)
        await self.watch_rule_sets(conn)
        return dropped

    async def seed_added_rules(self, conn: asyncpg.Connection, keys: Iterable[str]) -> int:
        """Place the threshold rules among ``keys`` (rules this node has just taken up: a
        reload added them, or it started with rules its last registration did not run) on the
        devices that already report their metric: a row per device the rule selects whose
        newest stored samples (ADDED_LOOKBACK) hold it, at that sample, under no definition;
        the hold timer then judges each from it (`rejudge_stale_rows`), so that a device that
        reports by exception, already violating, raises the alarm without waiting for a
        sample that may not come (a rule a reload changed is judged so already). Rows that
        exist are left alone. A page of devices a statement; how many rows were created."""
        wanted = set(keys)
        rules = [r for r in self.rules if isinstance(r, ThresholdRule) and r.key in wanted]
        if not rules:
            return 0
        seeded, after = 0, ""
        skew_s = self.clock.max_future_skew.total_seconds()
        while True:
            devices = await state_repo.device_page(conn, after=after, limit=ADDED_PAGE)
            pairs = [(d, r.key, r.metric) for d in devices for r in rules if r.selector.matches(d)]
            seeded += await state_repo.seed_added(
                conn, pairs, self.node_id, lookback=ADDED_LOOKBACK, max_future_skew_s=skew_s
            )
            if len(devices) < ADDED_PAGE:
                break
            after = devices[-1]
        if seeded:
            # The hold timer sweeps the rows of a definition no live node runs after each
            # change: these are such rows, placed after the change that took the rules up.
            self.rule_sets_changed += 1
            log.info("rule_added_placed", rule_keys=sorted(r.key for r in rules), rows=seeded)
        return seeded

    async def on_stored(
        self,
        conn: asyncpg.Connection,
        messages: Sequence[tuple[str, str, Telemetry]],
        *,
        now: datetime | None = None,
        heard_at: datetime | None = None,
        received: Mapping[str, float] | None = None,
    ) -> BatchAlarms:
        """Evaluate (device id, event id, message) in order; write alarms on ``conn``.

        ``now``: the transaction's time on the database clock if the caller has it already
        (the telemetry insert returns it), else it is read. ``heard_at``: when the messages
        were received if not now (a replayed dead letter): they clear only an inactivity
        alarm for a silence that began before it, and it is their receipt for the device
        clock's bounds (a reading received hours ago is judged then, not at the replay).
        ``received``: when this node read each device's newest message off the broker, on
        the monotonic clock (``Inbound.received_at``): an inactivity alarm for a silence that
        began after it is not cleared by them (a node a batch behind, docs/behaviour.md §4)."""
        rules = self.rules  # one rule set per batch, even if a reload swaps it meanwhile
        batch = BatchAlarms()
        if not messages or not len(rules):
            return batch
        if now is None:
            now = await repo.db_now(conn)
        await self._clear_inactivity(
            conn, rules, messages, now, batch, heard_at=heard_at, received=received
        )
        touched = _Touched(rules, messages)
        held = self._held_states(touched)
        if held is not None:
            # Judged from the rows held, then locked and written in one statement if nobody
            # wrote them since: before an alarm of theirs is written, as under lock_states.
            evaluations, unplaced = self._evaluate(rules, held, messages, now, heard_at)
            if not unplaced:
                if await self._write_states(conn, held, batch, locked=False):
                    await self._write_outcomes(conn, messages, evaluations, now, batch)
                    return await self._record_clocks(conn, batch)
                loaded = await self._lock_states(conn, touched)  # written since: judged again
            else:
                # A late sample to place: its run is judged from the stored samples under the
                # lock. The judgement from the copies stands if the lock finds every row the
                # very one held (no second evaluation of the batch).
                loaded = await self._lock_states(conn, touched)
                read = loaded.read
                if all(read.get(key) is entry for key, entry in held.read.items()):
                    loaded = held
                else:
                    batch.held_contended = True
                    self._contended(True)
        else:
            loaded = await self._lock_states(conn, touched)
            if loaded.missed:
                self._contended(True)  # another writer on these devices: lock first a while
        if loaded is not held:
            evaluations, unplaced = self._evaluate(rules, loaded, messages, now, heard_at)
        await self._write_outcomes(conn, messages, evaluations, now, batch)
        for key, at in sorted(unplaced.items()):
            await self._judge_run(conn, rules, key, at, states=loaded.states, now=now, batch=batch)
        await self._write_states(conn, loaded, batch, locked=True)
        return await self._record_clocks(conn, batch)

    def _evaluate(
        self,
        rules: RuleSet,
        loaded: _LoadedStates,
        messages: Sequence[tuple[str, str, Telemetry]],
        now: datetime,
        heard_at: datetime | None = None,
    ) -> tuple[list[Evaluation], dict[SlotKey, datetime]]:
        """Each message judged in order against ``loaded.states`` (which it moves on), with
        no statement: the evaluations, and per (device, rule) the oldest late sample of the
        batch its state could not place. ``heard_at``: the messages' receipt if not ``now``
        (a replayed dead letter's)."""
        clock = self.clock
        evaluations = []
        unplaced: dict[SlotKey, datetime] = {}
        for (device_id, event_id, message), keys in zip(messages, loaded.touched, strict=True):
            # Judged against the database's clock (the receipt, alike on every node).
            evaluation = evaluate(
                rules,
                loaded.states,
                device_id,
                event_id,
                message,
                received_at=now,
                clock=clock,
                keys=keys,
                heard_at=heard_at,
            )
            evaluations.append(evaluation)
            for rule_key in evaluation.unplaced:
                at = message.timestamp()
                known = unplaced.get((device_id, rule_key))
                unplaced[(device_id, rule_key)] = at if known is None else min(known, at)
        return evaluations, unplaced

    async def _write_outcomes(
        self,
        conn: asyncpg.Connection,
        messages: Sequence[tuple[str, str, Telemetry]],
        evaluations: Sequence[Evaluation],
        now: datetime,
        batch: BatchAlarms,
    ) -> None:
        """The evaluations' firings and clearings written, in message order."""
        # Firings and clearings are written in steps, one statement per kind of write for the
        # whole step (an alarm storm is one step; so is a batch of a fleet's hysteresis). A
        # step holds each (device, rule) once: it ends before a second outcome of the same
        # (device, rule), and before a late firing or a late clearing, which are written on
        # their own. So outcomes of one (device, rule) still take effect in message order
        # (one message may raise an alarm and clear it again: OPEN then CLOSE), and those of
        # different ones touch different alarms.
        step = _Step()
        for (device_id, _, message), evaluation in zip(messages, evaluations, strict=True):
            if evaluation.clock_adjustment is not None:
                _count_adjustment(batch, device_id, message, evaluation, now)
            for outcome in evaluation.outcomes:
                key = (outcome.device_id, outcome.rule_key)
                if _late(outcome) or key in step.keys:
                    await self._write_step(conn, step, now, batch)
                if not _late(outcome):
                    step.add(key, outcome)
                elif isinstance(outcome, Firing):
                    await self._fire_late(conn, outcome, now, batch)
                else:
                    await self._clear(conn, outcome, now, batch)
        await self._write_step(conn, step, now, batch)

    @staticmethod
    async def _record_clocks(conn: asyncpg.Connection, batch: BatchAlarms) -> BatchAlarms:
        if batch.device_clocks:  # rare: no statement at all when no clock was adjusted
            await clock_repo.record_adjustments(conn, list(batch.device_clocks.values()))
        return batch

    async def _judge_run(
        self,
        conn: asyncpg.Connection,
        rules: RuleSet,
        key: SlotKey,
        at: datetime,
        *,
        states: RuleStates,
        now: datetime,
        batch: BatchAlarms,
    ) -> None:
        """A late sample (device time ``at``) the rule state could not place: its rule judged
        again from the device's stored samples, from the newest clearing sample before it
        (gateway.domain.rules.runs). The runs no alarm stands for are raised (already cleared
        or superseded where a newer sample says so), the episodes that ended are cleared, and
        the state becomes the replay's. Under the row lock the batch holds: two nodes judge
        one run one after the other, and the second finds the first's alarm."""
        device_id, rule_key = key
        rule = rules.by_key(rule_key)
        if not isinstance(rule, ThresholdRule) or not judged_from_samples(rule):
            return
        before = [
            StoredSample(*row)
            for row in await runs_repo.samples_before(
                conn, device_id, rule.metric, at, RUN_LOOKBACK
            )
        ]
        index = newest_clearing(rule, before, at)
        if not before or (index is None and len(before) == RUN_LOOKBACK):
            # A run longer than the lookback reached `for_samples` long ago: its alarm was
            # raised in its time (the state placed those samples).
            batch.runs_unjudged += 1
            return
        start = before[-1] if index is None else before[index]
        samples = [
            StoredSample(*row)
            for row in await runs_repo.samples_from(
                conn,
                device_id,
                rule.metric,
                start.ts,
                RUN_REPLAY_MAX,
                # One dated past the bounds ahead is read at its receipt, where it was judged.
                max_future_skew_s=self.clock.max_future_skew.total_seconds(),
            )
        ]
        if len(samples) == RUN_REPLAY_MAX:
            # Far behind the newest (a backlog of hours): left to the ordering rule.
            batch.runs_unjudged += 1
            return
        seqs = await runs_repo.device_seqs(conn, device_id, start.ts, 4 * RUN_REPLAY_MAX)
        alarms = [
            StoredAlarm(*row)
            for row in await runs_repo.alarms_after(conn, device_id, rule_key, start.ts)
        ]
        episodes, replayed = replay_samples(
            rules, rule, device_id, samples, seqs=seqs, raised=alarms
        )
        for episode in uncovered(episodes, alarms):
            firing = dataclasses.replace(
                episode.firing,
                reason=f"{episode.firing.reason} (late: its run judged from the stored samples)",
            )
            newer = [a for a in alarms if a.sample_ts > firing.observed_at]
            if newer:
                successor = max(newer, key=lambda alarm: alarm.sample_ts)
                cleared_by = episode.clearing
                firing = dataclasses.replace(
                    firing,
                    superseded_by_event=successor.event_id,
                    cleared_by_event=None if cleared_by is None else cleared_by.telemetry_event_id,
                )
                await self._fire_late(conn, firing, now, batch)
            else:
                await self._fire(conn, [firing], now, batch)
                batch.late += 1
            alarms.append(StoredAlarm(firing.observed_at, firing.telemetry_event_id))
            batch.runs_raised += 1
        for episode in episodes:
            if episode.clearing is not None:
                clearing = episode.clearing
                late_clear = dataclasses.replace(clearing, raised_by_then=clearing.observed_at)
                await self._clear(conn, late_clear, now, batch)
        states[key] = merged_state(states.get(key, IDLE), replayed, episodes, alarms)
        batch.runs_judged += 1

    async def rejudge_stale_holds(
        self,
        conn: asyncpg.Connection,
        *,
        after: SlotKey = ("", ""),
        limit: int = HOLD_PAGE,
    ) -> tuple[int, SlotKey | None]:
        """One page of the hold timer's first step, on ``conn`` in the caller's transaction:
        the pending rows of this node's hold rules written under another definition that no
        other live node runs (a reload changed the rule while its hold was pending), judged
        again under this node's definition from the device's newest stored samples of the
        metric (`current_run`: from the newest sample that clears it on). A run still
        violating stays pending, from its first violating sample but never from before the
        row's own `pending_since` (the same one when the violation goes on under the new
        definition); otherwise the row is re-armed.
        Each row is written with this node's definition and the time it was last written
        kept, so `fire_due_holds` then fires it when the new definition's hold is due, on the
        same clock as before the reload. Only the rule's definition and the run change: its
        facts stay. A row this node's rule no longer selects is re-armed.

        Locked as `fire_due_holds` locks (another transaction's row is skipped), and written
        conditional on its version. Returns how many rows were judged again and the key to
        page after (None: no more rows)."""
        rules = self.rules  # one rule set per page, even if a reload swaps it meanwhile
        holds = {
            rule.key: rule
            for rule in rules
            if isinstance(rule, ThresholdRule) and rule.for_seconds > 0
        }
        if not holds:
            return 0, None
        asked = [
            HoldRule(key, rule_version(rule), rule.for_seconds, rule.for_samples)
            for key, rule in holds.items()
        ]
        rows = await state_repo.lock_stale_holds(
            conn, asked, self.node_id, NODE_LIVE_S, after=after, limit=limit
        )
        # Each row's own newest sample, the one it judged last (where it holds the metric;
        # else the newest by device time), for the rows whose device the rule still selects:
        # one statement for the page, as `rejudge_stale_rows` reads it.
        selected = [row for row in rows if holds[row.rule_key].selector.matches(row.device_id)]
        samples = await runs_repo.newest_samples(
            conn,
            [
                (
                    row.device_id,
                    holds[row.rule_key].metric,
                    row.last_device_ts or row.last_ts,
                    row.last_seq,
                )
                for row in selected
            ],
        )
        own_of = {
            (row.device_id, row.rule_key): None if sample is None else StoredSample(*sample)
            for row, sample in zip(selected, samples, strict=True)
        }
        judged: list[RuleStateRow] = []
        for row in rows:
            rule = holds[row.rule_key]
            count, since = 0, None
            if rule.selector.matches(row.device_id):
                own = own_of.get((row.device_id, row.rule_key))
                count, since = await self._current_run(conn, rule, row.device_id, own=own)
                if count and since is None:
                    # A run of one, the row's own newest sample: from when the row judged it.
                    since = row.last_ts
            if since is not None and row.pending_since is not None:
                # Never from before the row's own run: its start is on the row's timeline
                # (a time judged within the clock's bounds), the stored samples' device
                # times may not be (a clock behind, an upload judged at its receipt).
                since = max(since, row.pending_since)
            judged.append(
                msgspec.structs.replace(
                    row, rule_version=rule_version(rule), pending_count=count, pending_since=since
                )
            )
            log.info(
                "hold_rejudged",
                device_id=row.device_id,
                rule_key=row.rule_key,
                pending_since=None if row.pending_since is None else row.pending_since.isoformat(),
                now_pending_since=None if since is None else since.isoformat(),
            )
        try:
            await state_repo.write_rejudged(conn, judged, self.node_id)
        except StateWriteConflictError as exc:  # cannot happen under the lock; never trust it
            raise ConcurrentWriteError(str(exc)) from exc
        if len(rows) < limit:
            return len(rows), None
        last = rows[-1]
        return len(rows), (last.device_id, last.rule_key)

    @staticmethod
    async def _current_run(
        conn: asyncpg.Connection,
        rule: ThresholdRule,
        device_id: str,
        *,
        own: StoredSample | None = None,
    ) -> tuple[int, datetime | None]:
        """The pending run of `rule` on the device's newest stored samples (`current_run`).
        With `own`, the newest sample a row judged: where the newest by device time is
        another (a sample a clock ahead dated after it, judged at its receipt), a run of one
        with no start read if `own` violates, else none."""
        newest = [
            StoredSample(*row)
            for row in await runs_repo.samples_before(
                conn, device_id, rule.metric, _END_OF_TIME, RUN_LOOKBACK
            )
        ]
        if not newest:
            return 0, None  # none stored (or all past retention): nothing known to violate
        if own is not None and newest[0].event_id != own.event_id:
            # The row's timeline is not the device time's: its own newest stands alone.
            return (1, None) if violates(rule, own.value) else (0, None)
        index = newest_clearing(rule, newest, _END_OF_TIME)
        start = newest[-1] if index is None else newest[index]
        seqs = await runs_repo.device_seqs(conn, device_id, start.ts, 4 * RUN_LOOKBACK)
        return current_run(rule, device_id, newest, seqs=seqs)

    async def stale_keys(
        self, conn: asyncpg.Connection, *, after: SlotKey = ("", ""), limit: int = STALE_PAGE
    ) -> list[SlotKey]:
        """The keys of the rows `rejudge_stale_rows` judges, in (device, rule) order after
        ``after``, at most ``limit`` (not locked). One statement reads every row of this
        node's threshold rules: the hold timer asks only after a rule set changed."""
        asked = _threshold_rules(self.rules)
        if not asked:
            return []
        return await state_repo.stale_rows(
            conn, asked, self.node_id, NODE_LIVE_S, after=after, limit=limit
        )

    async def rejudge_stale_rows(
        self,
        conn: asyncpg.Connection,
        now: datetime,
        *,
        keys: Sequence[SlotKey] | None = None,
        after: SlotKey = ("", ""),
        limit: int = HOLD_PAGE,
    ) -> tuple[BatchAlarms, int, SlotKey | None]:
        """One page of the hold timer's step after a rule set changed, on ``conn`` in the
        caller's transaction: the firing and normal rows of this node's threshold rules (and
        the pending rows of those that hold no time) written under another definition that
        no other live node runs (a reload changed the rule), judged under this node's from
        the device's newest stored sample of the metric (`judged_again`). A firing row whose
        sample is back past the clear threshold is cleared through the clear path (the
        reason says the rule changed); a normal row whose sample violates fires through
        `create_alarms` (dedup key, supersede, audit, outbox), or starts its hold, or counts
        its run. A row with no stored sample left keeps its facts. Every row is written with
        this node's definition, conditional on its version, so no pass reads it again.

        The page's keys are read first, then those still stale locked as `fire_due_holds`
        locks (another transaction's row is skipped: an ingest batch brings it to its own
        definition, or rolls back and the next pass finds it). ``keys``: the page's keys as
        `stale_keys` read them (else read here, at most ``limit`` after ``after``). Returns
        what the page did, how many rows it found and could not lock, and the key to page
        after (None: no more)."""
        rules = self.rules  # one rule set per page, even if a reload swaps it meanwhile
        batch = BatchAlarms()
        thresholds = {rule.key: rule for rule in rules if isinstance(rule, ThresholdRule)}
        asked = _threshold_rules(rules)
        if not asked:
            return batch, 0, None
        if keys is None:
            keys = await state_repo.stale_rows(
                conn, asked, self.node_id, NODE_LIVE_S, after=after, limit=limit
            )
        rows = await state_repo.lock_stale_rows(conn, keys, asked, self.node_id, NODE_LIVE_S)
        firings: list[Firing] = []
        clearings: list[ClearRequest] = []
        changed: list[RuleStateRow] = []
        # The newest sample of each row's metric, for the rows whose device the rule still
        # selects (one statement for the page): the row's own newest, where it has the metric.
        selected = [row for row in rows if thresholds[row.rule_key].selector.matches(row.device_id)]
        wanted = [
            (row.device_id, thresholds[row.rule_key].metric, row.last_device_ts or row.last_ts)
            for row in selected
        ]
        samples = await runs_repo.newest_samples(
            conn, [(*want, row.last_seq) for want, row in zip(wanted, selected, strict=True)]
        )
        newest_of = {
            (row.device_id, row.rule_key): None if sample is None else StoredSample(*sample)
            for row, sample in zip(selected, samples, strict=True)
        }
        for row in rows:
            rule = thresholds[row.rule_key]
            version = rule_version(rule)
            state = _state_of(row)
            newest = newest_of.get((row.device_id, row.rule_key))
            run: tuple[int, datetime | None] = (1, None)
            if (
                newest is not None
                and not state.firing
                and rule.for_samples > 1
                and violates(rule, newest.value)
            ):
                run = await self._current_run(conn, rule, row.device_id, own=newest)
                # The run is read by device time; the row's own newest sample may be newer than
                # the newest by device time (a clock that ran ahead): it is a run of one then.
                run = run if run[0] else (1, None)
            event_id = rejudged_event_id(
                rule.key,
                row.device_id,
                "" if newest is None else newest.event_id,
                version,
                row.version,
            )
            judged = judged_again(
                rule,
                row.device_id,
                state,
                None if newest is None else (newest.value, newest.event_id),
                run=run,
                event_id=event_id,
                added=row.rule_version == state_repo.ADDED,
            )
            if judged.firing is not None:
                firings.append(judged.firing)
            if judged.clearing is not None:
                c = judged.clearing
                clearings.append(
                    ClearRequest(c.device_id, c.rule_key, c.telemetry_event_id, c.reason)
                )
            changed.append(_row_of(row, judged.state, version))
            if (judged.state.firing, judged.state.pending_count) == (
                state.firing,
                state.pending_count,
            ):
                continue  # kept as it was: only its definition is written
            log.info(
                "rule_rejudged",
                device_id=row.device_id,
                rule_key=row.rule_key,
                firing=state.firing,
                now_firing=judged.state.firing,
                now_pending=judged.state.pending_count,
                sample_event_id=None if newest is None else newest.event_id,
            )
        await self._fire(conn, firings, now, batch)
        batch.cleared += len(await clear_alarms(conn, clearings, now=now))
        try:
            await state_repo.write_states(conn, changed, self.node_id)
        except StateWriteConflictError as exc:  # cannot happen under the lock; never trust it
            raise ConcurrentWriteError(str(exc)) from exc
        batch.states_written += len(changed)
        skipped = len(keys) - len(rows)
        if len(keys) < limit:
            return batch, skipped, None
        return batch, skipped, keys[-1]

    async def fire_due_holds(
        self,
        conn: asyncpg.Connection,
        now: datetime,
        *,
        after: SlotKey = ("", ""),
        limit: int = HOLD_PAGE,
    ) -> tuple[BatchAlarms, SlotKey | None]:
        """One page of the hold timer (gateway.alarms.holds), on ``conn`` in the caller's
        transaction: fire the pending threshold violations whose `for_seconds` has passed by
        ``now`` (database time) with no further sample, and write their rows back.

        The rows are locked as an ingest batch locks them, skipping the ones another
        transaction holds (an ingest batch, another node's timer), and each is judged again as
        read under the lock (`fire_held`); the alarm goes through `create_alarms` and the row
        is written back conditional on its version, in the caller's transaction. So a row fires
        once, whichever nodes run the timer, and a sample committed after it finds it firing.
        Returns what the page did and the key to page after (None: no more rows).
        """
        rules = self.rules  # one rule set per page, even if a reload swaps it meanwhile
        batch = BatchAlarms()
        holds = {
            rule.key: rule
            for rule in rules
            if isinstance(rule, ThresholdRule) and rule.for_seconds > 0
        }
        if not holds:
            return batch, None
        asked = [
            HoldRule(key, rule_version(rule), rule.for_seconds, rule.for_samples)
            for key, rule in holds.items()
        ]
        rows = await state_repo.lock_due_holds(conn, asked, now, after=after, limit=limit)
        run: list[Firing] = []
        changed: list[RuleStateRow] = []
        for row, written_at in rows:
            rule = holds[row.rule_key]
            if not rule.selector.matches(row.device_id):
                # A reload changed the rule's devices (not part of its definition): the device's
                # samples are no longer judged by it, so nothing follows this violation any
                # more. Re-armed, as a reload's judgement re-arms the pending row of a device
                # its rule no longer selects: left pending, it fired as soon as a later reload
                # selected the device again, however long ago the device had cleared. Only a
                # row written before this node recorded its rules: one written since was
                # written by a node that selects the device (a rolling reload that widens the
                # rule, this node not reloaded yet), and is left to it.
                recorded = self._rules_recorded_at
                if recorded is not None and written_at < recorded:
                    changed.append(_row_of(row, _state_of(row).rearmed(), row.rule_version))
                continue
            judged = fire_held(rule, row.device_id, _state_of(row), written_at=written_at, now=now)
            if judged is None:
                continue  # not due under the lock after all
            firing, state = judged
            run.append(firing)
            changed.append(_row_of(row, state, row.rule_version))
        await self._fire(conn, run, now, batch)
        try:
            await state_repo.write_states(conn, changed, self.node_id)
        except StateWriteConflictError as exc:  # cannot happen under the lock; never trust it
            raise ConcurrentWriteError(str(exc)) from exc
        batch.states_written += len(changed)
        if len(rows) < limit:
            return batch, None
        last = rows[-1][0]
        return batch, (last.device_id, last.rule_key)

    def committed(self, batch: BatchAlarms) -> None:
        """After the commit of ``batch``'s transaction (never after a rollback): its metrics,
        and the rule-state rows it left, held for the next batches."""
        held = self._held
        for key, entry in batch.held.items():
            held.pop(key, None)  # to the end: the most recently committed
            held[key] = entry
        while len(held) > HELD_ROWS:
            del held[next(iter(held))]
        m = self.alarm_metrics
        if batch.created:
            # One logger for the batch: the module's lazy proxy builds a new one at every call
            # (3.6 us a call, timed with the line filtered out by the level: the bench's).
            logger = log.bind()
            for rule_key, alarm_id in batch.created:
                logger.info("alarm_created", alarm_id=alarm_id, rule_key=rule_key)
            for rule_key, count in collections.Counter(r for r, _ in batch.created).items():
                m.alarms_created.labels(rule_key).inc(count)
        m.alarms_superseded.inc(batch.superseded)
        m.alarms_deduplicated.inc(batch.deduplicated)
        m.alarms_cleared.inc(batch.cleared)
        m.rule_states_written.inc(batch.states_written)
        if batch.held_written:
            m.held_batches.labels("written").inc()
        if batch.held_contended:
            m.held_batches.labels("contended").inc()
        m.alarms_late.inc(batch.late)
        if batch.runs_judged or batch.runs_unjudged:
            m.late_runs.labels("judged").inc(batch.runs_judged)
            m.late_runs.labels("raised").inc(batch.runs_raised)
            m.late_runs.labels("unjudged").inc(batch.runs_unjudged)
        for reason, count in batch.clock_adjustments.items():
            m.clock_adjustments.labels(reason).inc(count)

    def _held_states(self, touched: _Touched) -> _LoadedStates | None:
        """The batch's rows as this node holds them, when it holds every one and has not
        found them written by others lately (else None: the batch locks and reads them)."""
        if self._held_skip:
            self._held_skip -= 1
            return None
        held = self._held
        if not touched.keys <= held.keys():
            return None
        return _loaded({key: held[key] for key in touched.keys}, touched)

    def _contended(self, contended: bool) -> None:
        """What a batch found of its held rows: written by someone else since (then the next
        batches lock their rows first, for twice as many batches each time it happens again,
        up to HELD_SKIP_MAX), or all as held (the node writes alone again)."""
        if contended:
            self._held_skip = self._held_backoff
            self._held_backoff = min(2 * self._held_backoff, HELD_SKIP_MAX)
        else:
            self._held_backoff = 1

    async def _lock_states(self, conn: asyncpg.Connection, touched: _Touched) -> _LoadedStates:
        """Read the states the batch touches, in one statement, locked in a fixed order."""
        keys, versions = touched.keys, touched.versions
        held = self._held
        # Rows held exist (a set comparison in C, the usual batch); else the bitmap's hint.
        exist = keys <= held.keys() or self._seen_rows.all_seen(keys)
        locked = await state_repo.lock_states(
            conn,
            [(device_id, rule_key, versions[rule_key]) for device_id, rule_key in keys],
            exist=exist,
            held=held,
        )
        read: dict[SlotKey, _Held] = {}
        missed = False
        for answered in locked:
            row = answered.row
            key = (row.device_id, row.rule_key)
            # A held row comes back as held; one read whole gets its state once.
            if isinstance(answered, _Held):
                read[key] = answered
            else:
                read[key] = _Held(answered.token, row, _state_of(row))
                missed = missed or key in held  # held, and written by someone else since
        if not exist:
            self._seen_rows.add(read)
        return _loaded(read, touched, missed=missed)

    async def _write_states(
        self, conn: asyncpg.Connection, loaded: _LoadedStates, batch: BatchAlarms, *, locked: bool
    ) -> bool:
        """Write back the rows whose state or rule version changed, each conditional on the
        version read. ``locked``: the batch read them under lock_states; else it judged them
        as held, and they are locked and written only if every row it touches is still the
        one held (False: nothing was written, and the batch is judged again under
        lock_states)."""
        changed: list[RuleStateRow] = []  # written whole
        moved: list[RuleStateRow] = []  # changed in the columns a sample moves only
        written: list[tuple[RuleStateRow, RuleState]] = []  # either, with its state
        kept: list[tuple[SlotKey, _Held]] = []
        for key, entry in loaded.read.items():
            state = loaded.states[key]
            version = loaded.versions[key[1]]
            if state == entry.state and entry.row.rule_version == version:
                kept.append((key, entry))  # left as read: held with the token it was read with
                continue
            row = _row_of(entry.row, state, version)
            if entry.row.rule_version == version and _UNMOVED(state) == _UNMOVED(entry.state):
                moved.append(row)
            else:
                changed.append(row)
            written.append((row, state))
        try:
            if locked:
                xmin = await state_repo.write_states(conn, changed, self.node_id, moved)
            elif loaded.read:
                tokens = [(k[0], k[1], entry.token) for k, entry in loaded.read.items()]
                answer = await state_repo.write_held_states(
                    conn, tokens, changed, self.node_id, moved
                )
                self._contended(answer is None)
                if answer is None:
                    batch.held_contended = True
                    return False
                batch.held_written = True
                xmin = answer
            else:  # no row to lock: nothing stateful in the batch
                xmin = ""
        except StateWriteConflictError as exc:  # cannot happen under the lock; never trust it
            raise ConcurrentWriteError(str(exc)) from exc
        held = batch.held
        for key, entry in kept:
            held[key] = entry
        for row, state in written:
            # As the write left it: one version on, this transaction's xmin.
            after = msgspec.structs.replace(row, version=row.version + 1)
            held[row.device_id, row.rule_key] = _Held(f"{after.version}.{xmin}", after, state)
        batch.states_written += len(written)
        return True

    async def _write_step(
        self, conn: asyncpg.Connection, step: _Step, now: datetime, batch: BatchAlarms
    ) -> None:
        """Write a step's firings, then its clearings (of other (device, rule)s), and empty it."""
        await self._fire(conn, step.firings, now, batch)
        if step.clearings:
            requests = [
                ClearRequest(
                    device_id=c.device_id,
                    rule_key=c.rule_key,
                    clear_event_id=c.telemetry_event_id,
                    reason=c.reason,
                )
                for c in step.clearings
            ]
            batch.cleared += len(await clear_alarms(conn, requests, now=now))
            step.clearings.clear()
        step.keys.clear()

    async def _fire(
        self, conn: asyncpg.Connection, run: list[Firing], now: datetime, batch: BatchAlarms
    ) -> list[Creation]:
        """Write a run of firings (distinct device and rule) and empty it; their creations."""
        if not run:
            return []
        requests = [_request(f) for f in run]
        creations = await create_alarms(
            conn, requests, node_id=self.node_id, now=now, summary=self.summary
        )
        for firing, creation in zip(run, creations, strict=True):
            if not creation.created or creation.alarm is None:
                batch.deduplicated += 1
                continue
            batch.created.append((firing.rule_key, creation.alarm.id))
            if creation.superseded_id is not None:
                batch.superseded += 1
        run.clear()
        return creations

    async def _fire_late(
        self, conn: asyncpg.Connection, firing: Firing, now: datetime, batch: BatchAlarms
    ) -> None:
        assert firing.superseded_by_event is not None
        successor = dedup_key(firing.rule_key, firing.device_id, firing.superseded_by_event)
        if not await repo.successor_open(conn, successor):
            # An occurrence is never hidden: the alarm that would stand for it has ended (people
            # closed it), so it is raised as any new occurrence is, and said to be late.
            # A clear between it and that alarm (committed before it) still cleared it: an
            # event committed after its own clear becomes an alarm already cleared.
            on_its_own = dataclasses.replace(
                firing,
                superseded_by_event=None,
                cleared_by_event=None,
                reason=f"{firing.reason} (late: the newer alarm of its rule had ended)",
            )
            [creation] = await self._fire(conn, [on_its_own], now, batch)
            batch.late += 1
            if firing.cleared_by_event is not None and creation.alarm is not None:
                cleared = await clear_created(
                    conn,
                    creation.alarm.id,
                    clear_event_id=firing.cleared_by_event,
                    reason="cleared by a clear committed before it (late)",
                    now=now,
                )
                batch.cleared += cleared
            return
        creation = await create_late_alarm(
            conn,
            _request(firing),
            superseded_by_event=firing.superseded_by_event,
            cleared_by_event=firing.cleared_by_event,
            node_id=self.node_id,
            now=now,
        )
        if not creation.created or creation.alarm is None:
            batch.deduplicated += 1
            return
        batch.created.append((firing.rule_key, creation.alarm.id))
        batch.late += 1

    async def _clear(
        self, conn: asyncpg.Connection, clearing: Clearing, now: datetime, batch: BatchAlarms
    ) -> None:
        cleared = await clear_alarm(
            conn,
            device_id=clearing.device_id,
            rule_key=clearing.rule_key,
            clear_event_id=clearing.telemetry_event_id,
            reason=clearing.reason,
            now=now,
            raised_by_then=clearing.raised_by_then,
        )
        if cleared is not None:
            batch.cleared += 1

    async def _clear_inactivity(
        self,
        conn: asyncpg.Connection,
        rules: RuleSet,
        messages: Sequence[tuple[str, str, Telemetry]],
        now: datetime,
        batch: BatchAlarms,
        *,
        heard_at: datetime | None = None,
        received: Mapping[str, float] | None = None,
    ) -> None:
        """Any message clears the device's inactivity alarms, whichever node raised them, and
        those of rules a reload removed or renamed (recognised by their trigger); one heard
        at ``heard_at`` (a replayed dead letter), or read off the broker at ``received`` (per
        device), only those for a silence begun before it."""
        unconfigured = self._unconfigured_inactivity
        if not rules.inactivity_rules and not unconfigured:
            return
        first_event: dict[str, str] = {}
        for device_id, event_id, _ in messages:
            first_event.setdefault(device_id, event_id)
        # Every inactivity rule's, not only those that select the device now: a reload that
        # changed a rule's `devices` leaves the alarm it raised for a device it no longer
        # selects, and the device heard from again ends that silence too (one key per rule).
        configured = [rule.key for rule in rules.inactivity_rules]
        keys, events, read = [], [], []
        heard = received or {}
        for device_id, event_id in first_event.items():
            for rule_key in (*configured, *unconfigured):
                keys.append(active_key(device_id, rule_key))
                events.append(event_id)
                read.append(heard.get(device_id))
        rows = await repo.clear_many(
            conn,
            keys,
            events,
            now,
            by_trigger=unconfigured,
            heard_at=heard_at,
            received=read if received else None,
            inactivity=True,
        )
        batch.cleared += len(rows)
        await record_cleared_many(
            conn, [(row, row["event_id"], "device heard from again") for row in rows]
        )


def _threshold_rules(rules: RuleSet) -> list[HoldRule]:
    """The threshold rules of ``rules`` as the stale rows' queries ask for them."""
    return [
        HoldRule(rule.key, rule_version(rule), rule.for_seconds, rule.for_samples)
        for rule in rules
        if isinstance(rule, ThresholdRule)
    ]


def _inactivity_keys(rules: RuleSet) -> frozenset[str]:
    return frozenset(rule.key for rule in rules.inactivity_rules)


def _late(outcome: Firing | Clearing) -> bool:
    """A late firing (a newer alarm of its rule stands) or a late clearing (of the alarm that
    was active at its time): written on its own, between steps."""
    if isinstance(outcome, Firing):
        return outcome.superseded_by_event is not None
    return outcome.raised_by_then is not None


def _count_adjustment(
    batch: BatchAlarms,
    device_id: str,
    message: Telemetry,
    evaluation: Evaluation,
    received_at: datetime,
) -> None:
    adjustment, judged_at = evaluation.clock_adjustment, evaluation.judged_at
    assert adjustment is not None
    assert judged_at is not None
    reason = adjustment.value
    batch.clock_adjustments[reason] = batch.clock_adjustments.get(reason, 0) + 1
    known = batch.device_clocks.get((device_id, reason))
    batch.device_clocks[(device_id, reason)] = ClockFigure(
        device_id,
        reason,
        1 if known is None else known.count + 1,
        received_at,
        message.timestamp(),
        judged_at,
    )


def _request(firing: Firing) -> AlarmRequest:
    return AlarmRequest(
        device_id=firing.device_id,
        rule_key=firing.rule_key,
        severity=firing.severity,
        telemetry_event_id=firing.telemetry_event_id,
        reason=firing.reason,
        trigger=None if firing.trigger is None else dict(firing.trigger),
        rule_description=firing.rule_description,
    )


def _state_of(row: RuleStateRow) -> RuleState:
    return RuleState(*_STATE_FIELDS(row))


def _row_of(read: RuleStateRow, state: RuleState, rule_version: str) -> RuleStateRow:
    return RuleStateRow(
        read.device_id, read.rule_key, read.version, rule_version, *_STATE_FIELDS(state)
    )


# RuleState's fields, which RuleStateRow has too (after its keys), in the same order.
_STATE_FIELDS = operator.attrgetter(*RuleState.__struct_fields__)
# Those a sample does not move: a state changed in none of them is written as "moved".
_UNMOVED = operator.attrgetter(
    *(f for f in RuleState.__struct_fields__ if f not in state_repo.SAMPLE_MOVES)
)


def inactivity_event_id(rule_key: str, device_id: str, last_seen: datetime) -> str:
    """The stand-in telemetry event id of an inactivity alarm: derived from stored facts, so
    every node (and a restarted one) computes the same dedup key for the same silence."""
    source = f"inactivity\n{rule_key}\n{device_id}\n{last_seen.isoformat()}".encode()
    return hashlib.sha256(source).hexdigest()
