"""The command tables enforce the aggregate's invariants: real PostgreSQL, constraint by name."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from gateway.domain.command import (
    TERMINAL_STATUSES,
    CommandStatus,
    Delivery,
    Guards,
    ReceiptOutcome,
    RejectReason,
    judge_receipt,
    receipt_effect,
)
from protocol.messages import ReceiptResult
from storage import commands

S = CommandStatus
T0 = datetime(2024, 5, 1, 8, 0, tzinfo=UTC)
WAIT_S = 10

INSERT = """
INSERT INTO command (
    device_id, name, params, delivery, status, idempotency_key, claim_generation,
    claimed_node_id, legacy_claim, claimed_at, lease_expire_at, sent_at, timeout_at,
    finished_at, retry_count, reclaim_count, result, result_code, raw_result_code, raw_ack,
    created_by
) VALUES (
    $1, $2, $3::jsonb, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
    $19, $20, $21
)
RETURNING id
"""
COLUMNS = (
    "device_id",
    "name",
    "params",
    "delivery",
    "status",
    "idempotency_key",
    "claim_generation",
    "claimed_node_id",
    "legacy_claim",
    "claimed_at",
    "lease_expire_at",
    "sent_at",
    "timeout_at",
    "finished_at",
    "retry_count",
    "reclaim_count",
    "result",
    "result_code",
    "raw_result_code",
    "raw_ack",
    "created_by",
)

NEW: dict[str, Any] = {
    "device_id": "dev-1",
    "name": "unlock",
    "params": {"door": 2},
    "delivery": "deferrable",
    "status": "PENDING",
    "idempotency_key": None,
    "claim_generation": 0,
    "claimed_node_id": None,
    "legacy_claim": False,
    "claimed_at": None,
    "lease_expire_at": None,
    "sent_at": None,
    "timeout_at": None,
    "finished_at": None,
    "retry_count": 0,
    "reclaim_count": 0,
    "result": None,
    "result_code": None,
    "raw_result_code": None,
    "raw_ack": None,
    "created_by": "alice",
}
CLAIM = {
    "claim_generation": 1,
    "claimed_node_id": "node-a",
    "claimed_at": T0,
    "lease_expire_at": T0 + timedelta(seconds=30),
}
SEND = {**CLAIM, "status": "SENT", "sent_at": T0, "timeout_at": T0 + timedelta(seconds=60)}
DONE = {"finished_at": T0 + timedelta(seconds=5)}

# One or more valid rows of every state, the way the lifecycle leaves them.
VALID: dict[str, dict[str, Any]] = {
    "pending_new": NEW,
    "pending_lease_expired": {**NEW, **CLAIM, "reclaim_count": 1},
    "pending_retry": {**NEW, **SEND, "status": "PENDING", "retry_count": 1, "result": "FAILED"},
    "pending_was_legacy": {**NEW, **CLAIM, "claimed_node_id": None, "legacy_claim": True},
    "claimed": {**NEW, **CLAIM, "status": "CLAIMED"},
    "claimed_again": {**NEW, **SEND, "status": "CLAIMED", "claim_generation": 3},
    "claimed_legacy": {
        **NEW,
        **CLAIM,
        "status": "CLAIMED",
        "claimed_node_id": None,
        "legacy_claim": True,
    },
    "sent": {**NEW, **SEND},
    "sent_legacy": {**NEW, **SEND, "claimed_node_id": None, "legacy_claim": True},
    "acked": {
        **NEW,
        **SEND,
        **DONE,
        "status": "ACKED",
        "result": "ACKED",
        "result_code": 0,
        "raw_result_code": "0x00",
        "raw_ack": "OK",
    },
    "acked_from_claimed": {
        **NEW,
        **CLAIM,
        **DONE,
        "status": "ACKED",
        "result": "ACKED",
        "result_code": 0,
    },
    "failed_acked_not_zero": {
        **NEW,
        **SEND,
        **DONE,
        "status": "FAILED",
        "result": "ACKED",
        "result_code": 3,
        "raw_result_code": "E42",
    },
    "failed_acked_no_code": {**NEW, **SEND, **DONE, "status": "FAILED", "result": "ACKED"},
    "failed_offline": {
        **NEW,
        **CLAIM,
        **DONE,
        "status": "FAILED",
        "delivery": "realtime",
        "result": "DEVICE_OFFLINE",
    },
    "failed_past_timeout": {**NEW, **SEND, **DONE, "status": "FAILED"},
    "timeout_retries": {
        **NEW,
        **SEND,
        **DONE,
        "status": "TIMEOUT",
        "retry_count": 10,
        "result": "FAILED",
        "result_code": 4,
    },
    "timeout_expired": {**NEW, **DONE, "status": "TIMEOUT"},
    "cancelled_unclaimed": {**NEW, **DONE, "status": "CANCELLED"},
    "cancelled_sent": {**NEW, **SEND, **DONE, "status": "CANCELLED", "reclaim_count": 6},
}


def args(row: dict[str, Any], device_id: str | None = None) -> tuple[Any, ...]:
    values = {**row, "params": msgspec.json.encode(row["params"]).decode()}
    if device_id is not None:
        values["device_id"] = device_id
    return tuple(values[name] for name in COLUMNS)


async def insert(db: asyncpg.Connection, row: dict[str, Any], device_id: str | None = None) -> int:
    command_id: int = await db.fetchval(INSERT, *args(row, device_id))
    return command_id


async def check_names(db: asyncpg.Connection, table: str) -> set[str]:
    return {
        r["conname"]
        for r in await db.fetch(
            "SELECT conname FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'c'",
            table,
        )
    }


# --- command ----------------------------------------------------------------------------------


async def test_valid_rows_of_every_state_are_accepted(db: asyncpg.Connection) -> None:
    assert {row["status"] for row in VALID.values()} == set(CommandStatus)
    for row in VALID.values():
        await insert(db, row)
    count = await db.fetchval("SELECT count(*) FROM command")
    assert count == len(VALID)


async def test_defaults(db: asyncpg.Connection) -> None:
    command_id = await db.fetchval(
        "INSERT INTO command (device_id, name) VALUES ('dev-1', 'reboot') RETURNING id"
    )
    row = await db.fetchrow("SELECT * FROM command WHERE id = $1", command_id)
    assert row is not None
    assert (row["status"], row["delivery"], row["params"]) == ("PENDING", "realtime", "{}")
    assert (row["claim_generation"], row["retry_count"], row["reclaim_count"]) == (0, 0, 0)
    assert row["legacy_claim"] is False
    assert row["expire_at"] - row["created_at"] == timedelta(hours=72)
    assert row["next_attempt_at"] == row["created_at"] == row["updated_at"]
    assert row["finished_at"] is None


# (constraint, a valid row, the change that breaks only that constraint)
BROKEN: list[tuple[str, str, dict[str, Any]]] = [
    ("command_status_valid", "pending_new", {"status": "pending"}),
    ("command_status_valid", "claimed", {"status": "claimed"}),
    ("command_delivery_valid", "pending_new", {"delivery": "eventually"}),
    # A Sparkplug id has two or three levels (docs/sparkplug.md); more, or an empty one, no.
    ("command_device_id_valid", "pending_new", {"device_id": "dev/1/2/3"}),
    ("command_device_id_valid", "pending_new", {"device_id": "dev//1"}),
    ("command_device_id_valid", "pending_new", {"device_id": "d" * 65}),
    ("command_device_id_valid", "pending_new", {"device_id": "dev-1\n"}),
    ("command_device_id_valid", "pending_new", {"device_id": ""}),
    ("command_name_valid", "pending_new", {"name": ""}),
    ("command_name_valid", "pending_new", {"name": "  "}),
    ("command_name_valid", "pending_new", {"name": "n" * 129}),
    ("command_idempotency_key_not_blank", "pending_new", {"idempotency_key": ""}),
    ("command_claim_generation_not_negative", "pending_new", {"claim_generation": -1}),
    ("command_retry_count_not_negative", "pending_retry", {"retry_count": -1}),
    ("command_reclaim_count_not_negative", "claimed", {"reclaim_count": -1}),
    ("command_unclaimed_has_no_claim", "pending_new", {"claimed_node_id": "node-a"}),
    ("command_unclaimed_has_no_claim", "pending_new", {"lease_expire_at": T0}),
    ("command_unclaimed_has_no_claim", "cancelled_unclaimed", {"sent_at": T0}),
    ("command_unclaimed_has_no_claim", "timeout_expired", {"timeout_at": T0}),
    ("command_unclaimed_has_no_claim", "pending_lease_expired", {"claim_generation": 0}),
    ("command_claimed_has_lease", "claimed", {"lease_expire_at": None}),
    ("command_claimed_has_lease", "claimed", {"claimed_at": None}),
    ("command_claimed_has_lease", "claimed_legacy", {"lease_expire_at": None}),
    ("command_sent_has_deadline", "sent", {"timeout_at": None}),
    ("command_sent_has_deadline", "sent", {"sent_at": None}),
    ("command_sent_has_deadline", "sent_legacy", {"claimed_at": None}),
    ("command_claim_in_force_has_node", "claimed", {"claimed_node_id": None}),
    ("command_claim_in_force_has_node", "sent", {"claimed_node_id": None}),
    ("command_claim_in_force_has_node", "sent_legacy", {"legacy_claim": False}),
    ("command_acked_has_success_code", "acked", {"result_code": 1}),
    ("command_acked_has_success_code", "acked", {"result_code": None}),
    ("command_acked_has_success_code", "acked", {"result": "SENT"}),
    ("command_acked_has_success_code", "acked", {"result": None, "result_code": None}),
    ("command_success_code_only_when_acked", "failed_acked_not_zero", {"result_code": 0}),
    (
        "command_success_code_only_when_acked",
        "cancelled_sent",
        {"result": "ACKED", "result_code": 0},
    ),
    ("command_finished_iff_terminal", "acked", {"finished_at": None}),
    ("command_finished_iff_terminal", "cancelled_unclaimed", {"finished_at": None}),
    ("command_finished_iff_terminal", "timeout_expired", {"finished_at": None}),
    ("command_finished_iff_terminal", "failed_offline", {"finished_at": None}),
    ("command_finished_iff_terminal", "pending_new", {"finished_at": T0}),
    ("command_finished_iff_terminal", "claimed", {"finished_at": T0}),
    ("command_finished_iff_terminal", "sent", {"finished_at": T0}),
]


async def test_every_check_constraint_has_a_breaking_row(db: asyncpg.Connection) -> None:
    # The campaign column's own check is broken by the test below (it needs no base row).
    assert await check_names(db, "command") == {name for name, _, _ in BROKEN} | {
        "command_paced_has_campaign"
    }


async def test_a_paced_command_belongs_to_a_campaign(db: asyncpg.Connection) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as raised:
        await db.execute("INSERT INTO command (device_id, name, paced) VALUES ('d1', 'x', true)")
    assert raised.value.constraint_name == "command_paced_has_campaign"


@pytest.mark.parametrize(("constraint", "base", "changes"), BROKEN)
async def test_rows_breaking_an_invariant_are_rejected_by_its_check(
    db: asyncpg.Connection, constraint: str, base: str, changes: dict[str, Any]
) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as raised:
        await insert(db, {**VALID[base], **changes})
    assert raised.value.constraint_name == constraint
    await insert(db, VALID[base])


async def test_idempotency_key_is_unique_per_device(db: asyncpg.Connection) -> None:
    keyed = {**NEW, "idempotency_key": "req-1"}
    first = await insert(db, keyed)
    with pytest.raises(asyncpg.UniqueViolationError) as raised:
        await insert(db, {**keyed, "name": "lock"})
    assert raised.value.constraint_name == "command_idempotency_key_unique"
    other_device = await insert(db, keyed, device_id="dev-2")
    assert other_device != first
    # Without a key, nothing is unique.
    for _ in range(3):
        await insert(db, NEW)
    # The ON CONFLICT form the API uses: the second request gets the first command back.
    again = await db.fetchval(
        """
        WITH inserted AS (
            INSERT INTO command (device_id, name, idempotency_key) VALUES ($1, 'unlock', $2)
            ON CONFLICT (device_id, idempotency_key) WHERE idempotency_key IS NOT NULL
            DO NOTHING RETURNING id
        )
        SELECT id FROM inserted
        UNION ALL
        SELECT id FROM command WHERE device_id = $1 AND idempotency_key = $2
        LIMIT 1
        """,
        "dev-1",
        "req-1",
    )
    assert again == first
    assert await db.fetchval("SELECT count(*) FROM command") == 5


async def test_indexes(db: asyncpg.Connection) -> None:
    indexes = {
        r["indexname"]: r["indexdef"].split(" USING btree ", 1)[1]
        for r in await db.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename LIKE 'command%'"
        )
    }
    assert indexes == {
        "command_pkey": "(id)",
        "command_idempotency_key_unique": (
            "(device_id, idempotency_key) WHERE (idempotency_key IS NOT NULL)"
        ),
        "command_device_idx": "(device_id, id)",
        # The reaper's scans, each over one open status: a finished command is in none.
        "command_lease_idx": "(lease_expire_at) WHERE (status = 'CLAIMED'::text)",
        "command_timeout_idx": "(timeout_at) WHERE (status = 'SENT'::text)",
        "command_expire_idx": (
            "(expire_at) WHERE (status = ANY (ARRAY['PENDING'::text, 'CLAIMED'::text,"
            " 'SENT'::text]))"
        ),
        "command_pending_idx": "(id) WHERE (status = 'PENDING'::text)",
        "command_pending_device_idx": "(device_id, id) WHERE (status = 'PENDING'::text)",
        "command_in_flight_device_idx": (
            "(device_id) WHERE (status = ANY (ARRAY['CLAIMED'::text, 'SENT'::text]))"
        ),
        "command_receipt_pkey": "(id)",
        "command_receipt_command_idx": "(command_id, id)",
        "command_audit_pkey": "(id)",
        # Each node's reaper pass: up to when it has stored what it received (migration 0057).
        "command_hearing_pkey": "(node_id)",
        "command_audit_command_idx": "(command_id, id)",
        # A campaign's counts per status and its commands page by page.
        "command_campaign_idx": "(campaign_id, status, id) WHERE (campaign_id IS NOT NULL)",
        # The fleet's rare outcomes page by page (GET /commands?status=FAILED).
        "command_unsuccessful_idx": (
            "(id) WHERE (status = ANY (ARRAY['FAILED'::text, 'TIMEOUT'::text, 'CANCELLED'::text]))"
        ),
    }


# --- the lifecycle through conditional writes -------------------------------------------------

CLAIM_SQL = """
WITH due AS (
    SELECT id FROM command
    WHERE status = 'PENDING' AND next_attempt_at <= now()
    ORDER BY next_attempt_at, id
    FOR UPDATE SKIP LOCKED
    LIMIT $2
)
UPDATE command c
SET status = 'CLAIMED', claim_generation = c.claim_generation + 1, claimed_node_id = $1,
    claimed_at = now(), lease_expire_at = now() + interval '30 seconds', updated_at = now()
