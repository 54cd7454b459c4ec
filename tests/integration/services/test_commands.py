"""The command lifecycle against real PostgreSQL: claims, the four guards, retries, reaper."""

from __future__ import annotations

import asyncio
import re
from datetime import timedelta

import aiomqtt
import asyncpg
import pytest

from gateway.commands.dispatcher import ClaimCheck, Dispatcher
from gateway.commands.lifecycle import (
    CommandClosedError,
    DeviceUnboundError,
    cancel,
    mark_sent,
    unbind,
)
from gateway.commands.reaper import Reaper, reap
from gateway.commands.receipts import apply_receipt, apply_receipts
from gateway.domain.command import Delivery, ReceiptOutcome, RejectReason
from gateway.support.broker_link import BrokerLink, SessionDown
from gateway.support.metrics import Metrics
from protocol import CommandReceipt, ReceiptResult, Topics
from storage import commands as repo
from storage.commands import CommandRow, MovedCommandRow
from tests.support.commands import new_command
from tests.support.waiting import wait_until

SENT_TIMEOUT_S = 86400.0


async def _create(
    db: asyncpg.Connection,
    device: str = "d1",
    delivery: Delivery = Delivery.REALTIME,
    key: str | None = None,
) -> int:
    created = await new_command(
        db, device_id=device, name="open_valve", params={"valve": 2}, delivery=delivery,
        idempotency_key=key, actor="op:alice", node_id="api", expire_after_s=72 * 3600,
    )  # fmt: skip
    return int(created.command.id)


async def _claim(db: asyncpg.Connection, node: str) -> list[CommandRow]:
    return await repo.claim_due(
        db, node_id=node, lease_s=30, limit=10, max_in_flight=1, actor="system:dispatcher"
    )


async def _receipt(
    db: asyncpg.Connection,
    command_id: int,
    *,
    generation: int | None,
    node: str | None,
    result: ReceiptResult = ReceiptResult.ACKED,
    code: int | None = 0,
    device: str = "d1",
    raw: str | int | None = None,
) -> tuple[ReceiptOutcome, RejectReason | None]:
    applied = await apply_receipt(
        db, device_id=device,
        receipt=CommandReceipt(command_id=command_id, claim_generation=generation, node_id=node,
                               result=result, result_code=code, raw_result_code=raw),
        node_id="receiver", sent_timeout_s=SENT_TIMEOUT_S,
    )  # fmt: skip
    return applied.outcome, applied.reason


async def _row(db: asyncpg.Connection, command_id: int) -> CommandRow:
    row = await repo.get(db, command_id)
    assert row is not None
    return row


async def _expire_lease(db: asyncpg.Connection, command_id: int) -> None:
    await db.execute(
        "UPDATE command SET lease_expire_at = now() - interval '1 second' WHERE id = $1",
        command_id,
    )


async def test_a_late_receipt_of_an_older_generation_never_overwrites_the_new_claim(
    db: asyncpg.Connection,
) -> None:
    command_id = await _create(db)
    (a_claim,) = await _claim(db, "node-a")
    assert a_claim.claim_generation == 1
    await _expire_lease(db, command_id)
    report = await reap(db, node_id="reaper", ack_window_s=0, sent_timeout_s=SENT_TIMEOUT_S)
    assert report.reclaimed == [command_id]
    row = await _row(db, command_id)
    assert (row.status, row.reclaim_count, row.claim_generation) == ("PENDING", 1, 1)

    (b_claim,) = await _claim(db, "node-b")
    assert b_claim.claim_generation == 2
    before = await _row(db, command_id)
    assert await _receipt(db, command_id, generation=1, node="node-a") == (
        ReceiptOutcome.DUPLICATED, None,
    )  # fmt: skip
    assert (await _row(db, command_id)) == before  # untouched
    assert await _receipt(db, command_id, generation=2, node="node-b") == (
        ReceiptOutcome.ACCEPTED, None,
    )  # fmt: skip
    assert (await _row(db, command_id)).status == "ACKED"
    outcomes = [r["outcome"] for r in await repo.receipts_of(db, command_id)]
    assert outcomes == ["duplicated", "accepted"]


