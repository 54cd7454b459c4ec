"""The downlink command aggregate: seven states, the transition whitelist, receipt judgement.

Pure: no I/O and no clock reads. Storage enforces the record's invariants with CHECK
constraints (``storage/migrations/0004_commands.sql``); a receipt is applied by one conditional
UPDATE carrying the four guards of docs/behaviour.md §7 (:func:`receipt_matches` states
them), and when that UPDATE changes nothing, :func:`judge_receipt` explains why from a fresh
read of the row.

Two counters, never merged: ``retry_count`` counts device-side failures requeued (more than
:data:`MAX_RETRIES` → TIMEOUT); ``reclaim_count`` counts leases that expired because a node went
silent (more than :data:`MAX_RECLAIMS` → :func:`needs_people`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from gateway.domain.errors import GatewayError
from protocol.messages import ReceiptResult, ResultCode

MAX_RETRIES: Final = 10
MAX_RECLAIMS: Final = 5
# The generation of a command's first claim; 0 means never claimed, and no downlink carries it.
FIRST_GENERATION: Final = 1


class CommandStatus(StrEnum):
    PENDING = "PENDING"
    CLAIMED = "CLAIMED"
    SENT = "SENT"
    ACKED = "ACKED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"


OPEN_STATUSES: Final = frozenset({CommandStatus.PENDING, CommandStatus.CLAIMED, CommandStatus.SENT})
TERMINAL_STATUSES: Final = frozenset(
    {CommandStatus.ACKED, CommandStatus.FAILED, CommandStatus.TIMEOUT, CommandStatus.CANCELLED}
)
# The statuses a receipt can act on: the four-guard UPDATE's ``status IN (...)``.
RECEIVING_STATUSES: Final = frozenset({CommandStatus.CLAIMED, CommandStatus.SENT})


class Delivery(StrEnum):
    REALTIME = "realtime"  # any failure is final and returned to the caller at once
    DEFERRABLE = "deferrable"  # device-side failures go back to PENDING with backoff


class ReceiptOutcome(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATED = "duplicated"  # a late or repeated receipt: not an error, state untouched
    REJECTED = "rejected"


class RejectReason(StrEnum):
    NODE_MISMATCH = "NODE_MISMATCH"
    NODE_UNKNOWN = "NODE_UNKNOWN"
    CLAIM_GENERATION_REQUIRED = "CLAIM_GENERATION_REQUIRED"
    UNKNOWN_COMMAND = "UNKNOWN_COMMAND"
    # A generation the command never had (newer than its latest claim, or 0, which no claim
    # carries): forged or confused.
    UNKNOWN_GENERATION = "UNKNOWN_GENERATION"
    COMMAND_CLOSED = "COMMAND_CLOSED"
    # PENDING: the claim the receipt answers has lapsed, or there never was one.
    NOT_CLAIMED = "NOT_CLAIMED"
    # A resultCode outside the standard ones: it would land in the command's standard field,
    # where readers take it for one of them. Vendor codes belong in rawResultCode.
    INVALID_RESULT_CODE = "INVALID_RESULT_CODE"


_S = CommandStatus
TRANSITIONS: Final[Mapping[CommandStatus, frozenset[CommandStatus]]] = MappingProxyType(
    {
        _S.PENDING: frozenset({_S.CLAIMED, _S.CANCELLED, _S.TIMEOUT}),
        # PENDING: the lease expired (reclaim), or a deferrable retry.
        _S.CLAIMED: frozenset({_S.SENT, _S.PENDING, _S.ACKED, _S.FAILED, _S.TIMEOUT, _S.CANCELLED}),
        # PENDING: a deferrable retry only; a SENT command's lease no longer matters.
        _S.SENT: frozenset({_S.ACKED, _S.FAILED, _S.PENDING, _S.TIMEOUT, _S.CANCELLED}),
        _S.ACKED: frozenset(),
        _S.FAILED: frozenset(),
        _S.TIMEOUT: frozenset(),
        _S.CANCELLED: frozenset(),
    }
)


def can_transition(status: CommandStatus, target: CommandStatus) -> bool:
    return target in TRANSITIONS[status]


class CommandError(GatewayError):
    """Root of the command aggregate's errors."""


