"""Late samples the rule state cannot place, judged again from the stored samples of their run.

A rule that counts samples (`for_samples` > 1) keeps one run of violations per device in its
state: how many, and since when. When the nodes of a `$share` group commit one device's samples
out of step (a node lagging, a failover's backlog), a violating sample can arrive after a newer
run began, or after the clear that ended its own run; which run it belonged to, and whether
that run had reached `for_samples`, is then no longer in the state, and the ordering rule alone
would drop it: the run's alarm would be missed. A late break (a clearing or in-band sample)
inside the pending run would likewise leave a run counted that device order splits.

Those samples are flagged by `evaluate` (`Evaluation.unplaced`), and the engine judges their
rule again from the facts themselves, the device's stored samples, in its transaction and under
the rule state's row lock:

- the replay starts at the newest clearing sample stored before the late one
  (`newest_clearing`): after a clearing sample, in device order, nothing is pending and
  nothing firing, so the state there is known without anything older;
- from there to the newest stored sample, `evaluate` reads them in device order
  (`replay_samples`), which gives each episode of the rule (the firing a run reached and
  the clearing that ended it) and the state one node reading in device order would now hold;
- an episode no stored alarm stands for (none raised by a sample inside it) is raised now,
  on its own trigger sample, already cleared by its clearing if it has one (`uncovered`); an
  episode that ended is cleared whichever alarm stands for it.

What a node cannot know is what is still in flight on another: a sample that arrives later
is late in its turn, and flagged in its turn. Every node computes the same trigger sample for
the same run, so the alarm's dedup key keeps two repairs of one run to one alarm. Rules with
`for_seconds` are left to the ordering rule and the hold timer: the timer fires holds on the
database's clock, which a replay of samples cannot reproduce.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import UTC, datetime

from gateway.domain.rules.evaluate import Clearing, Firing, clears, evaluate
from gateway.domain.rules.model import RuleSet, ThresholdRule
from gateway.domain.rules.state import IDLE, RuleState, RuleStates, replace
from protocol import MetricValue, Telemetry

__all__ = [
    "Episode",
    "StoredAlarm",
    "StoredSample",
    "covering",
    "current_run",
    "judged_from_samples",
    "merged_state",
    "newest_clearing",
    "replay_samples",
    "uncovered",
]


def judged_from_samples(rule: ThresholdRule) -> bool:
    """Whether late samples of `rule` that the state cannot place are judged again from the
    stored samples: rules that count samples and hold no time."""
    return rule.for_samples > 1 and rule.for_seconds <= 0


@dataclass(frozen=True, slots=True)
class StoredSample:
    """One stored sample of the rule's metric: its device time, seq, event id and value."""

    ts: datetime
    seq: int | None
    event_id: str
    value: MetricValue


@dataclass(frozen=True, slots=True)
class StoredAlarm:
    """An alarm of the (device, rule) as stored: the device time of the sample that raised it
    (its trigger's `sample_ts`) and that sample's event id."""

    sample_ts: datetime
    event_id: str


@dataclass(frozen=True, slots=True)
class Episode:
    """A firing of the replay and the clearing that ended it (None: it still stands), with
    the time of the last clearing sample before the firing (the replay's anchor at the
    earliest): an alarm raised by a sample after `after`, up to the clearing, stands for it."""

    firing: Firing
    clearing: Clearing | None
    after: datetime


def newest_clearing(
    rule: ThresholdRule, before: Sequence[StoredSample], at: datetime
) -> int | None:
    """The index in `before` (newest first) of the newest clearing sample dated before `at`
    (the late sample's own time: a late clear may end the run before it), None if none."""
    for index, sample in enumerate(before):
        if sample.ts < at and clears(rule, sample.value):
            return index
    return None


def replay_samples(
    rules: RuleSet,
    rule: ThresholdRule,
    device_id: str,
    samples: Sequence[StoredSample],
    *,
    seqs: AbstractSet[int] = frozenset(),
    raised: Sequence[StoredAlarm] = (),
) -> tuple[list[Episode], RuleState]:
    """`samples` (device order, from a clearing sample or the device's first) read by one
    node with a fresh state: the rule's episodes and the state it ends in.

    `raised`: the alarms of the rule already stored over the span. What was raised stands:
    where the replay reaches an alarm's sample without firing (the alarm was raised on what
    had arrived by then, and a sample in flight since says the run was shorter), it fires
    there as the alarm did, so that its episode ends, and the alarm clears, where the
    samples say so, and no second alarm is raised for the same run.

    `seqs`: the seqs of every stored message of the device over the same span (whatever it
    carried). Where two consecutive samples of the metric have seqs with a message missing
    between them (at most `MAX_GAP`), that message is in flight on another node, or lost: the
    run is not known to be consecutive there, so its count starts again after the gap. A
    sample that arrives later into the gap is late in its turn, and its run judged again."""
    episodes: list[Episode] = []
    states: RuleStates = {}
    key = (device_id, rule.key)
    open_firing: Firing | None = None
    open_after = after = samples[0].ts if samples else datetime.min
    previous: StoredSample | None = None
    raised_on = {alarm.event_id for alarm in raised}
    for sample in samples:
        if previous is not None and _gap(previous.seq, sample.seq, seqs):
            state = states.get(key)
            if state is not None and not state.firing:
                states[key] = state.rearmed()
        previous = sample
        message = Telemetry(ts=sample.ts, seq=sample.seq, metrics={rule.metric: sample.value})
        outcomes = list(evaluate(rules, states, device_id, sample.event_id, message).outcomes)
        state = states.get(key, IDLE)
        if sample.event_id in raised_on and not state.firing:
            states[key] = replace(
                state.rearmed(), firing=True, fired_ts=sample.ts, fired_event_id=sample.event_id
            )
            outcomes.append(_stands(rule, device_id, sample))
        for outcome in outcomes:
            if outcome.rule_key != rule.key:
                continue
            if isinstance(outcome, Firing):
                if open_firing is not None:  # a firing superseding the one standing
                    episodes.append(Episode(open_firing, None, open_after))
                open_firing, open_after = outcome, after
            elif open_firing is not None:
                episodes.append(Episode(open_firing, outcome, open_after))
                open_firing = None
        if clears(rule, sample.value):
            after = sample.ts
    if open_firing is not None:
        episodes.append(Episode(open_firing, None, open_after))
    return episodes, states.get(key, IDLE)


