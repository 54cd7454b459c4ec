"""AI summary tasks: three steps, and the LLM call outside every transaction.

1. Claim: in one short transaction, lock a due PENDING task (SKIP LOCKED: another worker
   takes another one), build the prompt from the alarm and the device's recent telemetry,
   store the request and mark it PROCESSING with a fresh claim token. Commit; the pooled
   connection goes back.
2. Call the LLM holding no transaction and no connection.
3. Write SUCCEEDED or FAILED conditional on PROCESSING *and* the claim token: a task reset
   (or failed as WORKER_LOST) meanwhile keeps what happened to it, and the late result is
   only logged. A failure is a fact: an ``ai.summary_failed`` event, and a new PENDING attempt
   with backoff while attempts remain.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec
import structlog

from gateway.ai.llm import LlmError, LlmPort, LlmReply
from gateway.ai.metrics import AiMetrics
from gateway.ai.output import OutputInvalid, parse_summary
from gateway.alarms.lifecycle import alarm_from_record
from gateway.config import AiConfig
from gateway.domain.ai_prompt import PROMPTS, AlarmFacts, build_request
from gateway.domain.ai_task import ErrorCode, retry_delay_after_s, should_retry
from gateway.support.backoff import Backoff
from gateway.support.loops import (
    RETRYABLE,
    every,
    failure_backoff,
    sleep_unless_stopped,
    wait_event_or_stop,
)
from gateway.support.metrics import Metrics
from gateway.support.node import Node
from protocol.events import Aggregate, EventType, SummaryTaskFinished
from storage import ai_tasks as repo
from storage import alarms as alarm_repo
from storage import outbox
from storage.ai_tasks import AiTaskRow
from storage.errors import TRANSIENT_DB_ERRORS

log = structlog.get_logger(__name__)

TELEMETRY_SAMPLES = 50
# Writing a result the database refused (away for a moment): the first retry after about this
# long, doubling up to the cap, for as long as the claim is not yet taken as lost.
WRITE_RETRY_S = 0.2
WRITE_RETRY_CAP_S = 5.0


@dataclass(frozen=True, slots=True)
class Claimed:
    task_id: int
    alarm_id: int
    attempt: int
    token: uuid.UUID
    model_name: str
    prompt_version: str
    request: dict[str, Any]
    # The event loop's clock at the claim: past it plus processing_timeout_s, the sweep takes
    # the task as lost, and its result is no longer written.
    claimed_at: float = 0.0
    # Why the claim could not build the task's request (a fault of the gateway's own code met
    # by this alarm): the task fails with it at once, WORKER_FAILED.
    broken: str | None = None


def task_to_json(row: AiTaskRow, *, with_payloads: bool) -> dict[str, Any]:
    hidden = {"claim_token"} | (set() if with_payloads else {"request_payload", "raw_response"})
    body = {k: v for k, v in msgspec.structs.asdict(row).items() if k not in hidden}
    converted: dict[str, Any] = msgspec.to_builtins(body)
    return converted


class SummaryWorker:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        llm: LlmPort,
        node_id: str,
        metrics: Metrics,
        max_attempts: int,
        json_mode: bool = True,
        workers: int = 2,
        processing_timeout_s: float = 300.0,
        poll_s: float = 1.0,
    ) -> None:
        self.pool = pool
        self.llm = llm
        self.node_id = node_id
        self.metrics = metrics
        self.ai_metrics = AiMetrics.of(metrics.registry)
        self.max_attempts = max_attempts
        self.json_mode = json_mode
        self.workers = workers
        self.processing_timeout_s = processing_timeout_s
        self.poll_s = poll_s
        self.wakeup = asyncio.Event()
        self.stop: asyncio.Event | None = None

    @classmethod
    def from_config(cls, node: Node, ai: AiConfig, *, llm: LlmPort) -> SummaryWorker:
        return cls(
            pool=node.pool,
            llm=llm,
            node_id=node.node_id,
            metrics=node.metrics,
            max_attempts=ai.max_attempts,
            json_mode=ai.json_mode,
            workers=ai.workers,
            processing_timeout_s=ai.processing_timeout_s,
        )

    async def run(self, stop: asyncio.Event) -> None:
        self.stop = stop
        async with asyncio.TaskGroup() as tasks:
            for n in range(self.workers):
                tasks.create_task(self._loop(stop), name=f"ai-worker-{n}")
            sweep_every = max(self.processing_timeout_s / 4, 1.0)
            tasks.create_task(every(sweep_every, stop, self.sweep, name="ai-sweeper"))

    async def _loop(self, stop: asyncio.Event) -> None:
        backoff = failure_backoff(self.poll_s)
        while not stop.is_set():
            try:
                if await self.run_once():
                    backoff.reset()
                    continue
            except RETRYABLE as exc:
                delay = max(self.poll_s, backoff.next_delay())
                log.warning("ai_worker_failed", error=repr(exc), retry_in_s=round(delay, 3))
                await sleep_unless_stopped(stop, delay)
                continue
            backoff.reset()
            self.wakeup.clear()
            await wait_event_or_stop(self.wakeup, stop, self.poll_s)

    async def run_once(self) -> bool:
        """Claim, call and record one task; False when none was due."""
        claimed = await self.claim()
        if claimed is None:
            return False
        await self.process(claimed)
        return True

    async def claim(self) -> Claimed | None:
        async with self.pool.acquire() as conn, conn.transaction():
            # Only the versions this release has: a newer node's task is that node's.
            row = await repo.lock_due(conn, sorted(PROMPTS))
            if row is None:
                return None
            record = await alarm_repo.get(conn, row.alarm_id)
            assert record is not None
            alarm = alarm_from_record(record)
            reason = await repo.alarm_reason(conn, alarm.id)
            facts = AlarmFacts(
                alarm_id=alarm.id,
                device_id=alarm.device_id,
                rule_key=alarm.rule_key,
                severity=alarm.severity.value,
                status=alarm.status.value,
                triggered_at=alarm.triggered_at,
                reason=reason,
                cleared_at=alarm.cleared_at,
            )
            telemetry = await repo.recent_telemetry(
                conn, alarm.device_id, alarm.triggered_at, TELEMETRY_SAMPLES
            )
            # The model of the server this node calls: the task's own is what the node that
            # created it was configured with, maybe before a switch of model or server.
            model = self.llm.model
            broken = None
            try:
                request = build_request(
                    version=row.prompt_version,
                    model=model,
                    facts=facts,
                    telemetry=telemetry,
                    json_mode=self.json_mode,
                )
            except Exception as exc:
                # A fault of our own code met by this alarm's facts: this task fails, the node
                # goes on (raised, it ended the daemon, and the same task, still due, ended it
                # again at every restart). The request records what could not be built.
                broken = _contained(exc, "building the prompt", task_id=row.id)
                request = {"prompt_version": row.prompt_version, "unbuilt": type(exc).__name__}
            token = uuid.uuid4()
            started = await repo.start(conn, row.id, token, self.node_id, request, model_name=model)
            assert started is not None  # the row is locked and PENDING
        return Claimed(
            task_id=row.id,
            alarm_id=row.alarm_id,
            attempt=row.attempt,
            token=token,
            model_name=model,
            prompt_version=row.prompt_version,
            request=request,
            claimed_at=asyncio.get_running_loop().time(),
            broken=broken,
        )

    async def process(self, task: Claimed) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        raw: str | None = None
        if task.broken is not None:
            await self._failed(task, ErrorCode.WORKER_FAILED, task.broken, None)
            return
        try:
            # No transaction, no pooled connection: a slow model cannot starve the pool.
            reply = await self._call(task)
            if reply is None:
                await self._release(task)
                return
            raw = reply.raw_response
            summary = parse_summary(reply.text)
        except LlmError as exc:
            await self._failed(task, exc.code, exc.message, exc.raw, exc.retry_after_s)
        except OutputInvalid as exc:
            await self._failed(task, ErrorCode.LLM_OUTPUT_INVALID, exc.detail, raw)
        except RETRYABLE:
            raise  # the database's: the loop waits and goes on, the sweep takes the task
        except Exception as exc:
            # A fault of our own code met by this answer (the model's text is outside input,
            # as a device's payload is): this task fails, the node goes on.
            message = _contained(exc, "reading the answer", task_id=task.task_id)
            await self._failed(task, ErrorCode.WORKER_FAILED, message, raw)
        else:
            assert raw is not None

            async def succeed(conn: asyncpg.Connection) -> AiTaskRow | None:
                row = await repo.succeed(
                    conn,
                    task.task_id,
                    task.token,
                    summary=summary.summary,
                    possible_cause=summary.possible_cause,
                    inspection_suggestion=summary.inspection_suggestion,
                    risk_level=summary.risk_level.value,
                    confidence=summary.confidence,
                    raw_response=raw,
                    model_name=reply.model or task.model_name,
                )
                if row is not None:
                    await self._event(conn, row, EventType.AI_SUMMARY_SUCCEEDED)
                return row

            self._count(await self._write(task, succeed), "SUCCEEDED", "")
        finally:
            self.ai_metrics.ai_latency.observe(loop.time() - started)

    async def _call(self, task: Claimed) -> LlmReply | None:
        """The model's reply to the claim, or None when the node stops first.

        A stop does not wait for the model: a call may take ``timeout_s`` (a minute or more for
        a slow local model), and the node has to exit within the service manager's stop
        timeout. The call is left, and the caller gives the task back."""
        stop = self.stop
        if stop is None:
            return await self.llm.complete(task.request)
        call = asyncio.ensure_future(self.llm.complete(task.request))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({call, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not call.done():
                call.cancel()
                await asyncio.wait({call})
        return None if call.cancelled() else call.result()

    async def _release(self, task: Claimed) -> None:
        """Give a claimed task back (PENDING, the same attempt, due now) as the node stops:
        not left PROCESSING for the sweep to fail as WORKER_LOST minutes later, an attempt
        spent on a call nobody answered wrong."""
        try:
            async with self.pool.acquire() as conn:
                released = await repo.release(conn, task.task_id, task.token)
        except TRANSIENT_DB_ERRORS as exc:  # the sweep takes it then
            log.warning("ai_task_not_released", task_id=task.task_id, error=repr(exc))
            return
        log.info("ai_task_released", task_id=task.task_id, released=released)

    async def _failed(
        self,
        task: Claimed,
        code: str,
        message: str,
        raw: str | None,
        server_wait_s: float | None = None,
    ) -> None:
        async def fail(conn: asyncpg.Connection) -> AiTaskRow | None:
            row = await repo.fail(
                conn,
                task.task_id,
                task.token,
                error_code=code,
                error_message=message,
                raw_response=raw,
            )
            if row is not None:
                await self._after_failure(conn, row, server_wait_s)
            return row

        self._count(await self._write(task, fail), "FAILED", code)

    async def _write(
        self,
        task: Claimed,
        write: Callable[[asyncpg.Connection], Awaitable[AiTaskRow | None]],
    ) -> AiTaskRow | None:
        """Write a claim's result in one transaction; while the database is away, again.

        The model's answer exists nowhere else: given up at the first refused write, it was
        lost, the task left PROCESSING until the sweep failed it as WORKER_LOST and the next
        attempt asked the model again. The write is conditional on the claim token, so a
        retry after a COMMIT whose answer was lost finds the result already there (and its
        event with it) and writes nothing twice. Retried until the claim would be taken as
        lost (``processing_timeout_s`` after it) or the worker stops."""
        loop = asyncio.get_running_loop()
        deadline = task.claimed_at + self.processing_timeout_s
        backoff = Backoff(WRITE_RETRY_S, WRITE_RETRY_CAP_S)
        retried = False
        while True:
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    row = await write(conn)
                    if row is None and retried:
                        # An earlier try may have committed unheard: then it is this one's.
                        row = await repo.finished_by_claim(conn, task.task_id, task.token)
            except TRANSIENT_DB_ERRORS as exc:
                delay = backoff.next_delay()
                stopping = self.stop is not None and self.stop.is_set()
                if stopping or loop.time() + delay >= deadline:
                    raise
                log.warning(
                    "ai_result_not_written",
                    task_id=task.task_id,
                    error=repr(exc),
                    retry_in_s=round(delay, 3),
                )
                retried = True
                if self.stop is None:
                    await asyncio.sleep(delay)
                else:
                    await sleep_unless_stopped(self.stop, delay)
            else:
                return row

    def _count(self, row: AiTaskRow | None, status: str, code: str) -> None:
        if row is None:
            # Reset (or swept as WORKER_LOST) while the call was in flight: its fate stands.
            log.warning("ai_result_discarded", status=status, error_code=code or None)
            self.ai_metrics.ai_tasks.labels("DISCARDED", code).inc()
            return
        self.ai_metrics.ai_tasks.labels(status, code).inc()

    async def _after_failure(
        self, conn: asyncpg.Connection, row: AiTaskRow, server_wait_s: float | None = None
    ) -> None:
        await self._event(conn, row, EventType.AI_SUMMARY_FAILED)
        attempt = row.attempt
        if should_retry(attempt, self.max_attempts):
            await repo.insert_task(
                conn,
                alarm_id=row.alarm_id,
                attempt=attempt + 1,
                model_name=row.model_name,
                prompt_version=row.prompt_version,
                # A rate-limiting server's Retry-After first: retried sooner, the attempt
                # is spent inside the limit.
                delay_s=retry_delay_after_s(attempt, server_wait_s),
            )

    async def _event(self, conn: asyncpg.Connection, row: AiTaskRow, event_type: EventType) -> None:
        await outbox.add_event(
            conn,
            aggregate_type=Aggregate.ALARM,
            aggregate_id=str(row.alarm_id),
            event_type=event_type,
            payload=SummaryTaskFinished(task=task_to_json(row, with_payloads=False)),
        )

    async def sweep(self) -> list[int]:
        """Fail tasks stuck in PROCESSING past the timeout (their worker died), and retry."""
        async with self.pool.acquire() as conn, conn.transaction():
            lost = await repo.sweep_lost(conn, self.processing_timeout_s)
            for row in lost:
                await self._after_failure(conn, row)
        for row in lost:
            self.ai_metrics.ai_tasks.labels("FAILED", ErrorCode.WORKER_LOST).inc()
            log.warning("ai_task_worker_lost", task_id=row.id, claimed_by=row.claimed_by)
        return [row.id for row in lost]


def _contained(exc: Exception, stage: str, *, task_id: int) -> str:
    """Log a fault of our own code met by one task (with its traceback) and say what the task
    records of it: the class only (an exception's text may quote what it met)."""
    log.error(
        "ai_task_failed_unexpectedly",
        task_id=task_id,
        stage=stage,
        error=type(exc).__name__,
        exc_info=exc,
    )
    return (
        f"{type(exc).__name__} while {stage}; a fault of the gateway, see its log"
        " (ai_task_failed_unexpectedly)"
    )
