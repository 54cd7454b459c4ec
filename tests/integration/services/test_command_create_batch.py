"""Concurrent command creations share a transaction, and each still gets its own exact answer
(docs/commands.md), against real PostgreSQL.

Batching is made deterministic, not hoped for (tests/support/held_batch.py): the first request's
transaction waits in PostgreSQL on a test connection's uncommitted key, the requests that arrive
meanwhile queue, and once the test connection rolls back they all go in the next batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import asyncpg
import pytest

from gateway.commands.creator import Creation
from gateway.commands.lifecycle import DeviceUnboundError
from gateway.commands.service import CommandService
from gateway.domain.command import Delivery
from gateway.support.metrics import Metrics
from tests.support.held_batch import HOLD, Block, first_batch_held, lock_waiters, queue_in_order
from tests.support.waiting import wait_until

N = 50


@pytest.fixture
def service(pool: asyncpg.Pool) -> CommandService:
    return CommandService(pool, "batch-test", 3600.0, metrics=Metrics())


def _create(
    service: CommandService,
    device: str,
    name: str,
    *,
    key: str | None = None,
    params: dict[str, Any] | None = None,
) -> Coroutine[Any, Any, Creation]:
    return service.create(
        device_id=device, name=name, params=params or {}, delivery=Delivery.REALTIME,
        idempotency_key=key, actor="op:alice",
    )  # fmt: skip


def _batches(service: CommandService) -> tuple[float | None, float | None]:
    """(transactions, requests they held) as the batch histogram counts them."""
    assert service.metrics is not None
    registry = service.metrics.registry
    return (
        registry.get_sample_value("gateway_command_create_batch_size_count"),
        registry.get_sample_value("gateway_command_create_batch_size_sum"),
    )


async def test_concurrent_creations_share_one_transaction_and_each_answer_is_exact(
    service: CommandService, db_dsn: str, db: asyncpg.Connection
) -> None:
    release = asyncio.Event()

    async def one(i: int) -> Creation:
        await release.wait()
        return await _create(service, f"d{i % 5}", f"c{i}", params={"i": i})

    async with first_batch_held(service, db_dsn):
        tasks = [asyncio.create_task(one(i)) for i in range(N - 1)]
        release.set()
        await wait_until(lambda: service.creator.queued == N - 1, message="all queued")
    answers = await asyncio.gather(*tasks)

    assert _batches(service) == (2, N)  # the held one alone, then every other one together
    ids = [a.command.id for a in answers]
    assert len(set(ids)) == N - 1
    for i, answer in enumerate(answers):
        row = answer.command
        assert answer.created
        assert (row.device_id, row.name, row.status) == (f"d{i % 5}", f"c{i}", "PENDING")
        assert row.created_by == "op:alice"
    # Released together, they queued in task order: ids ascend in it, per device too.
    assert ids == sorted(ids)
    xmins = await db.fetchval(
        "SELECT count(DISTINCT xmin::text) FROM command WHERE id = ANY($1::bigint[])", ids
    )
    assert xmins == 1
    audits = await db.fetch(
        "SELECT command_id, actor, action, from_status, to_status, node_id FROM command_audit"
        " WHERE command_id = ANY($1::bigint[]) ORDER BY command_id",
        ids,
    )
    assert [tuple(a) for a in audits] == [
        (i, "op:alice", "create", None, "PENDING", "batch-test") for i in ids
    ]


async def test_one_batch_answers_each_request_as_if_alone_in_arrival_order(
    service: CommandService, db_dsn: str, db: asyncpg.Connection
) -> None:
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen, bound)"
        " VALUES ('bound1', now(), now(), true), ('gone', now(), now(), false)"
    )
    before = await _create(service, "bound1", "earlier", key="k-old")
    async with first_batch_held(service, db_dsn):
        tasks = await queue_in_order(
            service,
            [
                _create(service, "bound1", "a1"),
                _create(service, "gone", "refused"),
                _create(service, "bound1", "a2", key="k-new"),
                _create(service, "new-device", "b1"),
                _create(service, "bound1", "again", key="k-new"),  # same key, same batch
                _create(service, "bound1", "repeat", key="k-old"),  # key of a committed one
                _create(service, "bound1", "a3"),
                _create(service, "new-device", "same key, other device", key="k-new"),
            ],
        )
    a1, refused, a2, b1, again, repeat, a3, other = await asyncio.gather(
        *tasks, return_exceptions=True
    )

    assert _batches(service) == (3, 10)  # the earlier one, the held one, then these eight
    assert isinstance(refused, DeviceUnboundError)
    assert refused.device_id == "gone"
    assert isinstance(a1, Creation)
    assert isinstance(a2, Creation)
    assert isinstance(a3, Creation)
    assert isinstance(b1, Creation)
    assert isinstance(other, Creation)
    assert isinstance(again, Creation)
    assert isinstance(repeat, Creation)
    assert [a.created for a in (a1, a2, b1, again, repeat, a3, other)] == [
        True, True, True, False, False, True, True,
    ]  # fmt: skip
    assert again.command.id == a2.command.id
    assert again.command.name == "a2"
    assert repeat.command.id == before.command.id
    assert repeat.command.name == "earlier"
    # The device's commands of the batch, in arrival order: oldest id first.
    assert a1.command.id < a2.command.id < a3.command.id
    assert b1.command.id < other.command.id
    assert a1.command.id < b1.command.id
    assert await db.fetchval("SELECT count(*) FROM command WHERE device_id = 'gone'") == 0
    assert await db.fetchval(
        "SELECT count(*) FROM command WHERE device_id = 'bound1' AND idempotency_key = 'k-new'"
    ) == 1  # fmt: skip


async def test_a_failed_batch_fails_every_request_in_it_and_commits_none(
    service: CommandService, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with first_batch_held(service, db_dsn) as held, Block(db_dsn, "d-late", "late"):
        tasks = await queue_in_order(
            service,
            [
                _create(service, "d1", "x1"),
                _create(service, "d-late", "blocks the second batch", key="late"),
                _create(service, "d2", "x2"),
            ],
        )
        # The held batch ends; the second one then waits on "late": its connection is cut.
        await held.release()
        await wait_until(lambda: service.creator.queued == 0)
        await wait_until(lambda: lock_waiters(db_dsn), message="second batch blocked")
        (victim,) = await lock_waiters(db_dsn)
        assert await db.fetchval("SELECT pg_terminate_backend($1)", victim)
        answers = await asyncio.gather(*tasks, return_exceptions=True)

    assert all(isinstance(a, asyncpg.PostgresError | asyncpg.InterfaceError) for a in answers)
    assert len({type(a) for a in answers}) == 1
    assert await db.fetchval("SELECT count(*) FROM command WHERE device_id <> $1", HOLD) == 0
    assert _batches(service) == (2, 4)
    # The next request gets a fresh connection from the pool.
    assert (await _create(service, "d1", "after")).created


async def test_a_request_the_database_refuses_fails_alone(
    service: CommandService, db_dsn: str, db: asyncpg.Connection
) -> None:
    """The API validates first; should a value reach PostgreSQL that a constraint refuses,
    the batch is retried one request at a time and only that request gets the error."""
    async with first_batch_held(service, db_dsn):
        tasks = await queue_in_order(
            service,
            [
                _create(service, "d1", "fine"),
                _create(service, "not a device id", "refused"),
                _create(service, "d2", "also fine"),
            ],
        )
    fine, refused, also = await asyncio.gather(*tasks, return_exceptions=True)

    assert isinstance(refused, asyncpg.CheckViolationError)
    assert isinstance(fine, Creation)
    assert isinstance(also, Creation)
    assert fine.created
    assert also.created
    assert fine.command.id < also.command.id
    # The held one, the batch of three (rolled back), then each of the three alone.
    assert _batches(service) == (5, 7)
    assert await db.fetchval("SELECT count(*) FROM command WHERE device_id <> $1", HOLD) == 2


async def test_a_lone_request_goes_at_once_in_its_own_batch(service: CommandService) -> None:
    for i in range(3):
        assert (await _create(service, "d1", f"c{i}")).created
    assert _batches(service) == (3, 3)


async def test_a_batch_in_a_deadlock_is_retried_one_request_at_a_time(
    service: CommandService, db_dsn: str
) -> None:
    """Two transactions inserting the same keys in opposite orders (two nodes' batches) can
    deadlock, where single inserts cannot: the batch PostgreSQL aborts is retried alone."""
    async with first_batch_held(service, db_dsn) as held, Block(db_dsn, "d-x", "kx") as other:
        # The other transaction leaves deadlock detection to the batch (it checks after 1 s).
        await other.conn.execute("SET LOCAL deadlock_timeout = '60s'")
        calls = [_create(service, "d-1", "one", key="k1"), _create(service, "d-x", "x", key="kx")]
        tasks = await queue_in_order(service, calls)
        await held.release()
        # The batch inserted k1 and waits for kx; the other transaction now wants k1.
        await wait_until(lambda: service.creator.queued == 0)
        await wait_until(lambda: lock_waiters(db_dsn), message="batch waiting for kx")
        await other.conn.execute(
            "INSERT INTO command (device_id, name, idempotency_key) VALUES ('d-1', 'other', 'k1')"
            " ON CONFLICT (device_id, idempotency_key) WHERE idempotency_key IS NOT NULL"
            " DO NOTHING"
        )  # returns once PostgreSQL has aborted the batch; its requests now go one at a time
    one, x = await asyncio.gather(*tasks)

    assert (one.created, one.command.name, x.created, x.command.name) == (
        True, "one", True, "x",
    )  # fmt: skip
    assert _batches(service) == (4, 5)  # the held one, the pair, then each of the pair alone