FROM due WHERE c.id = due.id
RETURNING c.id, c.claim_generation
"""
EXPIRE_LEASE_SQL = """
UPDATE command SET status = 'PENDING', reclaim_count = reclaim_count + 1, updated_at = now()
WHERE id = $1 AND status = 'CLAIMED'
"""
RECEIPT_SQL = """
UPDATE command
SET status = $4, result = $5, result_code = $6, updated_at = now(),
    finished_at = CASE WHEN $7::boolean THEN now() END,
    retry_count = retry_count + CASE WHEN $8::boolean THEN 1 ELSE 0 END,
    sent_at = CASE WHEN $4 = 'SENT' THEN coalesce(sent_at, now()) ELSE sent_at END,
    timeout_at = CASE WHEN $4 = 'SENT' THEN coalesce(timeout_at, now() + interval '60 seconds')
                      ELSE timeout_at END
WHERE id = $1 AND claim_generation = $2 AND claimed_node_id = $3
  AND status IN ('CLAIMED', 'SENT')
"""


async def read_guards(db: asyncpg.Connection, command_id: int) -> Guards:
    row = await db.fetchrow(
        "SELECT status, claim_generation, claimed_node_id FROM command WHERE id = $1", command_id
    )
    if row is None:
        return Guards(
            command_exists=False, status=None, claim_generation=None, claimed_node_id=None
        )
    return Guards(
        command_exists=True,
        status=CommandStatus(row["status"]),
        claim_generation=row["claim_generation"],
        claimed_node_id=row["claimed_node_id"],
    )


async def test_spec_scenario_late_receipt_after_a_reclaim(db: asyncpg.Connection) -> None:
    """Behaviour §7: A claims (gen 1), its lease expires, B re-claims (gen 2); A's is late."""
    command_id = await insert(db, NEW)
    assert [tuple(r) for r in await db.fetch(CLAIM_SQL, "node-a", 10)] == [(command_id, 1)]
    assert await db.execute(EXPIRE_LEASE_SQL, command_id) == "UPDATE 1"
    lapsed = await read_guards(db, command_id)
    assert lapsed == Guards(True, S.PENDING, 1, "node-a")
    assert judge_receipt(lapsed, receipt_generation=1, receipt_node="node-a") == (
        ReceiptOutcome.REJECTED,
        RejectReason.NOT_CLAIMED,
    )
    assert [tuple(r) for r in await db.fetch(CLAIM_SQL, "node-b", 10)] == [(command_id, 2)]

    late = ("ACKED", "ACKED", 0, True, False)
    assert await db.execute(RECEIPT_SQL, command_id, 1, "node-a", *late) == "UPDATE 0"
    assert judge_receipt(
        await read_guards(db, command_id), receipt_generation=1, receipt_node="node-a"
    ) == (ReceiptOutcome.DUPLICATED, None)

    effect = receipt_effect(
        delivery=Delivery.DEFERRABLE,
        current=S.CLAIMED,
        result=ReceiptResult.SENT,
        result_code=None,
        retry_count=0,
    )
    changes = (effect.status, effect.result, effect.result_code, effect.terminal, effect.retry)
    assert await db.execute(RECEIPT_SQL, command_id, 2, "node-b", *changes) == "UPDATE 1"
    # A's late ACK still cannot touch B's progress.
    assert await db.execute(RECEIPT_SQL, command_id, 1, "node-a", *late) == "UPDATE 0"
    row = await db.fetchrow(
        "SELECT status, claim_generation, claimed_node_id, reclaim_count, sent_at IS NOT NULL "
        "AS sent FROM command WHERE id = $1",
        command_id,
    )
    assert row is not None
    assert dict(row) == {
        "status": "SENT",
        "claim_generation": 2,
        "claimed_node_id": "node-b",
        "reclaim_count": 1,
        "sent": True,
    }


