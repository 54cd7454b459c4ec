"""The campaign aggregate's pure decision: when a RUNNING campaign closes, and how."""

from __future__ import annotations

import pytest

from gateway.domain.campaign import AbortCriteria, CampaignStatus, Tally, settle

ABORT = AbortCriteria(failure_ratio=0.2, min_finished=50)


def test_tally_counts_open_finished_and_failed() -> None:
    tally = Tally.of({"PENDING": 3, "CLAIMED": 1, "SENT": 2, "ACKED": 5, "FAILED": 2,
                      "TIMEOUT": 1, "CANCELLED": 4})  # fmt: skip
    assert tally == Tally(total=18, open=6, finished=12, failed=3)


def test_it_keeps_running_while_commands_are_open_and_the_criteria_are_not_met() -> None:
    assert settle({"PENDING": 10, "ACKED": 40, "FAILED": 9}, ABORT) is None  # 49 finished
    assert settle({"PENDING": 10, "ACKED": 45, "FAILED": 9}, ABORT) is None  # 9/54 < 0.2
    assert settle({"PENDING": 1, "FAILED": 100}, None) is None  # no criteria: never aborts


def test_the_abort_needs_min_finished_and_the_ratio_counting_failed_and_timeout() -> None:
    verdict = settle({"PENDING": 10, "ACKED": 40, "FAILED": 5, "TIMEOUT": 5}, ABORT)
    assert verdict is not None
    assert verdict.status is CampaignStatus.ABORTED
    assert "10 of 50" in verdict.reason
    # CANCELLED counts as finished but not as failed.
    assert settle({"PENDING": 1, "CANCELLED": 40, "FAILED": 10}, ABORT) is not None
    assert settle({"PENDING": 1, "CANCELLED": 41, "FAILED": 9, "ACKED": 0}, ABORT) is None


@pytest.mark.parametrize(
    ("ratio", "failed", "finished"), [(0.3, 3, 10), (0.1, 1, 10), (0.7, 7, 10)]
)
def test_the_ratio_is_reached_exactly_at_its_value(
    ratio: float, failed: int, finished: int
) -> None:
    criteria = AbortCriteria(failure_ratio=ratio, min_finished=finished)
    counts = {"FAILED": failed, "ACKED": finished - failed, "PENDING": 5}
    assert settle(counts, criteria) is not None
    assert (
        settle({**counts, "FAILED": failed - 1, "ACKED": finished - failed + 1}, criteria) is None
    )


def test_it_completes_when_every_command_is_terminal() -> None:
    verdict = settle({"ACKED": 3, "FAILED": 1, "CANCELLED": 1}, None)
    assert verdict is not None
    assert verdict.status is CampaignStatus.COMPLETED
    # ... unless that last failure reached the abort criteria.
    last = settle({"ACKED": 40, "FAILED": 10}, ABORT)
    assert last is not None
    assert last.status is CampaignStatus.ABORTED
    assert settle({}, None) is None  # nothing to judge
