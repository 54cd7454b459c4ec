"""Payloads of every event type, built from the catalogue's Structs (protocol/events.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec

from protocol.events import (
    AlarmChanged,
    AlarmCleared,
    AlarmCreated,
    AlarmReminder,
    AlarmSnapshot,
    CampaignClosed,
    CampaignCreated,
    CommandFinished,
    DeviceServiceChanged,
    EventPayload,
    EventType,
    ShelfChanged,
    SummaryTaskFinished,
    decode_payload,
)

AT = datetime(2026, 1, 1, tzinfo=UTC)


def snapshot(alarm_id: int = 7, **changes: Any) -> AlarmSnapshot:
    fields: dict[str, Any] = {
        "id": alarm_id,
        "device_id": "d",
        "rule_key": "hot",
        "severity": "MAJOR",
        "status": "NEW",
        "telemetry_event_id": "e" * 64,
        "dedup_key": f"hot:d:{'e' * 64}",
        "active_key": "d:hot",
        "triggered_at": AT,
        "trigger": {"metric": "temp", "op": ">", "threshold": 90, "value": 91},
        "rule_description": "too hot",
    }
    return AlarmSnapshot(**(fields | changes))


def created(alarm_id: int = 7, **changes: Any) -> AlarmCreated:
    return AlarmCreated(
        alarm=snapshot(alarm_id, **changes),
        action="create",
        actor="system:rules",
        from_=None,
        reason="temp > 90",
        supersedes=None,
    )


def changed(status: str, action: str = "close", from_: str = "HANDLED") -> AlarmChanged:
    return AlarmChanged(alarm=snapshot(status=status), action=action, actor="ops", from_=from_)


def command(status: str, device_id: str = "d") -> CommandFinished:
    return CommandFinished(
        command={"id": 3, "device_id": device_id, "status": status}, actor="device"
    )


def samples() -> dict[EventType, EventPayload]:
    """One payload of each event type."""
    campaign = {"id": 2, "name": "reboot", "status": "RUNNING", "total": 3}
    counts = {"PENDING": 0, "ACKED": 3}
    shelf = {"id": 4, "scope": "pair", "alarm_id": None, "device_id": "d", "rule_key": "hot"}
    period = {"id": 5, "device_id": "d", "reason": "repairs", "set_by": "op:ann"}
    return {
        EventType.ALARM_CREATED: created(),
        EventType.ALARM_SUPERSEDED: changed("SUPERSEDED", "supersede", "NEW"),
        EventType.ALARM_STATUS_CHANGED: changed("CLOSED"),
        EventType.ALARM_WOKEN: changed("NEW", "wake", "DELAYED"),
        EventType.ALARM_ESCALATED: changed("ESCALATED", "escalate", "CONFIRMED"),
        EventType.ALARM_REMINDER: AlarmReminder(alarm=snapshot(status="CONFIRMED")),
        EventType.ALARM_CLEARED: AlarmCleared(
            alarm_id=7,
            device_id="d",
            rule_key="hot",
            status="PUSHED",
            clear_event_id="c" * 64,
            reason="temp <= 90",
            cleared_at=AT.isoformat(),
            trigger=None,
            rule_description=None,
        ),
        EventType.COMMAND_FINISHED: command("ACKED"),
        EventType.CAMPAIGN_CREATED: CampaignCreated(campaign=campaign, actor="ops"),
        EventType.CAMPAIGN_COMPLETED: CampaignClosed(campaign=campaign, counts=counts, actor="x"),
        EventType.CAMPAIGN_ABORTED: CampaignClosed(campaign=campaign, counts=counts, actor="x"),
        EventType.CAMPAIGN_CANCELLED: CampaignClosed(campaign=campaign, counts=counts, actor="x"),
        EventType.AI_SUMMARY_SUCCEEDED: SummaryTaskFinished(task={"id": 1, "status": "DONE"}),
        EventType.AI_SUMMARY_FAILED: SummaryTaskFinished(task={"id": 1, "status": "FAILED"}),
        EventType.SHELF_STARTED: ShelfChanged(shelf=shelf, alarm_ids=[7, 9], actor="op:ann"),
        EventType.SHELF_ENDED: ShelfChanged(
            shelf={**shelf, "ended_by": "system:shelving", "end_reason": "expired"},
            alarm_ids=[7],
            actor="system:shelving",
        ),
        EventType.DEVICE_OUT_OF_SERVICE: DeviceServiceChanged(
            device_id="d", period=period, actor="op:ann"
        ),
        EventType.DEVICE_IN_SERVICE: DeviceServiceChanged(
            device_id="d", period={**period, "ended_by": "op:bob"}, actor="op:bob"
        ),
    }


async def assert_outbox_decodes(dsn: str) -> int:
    """Every event of the catalogue's types in the database's outbox decodes into its Struct,
    and encodes back to the same JSON (the Struct holds all of it); how many there were.
    Events of other types (a test's own ``test.e``) are left alone."""
    conn = await asyncpg.connect(dsn)
    try:
        if await conn.fetchval("SELECT to_regclass('outbox_event')") is None:
            return 0
        rows = await conn.fetch(
            "SELECT id, event_type, payload::text AS payload FROM outbox_event "
            "WHERE event_type = ANY($1::text[])",
            [event_type.value for event_type in EventType],
        )
    finally:
        await conn.close()
    for row in rows:
        try:
            event = decode_payload(row["event_type"], row["payload"])
        except msgspec.ValidationError as exc:
            raise AssertionError(
                f"outbox event {row['id']} ({row['event_type']}) is not of its schema: {exc}; "
                f"payload {row['payload']}"
            ) from exc
        written = msgspec.json.decode(row["payload"])
        assert msgspec.json.decode(msgspec.json.encode(event)) == written, row["event_type"]
    return len(rows)
