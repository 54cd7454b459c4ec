"""Rebirth requests: the edge nodes whose stream the host could not follow (``sparkplug_node``
rows with a rebirth wanted, decided by the batches in gateway.sparkplug.host) are sent
``NCMD`` with ``Node Control/Rebirth`` = true, again every ``rebirth_retry_s`` until their
NBIRTH comes. Every node of a ``$share`` group runs the loop; a due request is taken by one
(``FOR UPDATE SKIP LOCKED``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import asyncpg
import structlog

from gateway.sparkplug.metrics import SparkplugMetrics
from gateway.support.broker_link import SessionDown
from gateway.support.loops import every
from gateway.support.node import Publish
from protocol import sparkplug
from storage import sparkplug as repo

log = structlog.get_logger(__name__)

# Requests taken per pass.
BATCH = 100


class RebirthRequester:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        publish: Publish,
        metrics: SparkplugMetrics,
        retry_s: float,
        interval_s: float,
        reorder_window_s: float,
        up: Callable[[], bool] = lambda: True,
    ) -> None:
        self.pool = pool
        # The broker session can publish now: while it cannot, no request is taken.
        self.up = up
        self.publish = publish
        self.metrics = metrics
        self.retry_s = retry_s
        self.interval_s = interval_s
        self.reorder_window_s = reorder_window_s

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, stop, self.run_once, name="sparkplug-rebirth")

    async def run_once(self) -> list[tuple[str, str]]:
        """Judge seqs missing longer than the reorder window, then send the due requests;
        the edge nodes asked, as ``(group, node)``."""
        async with self.pool.acquire() as conn:
            if self.reorder_window_s > 0:
                for group, node in await repo.expire_missing(conn, self.reorder_window_s):
                    self.metrics.distrusted.inc()
                    log.warning(
                        "sparkplug_rebirth_wanted",
                        edge_node=f"{group}/{node}",
                        reason="a seq missing longer than the reorder window",
                    )
            if not self.up():
                return []
            async with conn.transaction():
                due = await repo.take_rebirths(conn, self.retry_s, BATCH)
        asked = []
        for group, node, reason in due:
            topic = sparkplug.topic(group, sparkplug.MessageType.NCMD, node)
            try:
                await self.publish(topic, sparkplug.encode_rebirth(int(time.time() * 1000)))
            except SessionDown:
                # Marked sent, not sent: the retry interval sends it again.
                log.info("sparkplug_rebirth_deferred", edge_node=f"{group}/{node}")
                continue
            except Exception as exc:  # refused, or no PUBACK: the retry interval sends it again
                log.warning(
                    "sparkplug_rebirth_not_sent", edge_node=f"{group}/{node}", error=repr(exc)
                )
                continue
            self.metrics.rebirth_requests.inc()
            log.info("sparkplug_rebirth_requested", edge_node=f"{group}/{node}", reason=reason)
            asked.append((group, node))
        return asked
