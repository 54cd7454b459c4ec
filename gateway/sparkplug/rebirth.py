"""Rebirth requests: the edge nodes whose stream the host could not follow (``sparkplug_node``
rows with a rebirth wanted, decided by the batches in gateway.sparkplug.host) are sent
``NCMD`` with ``Node Control/Rebirth`` = true, again every ``rebirth_retry_s`` until their
NBIRTH comes. Every node of a ``$share`` group runs the loop; a due request is taken by one
(``FOR UPDATE SKIP LOCKED``). The same loop ends the births of a rebirth that left devices of
the session before unborn for BIRTHS_GRACE_S: those devices are offline (their presence was
left as it was at the NBIRTH, gateway.sparkplug.host)."""

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
from storage import ingest as ingest_repo
from storage import sparkplug as repo

log = structlog.get_logger(__name__)

# Requests taken per pass.
BATCH = 100
# Seconds after an NBIRTH by which its session's DBIRTHs are over: Sparkplug sends them right
# after it, before any data (a data message ends them at once). Devices of the session before
# that none of them bore are offline then.
BIRTHS_GRACE_S = 10.0


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
        node_id: str | None = None,
        births_grace_s: float = BIRTHS_GRACE_S,
    ) -> None:
        self.pool = pool
        self.node_id = node_id
        self.births_grace_s = births_grace_s
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
            await self.end_births(conn)
            async with conn.transaction():
                # Asked again, at the last moment before the take: ending the births may have
                # waited (for devices' rows a batch holds) longer than the session lasted. A
                # pass that asked only before it took the requests for a broker it could not
                # reach: counted, marked sent, not asked again for ``retry_s`` once it was back.
                due = await repo.take_rebirths(conn, self.retry_s, BATCH) if self.up() else []
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

    async def end_births(self, conn: asyncpg.Connection) -> list[str]:
        """Set offline the devices of a session before an NBIRTH that no DBIRTH bore within
        ``births_grace_s`` of it (a device the edge node no longer has), in one transaction
        with the node's row; the devices set so. Only while the broker session is up: a
        DBIRTH may be on its way."""
        async with conn.transaction():
            ended = await repo.take_unborn(conn, self.births_grace_s, BATCH)
            gone = {f"{g}/{n}/{d}": "offline" for g, n, devices in ended for d in devices}
            await ingest_repo.record_presence(conn, gone, node_id=self.node_id)
        for group, node, devices in ended:
            log.info("sparkplug_devices_not_reborn", edge_node=f"{group}/{node}", devices=devices)
        return sorted(gone)
