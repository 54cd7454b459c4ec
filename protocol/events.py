"""The catalogue of domain events: every outbox event type and the schema of its payload.

These are a public contract: the outbox publishes them to ``{prefix}/events/{aggregate}/{id}``,
the console's ``/stream`` carries them, and webhooks quote them. Each event type has one payload
Struct (`PAYLOADS`); writers build it, readers decode into it with `decode_payload`.

The payloads carry no field naming their type (the type is the outbox row's ``event_type``,
the envelope's ``event_type``), and ``alarm.cleared`` is flat where the other alarm events nest
``alarm``: a msgspec tag would add a field to the wire. So `decode_payload` picks the Struct by
the event type instead of by a tag.

The snapshots of rows the events carry (``alarm``, ``command``, ``campaign``, ``task``) are
documented in docs/topics-and-payloads.md; the alarm's is a Struct, the others are the rows as
the HTTP API returns them, whose columns this layer does not own.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Final, TypeAlias

import msgspec
from msgspec import field


class EventType(enum.StrEnum):
    """Every outbox event type the daemon writes."""

    ALARM_CREATED = "alarm.created"
    ALARM_SUPERSEDED = "alarm.superseded"
    ALARM_STATUS_CHANGED = "alarm.status_changed"
    ALARM_WOKEN = "alarm.woken"
    ALARM_ESCALATED = "alarm.escalated"
    ALARM_REMINDER = "alarm.reminder"
    ALARM_CLEARED = "alarm.cleared"
    COMMAND_FINISHED = "command.finished"
    CAMPAIGN_CREATED = "campaign.created"
    CAMPAIGN_COMPLETED = "campaign.completed"
    CAMPAIGN_ABORTED = "campaign.aborted"
    CAMPAIGN_CANCELLED = "campaign.cancelled"
    AI_SUMMARY_SUCCEEDED = "ai.summary_succeeded"
    AI_SUMMARY_FAILED = "ai.summary_failed"
    SHELF_STARTED = "shelf.started"
    SHELF_ENDED = "shelf.ended"
    DEVICE_OUT_OF_SERVICE = "device.out_of_service"
    DEVICE_IN_SERVICE = "device.in_service"


class Aggregate(enum.StrEnum):
    """The ``aggregate_type`` of an event: the ``{aggregate}`` level of its topic."""

    ALARM = "alarm"
    COMMAND = "command"
    CAMPAIGN = "campaign"
    SHELF = "shelf"
    DEVICE = "device"


class AlarmSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The alarm as it is after the change: every column, as ``GET /alarms/{id}`` returns it.
    The domain's alarm is this, with enums for its severity and status."""

    id: int
    device_id: str
    rule_key: str
    severity: str
    status: str
    telemetry_event_id: str
    dedup_key: str
    active_key: str | None  # None once released
    triggered_at: datetime
    pushed_at: datetime | None = None
    delayed_at: datetime | None = None
    woken_at: datetime | None = None
    confirmed_at: datetime | None = None
    confirmed_by: str | None = None
    escalated_at: datetime | None = None
    handled_at: datetime | None = None
    handled_by: str | None = None
    closed_at: datetime | None = None
    closed_by: str | None = None
    false_at: datetime | None = None
    false_by: str | None = None
    superseded_at: datetime | None = None
    superseded_by: int | None = None
    cleared_at: datetime | None = None
    clear_event_id: str | None = None
    last_notified_at: datetime | None = None  # reminders: no state change
    # Why it fired, kept from its creation (null for alarms created before it was kept): a
    # threshold rule's {metric, op, threshold, value, sample_ts}, an event rule's {event,
    # sample_ts}, an inactivity rule's {silent_since, inactivity_rules}; and its rule's
    # description.
    trigger: dict[str, Any] | None = None
    rule_description: str | None = None


class AlarmChanged(msgspec.Struct, frozen=True, kw_only=True):
    """``alarm.status_changed``, ``alarm.superseded``, ``alarm.woken``, ``alarm.escalated``:
    the alarm after the step, the step (``action``), who took it, from which status."""

    alarm: AlarmSnapshot
    action: str
    actor: str
    from_: str | None = field(name="from")


class AlarmCreated(AlarmChanged, frozen=True, kw_only=True, omit_defaults=True):
    """``alarm.created``: `AlarmChanged`'s fields (``from`` is null), why the rule fired, the
    alarm it superseded; ``late`` (only when true) for an alarm created superseded already."""

    reason: str
    supersedes: int | None
    late: bool = False


class AlarmReminder(msgspec.Struct, frozen=True, kw_only=True):
    """``alarm.reminder``: the alarm, still open, reminded of (no status change)."""

    alarm: AlarmSnapshot