def _stands(rule: ThresholdRule, device_id: str, sample: StoredSample) -> Firing:
    """The firing of an alarm already stored on `sample` (never raised again: it covers its
    own episode)."""
    return Firing(
        rule.key,
        rule.severity,
        device_id,
        sample.event_id,
        "raised before",
        sample.ts,
        rule_description=rule.description,
    )


# The most messages missing between two samples that are taken for a gap in flight; a larger
# jump of seq is a device's own (a new counter, a restart's epoch), not messages in flight.
MAX_GAP = 64


def _gap(before: int | None, after: int | None, seqs: AbstractSet[int]) -> bool:
    if before is None or after is None or not before + 1 < after <= before + 1 + MAX_GAP:
        return False
    return any(seq not in seqs for seq in range(before + 1, after))


def covering(episode: Episode, alarms: Sequence[StoredAlarm]) -> StoredAlarm | None:
    """The stored alarm that stands for `episode`: one raised by a sample inside it."""
    end = None if episode.clearing is None else episode.clearing.observed_at
    for alarm in alarms:
        if episode.after < alarm.sample_ts and (end is None or alarm.sample_ts <= end):
            return alarm
    return None


def uncovered(episodes: Sequence[Episode], alarms: Sequence[StoredAlarm]) -> list[Episode]:
    """The episodes no stored alarm stands for: the runs the ordering rule missed."""
    return [episode for episode in episodes if covering(episode, alarms) is None]


def merged_state(
    old: RuleState, replayed: RuleState, episodes: Sequence[Episode], alarms: Sequence[StoredAlarm]
) -> RuleState:
    """The rule state after the replay: whether it fires and what is pending are the replay's
    (device order over what is stored); the times it keeps are the newest either knows, and
    the alarm it names is the one standing for the replay's open episode, else the newest.
    `alarms` includes those the repair raised."""
    newest_alarm = max(alarms, key=lambda alarm: alarm.sample_ts, default=None)
    standing = None
    if replayed.firing and episodes and episodes[-1].clearing is None:
        standing = covering(episodes[-1], alarms)
    named = standing or newest_alarm
    fired_ts, fired_event_id = old.fired_ts, old.fired_event_id
    newer = fired_ts is None or (named is not None and named.sample_ts > fired_ts)
    if named is not None and (standing is not None or newer):
        fired_ts, fired_event_id = named.sample_ts, named.event_id
    clear_ts, clear_event_id = old.clear_ts, old.clear_event_id
    if replayed.clear_ts is not None and (clear_ts is None or replayed.clear_ts > clear_ts):
        clear_ts, clear_event_id = replayed.clear_ts, replayed.clear_event_id
    last_ts, last_seq, last_device_ts = old.last_ts, old.last_seq, old.last_device_ts
    if replayed.last_ts is not None and (last_ts is None or replayed.last_ts > last_ts):
        last_ts, last_seq = replayed.last_ts, replayed.last_seq
        last_device_ts = replayed.last_device_ts
    return RuleState(
        firing=replayed.firing,
        pending_count=replayed.pending_count,
        pending_since=replayed.pending_since,
        last_ts=last_ts,
        last_seq=last_seq,
        fired_ts=fired_ts,
        fired_event_id=fired_event_id,
        released_ts=_newest(old.released_ts, replayed.released_ts),
        clear_ts=clear_ts,
        clear_event_id=clear_event_id,
        violating_ts=_newest(old.violating_ts, replayed.violating_ts),
        last_device_ts=last_device_ts,
    )


def _newest(a: datetime | None, b: datetime | None) -> datetime | None:
    if a is None:
        return b
    return a if b is None or a >= b else b


# Later than any stored sample: where the newest clearing sample is looked for from.
_END_OF_TIME = datetime.max.replace(tzinfo=UTC)


def current_run(
    rule: ThresholdRule,
    device_id: str,
    newest: Sequence[StoredSample],
    *,
    seqs: AbstractSet[int] = frozenset(),
) -> tuple[int, datetime | None]:
    """The run of violations `rule` has pending on the device's newest stored samples
    (`newest`: newest first, as many as were read): its count and its first sample's time,
    (0, None) when the newest sample does not violate. Judged as `replay_samples` judges a
    late sample's run, from the newest clearing sample on (the oldest read if none clears),
    with one difference: nothing fires. The hold timer takes it for the pending run of a row
    written under another definition of the rule (a reload), and judges its hold on the
    clock from there."""
    index = newest_clearing(rule, newest, _END_OF_TIME)
    run = list(reversed(newest if index is None else newest[: index + 1]))
    if not run:
        return 0, None
    # The same rule, counting for ever: the replay ends pending, never firing.
    counting = dataclasses.replace(rule, for_samples=sys.maxsize)
    _, state = replay_samples(RuleSet([counting]), counting, device_id, run, seqs=seqs)
    return state.pending_count, state.pending_since