async def test_wrong_node_missing_generation_and_unknown_node_are_rejected_and_logged(
    db: asyncpg.Connection,
) -> None:
    command_id = await _create(db)
    await _claim(db, "node-a")
    before = await _row(db, command_id)
    assert await _receipt(db, command_id, generation=1, node="node-x") == (
        ReceiptOutcome.REJECTED, RejectReason.NODE_MISMATCH,
    )  # fmt: skip
    assert await _receipt(db, command_id, generation=None, node="node-a") == (
        ReceiptOutcome.REJECTED, RejectReason.CLAIM_GENERATION_REQUIRED,
    )  # fmt: skip
    assert await _receipt(db, 999_999, generation=1, node="node-a") == (
        ReceiptOutcome.REJECTED, RejectReason.UNKNOWN_COMMAND,
    )  # fmt: skip
    assert (await _row(db, command_id)) == before
    # A row claimed before node ids were recorded: never guessed.
    await db.execute(
        "UPDATE command SET claimed_node_id = NULL, legacy_claim = true WHERE id = $1", command_id
    )
    assert await _receipt(db, command_id, generation=1, node="node-a") == (
        ReceiptOutcome.REJECTED, RejectReason.NODE_UNKNOWN,
    )  # fmt: skip
    reasons = await db.fetch("SELECT outcome, reason FROM command_receipt ORDER BY id")
    assert [(r["outcome"], r["reason"]) for r in reasons] == [
        ("rejected", "NODE_MISMATCH"), ("rejected", "CLAIM_GENERATION_REQUIRED"),
        ("rejected", "UNKNOWN_COMMAND"), ("rejected", "NODE_UNKNOWN"),
    ]  # fmt: skip


async def test_acked_is_not_success_unless_the_code_is_zero(db: asyncpg.Connection) -> None:
    failing = await _create(db, device="d1")
    await _claim(db, "n")
    await _receipt(db, failing, generation=1, node="n", code=3, raw="E-17")
    row = await _row(db, failing)
    assert (row.status, row.result, row.result_code) == ("FAILED", "ACKED", 3)
    assert row.raw_result_code == "E-17"

    fine = await _create(db, device="d2")
    await _claim(db, "n")
    await _receipt(db, fine, generation=1, node="n", code=0, device="d2")
    assert (await _row(db, fine)).status == "ACKED"


async def test_deferrable_failures_requeue_with_backoff_until_the_eleventh_times_out(
    db: asyncpg.Connection,
) -> None:
    command_id = await _create(db, delivery=Delivery.DEFERRABLE)
    for attempt in range(1, 12):
        (claimed,) = await _claim(db, "n")
        generation = claimed.claim_generation
        await _receipt(db, command_id, generation=generation, node="n",
                       result=ReceiptResult.DEVICE_OFFLINE, code=None)  # fmt: skip
        row = await _row(db, command_id)
        if attempt <= 10:
            assert (row.status, row.retry_count) == ("PENDING", attempt)
            assert row.next_attempt_at > row.updated_at
            assert await _claim(db, "n") == []  # not due before its backoff
            await db.execute("UPDATE command SET next_attempt_at = now() WHERE id = $1", command_id)
        else:
            assert row.status == "TIMEOUT"


async def test_realtime_failure_is_final(db: asyncpg.Connection) -> None:
    command_id = await _create(db)
    await _claim(db, "n")
    await _receipt(db, command_id, generation=1, node="n", result=ReceiptResult.DEVICE_OFFLINE,
                   code=None)  # fmt: skip
    assert (await _row(db, command_id)).status == "FAILED"


async def test_reaper_expires_and_times_out_sent_commands(db: asyncpg.Connection) -> None:
    expiring = await _create(db, device="d1")
    await db.execute("UPDATE command SET expire_at = now() - interval '1 second' WHERE id = $1",
                     expiring)  # fmt: skip
    sent = await _create(db, device="d2")
    (claimed,) = await _claim(db, "n")
    assert await mark_sent(db, claimed, node_id="n", sent_timeout_s=SENT_TIMEOUT_S) is not None
    await db.execute("UPDATE command SET timeout_at = now() - interval '1 second' WHERE id = $1",
                     sent)  # fmt: skip
    report = await reap(db, node_id="reaper", ack_window_s=0, sent_timeout_s=SENT_TIMEOUT_S)
    assert report.expired == [(expiring, "PENDING")]
    assert report.failed == [sent]
    assert (await _row(db, expiring)).status == "TIMEOUT"
    assert (await _row(db, sent)).status == "FAILED"


async def test_six_lease_expiries_raise_one_alarm_for_people(db: asyncpg.Connection) -> None:
    command_id = await _create(db)
    alarms: list[int] = []
    for _ in range(7):
        await _claim(db, "flaky-node")
        await _expire_lease(db, command_id)
        alarms += (
            await reap(db, node_id="r", ack_window_s=0, sent_timeout_s=SENT_TIMEOUT_S)
        ).alarms
    assert (await _row(db, command_id)).reclaim_count == 7
    assert len(alarms) == 1
    alarm = await db.fetchrow("SELECT * FROM alarm")
    assert alarm["rule_key"] == "command-reclaims"
    assert alarm["device_id"] == "d1"


