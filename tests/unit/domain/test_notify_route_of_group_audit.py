"""A group's repeat lists only the alarms the route it repeats for now still sends its
receiver (gateway.domain.notify.reminding_route, as gateway.notify.groups uses it): the
route's matchers and events, and its place among the routes."""

from __future__ import annotations

from gateway.domain.notify import compile_notify, reminding_route
from tests.unit.domain.test_notify_domain import _notify

_COLD_BY_DEVICE = """
[[notify.routes]]
events = ["alarm.created"]
rules = ["cold"]
devices = "care-*"
severities = ["MAJOR"]
receivers = ["a"]
group_by = ["device"]
repeat_interval_s = 3600
"""

_BODY = {"event": "alarm.created", "rule_key": "cold", "device_id": "care-1", "severity": "MAJOR"}


def test_a_repeat_keeps_only_the_notifications_its_route_sends_the_receiver() -> None:
    [route] = compile_notify(_notify(_COLD_BY_DEVICE)).routes
    routes = [route]
    assert reminding_route(routes, "a", _BODY) is route
    assert reminding_route(routes, "a", {**_BODY, "rule_key": "hot"}) is None
    assert reminding_route(routes, "a", {**_BODY, "device_id": "plant-1"}) is None
    assert reminding_route(routes, "a", {**_BODY, "severity": "MINOR"}) is None
    assert reminding_route(routes, "a", {**_BODY, "event": "alarm.cleared"}) is None


def test_a_route_ahead_that_matches_without_continue_takes_the_receivers_notification() -> None:
    ahead = '[[notify.routes]]\nevents = ["alarm.created"]\nreceivers = ["b"]\n'
    routes = compile_notify(_notify(ahead + _COLD_BY_DEVICE)).routes
    assert reminding_route(routes, "a", _BODY) is None
    with_continue = ahead + "continue = true\n"
    routes = compile_notify(_notify(with_continue + _COLD_BY_DEVICE)).routes
    assert reminding_route(routes, "a", _BODY) is routes[1]
    # A route ahead for another rule leaves the group's alarms to it.
    other = ahead.replace("receivers", 'rules = ["hot"]\nreceivers')
    routes = compile_notify(_notify(other + _COLD_BY_DEVICE)).routes
    assert reminding_route(routes, "a", _BODY) is routes[1]
