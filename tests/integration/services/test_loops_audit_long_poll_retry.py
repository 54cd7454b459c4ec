"""A loop woken by a NOTIFY (``drain_on_notify``: the outbox publisher, the notification
consumer, the command dispatcher, the campaigns; and the delivery worker's own loop) retries a
failed pass as ``every`` does: after a growing delay never longer than FAILURE_BACKOFF_CAP_S,
whatever its ``poll_s``.

It waited ``max(poll_s, backoff)``: with a long poll configured (the NOTIFY does the waking,
the poll is only the fallback), a pass failed by a database blip of a few seconds waited the
whole poll, and the NOTIFYs sent meanwhile could not end that wait. Real PostgreSQL, cut by a
proxy at the pass's statement; the cap is made short here so the retry, and its absence, show
at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg
import pytest
from structlog.testing import capture_logs

from gateway.config import parse_config
from gateway.notify.consumer import NotifyConsumer
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.worker import DeliveryWorker
from gateway.support import loops
from gateway.support.metrics import Metrics
from storage.pool import create_pool
from tests.support.dsn import proxy_for, through
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

CAP_S = 2.0
HOUR_S = 3600.0
CONFIG = f"""
[notify]
poll_s = {HOUR_S}

[[notify.receivers]]
name = "hook"
kind = "webhook"
url = "http://127.0.0.1:9/"

[[notify.routes]]
receivers = ["hook"]
"""
# The consumer's first statement of a pass (its progress row), and the worker's statement
# that every pass runs: each cut before the server sees it.
CONSUMER_PASS = Statement("INSERT INTO notify_consumer")
WORKER_PASS = Statement("AS oldest_age_s")
LOST = (OSError, asyncpg.exceptions.ConnectionDoesNotExistError, asyncpg.InterfaceError)


async def _failed_pass_is_retried_within_the_cap(
    db_dsn: str,
    statement: Statement,
    make: Callable[[asyncpg.Pool, str], tuple[Callable[[asyncio.Event], Awaitable[None]], object]],
    logged: str,
) -> list[dict[str, object]]:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    stop = asyncio.Event()
    try:
        cut = PgCut(proxy)
        dsn = through(db_dsn, proxy)
        pool = await create_pool(dsn, min_size=1, max_size=2)
        try:
            run, service = make(pool, dsn)
            passes = 0
            first_pass = service.run_once  # type: ignore[attr-defined]

            async def counted() -> int:
                nonlocal passes
                result: int = await first_pass()
                passes += 1
                return result

            service.run_once = counted  # type: ignore[attr-defined]
            cut.arm(statement, at="sent")
            with capture_logs() as logs:
                loop = asyncio.create_task(run(stop))
                try:
                    await wait_until(cut.fired.is_set, timeout=30, message="the cut fell")
                    with pytest.raises(LOST):
                        await asyncpg.connect(dsn, timeout=5)
                    await cut.outage(timeout=30)
                    assert passes == 0  # the first pass failed
                    # Tried again within the cap, not an hour later.
                    await wait_until(
                        lambda: passes > 0,
                        timeout=CAP_S * 4 + 10,
                        message="a pass after the database came back",
                    )
                finally:
                    stop.set()
                    await loop
        finally:
            pool.terminate()
    finally:
        await proxy.stop()
    failed = [e for e in logs if e["event"] == logged]
    assert failed, logs
    assert all(e["retry_in_s"] <= CAP_S for e in failed), failed
    return failed


async def test_a_consumer_pass_failed_by_the_database_away_is_tried_again_within_the_cap(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loops, "FAILURE_BACKOFF_CAP_S", CAP_S)
    config = parse_config(CONFIG)

    def make(
        pool: asyncpg.Pool, dsn: str
    ) -> tuple[Callable[[asyncio.Event], Awaitable[None]], object]:
        consumer = NotifyConsumer(
            pool=pool,
            dsn=dsn,
            metrics=NotifyMetrics(Metrics().registry),
            rules=config.notify_rules(),
            poll_s=config.notify.poll_s,
        )
        return consumer.run, consumer

    failed = await _failed_pass_is_retried_within_the_cap(
        db_dsn, CONSUMER_PASS, make, "periodic_step_failed"
    )
    assert {e["loop"] for e in failed} == {"notify-consumer"}


async def test_a_delivery_worker_pass_failed_by_the_database_away_is_tried_again_within_the_cap(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loops, "FAILURE_BACKOFF_CAP_S", CAP_S)
    config = parse_config(CONFIG)

    def make(
        pool: asyncpg.Pool, dsn: str
    ) -> tuple[Callable[[asyncio.Event], Awaitable[None]], object]:
        worker = DeliveryWorker(
            pool=pool,
            node_id="n1",
            metrics=NotifyMetrics(Metrics().registry),
            settings=config.notify,
            rules=config.notify_rules(),
            dsn=dsn,
        )
        return worker.run, worker

    await _failed_pass_is_retried_within_the_cap(db_dsn, WORKER_PASS, make, "notify_claim_failed")