async def test_cancel_unbind_and_a_receipt_after_cancellation(db: asyncpg.Connection) -> None:
    command_id = await _create(db)
    await _claim(db, "n")
    await cancel(db, command_id, actor="op:bob", node_id="api")
    assert await _receipt(db, command_id, generation=1, node="n") == (
        ReceiptOutcome.REJECTED, RejectReason.COMMAND_CLOSED,
    )  # fmt: skip
    assert (await _row(db, command_id)).status == "CANCELLED"
    with pytest.raises(CommandClosedError):
        await cancel(db, command_id, actor="op:bob", node_id="api")

    open_ones = [await _create(db, device="d9") for _ in range(3)]
    cancelled = await unbind(db, "d9", actor="op:bob", node_id="api")
    assert sorted(r.id for r in cancelled) == open_ones
    with pytest.raises(DeviceUnboundError):
        await _create(db, device="d9")
    events = await db.fetchval(
        "SELECT count(*) FROM outbox_event WHERE event_type = 'command.finished'"
    )
    assert events == 4


async def test_one_device_gets_its_commands_in_creation_order_one_at_a_time(
    db: asyncpg.Connection,
) -> None:
    first, second = await _create(db), await _create(db)
    other = await _create(db, device="d2")
    assert sorted(r.id for r in await _claim(db, "n")) == [first, other]
    assert await _claim(db, "n") == []
    await _receipt(db, first, generation=1, node="n")
    assert [r.id for r in await _claim(db, "n")] == [second]


async def test_an_idempotency_key_returns_the_same_command(db: asyncpg.Connection) -> None:
    one = await _create(db, key="k-1")
    again = await new_command(
        db, device_id="d1", name="other", params={}, delivery=Delivery.REALTIME,
        idempotency_key="k-1", actor="op", node_id="api", expire_after_s=60,
    )  # fmt: skip
    assert again.created is False
    assert again.command.id == one
    assert await _create(db, device="d2", key="k-1") != one  # keys are per device


async def test_the_node_reports_timeout_when_the_device_stays_silent(
    db: asyncpg.Connection,
) -> None:
    realtime = await _create(db, device="d1")
    deferrable = await _create(db, device="d2", delivery=Delivery.DEFERRABLE)
    for row in await _claim(db, "n"):
        await mark_sent(db, row, node_id="n", sent_timeout_s=SENT_TIMEOUT_S)
    await db.execute("UPDATE command SET sent_at = now() - interval '1 minute'")
    report = await reap(db, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S)
    assert sorted(report.timed_out_receipts) == [realtime, deferrable]
    assert (await _row(db, realtime)).status == "FAILED"
    requeued = await _row(db, deferrable)
    assert (requeued.status, requeued.retry_count) == ("PENDING", 1)
    receipts = await repo.receipts_of(db, realtime)
    assert [(r["result"], r["outcome"]) for r in receipts] == [("TIMEOUT", "accepted")]


async def test_deferrable_commands_wait_for_an_offline_device(db: asyncpg.Connection) -> None:
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen, presence, presence_at) "
        "VALUES ('sleepy', now(), now(), 'offline', now())"
    )
    deferred = await _create(db, device="sleepy", delivery=Delivery.DEFERRABLE)
    assert await _claim(db, "n") == []
    await db.execute("UPDATE device SET presence = 'online' WHERE device_id = 'sleepy'")
    assert [r.id for r in await _claim(db, "n")] == [deferred]
    urgent = await _create(db, device="sleepy-2")
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen, presence) "
        "VALUES ('sleepy-2', now(), now(), 'offline')"
    )
    assert [r.id for r in await _claim(db, "n")] == [urgent]  # realtime: tried at once


async def test_a_receipt_of_generation_zero_is_an_unknown_generation(
    db: asyncpg.Connection,
) -> None:
    """Generations start at 1: no claim ever carried 0, so it is not a late answer to one."""
    claimed = await _create(db, device="d1")
    await _claim(db, "n")
    never_claimed = await _create(db, device="d2")
    await db.execute("UPDATE command SET next_attempt_at = now() + interval '1 hour' WHERE id = $1",
                     never_claimed)  # fmt: skip
    before = {c: (await _row(db, c)) for c in (claimed, never_claimed)}
    for command_id, device in ((claimed, "d1"), (never_claimed, "d2")):
        assert await _receipt(db, command_id, generation=0, node="n", device=device) == (
            ReceiptOutcome.REJECTED, RejectReason.UNKNOWN_GENERATION,
        )  # fmt: skip
        assert (await _row(db, command_id)) == before[command_id]  # untouched
    kept = await db.fetch(
        "SELECT command_id, claim_generation, outcome, reason FROM command_receipt ORDER BY id"
    )
    assert [tuple(r) for r in kept] == [
        (claimed, 0, "rejected", "UNKNOWN_GENERATION"),
        (never_claimed, 0, "rejected", "UNKNOWN_GENERATION"),
    ]
    # The real claim is still answered as usual afterwards.
    assert await _receipt(db, claimed, generation=1, node="n") == (ReceiptOutcome.ACCEPTED, None)


