"""The campaign aggregate (behaviour §7): one request commanding many devices.

Pure: no I/O and no clock reads. A campaign is RUNNING until it closes once, as COMPLETED
(every command terminal), ABORTED (its abort criteria were met: its open commands are
cancelled) or CANCELLED (by an operator). :func:`settle` decides, from its commands' count per
status, whether a RUNNING campaign closes now; storage makes that decision a conditional write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from gateway.domain.command import OPEN_STATUSES, CommandStatus
from gateway.domain.errors import GatewayError


class CampaignStatus(StrEnum):
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    ABORTED = "ABORTED"
    CANCELLED = "CANCELLED"


# The command statuses counted as failed by the abort criteria.
FAILED_STATUSES: Final = frozenset({CommandStatus.FAILED, CommandStatus.TIMEOUT})


class CampaignError(GatewayError):
    code = "CAMPAIGN_ERROR"


@dataclass(frozen=True, slots=True)
class AbortCriteria:
    """Abort once ``min_finished`` commands are terminal and the share of them FAILED or
    TIMEOUT is at least ``failure_ratio``."""

    failure_ratio: float
    min_finished: int


@dataclass(frozen=True, slots=True)
class Tally:
    total: int
    open: int
    finished: int
    failed: int

    @classmethod
    def of(cls, counts: Mapping[str, int]) -> Tally:
        total = sum(counts.values())
        open_ = sum(n for status, n in counts.items() if CommandStatus(status) in OPEN_STATUSES)
        failed = sum(n for status, n in counts.items() if CommandStatus(status) in FAILED_STATUSES)
        return cls(total=total, open=open_, finished=total - open_, failed=failed)


@dataclass(frozen=True, slots=True)
class Verdict:
    status: CampaignStatus
    reason: str


def settle(counts: Mapping[str, int], abort: AbortCriteria | None) -> Verdict | None:
    """How a RUNNING campaign closes now, or None when it keeps running.

    The abort criteria are judged first: a campaign whose last command failed and so reached
    the failure ratio is ABORTED, not COMPLETED.
    """
    tally = Tally.of(counts)
    if (
        abort is not None
        and tally.finished >= abort.min_finished
        and tally.failed / tally.finished >= abort.failure_ratio  # min_finished >= 1
    ):
        return Verdict(
            CampaignStatus.ABORTED,
            f"{tally.failed} of {tally.finished} finished commands failed or timed out "
            f"(abort at a ratio of {abort.failure_ratio:g} once {abort.min_finished} finished)",
        )
    if tally.total > 0 and tally.open == 0:
        return Verdict(CampaignStatus.COMPLETED, f"all {tally.total} commands are terminal")
    return None
