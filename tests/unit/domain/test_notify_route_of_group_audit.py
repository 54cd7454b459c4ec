"""A group's repeat lists only the alarms the route it repeats for now accepts
(gateway.domain.notify.route_accepts)."""

from __future__ import annotations

from gateway.domain.notify import compile_notify, route_accepts
from tests.unit.domain.test_notify_domain import _notify

_COLD_BY_DEVICE = """
[[notify.routes]]
rules = ["cold"]
devices = "care-*"
severities = ["MAJOR"]
receivers = ["a"]
group_by = ["device"]
repeat_interval_s = 3600
"""


def test_a_repeat_keeps_only_the_notifications_its_route_accepts() -> None:
    [route] = compile_notify(_notify(_COLD_BY_DEVICE)).routes
    body = {"rule_key": "cold", "device_id": "care-1", "severity": "MAJOR"}
    assert route_accepts(route, body)
    assert not route_accepts(route, {**body, "rule_key": "hot"})
    assert not route_accepts(route, {**body, "device_id": "plant-1"})
    assert not route_accepts(route, {**body, "severity": "MINOR"})
    # A notification without the value (a command's, say) is not judged on it.
    assert route_accepts(route, {"rule_key": None, "device_id": "care-1"})
