"""A chatter window of a day is 86,400 s on the day the clocks go back, too.

`[alarms.figures] chatter_window_s` may be up to a day (86400). The window went to PostgreSQL
as an interval of "1 day", which PostgreSQL adds in the session's time zone: on a server whose
`timezone` is the site's (initdb sets the host's), the day the clocks went back was 25 hours
long, and a door raising three alarms over 24.5 hours was listed chattering ("3 within
86400 s"), in the API, on the console and in the gauge. Real PostgreSQL with the database's
`timezone` set to Europe/Berlin; the history is written with chosen times."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from gateway.alarms.figures import AlarmFigures
from gateway.config import AlarmFiguresConfig
from storage.pool import create_pool
from tests.support.alarm_history import raise_alarm

# Europe/Berlin goes back from 03:00 CEST to 02:00 CET on 2026-10-25 (01:00 UTC).
RAISED = [
    datetime(2026, 10, 24, 12, 0, tzinfo=UTC),
    datetime(2026, 10, 25, 0, 0, tzinfo=UTC),
    datetime(2026, 10, 25, 12, 30, tzinfo=UTC),  # 24.5 h after the first
]
NOW = datetime(2026, 10, 25, 18, 0, tzinfo=UTC)
A_DAY = AlarmFiguresConfig(chatter_raises=3, chatter_window_s=86400, chatter_lookback_s=172800)


@pytest.fixture
async def berlin_pool(db_dsn: str, db: asyncpg.Connection) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the test's database, whose `timezone` is the site's, as initdb sets it."""
    name = await db.fetchval("SELECT current_database()")
    await db.execute(f"ALTER DATABASE \"{name}\" SET timezone = 'Europe/Berlin'")
    pool = await create_pool(db_dsn, min_size=1, max_size=2)
    try:
        assert await pool.fetchval("SHOW timezone") == "Europe/Berlin"
        yield pool
    finally:
        await pool.close()


async def test_three_alarms_over_more_than_a_day_do_not_chatter_across_the_dst_change(
    berlin_pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    for moment in RAISED:
        await raise_alarm(db, "door-open", "door-7", moment)
    figures = AlarmFigures(berlin_pool, A_DAY, clock=lambda: NOW)
    report = await figures.report(timedelta(days=2))
    assert report["alarms"] == 3
    assert report["chattering"] == {"count": 0, "items": []}
    assert (await figures.run_once())["chattering"] == 0
