"""The body of a grouped notification (docs/notifications.md, "Grouping"): what a webhook
receiver gets for one window of a route's group. A wire contract: receivers parse it.

Each entry of ``notifications`` is exactly the body an ungrouped delivery of that event would
send (``event_id``, ``event``, ``alarm_id``, ``device_id``, ``rule_key``, ``severity``,
``status``, ``times``, ``link``, ``occurred_at``, ``source_event``, ``payload``), oldest first.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

GROUP_SCHEMA_VERSION = 1


class GroupedNotification(Struct, frozen=True, kw_only=True):
    kind: Literal["group"] = "group"
    schema_version: int = GROUP_SCHEMA_VERSION
    event: Literal["notify.group"] = "notify.group"
    # The window's id: the same on every attempt (X-Gateway-Event-Id): deduplicate on it.
    event_id: str
    receiver: str
    # "routes[<index>]{label=value,...}": the route and the values of its group_by labels.
    group_key: str
    group: dict[str, str]
    # 1 for the group's first window, then 2, 3, ...
    window: int
    # True: a repeat (repeat_interval_s) of the group's alarms still open, each listed once
    # with its newest notification (docs/notifications.md, "Repeat").
    repeat: bool = False
    # The notifications listed (in a repeat: the alarms).
    count: int
    notifications: list[dict[str, Any]]
