"""The alarm system's own figures (EEMUA 191, ISA-18.2): how many alarms people are given and
how they cope, computed in PostgreSQL over ``alarm`` and ``alarm_audit`` (docs/alarm-figures.md).

:meth:`AlarmFigures.report` answers ``GET /alarm-stats`` for a window: alarms per fixed
10-minute interval (the series, its average and peak), flood periods, chattering (rule, device)
pairs, stale alarms, the top rules and devices, people's actions per operator and the time to
acknowledge. All of it is read in one read-only REPEATABLE READ transaction, so the parts agree.

:meth:`AlarmFigures.run_once` samples the gauges (``gateway_alarm_figures_*``): a few indexed
counts, on every node every ``interval_s``, never at scrape.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Final

import asyncpg

from gateway.alarms.metrics import AlarmMetrics
from gateway.config import AlarmFiguresConfig
from gateway.support.loops import every_while_configured
from storage import figures as repo
from storage.alarms import db_now

INTERVAL: Final = timedelta(minutes=10)
# ?window=: a whole number of minutes, hours or days, from one interval to 31 days (4,464
# intervals in the series): 10m to 44640m, 1h to 744h, 1d to 31d and nothing else, so that
# the API document says exactly what is accepted (read alike by Python and ECMA 262).
WINDOW_PATTERN: Final = (
    r"^((1[0-9]|[2-9][0-9]|[1-9][0-9]{2,3}|[1-3][0-9]{4}|4[0-3][0-9]{3}|44[0-5][0-9]{2}"
    r"|446[0-3][0-9]|44640)m"
    r"|([1-9]|[1-9][0-9]|[1-6][0-9]{2}|7[0-3][0-9]|74[0-4])h"
    r"|([1-9]|[12][0-9]|3[01])d)$"
)
WINDOW_MIN: Final = INTERVAL
WINDOW_MAX: Final = timedelta(days=31)
WINDOW_DEFAULT: Final = "24h"
TOP: Final = 10  # the top rules and devices
CHATTERING_LISTED: Final = 100
STALE_LISTED: Final = 20
_UNITS: Final = {"m": "minutes", "h": "hours", "d": "days"}
_WINDOW: Final = re.compile(WINDOW_PATTERN.removesuffix("$") + r"\Z")

Clock = Callable[[], datetime]


class WindowError(ValueError):
    """A window the figures do not read (its message says what would do)."""


def parse_window(text: str) -> timedelta:
    """``"10m"``, ``"24h"``, ``"7d"``: from 10 minutes to 31 days."""
    if _WINDOW.match(text) is None:
        raise WindowError(f"{text[:40]!r} is not a duration such as 10m, 24h or 7d")
    window = timedelta(**{_UNITS[text[-1]]: int(text[:-1])})
    if not WINDOW_MIN <= window <= WINDOW_MAX:
        raise WindowError(f"{text!r} is not within 10m and 31d")
    return window


def _per_10min(count: int, window: timedelta) -> float:
    return round(count * (INTERVAL / window), 3)


class AlarmFigures:
    """The figures of one database; ``settings`` is swapped by a reload."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        settings: AlarmFiguresConfig | None = None,
        *,
        metrics: AlarmMetrics | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings or AlarmFiguresConfig()
        self.metrics = metrics
        # None: the database's clock (every node's figures agree); tests give a fixed one.
        self.clock = clock
        self.wakeup = asyncio.Event()

    def reconfigure(self, settings: AlarmFiguresConfig) -> None:
        """A reload's thresholds and interval, from the next pass (and the next report) on."""
        self.settings = settings
        self.wakeup.set()

    async def report(self, window: timedelta, *, now: datetime | None = None) -> dict[str, Any]:
        """The figures of ``[now - window, now)``, as ``GET /alarm-stats`` answers them; ``now``
        is the database's transaction time unless given (or the clock the figures were made
        with)."""
        settings = self.settings
        within = timedelta(seconds=settings.chatter_window_s)
        async with (
            self.pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            until = now or await self._now(conn)
            since = until - window
            await repo.no_jit(conn)
            intervals = await repo.per_interval(conn, since, until)
            flood_rows = await repo.floods(conn, since, until, settings.flood_alarms)
            rules = await repo.top_rules(conn, since, until, TOP)
            devices = await repo.top_devices(conn, since, until, TOP)
            chatter = await repo.chattering(
                conn,
                since,
                until,
                within=within,
                raises=settings.chatter_raises,
                limit=CHATTERING_LISTED,
            )
            stale = await repo.stale(
                conn, until - timedelta(seconds=settings.stale_after_s), STALE_LISTED
            )
            people = await repo.operators(conn, since, until)
        total = sum(r["alarms"] for r in intervals)
        everyone = next((r for r in people if r["everyone"]), None)
        flooded = sum(r["intervals"] for r in flood_rows)

        def top(rows: list[asyncpg.Record]) -> list[dict[str, Any]]:
            return [
                {"key": r["key"], "alarms": r["alarms"], "share": round(r["alarms"] / total, 4)}
                for r in rows
            ]

        return {
            "window_s": window.total_seconds(),
            "since": since,
            "until": until,
            "thresholds": {
                "flood_alarms": settings.flood_alarms,
                "chatter_raises": settings.chatter_raises,
                "chatter_window_s": settings.chatter_window_s,
                "stale_after_s": settings.stale_after_s,
                "target_per_10min": settings.target_per_10min,
            },
            "alarms": total,
            "per_10min": {
                "average": _per_10min(total, window),
                "peak": max((r["alarms"] for r in intervals), default=0),
                "series": [dict(r.items()) for r in intervals],
            },
            "floods": {
                "periods": [dict(r.items()) for r in flood_rows],
                "intervals": flooded,
                "share": round(flooded / len(intervals), 4) if intervals else 0.0,
            },
            "chattering": {
                "count": chatter[0]["total"] if chatter else 0,
                "items": [{k: v for k, v in r.items() if k != "total"} for r in chatter],
            },
            "stale": {
                "count": stale[0]["total"] if stale else 0,
                "oldest": [
                    {
                        **{k: v for k, v in r.items() if k != "total"},
                        "open_s": round((until - r["triggered_at"]).total_seconds(), 3),
                    }
                    for r in stale
                ],
            },
            "top_rules": top(rules),
            "top_devices": top(devices),
            "acknowledgement": {
                "acknowledged": 0 if everyone is None else everyone["acknowledged"],
                "median_s": None if everyone is None else everyone["ack_median_s"],
                "p90_s": None if everyone is None else everyone["ack_p90_s"],
                "max_s": None if everyone is None else everyone["ack_max_s"],
            },
            "operators": [
                {
                    "actor": r["actor"],
                    "actions": r["actions"],
                    "alarms": r["alarms"],
                    "per_10min": _per_10min(r["actions"], window),
                    "peak_10min": r["peak"],
                    "acknowledged": r["acknowledged"],
                    "ack_median_s": r["ack_median_s"],
                    "ack_p90_s": r["ack_p90_s"],
                }
                for r in people
                if not r["everyone"]
            ],
        }

    async def _now(self, conn: asyncpg.Connection) -> datetime:
        return self.clock() if self.clock is not None else await db_now(conn)

    async def run(self, stop: asyncio.Event) -> None:
        await every_while_configured(
            lambda: self.settings.interval_s,
            stop,
            self.run_once,
            wakeup=self.wakeup,
            name="alarm-figures",
        )

    async def run_once(self) -> dict[str, int]:
        """Sample the gauges once; what it set (``flood`` is 0 or 1)."""
        settings = self.settings
        async with self.pool.acquire() as conn, conn.transaction(readonly=True):
            now = await self._now(conn)
            await repo.no_jit(conn)
            row = await repo.gauges(
                conn,
                now,
                within=timedelta(seconds=settings.chatter_window_s),
                raises=settings.chatter_raises,
                chatter_since=now - timedelta(seconds=settings.chatter_lookback_s),
                stale_before=now - timedelta(seconds=settings.stale_after_s),
            )
        sampled = {
            "last_10min": row["last_10min"],
            "flood": int(row["last_10min"] > settings.flood_alarms),
            "chattering": row["chattering"],
            "stale": row["stale"],
            "open": row["open"],
        }
        if self.metrics is not None:
            m = self.metrics
            m.figures_last_10min.set(sampled["last_10min"])
            m.figures_flood.set(sampled["flood"])
            m.figures_chattering.set(sampled["chattering"])
            m.figures_stale.set(sampled["stale"])
            m.figures_open.set(sampled["open"])
            # The sample's time on the database's clock (its ``now``), not the node's: a node
            # booted at 1970 (no RTC, NTP not synced yet) said it last sampled then.
            m.figures_sampled.set(now.timestamp())
        return sampled
