"""A loop the configuration switches on and off (``every_while_configured``: the alarm figures'
gauges, the inactivity monitor, the rule watch) retries a failed pass as ``every`` does: after a
growing delay never longer than FAILURE_BACKOFF_CAP_S, whatever its interval.

It waited its whole interval instead. The figures' gauges are sampled every
``[alarms.figures] interval_s``, which has no upper bound: configured to an hour, a pass failed
by a database restart of a few seconds left every node's gauges (a flood, stale alarms) an hour
old. Real PostgreSQL, cut by a proxy at the pass's statement; the cap is made short here so
the retry, and its absence, show at once."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from gateway.alarms.figures import AlarmFigures
from gateway.alarms.metrics import AlarmMetrics
from gateway.config import AlarmFiguresConfig
from gateway.support import loops
from storage.pool import create_pool
from tests.support.dsn import proxy_for, through
from tests.support.pg_cut import PgCut, Statement
from tests.support.waiting import wait_until

CAP_S = 2.0
HOUR_S = 3600.0
# The gauges' statement: the pass's only read, cut before the server sees it.
GAUGES = Statement("AS last_10min")
LOST = (OSError, asyncpg.exceptions.ConnectionDoesNotExistError, asyncpg.InterfaceError)


async def test_a_figures_pass_failed_by_the_database_away_is_tried_again_within_the_cap(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loops, "FAILURE_BACKOFF_CAP_S", CAP_S)
    proxy = proxy_for(db_dsn)
    await proxy.start()
    stop = asyncio.Event()
    try:
        cut = PgCut(proxy)
        dsn = through(db_dsn, proxy)
        pool = await create_pool(dsn, min_size=1, max_size=2)
        try:
            figures = AlarmFigures(
                pool,
                AlarmFiguresConfig(interval_s=HOUR_S),
                metrics=AlarmMetrics(CollectorRegistry()),
            )
            sampled = 0
            first_pass = figures.run_once

            async def counted() -> dict[str, int]:
                nonlocal sampled
                result = await first_pass()
                sampled += 1
                return result

            figures.run_once = counted  # type: ignore[method-assign]
            cut.arm(GAUGES, at="sent")
            with capture_logs() as logs:
                loop = asyncio.create_task(figures.run(stop))
                try:
                    await wait_until(cut.fired.is_set, timeout=30, message="the cut fell")
                    with pytest.raises(LOST):
                        await asyncpg.connect(dsn, timeout=5)
                    await cut.outage(timeout=30)
                    assert sampled == 0  # the first pass failed
                    # Tried again within the cap, not an hour later.
                    await wait_until(
                        lambda: sampled > 0,
                        timeout=CAP_S * 4 + 10,
                        message="a figures pass after the database came back",
                    )
                finally:
                    stop.set()
                    await loop
        finally:
            pool.terminate()
    finally:
        await proxy.stop()
    failed = [e for e in logs if e["event"] == "periodic_step_failed"]
    assert failed, logs
    assert {e["loop"] for e in failed} == {"alarm-figures"}
    assert all(e["retry_in_s"] <= CAP_S for e in failed), failed
