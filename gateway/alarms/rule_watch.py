"""Rules that cannot fail silently: report rules whose metric or event telemetry never carries.

:func:`find_unseen` is the check itself (``gateway rules check`` runs it once over a window);
:class:`RuleWatch` is the daemon's loop: once a rule has been loaded for ``after_s`` and its
name was not seen in the telemetry stored (received) over the last ``after_s``, it logs
``rule_never_matched`` once for that rule (per process; a rule added by a reload gets its own
``after_s``). Each node of a cluster logs it: it is a hint to the person reading that node's
journal, not a decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import asyncpg
import structlog

from gateway.alarms.timers import Clock, database_clock
from gateway.domain.rule_check import UnseenRule, WatchedName, unseen, watched_names
from gateway.domain.rules import RuleSet
from gateway.support.loops import every_while_configured
from storage import telemetry_names

log = structlog.get_logger(__name__)

# The daemon looks at the names of at most this many rows of the window, then asks about each
# name not found there by itself (an EXISTS that stops at the first row carrying it): a busy
# window of millions of rows is never read whole to report nothing.
SAMPLE_ROWS = 10_000
MAX_INTERVAL_S = 60.0


async def find_unseen(
    conn: asyncpg.Connection,
    names: Sequence[WatchedName],
    since: datetime,
    *,
    sample_rows: int | None = None,
) -> list[UnseenRule]:
    """The watched names not carried by any telemetry row with ``ts >= since``.

    ``sample_rows=None`` reads every row of the window for the closest names (the CLI, asked
    by a person); a number bounds that read and confirms each miss with its own query.
    """
    if not names:
        return []
    seen_metrics = set(await telemetry_names.metric_names(conn, since, max_rows=sample_rows))
    seen_events = set(await telemetry_names.event_types(conn, since, max_rows=sample_rows))
    found: list[UnseenRule] = []
    for watched in names:
        report = unseen(watched, seen_metrics=seen_metrics, seen_events=seen_events)
        if report is None:
            continue
        if sample_rows is not None:
            seen = (
                telemetry_names.metric_seen
                if watched.watched == "metric"
                else (telemetry_names.event_seen)
            )
            if await seen(conn, since, watched.name):
                continue
        found.append(report)
    return found


class RuleWatch:
    """Logs each rule whose metric or event was not seen for ``after_s``, once."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        rules: Callable[[], RuleSet],
        after_s: float,
        clock: Clock = database_clock,
        sample_rows: int = SAMPLE_ROWS,
    ) -> None:
        self.pool = pool
        self.rules = rules
        self.after_s = after_s
        self.clock = clock
        self.sample_rows = sample_rows
        self._loaded_at: dict[WatchedName, datetime] = {}
        self._reported: set[WatchedName] = set()
        self._wakeup = asyncio.Event()

    @property
    def interval_s(self) -> float:
        return min(MAX_INTERVAL_S, max(1.0, self.after_s / 10))

    def reconfigure(self, after_s: float) -> None:
        """A reload: the new ``after_s`` (0 switches the watch off, more switches it on)."""
        self.after_s = after_s
        self._wakeup.set()

    def current_interval_s(self) -> float | None:
        return self.interval_s if self.after_s > 0 else None

    async def run(self, stop: asyncio.Event) -> None:
        # On every node even with the watch off: a reload may switch it on.
        await every_while_configured(
            self.current_interval_s, stop, self.run_once, wakeup=self._wakeup, name="rule-watch"
        )

    async def run_once(self) -> list[UnseenRule]:
        """One pass: the rules reported now (each is reported once)."""
        current = watched_names(self.rules())
        if not current:
            self._loaded_at.clear()
            self._reported.clear()
            return []  # nothing to watch: no query at all
        async with self.pool.acquire() as conn:
            now = await self.clock(conn)
            # A rule removed by a reload is forgotten, reported or not; one added (again)
            # starts its own wait, and is reported after it.
            self._loaded_at = {w: self._loaded_at.get(w, now) for w in current}
            self._reported &= self._loaded_at.keys()
            window = timedelta(seconds=self.after_s)
            due = [
                w for w in current if w not in self._reported and now - self._loaded_at[w] >= window
            ]
            reports = await find_unseen(conn, due, now - window, sample_rows=self.sample_rows)
        by_key = {(w.rule_key, w.watched, w.name): w for w in due}
        for report in reports:
            self._reported.add(by_key[(report.rule_key, report.watched, report.name)])
            log.warning(
                "rule_never_matched",
                rule=report.rule_key,
                watched=report.watched,
                name=report.name,
                closest_seen=list(report.closest),
                window_s=self.after_s,
                message=report.describe(),
            )
        return reports
