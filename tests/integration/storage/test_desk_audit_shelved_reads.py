"""The desk's list, groups and counts read shelves and out-of-service periods by joins (not
per alarm through alarm_shelved_until and device_out_of_service_at: ~70 µs an alarm, seconds
over a long history; scripts/desk-scale): they must answer what those functions answer, in
every corner a shelf or a period can be in (docs/behaviour.md §5, "Shelving", "Out of
service")."""

from __future__ import annotations

from collections import Counter

import asyncpg

from storage import desk

# Alarms: (device, rule, severity, status, cleared, minutes ago).
ALARMS = [
    ("d1", "r1", "MAJOR", "NEW", False, 60),
    ("d1", "r1", "MAJOR", "NEW", True, 50),
    ("d1", "r2", "CRITICAL", "CONFIRMED", False, 40),
    ("d2", "r1", "WARNING", "NEW", False, 300),
    ("d2", "r2", "INFO", "CLOSED", True, 200),
    ("d3", "r1", "CRITICAL", "NEW", False, 30),
    ("d3", "r3", "MAJOR", "PUSHED", True, 20),
    ("d4", "r1", "MAJOR", "NEW", False, 10),
    ("d4", "r2", "CRITICAL", "CLOSED", True, 100),
    ("d5", "r3", "INFO", "NEW", False, 5),
]

INSERT_ALARM = """
INSERT INTO alarm (device_id, rule_key, severity, status, telemetry_event_id, dedup_key,
                   triggered_at, pushed_at, confirmed_at, confirmed_by, handled_at, handled_by,
                   closed_at, closed_by, cleared_at, clear_event_id, node_id)
SELECT $1::text, $2::text, $3::text, $4::text, 'ev' || $6::int, $2 || ':' || $1 || ':ev' || $6,
       t, CASE WHEN $4 IN ('PUSHED', 'CONFIRMED') THEN t END,
       CASE WHEN $4 = 'CONFIRMED' THEN t END, CASE WHEN $4 = 'CONFIRMED' THEN 'op' END,
       CASE WHEN $4 = 'CLOSED' THEN t END, CASE WHEN $4 = 'CLOSED' THEN 'op' END,
       CASE WHEN $4 = 'CLOSED' THEN t END, CASE WHEN $4 = 'CLOSED' THEN 'op' END,
       CASE WHEN $5 THEN t END, CASE WHEN $5 THEN 'clr' END, 'n'
FROM (SELECT now() - make_interval(mins => $6::int) AS t) x
RETURNING id
"""

SHELF = """
INSERT INTO alarm_shelf (scope, alarm_id, device_id, rule_key, reason, shelved_by, shelved_at,
                         until, node_id, ended_at, ended_by, end_reason)
VALUES ($1, $2, $3, $4, 'why', 'op', now() + make_interval(mins => $5::int),
        now() + make_interval(mins => $6::int), 'n',
        now() + make_interval(mins => $7::int), CASE WHEN $7::int IS NOT NULL THEN 'op' END,
        CASE WHEN $7::int IS NOT NULL THEN 'lifted' END)
"""

PERIOD = """
INSERT INTO device_out_of_service (device_id, reason, set_by, since, until, ended_at, ended_by)
VALUES ($1, 'works', 'op', now() + make_interval(mins => $2::int),
        now() + make_interval(mins => $3::int), now() + make_interval(mins => $4::int),
        CASE WHEN $4::int IS NOT NULL THEN 'op' END)
"""

OPEN = ("NEW", "PUSHED", "DELAYED", "CONFIRMED", "ESCALATED")

# What the functions say, in the statement's own transaction (now() is the same).
REFERENCE = """
SELECT a.id, a.device_id, a.rule_key, a.severity, a.status, a.cleared_at IS NOT NULL AS cleared,
       (a.confirmed_at IS NOT NULL OR a.handled_at IS NOT NULL OR a.false_at IS NOT NULL) AS ack,
       alarm_shelved_until(a.id, a.device_id, a.rule_key, now()) AS shelved_until,
       device_out_of_service_at(a.device_id, a.triggered_at) AS out_of_service
FROM alarm a ORDER BY a.id
"""