@pytest.mark.parametrize(
    ("delivery", "retry_count"), list(itertools.product(Delivery, [0, 9, 10])), ids=str
)
async def test_every_receipt_effect_makes_a_valid_row(
    db: asyncpg.Connection, delivery: Delivery, retry_count: int
) -> None:
    for current, result, code in itertools.product(
        [S.CLAIMED, S.SENT], ReceiptResult, [0, 1, 3, None]
    ):
        base = VALID["claimed"] if current is S.CLAIMED else VALID["sent"]
        command_id = await insert(
            db, {**base, "delivery": delivery.value, "retry_count": retry_count}
        )
        effect = receipt_effect(
            delivery=delivery,
            current=current,
            result=result,
            result_code=code,
            retry_count=retry_count,
        )
        changes = (effect.status, effect.result, effect.result_code, effect.terminal, effect.retry)
        assert await db.execute(RECEIPT_SQL, command_id, 1, "node-a", *changes) == "UPDATE 1"
        status = await db.fetchval("SELECT status FROM command WHERE id = $1", command_id)
        assert status == effect.status
        assert (status in TERMINAL_STATUSES) is effect.terminal


# --- receipts and audit -----------------------------------------------------------------------

INSERT_RECEIPT = """
INSERT INTO command_receipt (
    command_id, reported_command_id, device_id, claim_generation, node_id, result, result_code,
    raw_result_code, raw_ack, outcome, reason, received_by
) VALUES ($1, $2, 'dev-1', $3, 'node-a', $4, $5, NULL, '{"r":0}', $6, $7, 'node-a')
"""