class IllegalCommandTransitionError(CommandError):
    """The whitelist has no ``status`` → ``target``."""

    code: Final = "ILLEGAL_TRANSITION"

    def __init__(self, status: CommandStatus, target: CommandStatus) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[status])) or "nothing (terminal)"
        super().__init__(f"a command in {status} cannot become {target}; allowed: {allowed}")
        self.status = status
        self.target = target


def check_transition(status: CommandStatus, target: CommandStatus) -> CommandStatus:
    """``target`` if the whitelist allows it from ``status``; else raise."""
    if not can_transition(status, target):
        raise IllegalCommandTransitionError(status, target)
    return target


# --- receipts ---------------------------------------------------------------------------------

STANDARD_RESULT_CODES: Final = frozenset(int(code) for code in ResultCode)


def is_standard_result_code(code: int | None) -> bool:
    """Absent, or one of :class:`ResultCode`: what a command's ``result_code`` may hold."""
    return code is None or code in STANDARD_RESULT_CODES


@dataclass(frozen=True, slots=True)
class Guards:
    """What a fresh read of the command row says about the four guards.

    A missing command has every other field ``None``; an existing one has a status and a
    generation. ``claimed_node_id`` is ``None`` for a command never claimed, or claimed before
    node ids were recorded (``legacy_claim``).
    """

    command_exists: bool
    status: CommandStatus | None
    claim_generation: int | None
    claimed_node_id: str | None
    # A receipt of the row's latest claim (its generation and node) was accepted already: a
    # PENDING row then waits for a retry that answer asked for, not after a lapsed lease.
    claim_answered: bool = False

    def __post_init__(self) -> None:
        if self.command_exists:
            if self.status is None or self.claim_generation is None:
                raise ValueError("an existing command has a status and a claim generation")
            if self.claim_generation < 0:
                raise ValueError("claim_generation is never negative")
        elif (self.status, self.claim_generation, self.claimed_node_id) != (None, None, None):
            raise ValueError("a missing command has no status, generation or node")
        elif self.claim_answered:
            raise ValueError("a missing command has no answered claim")


def receipt_matches(
    guards: Guards, *, receipt_generation: int | None, receipt_node: str | None
) -> bool:
    """The four-guard UPDATE's WHERE clause, as a predicate over the row it would hit.

    ``id = $command AND claim_generation = $gen AND claimed_node_id = $node AND status IN
    ('CLAIMED', 'SENT')``; SQL equality with NULL is never true, so neither is a None here.
    """
    return (
        guards.command_exists
        and receipt_generation is not None
        and receipt_generation == guards.claim_generation
        and receipt_node is not None
        and receipt_node == guards.claimed_node_id
        and guards.status in RECEIVING_STATUSES
    )


# Outcomes a receipt of the claim itself can produce; CANCELLED and TIMEOUT are not answers.
ANSWERED_STATUSES: frozenset[CommandStatus] = frozenset({CommandStatus.ACKED, CommandStatus.FAILED})


def judge_receipt(
    guards: Guards,
    *,
    receipt_generation: int | None,
    receipt_node: str | None,
    result_code: int | None = None,
) -> tuple[ReceiptOutcome, RejectReason | None]:
    """Why the receipt was not applied, from a fresh read of the row.

    A receipt for an existing command whose ``result_code`` is not a standard one is never
    applied (:func:`is_standard_result_code`), whatever its claim says.

    An older generation is a late receipt of an earlier claim, whichever node held that claim:
    the row only knows its latest claim's node, so the node is compared only within the same
    generation. A generation the row never reached, or a node the row never recorded, is
    rejected: never guessed. Generation 0 is no claim's (the first claim makes it 1), so a
    receipt naming it answers nothing, whatever state the command is in.
    """
    status, generation, node = guards.status, guards.claim_generation, guards.claimed_node_id
    reason: RejectReason | None
    if receipt_generation is None:
        reason = RejectReason.CLAIM_GENERATION_REQUIRED
    elif status is None or generation is None:
        reason = RejectReason.UNKNOWN_COMMAND
    elif not is_standard_result_code(result_code):
        reason = RejectReason.INVALID_RESULT_CODE
    elif receipt_generation < FIRST_GENERATION:
        reason = RejectReason.UNKNOWN_GENERATION
    elif generation == 0:  # never claimed: no node to compare with, no claim to answer
        reason = _closed_or_not_claimed(status)
    elif node is None:
        reason = RejectReason.NODE_UNKNOWN
    elif receipt_generation < generation:
        reason = None  # a late receipt
    elif receipt_generation > generation:
        reason = RejectReason.UNKNOWN_GENERATION
    elif receipt_node != node:
        reason = RejectReason.NODE_MISMATCH
    elif (
        status in RECEIVING_STATUSES
        or status in ANSWERED_STATUSES
        or (status is CommandStatus.PENDING and guards.claim_answered)
    ):
        # The same claim, still open (another copy of the receipt won, or a SENT receipt
        # found the command SENT already), or already answered by it (a device repeating
        # itself, a QoS 1 redelivery; PENDING: the answer asked for a retry, which keeps the
        # generation until the next claim): a duplicate, not an error.
        reason = None
    else:
        reason = _closed_or_not_claimed(status)
    if reason is None:
        return ReceiptOutcome.DUPLICATED, None
    return ReceiptOutcome.REJECTED, reason