@pytest.mark.parametrize("code", [5, 17, -1, 2**31 - 1])
async def test_a_result_code_outside_the_standard_ones_is_refused_and_kept_raw(
    db: asyncpg.Connection, code: int
) -> None:
    """resultCode is 0-4; anything else would land in the command's standard field."""
    command_id = await _create(db)
    (claimed,) = await _claim(db, "n")
    assert await mark_sent(db, claimed, node_id="n", sent_timeout_s=SENT_TIMEOUT_S) is not None
    before = await _row(db, command_id)
    for result in (ReceiptResult.ACKED, ReceiptResult.FAILED):
        outcome = await _receipt(db, command_id, generation=1, node="n", result=result,
                                 code=code, raw="E-99")  # fmt: skip
        assert outcome == ("rejected", "INVALID_RESULT_CODE")
        assert (await _row(db, command_id)) == before  # untouched: still SENT, no result
    kept = await db.fetch(
        "SELECT result, result_code, raw_result_code, outcome, reason FROM command_receipt"
        " WHERE command_id = $1 ORDER BY id",
        command_id,
    )
    assert [tuple(r) for r in kept] == [
        ("ACKED", code, "E-99", "rejected", "INVALID_RESULT_CODE"),
        ("FAILED", code, "E-99", "rejected", "INVALID_RESULT_CODE"),
    ]
    # A standard code from the same claim is still applied afterwards.
    assert await _receipt(db, command_id, generation=1, node="n", code=4) == ("accepted", None)
    row = await _row(db, command_id)
    assert (row.status, row.result_code) == ("FAILED", 4)


async def _sent_receipt(
    db: asyncpg.Connection,
    command_id: int,
    generation: int,
    *,
    batch: bool,
    outcome: ReceiptOutcome = ReceiptOutcome.ACCEPTED,
) -> None:
    """The device's SENT receipt ("received, working on it"), alone or through a batch."""
    receipt = CommandReceipt(command_id=command_id, claim_generation=generation, node_id="n",
                             result=ReceiptResult.SENT)  # fmt: skip
    if batch:
        (applied,) = await apply_receipts(
            db, [("d1", receipt)], node_id="receiver", sent_timeout_s=SENT_TIMEOUT_S
        )
    else:
        applied = await apply_receipt(
            db, device_id="d1", receipt=receipt, node_id="receiver", sent_timeout_s=SENT_TIMEOUT_S
        )
    assert applied.outcome is outcome


@pytest.mark.parametrize("batch", [False, True], ids=["alone", "batch"])
async def test_a_retry_the_device_confirms_before_the_puback_is_sent_from_now(
    db: asyncpg.Connection, batch: bool
) -> None:
    """A deferrable command sent, failed (DEVICE_OFFLINE) and kept waiting a day is claimed
    again; the device's SENT receipt arrives before the dispatcher handles the PUBACK (which
    then finds it SENT and writes nothing). The new claim is SENT from now, with its own
    timeout_at: the reaper neither times it out nor fails it by the first claim's times."""
    command_id = await _create(db, delivery=Delivery.DEFERRABLE)
    (first,) = await _claim(db, "n")
    assert await mark_sent(db, first, node_id="n", sent_timeout_s=SENT_TIMEOUT_S) is not None
    await _receipt(db, command_id, generation=1, node="n", result=ReceiptResult.DEVICE_OFFLINE,
                   code=None)  # fmt: skip
    await db.execute(
        "UPDATE command SET sent_at = sent_at - interval '25 hours', "
        "timeout_at = timeout_at - interval '25 hours', next_attempt_at = now() WHERE id = $1",
        command_id,
    )
    (second,) = await _claim(db, "n")
    assert (second.claim_generation, second.sent_at, second.timeout_at) == (2, None, None)
    before = await db.fetchval("SELECT now()")
    await _sent_receipt(db, command_id, 2, batch=batch)
    assert await mark_sent(db, second, node_id="n", sent_timeout_s=SENT_TIMEOUT_S) is None
    row = await _row(db, command_id)
    assert row.status == "SENT"
    assert row.sent_at is not None
    assert row.sent_at >= before  # this claim's, not a day old
    assert row.timeout_at == row.sent_at + timedelta(seconds=SENT_TIMEOUT_S)
    report = await reap(db, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S)
    assert (report.timed_out_receipts, report.failed) == ([], [])
    assert (await _row(db, command_id)).status == "SENT"


async def test_a_retry_after_the_ack_window_is_judged_by_its_own_window(
    db: asyncpg.Connection,
) -> None:
    """The first claim's device stayed silent past the ack window (the node's TIMEOUT: a
    retry); the retry's device confirms it with a SENT receipt, and the next reaper pass
    leaves it SENT rather than time it out again by the first claim's sent_at."""
    command_id = await _create(db, delivery=Delivery.DEFERRABLE)
    (first,) = await _claim(db, "n")
    assert await mark_sent(db, first, node_id="n", sent_timeout_s=SENT_TIMEOUT_S) is not None
    await db.execute(
        "UPDATE command SET sent_at = now() - interval '31 seconds' WHERE id = $1", command_id
    )
    one = await reap(db, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S)
    assert one.timed_out_receipts == [command_id]
    await db.execute("UPDATE command SET next_attempt_at = now() WHERE id = $1", command_id)
    (second,) = await _claim(db, "n")
    assert second.claim_generation == 2
    await _sent_receipt(db, command_id, 2, batch=True)
    two = await reap(db, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S)
    assert two.timed_out_receipts == []
    row = await _row(db, command_id)
    assert (row.status, row.claim_generation, row.retry_count) == ("SENT", 2, 1)