async def test_receipt_value_sets_match_the_domain(db: asyncpg.Connection) -> None:
    checks = await db.fetch(
        "SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint "
        "WHERE conrelid = 'command_receipt'::regclass AND contype = 'c'"
    )
    definitions = {r["conname"]: r["def"] for r in checks}
    assert set(definitions) == {
        "command_receipt_result_valid",
        "command_receipt_outcome_valid",
        "command_receipt_reason_valid",
        "command_receipt_rejected_has_reason",
        "command_receipt_linked_unless_unknown",
    }
    for name, values in [
        ("command_receipt_result_valid", ReceiptResult),
        ("command_receipt_outcome_valid", ReceiptOutcome),
        ("command_receipt_reason_valid", RejectReason),
    ]:
        assert all(f"'{v.value}'::text" in definitions[name] for v in values), name
        assert definitions[name].count("::text") == len(values), name


async def test_receipts_of_every_outcome_are_kept(db: asyncpg.Connection) -> None:
    command_id = await insert(db, VALID["sent"])
    await db.execute(INSERT_RECEIPT, command_id, command_id, 1, "ACKED", 0, "accepted", None)
    await db.execute(INSERT_RECEIPT, command_id, command_id, 0, "SENT", None, "duplicated", None)
    for reason in RejectReason:
        linked = None if reason is RejectReason.UNKNOWN_COMMAND else command_id
        await db.execute(INSERT_RECEIPT, linked, 999, 1, "FAILED", 3, "rejected", reason.value)
    await db.execute(
        INSERT_RECEIPT, None, 999, None, "FAILED", None, "rejected", "CLAIM_GENERATION_REQUIRED"
    )
    counts = await db.fetch(
        "SELECT outcome, count(*) AS n FROM command_receipt GROUP BY outcome ORDER BY outcome"
    )
    assert [tuple(r) for r in counts] == [
        ("accepted", 1),
        ("duplicated", 1),
        ("rejected", len(RejectReason) + 1),
    ]


