"""The hold timer: threshold rules with `for_seconds`, judged on a clock.

A device that reports by exception sends its violating value once and then nothing while the
value holds; judged only when a sample arrives, its `for_seconds` would never pass. Every
pass, on every node, locks the pending rule-state rows whose hold has passed with no further
sample and fires them (`AlarmEngine.fire_due_holds`), a page per transaction. The decision
lives in the rows, taken under the same locks and conditional writes as an ingest batch, so
two nodes never fire a hold twice and a sample committed meanwhile is never raced: whichever
commits first, the other sees its effect (docs/rules-and-alarms.md, "Holds on the clock").
Before that, each pass judges again the pending rows a reload left under another definition
of their rule that no live node runs (`AlarmEngine.rejudge_stale_holds`): no sample may come
to bring them up to date. And after a rule set changed (this node's start or reload, another
live node's rules), the firing and normal rows of such a definition are judged again too, from
the device's newest stored sample (`AlarmEngine.rejudge_stale_rows`: an alarm the definition
in force no longer sees clears, one it sees now fires), until a pass has judged every one it
found: that query reads every row of the rules, so it does not run on every pass.
"""

from __future__ import annotations

import asyncio

import asyncpg
import structlog

from gateway.alarms.engine import HOLD_PAGE, STALE_PAGE, AlarmEngine
from gateway.alarms.timers import Clock, database_clock
from gateway.domain.errors import ConcurrentWriteError
from gateway.domain.rules import SlotKey, ThresholdRule
from gateway.support.loops import every
from storage.errors import TRANSIENT_DB_ERRORS

log = structlog.get_logger(__name__)


class HoldTimer:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        engine: AlarmEngine,
        interval_s: float = 5.0,
        clock: Clock = database_clock,
        stale_page: int = STALE_PAGE,
        judge_page: int = HOLD_PAGE,
    ) -> None:
        self.pool = pool
        self.engine = engine
        # How late a hold may fire, at most, past its due time (plus a slow pass).
        self.interval_s = interval_s
        self.clock = clock
        # The engine's `rule_sets_changed` for which every stale row found was judged; the
        # one the current sweep through the stale rows' keys is for, where it is, and
        # whether it has judged every row it found so far.
        self._judged_for = 0
        self._sweep_for = 0
        self._sweep_after: SlotKey = ("", "")
        self._sweep_clean = True
        self.stale_page = stale_page  # keys of stale rows read per pass
        self.judge_page = judge_page  # of which judged per transaction

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.interval_s, stop, self.run_once, name="hold-timer")

    async def run_once(self) -> list[int]:
        """Fire every hold due now; the ids of the alarms this call raised.

        First the pending rows of a definition no live node runs any more (a rule a reload
        changed mid-hold) are judged again under this node's (`rejudge_stale_holds`), then
        the holds due are fired, those rows' among them. After a rule set changed, the
        firing and normal rows of such a definition are judged again first
        (`rejudge_stale_rows`): the ids of the alarms that raised are among those returned."""
        # Judging rows a reload left is a correction, and what breaks it (a bug of ours, a
        # row the database refuses) must never keep the holds due from firing: only the
        # database away (transient) ends the pass, as it would end the holds' own step.
        try:
            await self.rejudge_stale()
        except TRANSIENT_DB_ERRORS:
            raise
        except Exception:
            log.exception("hold_rejudge_failed")
        raised: list[int] = []
        try:
            raised = await self.rejudge_stale_rows()
        except TRANSIENT_DB_ERRORS:
            raise
        except Exception:
            # Given up for this change of rule sets (the next change sweeps again): tried at
            # every pass, it would fail again, and take its time from every pass's holds.
            self._judged_for = self.engine.rule_sets_changed
            log.exception("rule_rejudge_failed", gave_up_until="the next change of rule sets")
        after: SlotKey | None = ("", "")
        while after is not None:
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    now = await self.clock(conn)
                    batch, after = await self.engine.fire_due_holds(conn, now, after=after)
            except ConcurrentWriteError as exc:
                # Another transaction wrote an alarm of these rows first: nothing of the page
                # was written; the next pass judges the rows as that one left them.
                log.warning("hold_timer_conflict", error=str(exc))
                break
            self.engine.committed(batch)
            for rule_key, alarm_id in batch.created:
                log.info("alarm_hold_fired", alarm_id=alarm_id, rule_key=rule_key)
                raised.append(alarm_id)
        return raised

    async def rejudge_stale(self) -> int:
        """Judge again, under this node's definitions, the pending rows written under one no
        live node runs any more; how many."""
        judged = 0
        if not any(isinstance(r, ThresholdRule) and r.for_seconds > 0 for r in self.engine.rules):
            return judged  # no hold rule: no transaction either
        after: SlotKey | None = ("", "")
        while after is not None:
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    page, after = await self.engine.rejudge_stale_holds(conn, after=after)
            except ConcurrentWriteError as exc:
                log.warning("hold_timer_conflict", error=str(exc))
                break
            judged += page
        return judged

    async def rejudge_stale_rows(self) -> list[int]:
        """After a rule set changed (`AlarmEngine.rule_sets_changed`), judge again the firing
        and normal rows written under a definition no live node runs any more: one page of
        their keys (`stale_page`) per pass, so that the holds due still fire between pages,
        judged a page per transaction (`judge_page`), and no more pages once the pass has
        taken its interval (the rest at the next pass); the ids of the alarms raised. Done for
        that change once a sweep through every key found has judged each row (a sweep that
        found one another transaction held, or hit a conflict, starts again at the next
        pass)."""
        changed = self.engine.rule_sets_changed
        if changed == self._judged_for:
            return []
        if changed != self._sweep_for:  # a new change: a sweep from the first key
            self._sweep_for, self._sweep_after, self._sweep_clean = changed, ("", ""), True
        async with self.pool.acquire() as conn:
            keys = await self.engine.stale_keys(
                conn, after=self._sweep_after, limit=self.stale_page
            )
        ended = len(keys) < self.stale_page
        raised: list[int] = []
        loop = asyncio.get_running_loop()
        began = loop.time()
        for start in range(0, len(keys), self.judge_page):
            if start and loop.time() - began >= self.interval_s:
                # A pass's time is the holds' lateness: the holds due fire now, and the next
                # pass goes on from this key (a reload that changes a large fleet's alarms
                # took 17 s for 10,000 rows on a loaded machine).
                ended = False
                break
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    now = await self.clock(conn)
                    batch, skipped, _ = await self.engine.rejudge_stale_rows(
                        conn, now, keys=keys[start : start + self.judge_page]
                    )
            except ConcurrentWriteError as exc:
                # Another transaction wrote an alarm of these rows first: nothing of the page
                # was written; the next sweep judges them as that one left them.
                log.warning("hold_timer_conflict", error=str(exc))
                self._sweep_clean = False
            else:
                self.engine.committed(batch)
                self._sweep_clean = self._sweep_clean and not skipped
                raised.extend(alarm_id for _, alarm_id in batch.created)
                if batch.cleared:
                    log.info("rule_rejudged_cleared", alarms=batch.cleared)
            # Only past the rows a transaction ended for: a pass that fails (the database
            # went away) is run again from the first row it did not judge.
            self._sweep_after = keys[min(start + self.judge_page, len(keys)) - 1]
        if ended:
            self._sweep_after = ("", "")
            if self._sweep_clean:
                self._judged_for = changed
            self._sweep_clean = True  # else again from the first key at the next pass
        return raised