@pytest.mark.parametrize("batch", [False, True], ids=["alone", "batch"])
async def test_a_sent_receipt_sends_a_claim_from_now_whatever_times_the_row_held(
    db: asyncpg.Connection, batch: bool
) -> None:
    """A claim made before claims cleared the SENT times (in flight at an upgrade) still holds
    an earlier claim's: a SENT receipt on it sets them anew, as the PUBACK would. A second SENT
    receipt on the SENT command keeps them (its ack window is not extended): a repeat of the
    first, `duplicated`."""
    command_id = await _create(db, delivery=Delivery.DEFERRABLE)
    await _claim(db, "n")
    await db.execute(
        "UPDATE command SET sent_at = now() - interval '25 hours', "
        "timeout_at = now() - interval '1 hour' WHERE id = $1",
        command_id,
    )
    before = await db.fetchval("SELECT now()")
    await _sent_receipt(db, command_id, 1, batch=batch)
    row = await _row(db, command_id)
    assert row.status == "SENT"
    assert row.sent_at is not None
    assert row.sent_at >= before
    assert row.timeout_at == row.sent_at + timedelta(seconds=SENT_TIMEOUT_S)
    await _sent_receipt(db, command_id, 1, batch=batch, outcome=ReceiptOutcome.DUPLICATED)
    again = await _row(db, command_id)
    assert (again.sent_at, again.timeout_at) == (row.sent_at, row.timeout_at)


async def _audit_of(db: asyncpg.Connection, command_ids: list[int], action: str) -> list[tuple]:
    rows = await db.fetch(
        "SELECT command_id, from_status, to_status FROM command_audit"
        " WHERE command_id = ANY($1::bigint[]) AND action = $2 ORDER BY command_id",
        command_ids, action,
    )  # fmt: skip
    return [tuple(r) for r in rows]


async def test_unbind_audits_the_status_each_command_left(db: asyncpg.Connection) -> None:
    sent, claimed, pending = [await _create(db, device="d9") for _ in range(3)]
    done = await _create(db, device="d9")
    await cancel(db, done, actor="op:bob", node_id="api")
    # Two in flight at once, so that one can be SENT and one CLAIMED.
    for _ in range(2):
        await repo.claim_due(
            db, node_id="n", lease_s=30, limit=10, max_in_flight=2, actor="system:dispatcher"
        )
    first = await _row(db, sent)
    assert await mark_sent(db, first, node_id="n", sent_timeout_s=SENT_TIMEOUT_S) is not None
    assert [(await _row(db, c)).status for c in (sent, claimed, pending)] == [
        "SENT", "CLAIMED", "PENDING",
    ]  # fmt: skip

    cancelled = await unbind(db, "d9", actor="op:bob", node_id="api")
    assert sorted(r.id for r in cancelled) == [sent, claimed, pending]
    assert await _audit_of(db, [sent, claimed, pending, done], "unbind") == [
        (sent, "SENT", "CANCELLED"),
        (claimed, "CLAIMED", "CANCELLED"),
        (pending, "PENDING", "CANCELLED"),
    ]


