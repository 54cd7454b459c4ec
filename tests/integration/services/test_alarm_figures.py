"""The alarm system's figures over a scripted history (EEMUA 191, ISA-18.2): exact flood
periods, chattering pairs, stale alarms, top lists, operators and times to acknowledge, as
PostgreSQL computes them; and the gauges' loop in run-once mode."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import aiohttp
import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from gateway.alarms.figures import WINDOW_PATTERN, AlarmFigures, WindowError, parse_window
from gateway.alarms.metrics import AlarmMetrics
from gateway.config import AlarmFiguresConfig, Config
from storage.alarms import db_now
from tests.support.alarm_history import raise_alarm
from tests.support.api_client import VIEWER
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def at(hh: int, mm: int, ss: int = 0, *, day: int = 2) -> datetime:
    return datetime(2026, 3, day, hh, mm, ss, tzinfo=UTC)


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


async def _history(conn: asyncpg.Connection) -> None:
    """The day before NOW (12:00), 59 alarms in it, and three from before."""
    # A flood of two intervals: 12 door alarms in 09:00-09:10, 11 in 09:10-09:20.
    for i in range(12):
        actions: tuple[tuple[str, str, datetime], ...] = ()
        if i == 0:  # acknowledged after 60 s, then handled and closed: one acknowledgement
            actions = (
                ("confirm", "olga", at(9, 1)),
                ("handle", "olga", at(9, 30)),
                ("close", "olga", at(9, 31)),
            )
        elif i == 1:  # raised 09:00:30, confirmed after 120 s
            actions = (("confirm", "ivan", at(9, 2, 30)),)
        elif i == 2:  # raised 09:01:00, called false after 300 s
            actions = (("false", "ivan", at(9, 6)),)
        await raise_alarm(
            conn, "door", f"door-{i + 1}", at(9, 0) + s(30 * i), severity="MAJOR", actions=actions
        )
    for i in range(11):
        await raise_alarm(conn, "door", f"door-{i + 1}", at(9, 10) + s(40 * i))
    # Exactly 10 in 09:20-09:30: not more than 10, no flood.
    for i in range(10):
        actions = (("confirm", "olga", at(9, 24)),) if i == 0 else ()  # after 240 s
        await raise_alarm(conn, "smoke", f"smoke-{i + 1}", at(9, 20) + s(50 * i), actions=actions)
    # A flood of one interval: 11 in 11:40-11:50.
    for i in range(11):
        actions = (("handle", "ivan", at(11, 41)),) if i == 0 else ()  # after 60 s
        await raise_alarm(conn, "leak", f"leak-{i + 1}", at(11, 40) + s(45 * i), actions=actions)
    # Chattering: 3 or more within a minute (the first and the last at most 60 s apart).
    for moment in (at(5, 0), at(5, 0, 20), at(5, 0, 50), at(5, 30)):
        await raise_alarm(conn, "temp-high", "t-1", moment)  # 3 in 50 s, then one more
    for moment in (at(6, 0), at(6, 0, 40), at(6, 1, 10)):
        await raise_alarm(conn, "temp-high", "t-2", moment)  # 3 in 70 s: not chattering
    for moment in (at(7, 0), at(7, 0, 10), at(7, 0, 20), at(7, 0, 30)):
        await raise_alarm(conn, "temp-high", "t-3", moment)  # 4 in 30 s
    for moment in (at(8, 0), at(8, 0, 30), at(8, 1)):
        await raise_alarm(conn, "temp-high", "t-4", moment)  # 3 in exactly 60 s
    # Open for just under 24 h: in the window, not stale.
    await raise_alarm(conn, "old", "o-4", at(12, 0, 1, day=1))
    # Before the window: open for 24 h and a second (stale), open since Feb 27 (stale, its
    # acknowledgement outside the window), closed long ago (not stale).
    await raise_alarm(conn, "old", "o-1", at(11, 59, 59, day=1))
    await raise_alarm(
        conn, "old", "o-2", at(10, 0, day=27).replace(month=2),
        actions=(("confirm", "olga", at(10, 5, day=27).replace(month=2)),),
    )  # fmt: skip
    feb26 = at(10, 0, day=26).replace(month=2)
    await raise_alarm(
        conn, "old", "o-3", feb26,
        actions=(("handle", "ivan", feb26 + s(60)), ("close", "ivan", feb26 + s(120))),
    )  # fmt: skip
    # At NOW exactly: after the window [NOW - 24 h, NOW).
    await raise_alarm(conn, "late", "l-1", NOW)


@pytest.fixture
async def figures(pool: asyncpg.Pool, db: asyncpg.Connection) -> AlarmFigures:
    await _history(db)
    return AlarmFigures(pool, AlarmFiguresConfig(), clock=lambda: NOW)


async def test_alarms_per_10_minutes_and_flood_periods(figures: AlarmFigures) -> None:
    report = await figures.report(DAY)
    assert report["since"] == NOW - DAY
    assert report["until"] == NOW
    assert report["alarms"] == 59
    series = report["per_10min"]["series"]
    assert len(series) == 144
    assert series[0]["starts_at"] == NOW - DAY
    assert series[-1]["starts_at"] == NOW - s(600)
    counts = {r["starts_at"]: r["alarms"] for r in series if r["alarms"]}
    assert counts == {
        at(12, 0, day=1): 1,
        at(5, 0): 3,
        at(5, 30): 1,
        at(6, 0): 3,
        at(7, 0): 4,
        at(8, 0): 3,
        at(9, 0): 12,
        at(9, 10): 11,
        at(9, 20): 10,
        at(11, 40): 11,
    }
    assert report["per_10min"]["peak"] == 12
    assert report["per_10min"]["average"] == round(59 / 144, 3)
    floods = report["floods"]
    assert floods["periods"] == [
        {"starts_at": at(9, 0), "ends_at": at(9, 20), "intervals": 2, "alarms": 23, "peak": 12},
        {"starts_at": at(11, 40), "ends_at": at(11, 50), "intervals": 1, "alarms": 11, "peak": 11},
    ]
    assert floods["intervals"] == 3
    assert floods["share"] == round(3 / 144, 4)


async def test_a_lower_flood_threshold_joins_the_periods(figures: AlarmFigures) -> None:
    figures.reconfigure(AlarmFiguresConfig(flood_alarms=9))
    periods = (await figures.report(DAY))["floods"]["periods"]
    assert [(p["starts_at"], p["ends_at"], p["alarms"]) for p in periods] == [
        (at(9, 0), at(9, 30), 33),
        (at(11, 40), at(11, 50), 11),
    ]


async def test_chattering_pairs_are_exact(figures: AlarmFigures) -> None:
    chattering = (await figures.report(DAY))["chattering"]
    assert chattering == {
        "count": 3,
        "items": [
            {"rule_key": "temp-high", "device_id": "t-3", "alarms": 4, "peak": 4,
             "since": at(7, 0, 20)},
            {"rule_key": "temp-high", "device_id": "t-1", "alarms": 4, "peak": 3,
             "since": at(5, 0, 50)},
            {"rule_key": "temp-high", "device_id": "t-4", "alarms": 3, "peak": 3,
             "since": at(8, 1)},
        ],
    }  # fmt: skip
    # Four in a minute: only t-3.
    figures.reconfigure(AlarmFiguresConfig(chatter_raises=4))
    items = (await figures.report(DAY))["chattering"]["items"]
    assert [i["device_id"] for i in items] == ["t-3"]
    # Three within 70 s: t-2 too.
    figures.reconfigure(AlarmFiguresConfig(chatter_window_s=70))
    items = (await figures.report(DAY))["chattering"]["items"]
    assert [i["device_id"] for i in items] == ["t-3", "t-1", "t-2", "t-4"]


async def test_stale_alarms_are_the_open_ones_older_than_a_day(figures: AlarmFigures) -> None:
    stale = (await figures.report(DAY))["stale"]
    assert stale["count"] == 2
    assert [(a["device_id"], a["status"], a["open_s"]) for a in stale["oldest"]] == [
        ("o-2", "CONFIRMED", (NOW - at(10, 0, day=27).replace(month=2)).total_seconds()),
        ("o-1", "NEW", 86401.0),
    ]
    # The same alarms whatever the window: staleness is about now.
    assert (await figures.report(timedelta(hours=1)))["stale"]["count"] == 2


async def test_top_rules_and_devices(figures: AlarmFigures) -> None:
    report = await figures.report(DAY)
    assert [(t["key"], t["alarms"]) for t in report["top_rules"]] == [
        ("door", 23), ("temp-high", 14), ("leak", 11), ("smoke", 10), ("old", 1),
    ]  # fmt: skip
    assert report["top_rules"][0]["share"] == round(23 / 59, 4)
    assert [(t["key"], t["alarms"]) for t in report["top_devices"]] == [
        ("t-1", 4), ("t-3", 4), ("t-2", 3), ("t-4", 3),
        ("door-1", 2), ("door-10", 2), ("door-11", 2), ("door-2", 2), ("door-3", 2), ("door-4", 2),
    ]  # fmt: skip


async def test_time_to_acknowledge_and_operators(figures: AlarmFigures) -> None:
    report = await figures.report(DAY)
    # First people's actions in the window: 60 (olga), 120 (ivan), 300 (ivan), 240 (olga),
    # 60 (ivan) seconds after their alarms. o-2's confirm was before the window.
    assert report["acknowledgement"] == {
        "acknowledged": 5,
        "median_s": 120.0,
        "p90_s": pytest.approx(276.0),  # 240 + 0.6 * (300 - 240)
        "max_s": 300.0,
    }
    operators = {o["actor"]: o for o in report["operators"]}
    assert set(operators) == {"olga", "ivan"}  # the system's own rows are not an operator's
    olga, ivan = operators["olga"], operators["ivan"]
    assert (olga["actions"], olga["alarms"], olga["acknowledged"]) == (4, 2, 2)
    assert olga["ack_median_s"] == 150.0
    assert olga["peak_10min"] == 2  # handle 09:30 and close 09:31
    assert olga["per_10min"] == round(4 / 144, 3)
    assert (ivan["actions"], ivan["alarms"], ivan["acknowledged"]) == (3, 3, 3)
    assert ivan["ack_median_s"] == 120.0
    assert ivan["peak_10min"] == 2  # 09:02:30 and 09:06
    assert [o["actor"] for o in report["operators"]] == ["olga", "ivan"]  # most actions first


async def test_an_empty_window(pool: asyncpg.Pool) -> None:
    report = await AlarmFigures(pool, clock=lambda: NOW).report(timedelta(minutes=10))
    assert report["alarms"] == 0
    assert report["per_10min"] == {
        "average": 0.0, "peak": 0, "series": [{"starts_at": NOW - s(600), "alarms": 0}],
    }  # fmt: skip
    assert report["floods"] == {"periods": [], "intervals": 0, "share": 0.0}
    assert report["chattering"] == {"count": 0, "items": []}
    assert report["acknowledgement"]["median_s"] is None
    assert report["operators"] == []
    assert report["top_rules"] == []


async def test_an_unaligned_window_counts_only_inside_it(figures: AlarmFigures) -> None:
    # [09:05, 09:15): door alarms 09:05:00, 09:05:30 and 09:10:00 .. 09:14:40.
    report = await figures.report(timedelta(minutes=10), now=at(9, 15))
    assert [(r["starts_at"], r["alarms"]) for r in report["per_10min"]["series"]] == [
        (at(9, 0), 2),
        (at(9, 10), 8),
    ]
    assert report["alarms"] == 10


async def test_the_gauges_in_run_once_mode(pool: asyncpg.Pool, db: asyncpg.Connection) -> None:
    await _history(db)
    registry = CollectorRegistry()
    metrics = AlarmMetrics(registry)
    moment = at(11, 50)
    figures = AlarmFigures(
        pool, AlarmFiguresConfig(chatter_lookback_s=86400), metrics=metrics, clock=lambda: moment
    )
    sampled = await figures.run_once()
    # [11:40, 11:50): 11 leak alarms, a flood; chattering t-1, t-3, t-4 within the day; stale:
    # o-2 only (o-1 is not a day old at 11:50); open: 59 - door-1 (closed), door-3 (false),
    # leak-1 (handled) + o-1, o-2, and l-1 (raised at 12:00, open too).
    assert sampled == {"last_10min": 11, "flood": 1, "chattering": 3, "stale": 1, "open": 59}
    gauges = _gauges(registry)
    sampled_at = gauges.pop("sampled_timestamp_seconds")
    assert gauges == {"last_10min": 11, "flood": 1, "chattering": 3, "stale": 1, "open": 59}
    assert sampled_at is not None
    assert sampled_at == moment.timestamp()  # the database's clock (here, the test's)
    # At noon: nothing in the last 10 minutes, no flood; nothing chattered in the last hour.
    moment = NOW
    figures.reconfigure(AlarmFiguresConfig())
    assert await figures.run_once() == {
        "last_10min": 0, "flood": 0, "chattering": 0, "stale": 2, "open": 59,
    }  # fmt: skip
    assert _gauges(registry)["flood"] == 0


def _gauges(registry: CollectorRegistry) -> dict[str, float | None]:
    names = ("last_10min", "flood", "chattering", "stale", "open", "sampled_timestamp_seconds")
    return {n: registry.get_sample_value(f"gateway_alarm_figures_{n}") for n in names}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10m", 600), ("24h", 86400), ("7d", 604800), ("31d", 31 * 86400), ("744h", 31 * 86400)],
)
def test_windows(text: str, seconds: int) -> None:
    assert parse_window(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["9m", "32d", "0h", "1w", "24", "h", "-1h", "1.5h", "01h", ""])
def test_windows_refused(text: str) -> None:
    with pytest.raises(WindowError):
        parse_window(text)


def test_the_pattern_is_exactly_the_windows_read() -> None:
    # The API document's pattern admits a window exactly when parse_window reads it.
    pattern = re.compile(WINDOW_PATTERN.removesuffix("$") + r"\Z")
    for unit, most in (("m", 50_000), ("h", 1_000), ("d", 100)):
        for number in range(most):
            for text in (f"{number}{unit}", f"0{number}{unit}"):
                try:
                    parse_window(text)
                    read = True
                except WindowError:
                    read = False
                assert (pattern.match(text) is not None) == read, text


async def test_a_reload_brings_new_thresholds_to_the_gauges_and_the_api(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    tokens = f'[[api.tokens]]\nname = "wall"\ntoken = "{VIEWER}"\nrole = "viewer"\n'
    port = free_port()

    def config(figures: str) -> Config:
        extra = f"{tokens}\n[alarms.figures]\n{figures}\n"
        return make_config(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port, extra=extra)

    now = await db_now(db)
    for i in range(6):  # six in the last 10 minutes: no flood at 10, a flood at 5
        await raise_alarm(db, "door", f"door-{i}", now - s(60 + i))
    async with running_daemon(config("interval_s = 3600")) as daemon:
        registry = daemon.metrics.registry
        await wait_until(
            lambda: registry.get_sample_value("gateway_alarm_figures_last_10min") == 6,
            timeout=30,
            message="the first sample, at start",
        )
        assert registry.get_sample_value("gateway_alarm_figures_flood") == 0
        daemon.reload(config("interval_s = 3600\nflood_alarms = 5"))
        # The reload wakes the loop: no waiting out the hour.
        await wait_until(
            lambda: registry.get_sample_value("gateway_alarm_figures_flood") == 1,
            timeout=30,
            message="a sample with the reloaded threshold",
        )
        async with (
            aiohttp.ClientSession() as http,
            http.get(
                f"http://127.0.0.1:{port}/alarm-stats?window=1h",
                headers={"Authorization": f"Bearer {VIEWER}"},
            ) as reply,
        ):
            body = await reply.json()
        assert reply.status == 200, body
        assert body["thresholds"]["flood_alarms"] == 5
        assert body["alarms"] == 6
