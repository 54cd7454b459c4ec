"""A person's action on an alarm (``AlarmService.act``) that gave up waiting for a lock past
its bound (``lock_timeout``, 55P03) says what was held. Not always the alarm: once the alarm
row is ours, the step goes on to statements that wait for other transactions' locks, and
their waits were answered "alarm N is held by another transaction (a node stopped in the
middle of a change?)", sending the operator to look for a holder of the alarm that none had.

Real waits, each on a lock the test holds in real PostgreSQL:

* a held notification's row (``notify_delivery``): the night desk confirms a DELAYED alarm, and
  its held notifications are recorded SUPPRESSED in the same step; a consumer adding to that
  window, or a node stopped there, holds the row.
* the ``outbox_event`` table, held in SHARE mode as a ``CREATE INDEX`` on it holds it: every
  step writes its event there after its audit row. Every alarm's step waits for it alike, so
  a bulk action stops at the first, as at a held ``alarm_audit`` table.
"""

from __future__ import annotations

import asyncpg
import pytest

from gateway.alarms.service import AlarmHeldError, AlarmService
from gateway.domain.alarm import Action
from tests.integration.api.test_alarm_action_on_a_held_row import _within
from tests.integration.api.test_alarm_desk_audit import Api
from tests.integration.api.test_desk_audit_bulk_held_audit_table import (  # noqa: F401 - api: the fixture
    LOCK_WAIT_S,
    api,
    bulk_at_held_table,
)
from tests.integration.services.test_notify_grouping import (
    _config,
    _consume_together,
    _quiet_now,
    _raise,
    _statuses,
    _two_nodes,
)
from tests.integration.services.test_notify_quiet_handled import UNGROUPED, _held
from tests.support.receivers import webhook_server


async def test_a_confirm_waiting_for_a_held_notification_names_it_not_the_alarm(
    db_dsn: str, db: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    async with (
        webhook_server() as server,
        _two_nodes(db_dsn, _config(server.url(""), UNGROUPED)) as nodes,
    ):
        for node in nodes:
            node.consumer.quiet = _quiet_now()
        alarm = await _raise(db, "care-0", "hot", 0)
        await _consume_together(nodes)
        assert (await _statuses(db, [alarm]))[alarm] == "DELAYED"
        [held] = await _held(db, alarm)
    holder = await asyncpg.connect(db_dsn)
    try:
        async with holder.transaction():
            await holder.execute(
                "SELECT 1 FROM notify_delivery WHERE id = $1 FOR UPDATE", held["id"]
            )
            with pytest.raises(AlarmHeldError) as caught:
                await _within(
                    "a confirm over a held notification",
                    AlarmService(pool, "n1").act(alarm, Action.CONFIRM, actor="night-desk"),
                )
    finally:
        await holder.close()
    message = str(caught.value)
    assert f"alarm {alarm} is held" not in message, message
    assert "notify_delivery" in message, message
    assert "nothing changed; retry" in message, message
    assert (await _statuses(db, [alarm]))[alarm] == "DELAYED"


async def test_a_confirm_waiting_for_the_held_outbox_table_names_it_not_the_alarm(
    db: asyncpg.Connection, db_dsn: str, pool: asyncpg.Pool
) -> None:
    alarm = await _raise(db, "care-0", "hot", 0)
    holder = await asyncpg.connect(db_dsn)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE outbox_event IN SHARE MODE")  # as CREATE INDEX
            with pytest.raises(AlarmHeldError) as caught:
                await _within(
                    "a confirm at a held outbox table",
                    AlarmService(pool, "n1").act(alarm, Action.CONFIRM, actor="night-desk"),
                )
    finally:
        await holder.close()
    message = str(caught.value)
    assert f"alarm {alarm} is held" not in message, message
    assert "outbox_event table" in message, message
    assert "nothing changed; retry" in message, message
    assert (await _statuses(db, [alarm]))[alarm] != "CONFIRMED"


async def test_a_bulk_action_stops_at_a_held_outbox_table(api: Api) -> None:  # noqa: F811 - the fixture
    """Every alarm's event waits for the held outbox table alike: the bulk stops at the first,
    as at a held audit table, the others NOT_ATTEMPTED naming the table; it tried each, 5 s
    apiece, each answered "alarm N is held"."""
    ids, items, took = await bulk_at_held_table(api, "outbox_event")
    first, *later = ids
    stopped = items[first]
    assert (stopped["ok"], stopped["error"]) == (False, "UNAVAILABLE"), stopped
    assert "outbox_event table" in stopped["message"], stopped
    for alarm_id in later:
        item = items[alarm_id]
        assert item["error"] == "NOT_ATTEMPTED", item
        assert "outbox_event table" in item["message"], item
    assert took < 2 * LOCK_WAIT_S, took  # one wait, not one per alarm
    statuses = [await api.db.fetchval("SELECT status FROM alarm WHERE id = $1", a) for a in ids]
    assert statuses == ["NEW", "NEW", "NEW"]