def _closed_or_not_claimed(status: CommandStatus) -> RejectReason:
    if status in TERMINAL_STATUSES:
        return RejectReason.COMMAND_CLOSED
    return RejectReason.NOT_CLAIMED


@dataclass(frozen=True, slots=True)
class Effect:
    """What an accepted receipt does to its command.

    ``retry``: ``retry_count + 1`` and back to PENDING with a later ``next_attempt_at``
    (:func:`retry_delay_s`). ``result`` / ``result_code`` are the receipt's standard fields,
    stored on the command as they came.
    """

    status: CommandStatus
    retry: bool
    terminal: bool
    result: str
    result_code: int | None


def receipt_effect(
    *,
    delivery: Delivery,
    current: CommandStatus,
    result: ReceiptResult,
    result_code: int | None,
    retry_count: int,
) -> Effect:
    """The effect of an accepted receipt on a command in ``current``.

    ACKED is not success: only ``resultCode = 0`` (the device *claiming* success) is ACKED, any
    other code (or none) is FAILED. A SENT receipt confirms delivery (no change if already
    SENT). TIMEOUT, DEVICE_OFFLINE and FAILED fail a realtime command and requeue a deferrable
    one, until a requeue would exceed :data:`MAX_RETRIES` (then TIMEOUT).
    """
    if retry_count < 0:
        raise ValueError("retry_count is never negative")
    if not is_standard_result_code(result_code):
        raise ValueError(f"result code {result_code} is not a standard one: refuse the receipt")
    retry = False
    if result is ReceiptResult.ACKED:
        success = result_code is not None and result_code == ResultCode.SUCCESS
        target = CommandStatus.ACKED if success else CommandStatus.FAILED
    elif result is ReceiptResult.SENT:
        target = CommandStatus.SENT
    elif delivery is Delivery.REALTIME:
        target = CommandStatus.FAILED
    elif retry_count + 1 > MAX_RETRIES:
        target = CommandStatus.TIMEOUT
    else:
        target, retry = CommandStatus.PENDING, True
    if target is not current:
        check_transition(current, target)
    elif current not in RECEIVING_STATUSES:
        raise IllegalCommandTransitionError(current, target)
    return Effect(
        status=target,
        retry=retry,
        terminal=target in TERMINAL_STATUSES,
        result=result.value,
        result_code=result_code,
    )


def retry_delay_s(
    retry_count: int,
    *,
    base_s: float = 2.0,
    cap_s: float = 600.0,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before the next attempt of a command requeued ``retry_count`` times before.

    ``retry_count`` is the count before this requeue (0 for the first one). Equal jitter,
    ``uniform(c / 2, c)`` with ``c = min(cap_s, base_s * 2**retry_count)``: the jitter spreads a
    fleet's retries apart, and the floor keeps an offline device from being retried soon after
    its tenth failure by the luck of the draw.
    """
    if retry_count < 0:
        raise ValueError("retry_count is never negative")
    if not 0 < base_s <= cap_s:
        raise ValueError("need 0 < base_s <= cap_s")
    # Bound the exponent: 2.0**1100 overflows long before anyone waits that long.
    ceiling = min(cap_s, base_s * 2.0 ** min(retry_count, 64))
    return (rng or _RNG).uniform(ceiling / 2, ceiling)


_RNG: Final = random.Random()


def needs_people(reclaim_count: int) -> bool:
    """True once nodes lost the command more than :data:`MAX_RECLAIMS` times (raise an alarm)."""
    return reclaim_count > MAX_RECLAIMS
