"""Command creation for the API, with concurrent requests sharing one transaction (a group
commit; docs/commands.md).

A request that finds no batch in flight is written at once, alone; requests that arrive while a
batch's transaction is in flight wait for it and then go together in the next one (at most
``max_batch``). No timer holds anything back, so a lone request costs what it did before, and
under load one commit serves many requests. Whatever the batch size, a batch is one
transaction of at most four statements: which target devices are unbound, the inserts with
their audit rows, (only when some key was taken) the rows already holding those keys, and the
transaction's id (asked should the COMMIT's answer be lost).

Each request gets exactly the answer it would have got alone, in arrival order: its new row
(``created``), the row that already held its idempotency key (not ``created``; also when an
earlier request of the same batch took the key), or :class:`DeviceUnboundError`. When the
batch's transaction fails, nothing of it is committed and every request in it gets that
exception; a failure that one request's data can cause alone (a constraint, a bad value), or a
deadlock with another node's batch, is retried one request at a time instead. A batch whose
connection was lost after its COMMIT was sent asks another connection whether it committed:
if it did, the requests get their answers as if nothing had happened.

Written by hand rather than with a library: what is batched is one transaction whose answer
must be split back per request, which the task-queue libraries at hand do not do.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import asyncpg
import structlog

from gateway.commands.lifecycle import DeviceUnboundError
from gateway.commands.metrics import CommandMetrics
from gateway.domain.command import Delivery
from gateway.support.metrics import Metrics
from storage import commands as repo
from storage import ingest as ingest_repo
from storage.commands import CommandRow
from storage.errors import TRANSIENT_DB_ERRORS
from storage.ingest import Xact

log = structlog.get_logger(__name__)

T = TypeVar("T")

MAX_BATCH: Final = 500
# How long a creation whose COMMIT answer was lost asks whether it committed (its request
# waits meanwhile); not known by then, the request gets the database's error (503).
COMMIT_STATUS_WAIT_S: Final = 5.0
# Failures a batch can meet that its requests would not meet alone, so each is retried alone:
# what one request's own data can make PostgreSQL refuse (only that request then fails), and a
# deadlock. A batch inserts several keys, so two batches (on two nodes) taking the same keys in
# different orders can deadlock, where single inserts only wait for each other.
_RETRY_ALONE: Final = (
    asyncpg.IntegrityConstraintViolationError,
    asyncpg.DataError,
    asyncpg.DeadlockDetectedError,
)


@dataclass(frozen=True, slots=True)
class Creation:
    """A creation's answer: the new command (``created``), or the one already holding its
    idempotency key."""

    command: CommandRow
    created: bool


@dataclass(frozen=True, slots=True)
class NewCommand:
    """One API request's command, validated by the API."""

    device_id: str
    name: str
    params: dict[str, Any]
    delivery: Delivery
    idempotency_key: str | None
    actor: str


@dataclass(frozen=True, slots=True)
class _Waiting:
    command: NewCommand
    answer: asyncio.Future[Creation]