async def _fill(db: asyncpg.Connection) -> list[int]:
    for device in ("d1", "d2", "d3", "d4", "d5"):
        await db.execute(
            "INSERT INTO device (device_id, first_seen, last_seen) VALUES ($1, now(), now())",
            device,
        )
    ids = [
        int(await db.fetchval(INSERT_ALARM, dev, rule, sev, status, cleared, ago))
        for dev, rule, sev, status, cleared, ago in ALARMS
    ]
    # Alarm shelves (minutes from now: shelved at, until, ended at): in force; lifted; ended
    # at a time still ahead (in force until then) beside one not ended; not begun yet; and an
    # alarm shelf over a pair shelf that ends later.
    for alarm, start, until, ended in [
        (0, -10, 60, None),
        (1, -30, 60, -5),
        (2, -30, 60, 20),
        (2, -5, 30, None),
        (3, 5, 60, None),
        (5, -10, 15, None),
    ]:
        dev, rule = ALARMS[alarm][0], ALARMS[alarm][1]
        await db.execute(SHELF, "alarm", ids[alarm], dev, rule, start, until, ended)
    # Pair shelves: d3/r1 in force (over the alarm shelf of index 5, later), d1/r2 lifted,
    # d4/r2 in force (a closed alarm's pair: history is shelved too), d5/r3 not begun.
    for dev, rule, start, until, ended in [
        ("d3", "r1", -20, 90, None),
        ("d1", "r2", -20, 90, -1),
        ("d4", "r2", -20, 90, None),
        ("d5", "r3", 10, 90, None),
    ]:
        await db.execute(SHELF, "pair", None, dev, rule, start, until, ended)
    # Periods (minutes from now: since, until, ended at): d1 since before its alarms, open; d2
    # over its first alarm only (300 minutes ago), ended; d3 begun after its alarms; d4 until
    # a time past before its alarm; d5 none.
    for dev, since, until, ended in [
        ("d1", -120, None, None),
        ("d2", -400, None, -250),
        ("d3", -10, None, None),
        ("d4", -200, -150, None),
    ]:
        await db.execute(PERIOD, dev, since, until, ended)
    return ids


def _worst(severity: str) -> int:
    return {"INFO": 1, "WARNING": 2, "MAJOR": 3}.get(severity, 4)


async def test_list_groups_and_counts_answer_what_the_functions_answer(
    db: asyncpg.Connection,
) -> None:
    await _fill(db)
    async with db.transaction():  # one now() for the reads and the reference
        ref = {r["id"]: r for r in await db.fetch(REFERENCE)}
        listed = await desk.list_alarms(db, desk.Filters(shelved="any"), before_id=None, limit=100)
        counts = {r["severity"]: dict(r) for r in await desk.counts(db)}
        grouped = {
            (mode, by): {
                r["key"]: (r["count"], r["newest_id"], r["worst"])
                for r in await desk.groups(db, desk.Filters(shelved=mode), by=by, limit=100)
            }
            for mode in ("exclude", "only", "any")
            for by in ("rule", "device")
        }
        # The setting the reads planned under is theirs alone.
        assert await db.fetchval("SELECT current_setting('plan_cache_mode')") == "auto"

    assert sorted(r["id"] for r in listed) == sorted(ref)
    for row in listed:
        want = ref[row["id"]]
        assert (row["shelved_until"], row["out_of_service"]) == (
            want["shelved_until"],
            want["out_of_service"],
        ), row["id"]
    # The corners are there: shelved and not, out of service and not.
    assert {r["shelved_until"] is None for r in ref.values()} == {True, False}
    assert {r["out_of_service"] for r in ref.values()} == {True, False}

    for mode in ("exclude", "only", "any"):
        chosen = [
            r
            for r in ref.values()
            if mode == "any" or (r["shelved_until"] is not None) == (mode == "only")
        ]
        for by, column in (("rule", "rule_key"), ("device", "device_id")):
            want_groups: dict[str, tuple[int, int, int]] = {}
            for r in chosen:
                count, newest, worst = want_groups.get(r[column], (0, 0, 0))
                want_groups[r[column]] = (
                    count + 1,
                    max(newest, r["id"]),
                    max(worst, _worst(r["severity"])),
                )
            assert grouped[(mode, by)] == want_groups, (mode, by)

    want_counts: dict[str, Counter[str]] = {}
    for r in ref.values():
        if r["status"] not in OPEN:
            continue
        c = want_counts.setdefault(r["severity"], Counter())
        c["total"] += 1
        if r["shelved_until"] is not None:
            c["shelved"] += 1
        else:
            side = "returned" if r["cleared"] else "active"
            c[f"{side}_{'acknowledged' if r['ack'] else 'unacknowledged'}"] += 1
        c["out_of_service"] += int(r["out_of_service"])
    columns = (
        "total",
        "active_unacknowledged",
        "active_acknowledged",
        "returned_unacknowledged",
        "returned_acknowledged",
        "shelved",
        "out_of_service",
    )
    assert {s: {k: counts[s][k] for k in columns} for s in counts} == {
        s: {k: c[k] for k in columns} for s, c in want_counts.items()
    }
