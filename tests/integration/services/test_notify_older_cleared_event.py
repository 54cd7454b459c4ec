"""An ``alarm.cleared`` event written by a release before the event said why the alarm fired
(no ``trigger``, no ``rule_description``: dbdf0ec added them), read by this one: in a rolling
upgrade the old node keeps writing them while an upgraded node's consumer reads them, and
events written before the upgrade may not be read yet. Its "recovered" notification was
dropped: the payload failed its Struct (``notify_event_undecodable``), and nobody was told."""

from __future__ import annotations

import uuid

import asyncpg
import pytest
from structlog.testing import capture_logs

from storage import outbox
from tests.integration.services.test_notify import (
    Notifier,
    _config,
    _deliveries,
    _drain,
    _route,
    _webhook,
)

# As the release before dbdf0ec wrote it (gateway/alarms/service.py, record_cleared then).
OLDER_CLEARED = (
    '{"alarm_id": 7, "device_id": "dev-1", "rule_key": "hot", "status": "PUSHED",'
    ' "clear_event_id": "' + "ab" * 32 + '", "reason": "temp back under 80",'
    ' "cleared_at": "2026-11-30T10:00:00+00:00"}'
)


# The older shape decodes, but does not encode back to itself (the nulls it lacked are added).
@pytest.mark.synthetic_events
async def test_a_cleared_event_of_the_previous_release_is_still_a_notification(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    config = _config(
        _webhook("a", "http://127.0.0.1:9/a"), _route(["a"], 'events = ["alarm.cleared"]')
    )
    node = Notifier(pool, db_dsn, config)
    event_id = uuid.uuid4()
    await db.execute(outbox.INSERT_EVENT, event_id, "alarm", "7", "alarm.cleared", OLDER_CLEARED)
    with capture_logs() as logs:
        await _drain(node.consumer)
    undecodable = [e for e in logs if e["event"] == "notify_event_undecodable"]
    assert undecodable == []
    deliveries = await _deliveries(db)
    assert [(d["event_id"], d["receiver"], d["device_id"]) for d in deliveries] == [
        (event_id, "a", "dev-1")
    ]