async def test_a_cancel_audits_the_status_it_really_left(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The command moves CLAIMED -> SENT while the cancel waits for its row lock."""
    command_id = await _create(db)
    (claimed,) = await _claim(db, "n")
    dispatcher = await asyncpg.connect(db_dsn)
    canceller = await asyncpg.connect(db_dsn)
    try:
        moving = dispatcher.transaction()
        await moving.start()
        assert await mark_sent(dispatcher, claimed, node_id="n", sent_timeout_s=SENT_TIMEOUT_S)
        pid = canceller.get_server_pid()

        async def cancel_in_transaction() -> MovedCommandRow:
            async with canceller.transaction():
                return await cancel(canceller, command_id, actor="op:bob", node_id="api")

        cancelling = asyncio.create_task(cancel_in_transaction())

        async def blocked() -> bool:
            waiting = await db.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
            )
            return bool(waiting) or cancelling.done()

        await wait_until(blocked, message="the cancel waits for the dispatcher's row lock")
        await moving.commit()
        row = await cancelling
    finally:
        await dispatcher.close()
        await canceller.close()
    assert row.status == "CANCELLED"
    assert await _audit_of(db, [command_id], "cancel") == [(command_id, "SENT", "CANCELLED")]


async def test_a_connection_plans_the_claim_once_and_reuses_the_plan(
    db: asyncpg.Connection,
) -> None:
    """Planning the claim cost more than running it: each claim reuses the connection's plan
    (a generic one), and claims still take the oldest due command of each device."""
    for n in range(8):
        await _create(db, device=f"plan-{n}")
    taken = []
    for _ in range(8):
        [claimed] = await repo.claim_due(
            db, node_id="n1", lease_s=30, limit=1, max_in_flight=1, actor="system:dispatcher"
        )
        taken.append(claimed.device_id)
    assert taken == [f"plan-{n}" for n in range(8)]
    assert (
        await repo.claim_due(
            db, node_id="n1", lease_s=30, limit=1, max_in_flight=1, actor="system:dispatcher"
        )
        == []
    )
    generic, custom = await db.fetchrow(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
        repo.CLAIM_DUE,
    )
    assert (generic, custom) == (9, 0)
    # The setting ends with each claim's transaction: nothing else on the connection has it.
    assert await db.fetchval("SELECT current_setting('plan_cache_mode')") == "auto"


async def test_a_batch_of_sent_marks_writes_only_its_own_open_claims_and_never_waits(
    db: asyncpg.Connection, db_dsn: str
) -> None:
    """One statement for a batch of PUBACKs: the claim still open in its generation goes SENT
    (with its audit row); a command a receipt already finished, a claim of another generation
    and a row another transaction holds are left alone, the last without waiting for it."""
    acked, held, sent, reclaimed = [await _create(db, device=f"batch-{n}") for n in range(4)]
    assert len(await _claim(db, "n")) == 4
    assert await _receipt(db, acked, generation=1, node="n", device="batch-0") == (
        ReceiptOutcome.ACCEPTED,
        None,
    )
    other = await asyncpg.connect(db_dsn)
    try:
        holding = other.transaction()
        await holding.start()
        await other.execute("SELECT 1 FROM command WHERE id = $1 FOR UPDATE", held)
        async with asyncio.timeout(10):
            written = await repo.mark_sent_many(
                db,
                [(acked, 1), (held, 1), (sent, 1), (reclaimed, 2)],
                node_id="n",
                timeout_s=SENT_TIMEOUT_S,
                actor="system:dispatcher",
            )
        await holding.rollback()
    finally:
        await other.close()
    assert written == {sent}
    statuses = dict(await db.fetch("SELECT id, status FROM command"))
    assert statuses == {acked: "ACKED", held: "CLAIMED", sent: "SENT", reclaimed: "CLAIMED"}
    assert await db.fetchval(
        "SELECT array_agg(command_id) FROM command_audit WHERE action = 'sent'"
    ) == [sent]


async def test_batches_of_sent_marks_and_receipts_look_their_commands_up_by_id(
    db: asyncpg.Connection,
) -> None:
    """With statistics taken before a burst (every command still pending, as after a big
    campaign's creation), PostgreSQL believes nothing is in flight: a batch statement naming
    a status of the commands in flight then read all of them through their partial index
    rather than look its few ids up."""
    await db.execute(
        """
        INSERT INTO command (device_id, name)
        SELECT 'burst-' || g, 'reboot' FROM generate_series(1, 3000) AS g
        """
    )
    await db.execute("ANALYZE command")
    await db.execute(
        """
        UPDATE command SET status = 'SENT', claim_generation = 1, claimed_node_id = 'n',
               claimed_at = now(), sent_at = now(), timeout_at = now() + interval '1 hour'
        WHERE id % 3 = 0
        """
    )
    few = [row["id"] for row in await db.fetch("SELECT id FROM command WHERE id % 3 = 0 LIMIT 5")]
    n = len(few)
    receipts = (few, [1] * n, ["n"] * n, ["SENT"] * n, ["ACKED"] * n, ["ACKED"] * n, [0] * n,
                [None] * n, [None] * n, [True] * n, [0] * n, [2.0] * n, [60.0] * n)  # fmt: skip
    statements = {
        "mark_sent_many": (
            repo.MARK_SENT_MANY,
            (few, [1] * n, "n", 60.0, "system:dispatcher", None),
        ),
        "apply_receipts": (repo.APPLY_RECEIPTS, receipts),
    }
    for name, (sql, args) in statements.items():
        plan = await db.fetchval("EXPLAIN (FORMAT JSON) " + sql, *args)
        used = set(re.findall(r'"Index Name": "(\w+)"', plan))
        assert used == {"command_pkey"}, (name, plan)


async def test_a_dispatcher_whose_broker_session_is_down_loses_no_claim_to_it(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """Down: nothing is claimed. Gone mid-publish (SessionDown): back to PENDING at once, no
    reclaim counted, audited as a release. Any other failure: the claim stays to lapse, as
    before (a reclaim). A reconnect wakes the dispatcher."""
    up = {"now": False}
    failure: dict[str, Exception] = {"now": SessionDown("the broker connection ended")}

    async def publish(_topic: str, _payload: bytes, *, ready: object = None) -> None:
        raise failure["now"]

    link = BrokerLink(lambda: up["now"])
    dispatcher = Dispatcher(
        pool=pool, dsn=db_dsn, node_id="n1", topics=Topics("iot"), publish=publish,
        metrics=Metrics(), lease_s=30, sent_timeout_s=SENT_TIMEOUT_S, broker=link,
    )  # fmt: skip
    command_id = await _create(db)
    assert await dispatcher.run_once() == 0  # the session is down: nothing claimed
    assert (await _row(db, command_id)).claim_generation == 0
    up["now"] = True
    assert await dispatcher.run_once() == 1
    await dispatcher.flush()
    released = await _row(db, command_id)
    assert (released.status, released.claim_generation, released.reclaim_count) == (
        "PENDING", 1, 0,
    )  # fmt: skip
    assert released.lease_expire_at is None
    audit = await db.fetchrow(
        "SELECT action, from_status, to_status, claim_generation, node_id, note"
        " FROM command_audit WHERE command_id = $1 ORDER BY id DESC LIMIT 1",
        command_id,
    )
    assert tuple(audit)[:5] == ("release", "CLAIMED", "PENDING", 1, "n1")
    assert "not a reclaim" in audit["note"]
    failure["now"] = aiomqtt.MqttError("publish refused")
    assert await dispatcher.run_once() == 1
    await dispatcher.flush()
    kept = await _row(db, command_id)
    assert (kept.status, kept.claim_generation, kept.reclaim_count) == ("CLAIMED", 2, 0)
    assert not dispatcher._wakeup.is_set()
    link.connected()
    assert dispatcher._wakeup.is_set()


async def test_a_missing_receipt_is_judged_only_by_a_node_that_could_hear_it_all_the_window(
    db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """The broker, then the database, away for longer than the ack window: a device's receipt
    waits at the broker (or in the ingest queue) meanwhile. The node times out no SENT command
    until its broker session, and its passes against the database, have been up for the whole
    window again: the held receipt is applied, not refused as closed; a device that stays
    silent is timed out once the window has passed since."""
    answered, silent = await _create(db, device="d1"), await _create(db, device="d2")
    for row in await _claim(db, "n"):
        await mark_sent(db, row, node_id="n", sent_timeout_s=SENT_TIMEOUT_S)
    await db.execute("UPDATE command SET sent_at = now() - interval '10 minutes'")
    up, now = True, 1000.0
    link = BrokerLink(up=lambda: up)
    reaper = Reaper(
        pool=pool, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S, interval_s=1,
        metrics=Metrics(), broker=link, clock=lambda: now,
    )  # fmt: skip

    async def statuses() -> tuple[str, str]:
        await reaper.run_once()
        return (await _row(db, answered)).status, (await _row(db, silent)).status

    # Just started: it has heard nothing for a window yet.
    assert await statuses() == ("SENT", "SENT")
    now += 30
    up = False  # the broker away, ten minutes
    assert await statuses() == ("SENT", "SENT")
    now += 600
    assert await statuses() == ("SENT", "SENT")
    up = True  # back: the session reconnected
    link.connected()
    now += 1
    assert await statuses() == ("SENT", "SENT")
    now += 28
    assert await statuses() == ("SENT", "SENT")
    # The receipt the broker held comes: applied.
    generation = (await _row(db, answered)).claim_generation
    assert await _receipt(db, answered, generation=generation, node="n", device="d1") == (
        ReceiptOutcome.ACCEPTED,
        None,
    )
    now += 2  # 31 s heard: the silent device is timed out
    assert await statuses() == ("ACKED", "FAILED")

    # The database out of reach: a pass fails; the window starts again after it.
    third = await _create(db, device="d3")
    for row in await _claim(db, "n"):
        await mark_sent(db, row, node_id="n", sent_timeout_s=SENT_TIMEOUT_S)
    await db.execute(
        "UPDATE command SET sent_at = now() - interval '10 minutes' WHERE id = $1", third
    )
    reaper.pool = await asyncpg.create_pool("postgresql://postgres@127.0.0.1:1/none", min_size=0)
    with pytest.raises(ConnectionRefusedError):
        await reaper.run_once()
    await reaper.pool.close()
    reaper.pool = pool
    now += 100
    await reaper.run_once()
    assert (await _row(db, third)).status == "SENT"
    now += 31
    await reaper.run_once()
    assert (await _row(db, third)).status == "FAILED"


async def test_the_ack_window_spares_only_devices_of_a_mapping_still_configured(
    db: asyncpg.Connection,
) -> None:
    """A device read through [[ingest.mappings]] answers no receipt (its commands go out on
    the vendor's topic): the ack window leaves them SENT. Once its mapping is gone from the
    configuration it gets the native downlink again, and its commands are judged as any."""
    command_id = await _create(db, device="kitchen")
    for row in await _claim(db, "n"):
        await mark_sent(db, row, node_id="n", sent_timeout_s=SENT_TIMEOUT_S)
    await db.execute("UPDATE command SET sent_at = now() - interval '1 minute'")
    await db.execute(
        "INSERT INTO device_mapping (device_id, mapping, captures) "
        "VALUES ('kitchen', 'tasmota', '{\"device\": \"kitchen\"}')"
    )
    kept = await reap(
        db, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S, mappings=["tasmota"]
    )
    assert kept.timed_out_receipts == []
    assert (await _row(db, command_id)).status == "SENT"
    gone = await reap(
        db, node_id="n", ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S, mappings=["shelly"]
    )
    assert gone.timed_out_receipts == [command_id]
    assert (await _row(db, command_id)).status == "FAILED"


REFUSE_NODE_RECEIPTS = """
CREATE FUNCTION refuse_receipt() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.received_by = 'n-refused' THEN
        RAISE EXCEPTION 'receipt rows kept by % are refused here', NEW.received_by;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER refuse_receipt BEFORE INSERT ON command_receipt
    FOR EACH ROW EXECUTE FUNCTION refuse_receipt();
"""


async def test_the_nodes_own_timeout_receipts_are_counted_as_receipts_once_committed(
    db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """gateway_command_receipts_total counts every receipt row (docs/commands.md), the node's
    own TIMEOUT of the ack window too, after the commit that keeps it: a pass rolled back
    counts nothing, the pass that commits counts each once, with the transitions."""
    realtime = await _create(db, device="d1")
    deferrable = await _create(db, device="d2", delivery=Delivery.DEFERRABLE)
    for row in await _claim(db, "n"):
        await mark_sent(db, row, node_id="n", sent_timeout_s=SENT_TIMEOUT_S)
    await db.execute("UPDATE command SET sent_at = now() - interval '1 minute'")
    await db.execute(REFUSE_NODE_RECEIPTS)
    metrics = Metrics()

    def counted(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    def reaper(node: str) -> Reaper:
        """A node that has heard receipts for longer than the ack window."""
        now = [1000.0]
        made = Reaper(
            pool=pool, node_id=node, ack_window_s=30, sent_timeout_s=SENT_TIMEOUT_S,
            interval_s=1, metrics=metrics, clock=lambda: now[0],
        )  # fmt: skip
        now[0] += 31
        return made

    with pytest.raises(asyncpg.RaiseError):
        await reaper("n-refused").run_once()  # its receipt rows refused: the pass rolls back
    assert (await _row(db, realtime)).status == "SENT"
    assert counted("gateway_command_receipts_total", outcome="accepted", reason="") == 0
    assert counted("gateway_command_dispatch_to_receipt_seconds_count") == 0

    await reaper("n").run_once()
    assert (await _row(db, realtime)).status == "FAILED"
    assert (await _row(db, deferrable)).status == "PENDING"
    kept = await db.fetch("SELECT result, outcome, reason FROM command_receipt")
    assert [tuple(r) for r in kept] == [("TIMEOUT", "accepted", None)] * 2
    assert counted("gateway_command_receipts_total", outcome="accepted", reason="") == 2
    # The realtime one finished: its latency from the claim, as any finishing receipt's.
    assert counted("gateway_command_dispatch_to_receipt_seconds_count") == 1
    assert counted("gateway_command_transitions_total", from_status="SENT", to_status="FAILED") == 1
    assert (
        counted("gateway_command_transitions_total", from_status="SENT", to_status="PENDING") == 1
    )


async def test_a_batchs_claims_are_read_again_in_the_background_then_waited_for(
    db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """The dispatcher's check of a batch's waiting downlinks (ClaimCheck): the claim's read
    serves for after_s; then a slot reads again in the background and goes on with the last
    read; from twice after_s on, it waits for the new read. A command cancelled, or claimed
    by another node since, is withdrawn."""
    ids = [await _create(db, device=f"d{n}") for n in range(4)]
    claimed = await _claim(db, "n")
    now = [100.0]
    check = ClaimCheck(pool, claimed, node_id="n", after_s=0.25, clock=lambda: now[0])
    async with db.transaction():
        await cancel(db, ids[0], actor="op:bob", node_id="api")
    now[0] += 0.1
    assert await check.still_claimed(ids[1]) is True  # the claim's read still serves
    assert check._reading is None
    now[0] += 0.2  # 0.3 s: read again, not waited for
    assert await check.still_claimed(ids[3]) is True
    await check.close()
    assert check.withdrawn == {ids[0]}
    now[0] += 0.05
    assert await check.still_claimed(ids[0]) is False
    await _expire_lease(db, ids[2])
    await repo.reclaim_expired(db)
    assert [r.id for r in await _claim(db, "other")] == [ids[2]]
    now[0] += 0.6  # 0.65 s since the last read: this one waits for the next
    assert await check.still_claimed(ids[2]) is False
    assert check.withdrawn == {ids[0], ids[2]}
