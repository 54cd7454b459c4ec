"""Command reaping, on every node: lapsed claims back to PENDING (a new generation), receipts
that never came to TIMEOUT or FAILED, expired commands to EXPIRED — each a conditional write,
so whichever node passes first does it once."""

from __future__ import annotations

import asyncio
from collections import Counter

import asyncpg
import structlog

from gateway.commands.lifecycle import reap
from gateway.config import CommandsConfig
from gateway.support.loops import every
from gateway.support.metrics import Metrics
from gateway.support.node import Node

log = structlog.get_logger(__name__)


class Reaper:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        node_id: str,
        ack_window_s: float,
        sent_timeout_s: float,
        interval_s: float,
        metrics: Metrics,
    ) -> None:
        self.metrics = metrics
        self.pool = pool
        self.node_id = node_id
        self.ack_window_s = ack_window_s
        self.sent_timeout_s = sent_timeout_s
        self.interval_s = interval_s

    @classmethod
    def from_config(cls, node: Node, commands: CommandsConfig) -> Reaper:
        return cls(
            pool=node.pool,
            node_id=node.node_id,
            ack_window_s=commands.ack_window_s,
            sent_timeout_s=commands.sent_timeout_s,
            interval_s=commands.reaper_interval_s,
            metrics=node.metrics,
        )

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, stop, self.run_once, name="command-reaper")

    async def run_once(self) -> None:
        async with self.pool.acquire() as conn, conn.transaction():
            report = await reap(
                conn,
                node_id=self.node_id,
                ack_window_s=self.ack_window_s,
                sent_timeout_s=self.sent_timeout_s,
            )
        # After the commit: a pass that rolled back changed nothing.
        for (from_status, to_status), n in Counter(report.transitions).items():
            self.metrics.count_command(from_status, to_status, n)
        if any((report.reclaimed, report.timed_out_receipts, report.failed, report.expired)):
            log.info(
                "commands_reaped",
                reclaimed=report.reclaimed,
                timed_out=report.timed_out_receipts,
                failed=report.failed,
                expired=report.expired,
                alarms=report.alarms,
            )