class AlarmCleared(msgspec.Struct, frozen=True, kw_only=True):
    """``alarm.cleared``, flat: the condition recovered (never a status change)."""

    alarm_id: int
    device_id: str
    rule_key: str
    status: str
    clear_event_id: str
    reason: str
    cleared_at: str  # ISO 8601, as PostgreSQL's timestamptz gives it (``+00:00``)
    # Written always; null when absent: an event of a release before they were (a rolling
    # upgrade's older node, or its events not yet read) is read too, not refused.
    trigger: dict[str, Any] | None = None
    rule_description: str | None = None


class CommandFinished(msgspec.Struct, frozen=True, kw_only=True):
    """``command.finished``: a command reached ACKED, FAILED, TIMEOUT or CANCELLED."""

    command: dict[str, Any]  # the command row, as ``GET /commands/{id}`` returns it
    actor: str


class CampaignCreated(msgspec.Struct, frozen=True, kw_only=True):
    """``campaign.created``."""

    campaign: dict[str, Any]  # the campaign row without its device list, with ``total``
    actor: str


class CampaignClosed(msgspec.Struct, frozen=True, kw_only=True):
    """``campaign.completed``, ``campaign.aborted``, ``campaign.cancelled``."""

    campaign: dict[str, Any]  # as in `CampaignCreated`
    counts: dict[str, int]  # every command status with its count
    actor: str


class SummaryTaskFinished(msgspec.Struct, frozen=True, kw_only=True):
    """``ai.summary_succeeded``, ``ai.summary_failed``: an alarm's AI summary task."""

    task: dict[str, Any]  # the task row, without its prompt and response


class ShelfChanged(msgspec.Struct, frozen=True, kw_only=True):
    """``shelf.started``, ``shelf.ended``: a shelf made, or ended (lifted by a person, expired
    at its until, or renewed by a new shelf of the same target), and the alarms it covers at
    that step (the shelved alarm, or the pair's open alarms). Not notifications: they tell
    consoles and integrations what the desk shows (shelved alarms leave the default view)."""

    shelf: dict[str, Any]  # the shelf as ``GET /shelves/{id}`` returns it
    alarm_ids: list[int]
    actor: str


class DeviceServiceChanged(msgspec.Struct, frozen=True, kw_only=True):
    """``device.out_of_service``, ``device.in_service``: a device's maintenance period put in
    force (replacing any in force) or ended by a person."""

    device_id: str
    period: dict[str, Any]  # the period as ``GET /devices/{id}`` shows it (``out_of_service``)
    actor: str


EventPayload: TypeAlias = (
    AlarmCreated
    | AlarmChanged
    | AlarmReminder
    | AlarmCleared
    | CommandFinished
    | CampaignCreated
    | CampaignClosed
    | SummaryTaskFinished
    | ShelfChanged
    | DeviceServiceChanged
)

# The payload Struct of each event type.
PAYLOADS: Final[dict[EventType, type[EventPayload]]] = {
    EventType.ALARM_CREATED: AlarmCreated,
    EventType.ALARM_SUPERSEDED: AlarmChanged,
    EventType.ALARM_STATUS_CHANGED: AlarmChanged,
    EventType.ALARM_WOKEN: AlarmChanged,
    EventType.ALARM_ESCALATED: AlarmChanged,
    EventType.ALARM_REMINDER: AlarmReminder,
    EventType.ALARM_CLEARED: AlarmCleared,
    EventType.COMMAND_FINISHED: CommandFinished,
    EventType.CAMPAIGN_CREATED: CampaignCreated,
    EventType.CAMPAIGN_COMPLETED: CampaignClosed,
    EventType.CAMPAIGN_ABORTED: CampaignClosed,
    EventType.CAMPAIGN_CANCELLED: CampaignClosed,
    EventType.AI_SUMMARY_SUCCEEDED: SummaryTaskFinished,
    EventType.AI_SUMMARY_FAILED: SummaryTaskFinished,
    EventType.SHELF_STARTED: ShelfChanged,
    EventType.SHELF_ENDED: ShelfChanged,
    EventType.DEVICE_OUT_OF_SERVICE: DeviceServiceChanged,
    EventType.DEVICE_IN_SERVICE: DeviceServiceChanged,
}

_DECODERS: Final[dict[EventType, msgspec.json.Decoder[Any]]] = {
    event_type: msgspec.json.Decoder(payload) for event_type, payload in PAYLOADS.items()
}


def decode_payload(event_type: str, payload: str | bytes) -> EventPayload:
    """The payload of an event of ``event_type``, as its Struct. `ValueError` for a type not
    in the catalogue; `msgspec.ValidationError` for a payload not of its type's schema."""
    decoded: EventPayload = _DECODERS[EventType(event_type)].decode(payload)
    return decoded