RECEIPT_BROKEN: list[tuple[str, str, str | None, bool]] = [
    # (constraint, outcome, reason, linked to the command)
    ("command_receipt_rejected_has_reason", "rejected", None, True),
    ("command_receipt_rejected_has_reason", "accepted", "NODE_MISMATCH", True),
    ("command_receipt_rejected_has_reason", "duplicated", "NOT_CLAIMED", True),
    ("command_receipt_outcome_valid", "ok", None, True),
    ("command_receipt_reason_valid", "rejected", "BAD_LUCK", True),
    ("command_receipt_linked_unless_unknown", "accepted", None, False),
    ("command_receipt_linked_unless_unknown", "duplicated", None, False),
    ("command_receipt_linked_unless_unknown", "rejected", "NODE_MISMATCH", False),
    ("command_receipt_linked_unless_unknown", "rejected", "UNKNOWN_COMMAND", True),
]


@pytest.mark.parametrize(("constraint", "outcome", "reason", "linked"), RECEIPT_BROKEN)
async def test_receipt_checks(
    db: asyncpg.Connection, constraint: str, outcome: str, reason: str | None, linked: bool
) -> None:
    command_id = await insert(db, VALID["sent"])
    with pytest.raises(asyncpg.CheckViolationError) as raised:
        await db.execute(
            INSERT_RECEIPT, command_id if linked else None, 7, 1, "ACKED", 0, outcome, reason
        )
    assert raised.value.constraint_name == constraint


