"""The command aggregate: the whitelist pair by pair, receipt judgement and effects, backoff."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.domain.command import (
    MAX_RECLAIMS,
    MAX_RETRIES,
    OPEN_STATUSES,
    TERMINAL_STATUSES,
    TRANSITIONS,
    CommandError,
    CommandStatus,
    Delivery,
    Effect,
    Guards,
    IllegalCommandTransitionError,
    ReceiptOutcome,
    RejectReason,
    can_transition,
    check_transition,
    is_standard_result_code,
    judge_receipt,
    needs_people,
    receipt_effect,
    receipt_matches,
    retry_delay_s,
)
from gateway.domain.errors import GatewayError
from protocol.messages import ReceiptResult

S, R, Out, Why = CommandStatus, ReceiptResult, ReceiptOutcome, RejectReason
RT, DF = Delivery.REALTIME, Delivery.DEFERRABLE

# docs/behaviour.md §7, written out again here so that a change to the module cannot pass unnoticed.
WHITELIST: set[tuple[CommandStatus, CommandStatus]] = {
    (S.PENDING, S.CLAIMED),
    (S.PENDING, S.CANCELLED),
    (S.PENDING, S.TIMEOUT),
    (S.CLAIMED, S.SENT),
    (S.CLAIMED, S.PENDING),
    (S.CLAIMED, S.ACKED),
    (S.CLAIMED, S.FAILED),
    (S.CLAIMED, S.TIMEOUT),
    (S.CLAIMED, S.CANCELLED),
    (S.SENT, S.ACKED),
    (S.SENT, S.FAILED),
    (S.SENT, S.PENDING),
    (S.SENT, S.TIMEOUT),
    (S.SENT, S.CANCELLED),
}


# --- states and the whitelist -----------------------------------------------------------------


def test_status_sets_and_values() -> None:
    assert [s.value for s in CommandStatus] == [s.name for s in CommandStatus]
    assert len(CommandStatus) == 7
    assert {S.PENDING, S.CLAIMED, S.SENT} == OPEN_STATUSES
    assert {S.ACKED, S.FAILED, S.TIMEOUT, S.CANCELLED} == TERMINAL_STATUSES
    assert set(CommandStatus) == OPEN_STATUSES | TERMINAL_STATUSES
    assert [d.value for d in Delivery] == ["realtime", "deferrable"]
    assert [o.value for o in ReceiptOutcome] == ["accepted", "duplicated", "rejected"]
    assert [r.value for r in RejectReason] == [r.name for r in RejectReason]
    assert (MAX_RETRIES, MAX_RECLAIMS) == (10, 5)


def test_the_whitelist_is_exactly_spec_section_7() -> None:
    assert set(TRANSITIONS) == set(CommandStatus)
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == WHITELIST
    assert all(not TRANSITIONS[s] for s in TERMINAL_STATUSES)


@pytest.mark.parametrize(
    ("status", "target"), list(itertools.product(CommandStatus, CommandStatus)), ids=str
)
def test_every_status_pair(status: CommandStatus, target: CommandStatus) -> None:
    allowed = (status, target) in WHITELIST
    assert can_transition(status, target) is allowed
    if allowed:
        assert check_transition(status, target) is target
        return
    with pytest.raises(IllegalCommandTransitionError) as raised:
        check_transition(status, target)
    error = raised.value
    assert (error.status, error.target, error.code) == (status, target, "ILLEGAL_TRANSITION")
    assert isinstance(error, CommandError)
    assert isinstance(error, GatewayError)
    assert f"cannot become {target}" in str(error)


def test_every_state_is_reachable_and_every_open_one_can_end() -> None:
    reached, frontier = {S.PENDING}, [S.PENDING]
    while frontier:
        status = frontier.pop()
        for target in TRANSITIONS[status] - reached:
            reached.add(target)
            frontier.append(target)
    assert reached == set(CommandStatus)
    for status in OPEN_STATUSES:
        assert TRANSITIONS[status] & TERMINAL_STATUSES
        assert S.CANCELLED in TRANSITIONS[status]
        assert S.TIMEOUT in TRANSITIONS[status]  # expire_at applies to every open command


# --- judging a receipt the four-guard UPDATE did not apply ------------------------------------

MISSING = Guards(command_exists=False, status=None, claim_generation=None, claimed_node_id=None)


def guards(status: CommandStatus, generation: int = 2, node: str | None = "B") -> Guards:
    return Guards(
        command_exists=True, status=status, claim_generation=generation, claimed_node_id=node
    )


# (the row, the receipt's generation and node, the outcome)
JUDGED: list[tuple[Guards, int | None, str | None, tuple[ReceiptOutcome, RejectReason | None]]] = [
    # No generation: rejected before anything else, whatever the row.
    (MISSING, None, "B", (Out.REJECTED, Why.CLAIM_GENERATION_REQUIRED)),
    (guards(S.CLAIMED), None, "B", (Out.REJECTED, Why.CLAIM_GENERATION_REQUIRED)),
    (guards(S.SENT), None, None, (Out.REJECTED, Why.CLAIM_GENERATION_REQUIRED)),
    (guards(S.ACKED), None, "B", (Out.REJECTED, Why.CLAIM_GENERATION_REQUIRED)),
    # No such command.
    (MISSING, 1, "B", (Out.REJECTED, Why.UNKNOWN_COMMAND)),
    (MISSING, 0, None, (Out.REJECTED, Why.UNKNOWN_COMMAND)),
    # Generation 0 is no claim's (the first claim makes it 1): never a late answer.
    (guards(S.PENDING, 0, None), 0, None, (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    (guards(S.CLAIMED), 0, "B", (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    (guards(S.SENT, 1, "B"), 0, "B", (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    (guards(S.CANCELLED), 0, "B", (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    (guards(S.ACKED, 2, None), 0, "B", (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    # Never claimed (generation 0, no node): nothing to answer, whatever the receipt says.
    (guards(S.PENDING, 0, None), 1, "B", (Out.REJECTED, Why.NOT_CLAIMED)),
    (guards(S.CANCELLED, 0, None), 1, "B", (Out.REJECTED, Why.COMMAND_CLOSED)),
    (guards(S.TIMEOUT, 0, None), 3, "A", (Out.REJECTED, Why.COMMAND_CLOSED)),
    # Claimed before node ids were recorded: never guessed, in any state, at any generation.
    (guards(S.CLAIMED, 2, None), 2, "B", (Out.REJECTED, Why.NODE_UNKNOWN)),
    (guards(S.SENT, 2, None), 2, None, (Out.REJECTED, Why.NODE_UNKNOWN)),
    (guards(S.SENT, 2, None), 1, "A", (Out.REJECTED, Why.NODE_UNKNOWN)),
    (guards(S.PENDING, 2, None), 2, "B", (Out.REJECTED, Why.NODE_UNKNOWN)),
    (guards(S.ACKED, 2, None), 2, "B", (Out.REJECTED, Why.NODE_UNKNOWN)),
    # An older generation: a late receipt of an earlier claim, whichever node held it.
    (guards(S.CLAIMED), 1, "B", (Out.DUPLICATED, None)),
    (guards(S.CLAIMED), 1, "A", (Out.DUPLICATED, None)),
    (guards(S.SENT), 1, None, (Out.DUPLICATED, None)),
    (guards(S.PENDING), 1, "A", (Out.DUPLICATED, None)),
    (guards(S.ACKED), 1, "A", (Out.DUPLICATED, None)),
    (guards(S.CANCELLED), 1, "B", (Out.DUPLICATED, None)),
    # A generation the command never reached.
    (guards(S.CLAIMED), 3, "B", (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    (guards(S.SENT), 99, "A", (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    (guards(S.FAILED), 3, "B", (Out.REJECTED, Why.UNKNOWN_GENERATION)),
    # The current generation from another node (or none).
    (guards(S.CLAIMED), 2, "A", (Out.REJECTED, Why.NODE_MISMATCH)),
    (guards(S.SENT), 2, None, (Out.REJECTED, Why.NODE_MISMATCH)),
    (guards(S.ACKED), 2, "A", (Out.REJECTED, Why.NODE_MISMATCH)),
    (guards(S.PENDING), 2, "b", (Out.REJECTED, Why.NODE_MISMATCH)),
    # The current claim, already answered by it: the device repeating itself ...
    (guards(S.ACKED), 2, "B", (Out.DUPLICATED, None)),
    (guards(S.FAILED), 2, "B", (Out.DUPLICATED, None)),
    # ... or closed without an answer (timed out, cancelled) ...
    (guards(S.TIMEOUT), 2, "B", (Out.REJECTED, Why.COMMAND_CLOSED)),
    (guards(S.CANCELLED), 2, "B", (Out.REJECTED, Why.COMMAND_CLOSED)),
    # ... or its lease lapsed (PENDING again, awaiting its next claim) ...
    (guards(S.PENDING), 2, "B", (Out.REJECTED, Why.NOT_CLAIMED)),
    # ... or still open: the row moved between the UPDATE and the read.
    (guards(S.CLAIMED), 2, "B", (Out.DUPLICATED, None)),
    (guards(S.SENT), 2, "B", (Out.DUPLICATED, None)),
]


@pytest.mark.parametrize(("row", "generation", "node", "expected"), JUDGED)
def test_judge_receipt(
    row: Guards,
    generation: int | None,
    node: str | None,
    expected: tuple[ReceiptOutcome, RejectReason | None],
) -> None:
    assert judge_receipt(row, receipt_generation=generation, receipt_node=node) == expected


# (the row, the receipt's generation, node and resultCode, the outcome)
CODE_JUDGED: list[
    tuple[Guards, int | None, str | None, int | None, tuple[ReceiptOutcome, RejectReason | None]]
] = [
    # Outside 0-4: refused for any existing command, whatever the claim says ...
    (guards(S.SENT), 2, "B", 17, (Out.REJECTED, Why.INVALID_RESULT_CODE)),
    (guards(S.CLAIMED), 2, "B", -1, (Out.REJECTED, Why.INVALID_RESULT_CODE)),
    (guards(S.CLAIMED), 2, "B", 5, (Out.REJECTED, Why.INVALID_RESULT_CODE)),
    (guards(S.ACKED), 1, "A", 5, (Out.REJECTED, Why.INVALID_RESULT_CODE)),
    (guards(S.CANCELLED), 2, "B", 99, (Out.REJECTED, Why.INVALID_RESULT_CODE)),
    (guards(S.SENT), 0, "B", 2**31 - 1, (Out.REJECTED, Why.INVALID_RESULT_CODE)),
    # ... once the receipt names a generation and the command exists.
    (guards(S.SENT), None, "B", 17, (Out.REJECTED, Why.CLAIM_GENERATION_REQUIRED)),
    (MISSING, 1, "B", 17, (Out.REJECTED, Why.UNKNOWN_COMMAND)),
    # The standard codes, and none, are judged by the claim alone.
    *[(guards(S.SENT), 2, "B", code, (Out.DUPLICATED, None)) for code in (0, 1, 2, 3, 4, None)],
    (guards(S.SENT), 2, "A", 4, (Out.REJECTED, Why.NODE_MISMATCH)),
]


@pytest.mark.parametrize(("row", "generation", "node", "code", "expected"), CODE_JUDGED)
def test_judge_receipt_result_codes(
    row: Guards,
    generation: int | None,
    node: str | None,
    code: int | None,
    expected: tuple[ReceiptOutcome, RejectReason | None],
) -> None:
    judged = judge_receipt(row, receipt_generation=generation, receipt_node=node, result_code=code)
    assert judged == expected


def test_standard_result_codes_are_exactly_zero_to_four_or_none() -> None:
    assert [code for code in range(-3, 10) if is_standard_result_code(code)] == [0, 1, 2, 3, 4]
    assert is_standard_result_code(None)


def test_the_table_covers_every_reason_and_outcome() -> None:
    judged = [expected for *_, expected in JUDGED] + [expected for *_, expected in CODE_JUDGED]
    assert {outcome for outcome, _ in judged} == set(ReceiptOutcome) - {Out.ACCEPTED}
    assert {reason for _, reason in judged} == {*RejectReason, None}


NODES = [None, "A", "B"]


@given(
    exists=st.booleans(),
    status=st.sampled_from(CommandStatus),
    row_generation=st.integers(0, 4),
    row_node=st.sampled_from(NODES),
    generation=st.none() | st.integers(0, 5),
    node=st.sampled_from(NODES),
)
def test_judgement_laws(
    *,
    exists: bool,
    status: CommandStatus,
    row_generation: int,
    row_node: str | None,
    generation: int | None,
    node: str | None,
) -> None:
    row = guards(status, row_generation, row_node) if exists else MISSING
    outcome, reason = judge_receipt(row, receipt_generation=generation, receipt_node=node)
    assert outcome is not Out.ACCEPTED, "accepting is the UPDATE's job, never the judge's"
    assert (outcome is Out.REJECTED) == (reason is not None)
    if outcome is Out.DUPLICATED:
        # Only a real claim of this command, never a guess about a node the row lacks.
        assert exists
        assert generation is not None
        assert generation >= 1  # a claim that was really issued
        assert row_generation >= 1
        assert row_node is not None
        assert generation < row_generation or status in {S.CLAIMED, S.SENT, S.ACKED, S.FAILED}
    if exists and generation == 0:
        assert reason is Why.UNKNOWN_GENERATION
    if row_node is None and exists and row_generation >= 1 and generation:
        assert reason is Why.NODE_UNKNOWN


@pytest.mark.parametrize(
    ("row", "generation", "node", "matches"),
    [
        (guards(S.CLAIMED), 2, "B", True),
        (guards(S.SENT), 2, "B", True),
        (guards(S.PENDING), 2, "B", False),
        (guards(S.ACKED), 2, "B", False),
        (guards(S.CLAIMED), 1, "B", False),
        (guards(S.CLAIMED), 2, "A", False),
        (guards(S.CLAIMED), None, "B", False),
        (guards(S.CLAIMED, 2, None), 2, None, False),  # NULL = NULL is not true in SQL
        (MISSING, 2, "B", False),
    ],
)
def test_receipt_matches_mirrors_the_four_guards(
    row: Guards, generation: int | None, node: str | None, matches: bool
) -> None:
    assert receipt_matches(row, receipt_generation=generation, receipt_node=node) is matches


def test_spec_scenario_a_late_receipt_never_overwrites_the_reclaim() -> None:
    """docs/behaviour.md §7: A claims (gen 1), its lease expires, B re-claims (gen 2)."""
    claimed_by_a = guards(S.CLAIMED, 1, "A")
    assert receipt_matches(claimed_by_a, receipt_generation=1, receipt_node="A")
    # The lease expires: PENDING, reclaim_count 1, the generation unchanged.
    lapsed = guards(S.PENDING, 1, "A")
    assert not receipt_matches(lapsed, receipt_generation=1, receipt_node="A")
    assert judge_receipt(lapsed, receipt_generation=1, receipt_node="A") == (
        Out.REJECTED,
        Why.NOT_CLAIMED,
    )
    claimed_by_b = guards(S.CLAIMED, 2, "B")
    # A's receipt arrives now: the UPDATE misses, and it is a late receipt, not an error.
    assert not receipt_matches(claimed_by_b, receipt_generation=1, receipt_node="A")
    assert judge_receipt(claimed_by_b, receipt_generation=1, receipt_node="A") == (
        Out.DUPLICATED,
        None,
    )
    # B's own receipt is the one the UPDATE applies.
    assert receipt_matches(claimed_by_b, receipt_generation=2, receipt_node="B")
    # A pretending to hold B's generation is refused.
    assert judge_receipt(claimed_by_b, receipt_generation=2, receipt_node="A") == (
        Out.REJECTED,
        Why.NODE_MISMATCH,
    )


@pytest.mark.parametrize(
    ("exists", "status", "generation", "node"),
    [
        (True, None, 1, "A"),
        (True, S.CLAIMED, None, "A"),
        (True, S.CLAIMED, -1, "A"),
        (False, S.CLAIMED, None, None),
        (False, None, 0, None),
        (False, None, None, "A"),
    ],
)
def test_inconsistent_guards_are_refused(
    exists: bool, status: CommandStatus | None, generation: int | None, node: str | None
) -> None:
    with pytest.raises(ValueError, match=r"command|negative"):
        Guards(
            command_exists=exists, status=status, claim_generation=generation, claimed_node_id=node
        )


# --- the effect of an accepted receipt --------------------------------------------------------

CODES: list[int | None] = [0, 1, 3, None]
FAILURES = [R.TIMEOUT, R.DEVICE_OFFLINE, R.FAILED]


def expected_effect(
    delivery: Delivery,
    current: CommandStatus,
    result: ReceiptResult,
    code: int | None,
    retry_count: int,
) -> Effect:
    """docs/behaviour.md §7 restated case by case."""
    if result is R.ACKED:
        status, retry = (S.ACKED if code == 0 else S.FAILED), False
    elif result is R.SENT:
        status, retry = S.SENT, False
    elif delivery is RT:
        status, retry = S.FAILED, False
    elif retry_count >= MAX_RETRIES:
        status, retry = S.TIMEOUT, False
    else:
        status, retry = S.PENDING, True
    terminal = status in {S.ACKED, S.FAILED, S.TIMEOUT}
    return Effect(status, retry, terminal, result.value, code)


@pytest.mark.parametrize(
    ("delivery", "current", "result", "code", "retry_count"),
    list(itertools.product(Delivery, [S.CLAIMED, S.SENT], ReceiptResult, CODES, [0, 9, 10])),
    ids=str,
)
def test_receipt_effect(
    delivery: Delivery,
    current: CommandStatus,
    result: ReceiptResult,
    code: int | None,
    retry_count: int,
) -> None:
    effect = receipt_effect(
        delivery=delivery,
        current=current,
        result=result,
        result_code=code,
        retry_count=retry_count,
    )
    assert effect == expected_effect(delivery, current, result, code, retry_count)
    assert effect.status is current or can_transition(current, effect.status)


@pytest.mark.parametrize(
    ("delivery", "result", "code", "retry_count", "status", "retry"),
    [
        # ACKED is not success: only code 0 is.
        (RT, R.ACKED, 0, 0, S.ACKED, False),
        (DF, R.ACKED, 0, 10, S.ACKED, False),
        (RT, R.ACKED, 1, 0, S.FAILED, False),
        (DF, R.ACKED, 3, 0, S.FAILED, False),  # the device answered: no retry
        (DF, R.ACKED, None, 0, S.FAILED, False),
        # Realtime fails at once, whatever the count.
        (RT, R.DEVICE_OFFLINE, None, 0, S.FAILED, False),
        (RT, R.TIMEOUT, None, 9, S.FAILED, False),
        # Deferrable: the tenth requeue is allowed, the eleventh is TIMEOUT.
        (DF, R.DEVICE_OFFLINE, None, 0, S.PENDING, True),
        (DF, R.FAILED, 4, 9, S.PENDING, True),
        (DF, R.TIMEOUT, None, 10, S.TIMEOUT, False),
        (DF, R.FAILED, 3, 11, S.TIMEOUT, False),
    ],
)
def test_receipt_effect_examples(
    *,
    delivery: Delivery,
    result: ReceiptResult,
    code: int | None,
    retry_count: int,
    status: CommandStatus,
    retry: bool,
) -> None:
    effect = receipt_effect(
        delivery=delivery, current=S.SENT, result=result, result_code=code, retry_count=retry_count
    )
    assert (effect.status, effect.retry) == (status, retry)
    assert effect.terminal is (status in TERMINAL_STATUSES)
    assert (effect.result, effect.result_code) == (result.value, code)


def test_a_sent_receipt_confirms_delivery() -> None:
    for current in (S.CLAIMED, S.SENT):
        effect = receipt_effect(
            delivery=DF, current=current, result=R.SENT, result_code=None, retry_count=0
        )
        assert effect == Effect(
            S.SENT, retry=False, terminal=False, result="SENT", result_code=None
        )


@pytest.mark.parametrize(
    ("current", "result"),
    list(itertools.product([S.PENDING, *sorted(TERMINAL_STATUSES)], ReceiptResult)),
    ids=str,
)
def test_no_effect_on_a_command_no_receipt_can_reach(
    current: CommandStatus, result: ReceiptResult
) -> None:
    for delivery in Delivery:
        with pytest.raises(IllegalCommandTransitionError) as raised:
            receipt_effect(
                delivery=delivery, current=current, result=result, result_code=0, retry_count=0
            )
        assert raised.value.status is current


def test_negative_retry_count_is_refused() -> None:
    with pytest.raises(ValueError, match="never negative"):
        receipt_effect(delivery=DF, current=S.SENT, result=R.FAILED, result_code=3, retry_count=-1)


@pytest.mark.parametrize("code", [-1, 5, 17])
def test_no_effect_carries_a_code_outside_the_standard_ones(code: int) -> None:
    with pytest.raises(ValueError, match="not a standard one"):
        receipt_effect(delivery=DF, current=S.SENT, result=R.ACKED, result_code=code, retry_count=0)


# --- backoff and the reclaim alarm ------------------------------------------------------------


@pytest.mark.parametrize("retry_count", range(15))
def test_retry_delay_bounds(retry_count: int) -> None:
    rng = random.Random(retry_count)
    ceiling = min(600.0, 2.0 * 2**retry_count)
    for _ in range(200):
        delay = retry_delay_s(retry_count, rng=rng)
        assert ceiling / 2 <= delay <= ceiling
        assert 1.0 <= delay <= 600.0


def test_retry_delay_grows_until_the_cap() -> None:
    rng = random.Random(7)
    means = [
        statistics.fmean(retry_delay_s(n, rng=rng) for _ in range(400)) for n in range(MAX_RETRIES)
    ]
    assert all(a < b for a, b in itertools.pairwise(means[:9]))  # ceilings 2 .. 512 s
    assert 1.4 <= means[0] <= 1.6  # uniform(1, 2)
    assert 450 <= means[-1] <= 600  # 9: 1024 s capped at 600 s, so [300, 600]
    # The floor keeps late retries late: no luck brings the tenth under five minutes.
    assert min(retry_delay_s(MAX_RETRIES - 1, rng=rng) for _ in range(1000)) >= 300


def test_retry_delay_is_deterministic_with_a_seed_and_jittered() -> None:
    first = [retry_delay_s(5, rng=random.Random(1)) for _ in range(3)]
    assert len(set(first)) == 1
    spread = {retry_delay_s(5, rng=random.Random(seed)) for seed in range(50)}
    assert len(spread) == 50
    assert 1.0 <= retry_delay_s(0) <= 2.0  # the module's own generator
    assert retry_delay_s(10**6, base_s=1.0, cap_s=5.0, rng=random.Random(0)) <= 5.0


@pytest.mark.parametrize(
    ("retry_count", "base_s", "cap_s"), [(-1, 2.0, 600.0), (1, 0.0, 1.0), (1, 5.0, 1.0)]
)
def test_retry_delay_refuses_nonsense(retry_count: int, base_s: float, cap_s: float) -> None:
    with pytest.raises(ValueError, match=r"never negative|base_s"):
        retry_delay_s(retry_count, base_s=base_s, cap_s=cap_s)


@pytest.mark.parametrize(("reclaims", "alarm"), [(0, False), (5, False), (6, True), (60, True)])
def test_needs_people(reclaims: int, alarm: bool) -> None:
    assert needs_people(reclaims) is alarm