class CommandCreator:
    """Creates commands, one transaction per batch of the requests waiting at the time."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        node_id: str,
        expire_after_s: float,
        *,
        metrics: Metrics | None = None,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.expire_after_s = expire_after_s
        self.metrics = metrics
        self.command_metrics = None if metrics is None else CommandMetrics.of(metrics.registry)
        self.max_batch = max_batch
        self._queue: deque[_Waiting] = deque()
        self._writer: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        """Requests waiting for the batch in flight to end (not counting that batch)."""
        return len(self._queue)

    async def create(self, command: NewCommand) -> Creation:
        """The command created, or the existing one holding its idempotency key.

        Raises :class:`DeviceUnboundError`, or what the batch's transaction raised.
        """
        answer: asyncio.Future[Creation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(command, answer))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_queued(), name="command-creator")
        # A caller cancelled here (its client went away) leaves its command to the batch: it
        # may still be created, as it could be when a client disconnects after the commit.
        return await answer

    async def _write_queued(self) -> None:
        """Write batches until the queue is empty; the next request then starts a new writer."""
        try:
            while self._queue:
                batch: list[_Waiting] = []
                while self._queue and len(batch) < self.max_batch:
                    waiting = self._queue.popleft()
                    if not waiting.answer.done():  # its caller was cancelled meanwhile
                        batch.append(waiting)
                if batch:
                    await self._write(batch)
        except BaseException:
            # Cancelled (shutdown): nobody may wait forever for an answer.
            for waiting in self._queue:
                waiting.answer.cancel()
            self._queue.clear()
            raise
        finally:
            self._writer = None

    async def _write(self, batch: Sequence[_Waiting]) -> None:
        if self.command_metrics is not None:
            self.command_metrics.command_create_batch.observe(len(batch))
        try:
            answers = await self._transaction([w.command for w in batch])
        except _RETRY_ALONE as exc:
            if len(batch) == 1:
                _answer(batch[0], exc)
            else:
                for waiting in batch:
                    if not waiting.answer.done():  # its caller was cancelled meanwhile
                        await self._write([waiting])
            return
        except asyncio.CancelledError:
            for waiting in batch:
                waiting.answer.cancel()
            raise
        except Exception as exc:  # the batch's failure is each request's answer
            for waiting in batch:
                _answer(waiting, exc)
            return
        for waiting, outcome in zip(batch, answers, strict=True):
            _answer(waiting, outcome)

    async def _transaction(
        self, commands: Sequence[NewCommand]
    ) -> list[Creation | DeviceUnboundError]:
        async def create(conn: asyncpg.Connection) -> list[Creation | DeviceUnboundError]:
            return await create_commands(
                conn, commands, expire_after_s=self.expire_after_s, node_id=self.node_id
            )

        # Lost after the COMMIT was sent, the commands may exist (and a realtime one is
        # dispatched): "nothing written, retry" would have them created twice.
        return await confirmed_transaction(self.pool, create, what="command")


async def confirmed_transaction(
    pool: asyncpg.Pool,
    work: Callable[[asyncpg.Connection], Awaitable[T]],
    *,
    what: str,
    wrote: Callable[[T], bool] = lambda _: True,
) -> T:
    """``work`` in a transaction of its own, and its result. Should the connection be lost
    once the COMMIT was sent, whether it committed is asked (`commit_confirmed`): if it did,
    the result stands; else the error is raised, as for any failed transaction. ``wrote``:
    whether the result wrote anything (nothing written, nothing to confirm)."""
    result: T | None = None
    xact: Xact | None = None
    try:
        async with pool.acquire() as conn, conn.transaction():
            result = await work(conn)
            if wrote(result):
                # Asked before the COMMIT: should its answer be lost, whether it committed.
                xact = await ingest_repo.assigned_xact_id(conn)
    except TRANSIENT_DB_ERRORS as exc:
        if (
            result is None
            or xact is None
            or isinstance(exc, asyncpg.exceptions.TransactionRollbackError)
            or not await commit_confirmed(pool, xact, exc, what=what)
        ):
            raise
    assert result is not None
    return result


async def commit_confirmed(
    pool: asyncpg.Pool, xact: Xact, lost: BaseException, *, what: str
) -> bool:
    """Whether ``xact``, whose COMMIT answer was lost (``lost``), committed: asked on another
    connection of the same server, not restarted since (see storage.ingest.xact_status), for
    at most ``COMMIT_STATUS_WAIT_S`` (a request is waiting). Not known by then (the database
    still away, the commit still under way, another server): not committed, and the request
    gets the error, as before. ``what`` names the change in the log lines."""
    log.warning("commit_answer_lost", change=what, xid=xact.id, error=repr(lost))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + COMMIT_STATUS_WAIT_S
    delay = 0.05
    status: str | None = None
    while True:
        try:
            async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                async with pool.acquire() as conn:
                    same_server, status = await ingest_repo.xact_status(conn, xact)
            if not same_server:
                status = "other server"
        except TRANSIENT_DB_ERRORS:
            status = "unknown"
        except asyncpg.PostgresError:
            status = "unknown"  # an id this server never gave: a standby promoted since
        if status in {"committed", "aborted", "other server", None}:
            break
        if loop.time() + delay > deadline:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
    log.warning("commit_status", change=what, xid=xact.id, status=status)
    return status == "committed"


async def create_commands(
    conn: asyncpg.Connection,
    commands: Sequence[NewCommand],
    *,
    expire_after_s: float,
    node_id: str,
) -> list[Creation | DeviceUnboundError]:
    """One batch's commands, in the caller's transaction: each request's answer, in order
    (a new row, the row holding its key, or the device's :class:`DeviceUnboundError`)."""
    unbound = await repo.unbound_among(conn, list({c.device_id for c in commands}))
    bound = [c for c in commands if c.device_id not in unbound]
    rows = await repo.insert_many(
        conn,
        [
            (c.device_id, c.name, c.params, c.delivery.value, c.idempotency_key, c.actor)
            for c in bound
        ],
        expire_after_s=expire_after_s,
        node_id=node_id,
    )
    # Rows with a key are found by it (unique per device); the rest were inserted in
    # the requests' order, so their ids ascend in it.
    keyed = {(r.device_id, r.idempotency_key): r for r in rows if r.idempotency_key is not None}
    unkeyed = iter([r for r in rows if r.idempotency_key is None])
    taken = [
        (c.device_id, c.idempotency_key)
        for c in bound
        if c.idempotency_key is not None and (c.device_id, c.idempotency_key) not in keyed
    ]
    existing = {
        (r.device_id, r.idempotency_key): r
        for r in await repo.by_idempotency_keys(conn, list(dict.fromkeys(taken)))
    }
    answers: list[Creation | DeviceUnboundError] = []
    answered: set[tuple[str, str]] = set()
    for c in commands:
        if c.device_id in unbound:
            answers.append(DeviceUnboundError(c.device_id))
        elif c.idempotency_key is None:
            row = next(unkeyed)
            if row.device_id != c.device_id:
                raise RuntimeError("batched insert returned rows out of order")
            answers.append(Creation(row, created=True))
        else:
            key = (c.device_id, c.idempotency_key)
            if key in keyed:
                # The first request with this key made the row; a later one in the
                # same batch gets it, as it would have after that one's commit.
                answers.append(Creation(keyed[key], created=key not in answered))
                answered.add(key)
            else:
                answers.append(Creation(existing[key], created=False))
    if next(unkeyed, None) is not None:
        raise RuntimeError("batched insert returned more rows than requests")
    return answers


def _answer(waiting: _Waiting, outcome: Creation | BaseException) -> None:
    if waiting.answer.done():  # its caller was cancelled
        return
    if isinstance(outcome, BaseException):
        waiting.answer.set_exception(outcome)
    else:
        waiting.answer.set_result(outcome)