async def test_receipt_result_and_command_must_exist(db: asyncpg.Connection) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as raised:
        await db.execute(INSERT_RECEIPT, None, 7, 1, "DONE", 0, "rejected", "UNKNOWN_COMMAND")
    assert raised.value.constraint_name == "command_receipt_result_valid"
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await db.execute(INSERT_RECEIPT, 12345, 12345, 1, "ACKED", 0, "accepted", None)


INSERT_AUDIT = """
INSERT INTO command_audit (command_id, actor, action, from_status, to_status, claim_generation,
                           node_id, note)
VALUES ($1, $2, 'claim', $3, $4, 1, 'node-a', NULL)
"""


async def test_audit_rows(db: asyncpg.Connection) -> None:
    command_id = await insert(db, VALID["claimed"])
    await db.execute(INSERT_AUDIT, command_id, "alice", None, "PENDING")
    await db.execute(INSERT_AUDIT, command_id, "system:dispatcher", "PENDING", "CLAIMED")
    assert await check_names(db, "command_audit") == {
        "command_audit_actor_not_blank",
        "command_audit_from_status_valid",
        "command_audit_to_status_valid",
    }
    for actor, from_status, to_status, constraint in [
        ("", "PENDING", "CLAIMED", "command_audit_actor_not_blank"),
        (" ", "PENDING", "CLAIMED", "command_audit_actor_not_blank"),
        ("bob", "WAITING", "CLAIMED", "command_audit_from_status_valid"),
        ("bob", "PENDING", "claimed", "command_audit_to_status_valid"),
    ]:
        with pytest.raises(asyncpg.CheckViolationError) as raised:
            await db.execute(INSERT_AUDIT, command_id, actor, from_status, to_status)
        assert raised.value.constraint_name == constraint
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await db.execute(INSERT_AUDIT, command_id + 1, "bob", "PENDING", "CLAIMED")


