"""`current_run`: the pending run of a hold rule on the device's newest stored samples, as the
hold timer judges a row written under another definition of the rule (a reload mid-hold)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gateway.domain.rules import (
    RuleConfig,
    StoredSample,
    ThresholdRule,
    compile_rules,
    current_run,
)

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
CONFIG = RuleConfig(
    key="held", kind="threshold", metric="temp", op=">", value=80, clear_value=75,
    for_seconds=60, severity="MAJOR",
)  # fmt: skip
(HELD,) = compile_rules([CONFIG])
assert isinstance(HELD, ThresholdRule)


def _newest_first(*values: float) -> list[StoredSample]:
    samples = [
        StoredSample(T0 + timedelta(seconds=i), None, f"e{i}", value)
        for i, value in enumerate(values)
    ]
    return samples[::-1]


def test_a_violation_going_on_is_pending_from_its_first_sample_and_never_fires() -> None:
    # Held far past 60 s in the samples themselves: still only pending (the timer fires it).
    samples = _newest_first(70, 95, 96, 97)
    samples[0] = StoredSample(T0 + timedelta(hours=1), None, "e3", 97)
    assert current_run(HELD, "d1", samples) == (3, T0 + timedelta(seconds=1))


def test_a_newest_sample_that_clears_or_sits_in_the_band_leaves_nothing_pending() -> None:
    assert current_run(HELD, "d1", _newest_first(95, 96, 70)) == (0, None)
    assert current_run(HELD, "d1", _newest_first(95, 96, 77)) == (0, None)  # band: re-armed


def test_a_band_sample_inside_the_run_starts_it_again() -> None:
    assert current_run(HELD, "d1", _newest_first(95, 77, 96)) == (1, T0 + timedelta(seconds=2))


def test_with_no_clearing_sample_read_the_run_starts_at_the_oldest_read() -> None:
    assert current_run(HELD, "d1", _newest_first(95, 96)) == (2, T0)
    assert current_run(HELD, "d1", []) == (0, None)


def test_a_message_missing_between_two_samples_starts_the_run_again_after_it() -> None:
    # seq 2 is not stored (in flight on another node, or lost): 95 and 96 are not known to be
    # consecutive.
    samples = [
        StoredSample(T0 + timedelta(seconds=i), seq, f"e{seq}", value)
        for i, (seq, value) in enumerate([(0, 70), (1, 95), (3, 96), (4, 97)])
    ][::-1]
    assert current_run(HELD, "d1", samples, seqs=frozenset({0, 1, 3, 4})) == (
        2,
        T0 + timedelta(seconds=2),
    )
    assert current_run(HELD, "d1", samples, seqs=frozenset({0, 1, 2, 3, 4})) == (
        3,
        T0 + timedelta(seconds=1),
    )