# --- wake-ups ---------------------------------------------------------------------------------

MARKER = "marker"


@pytest.fixture
async def notifications(db_dsn: str) -> AsyncIterator[asyncio.Queue[str]]:
    """Payloads on ``command_due``, seen from a second connection."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(db_dsn)

    def received(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        queue.put_nowait(payload)

    try:
        await listener.add_listener("command_due", received)
        yield queue
    finally:
        await listener.close()


async def next_payload(queue: asyncio.Queue[str]) -> str:
    async with asyncio.timeout(WAIT_S):
        return await queue.get()


async def assert_quiet(db: asyncpg.Connection, queue: asyncio.Queue[str]) -> None:
    """Nothing was notified since the last check: notifications arrive in commit order, so the
    marker committed now is the next payload unless something came before it."""
    await db.execute("SELECT pg_notify('command_due', $1)", MARKER)
    assert await next_payload(queue) == MARKER


async def test_the_notify_trigger_wakes_dispatchers_for_due_work_only(
    db: asyncpg.Connection, notifications: asyncio.Queue[str]
) -> None:
    command_id = await insert(db, NEW)
    assert await next_payload(notifications) == ""
    await assert_quiet(db, notifications)

    # A batch in one statement: one wake-up (PostgreSQL folds identical notifications).
    await db.executemany(INSERT, [args(NEW, device_id=f"dev-{i}") for i in range(20)])
    assert await next_payload(notifications) == ""
    await assert_quiet(db, notifications)

    # Claims (even one that takes nothing) and sends wake nobody.
    assert len(await db.fetch(CLAIM_SQL, "node-a", 100)) == 21
    assert await db.fetch(CLAIM_SQL, "node-a", 100) == []
    effect = ("SENT", "SENT", None, False, False)
    assert await db.execute(RECEIPT_SQL, command_id, 1, "node-a", *effect) == "UPDATE 1"
    await db.execute("UPDATE command SET raw_ack = 'x' WHERE id = $1", command_id)
    await assert_quiet(db, notifications)

    # Back to PENDING (a deferrable retry, a lapsed lease) is due work again.
    retry = ("PENDING", "DEVICE_OFFLINE", None, False, True)
    assert await db.execute(RECEIPT_SQL, command_id, 1, "node-a", *retry) == "UPDATE 1"
    assert await next_payload(notifications) == ""
    other = await db.fetchval("SELECT id FROM command WHERE status = 'CLAIMED' LIMIT 1")
    assert await db.execute(EXPIRE_LEASE_SQL, other) == "UPDATE 1"
    assert await next_payload(notifications) == ""
    # So is a PENDING command whose next attempt moved.
    await db.execute(
        "UPDATE command SET next_attempt_at = now() + interval '5 seconds' WHERE id = $1",
        command_id,
    )
    assert await next_payload(notifications) == ""
    await assert_quiet(db, notifications)

    # A command that finishes frees a slot of its device, whose next command may now be due;
    # a finished command changing again does not.
    claimed = await db.fetchval("SELECT id FROM command WHERE status = 'CLAIMED' LIMIT 1")
    acked = ("ACKED", "ACKED", 0, True, False)
    assert await db.execute(RECEIPT_SQL, claimed, 1, "node-a", *acked) == "UPDATE 1"
    assert await next_payload(notifications) == ""
    await db.execute("UPDATE command SET status = 'ACKED', raw_ack = 'y' WHERE id = $1", claimed)
    await assert_quiet(db, notifications)


async def test_a_page_of_each_status_reads_an_index_of_that_status_in_a_generic_plan(
    db: asyncpg.Connection,
) -> None:
    """GET /commands?status=: a prepared statement's generic plan (what a long-running node
    ends up with) must not walk every command ever made to find a page of a rare status."""
    await db.execute(
        """
        INSERT INTO command (device_id, name, status, claim_generation, claimed_node_id,
                             claimed_at, sent_at, timeout_at, result, result_code, finished_at)
        SELECT 'dev-' || g % 50, 'reboot', 'ACKED', 1, 'n1', now(), now(), now(), 'ACKED', 0,
               now()
        FROM generate_series(1, 20000) AS g
        """
    )
    await db.execute("ANALYZE command")
    await db.execute("SET plan_cache_mode = force_generic_plan")
    try:
        for n, (status, indexes) in enumerate(
            [
                ("FAILED", {"command_unsuccessful_idx"}),
                ("TIMEOUT", {"command_unsuccessful_idx"}),
                ("CANCELLED", {"command_unsuccessful_idx"}),
                ("PENDING", {"command_pending_idx", "command_pending_device_idx"}),
                # The few in flight, by whichever of their partial indexes.
                ("SENT", {"command_in_flight_device_idx", "command_expire_idx"}),
            ]
        ):
            await db.execute(
                f"PREPARE page_{n}(text, bigint, integer) AS {commands.LIST_OF_STATUS[status]}"
            )
            plan = await db.fetchval(
                f"EXPLAIN (FORMAT JSON) EXECUTE page_{n}('{status}', NULL, 50)"
            )
            used = set(re.findall(r'"Index Name": "(\w+)"', plan))
            assert used, (status, plan)
            assert used <= indexes, (status, plan)
            assert "Seq Scan" not in plan, (status, plan)
    finally:
        await db.execute("RESET plan_cache_mode")
        await db.execute("DEALLOCATE ALL")
