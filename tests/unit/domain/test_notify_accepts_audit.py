"""Whether a receiver is still reminded of a group member's alarm by some grouping route
(gateway.domain.notify.reminding_route): the route choosing the receiver now, wherever it
stands."""

from __future__ import annotations

from gateway.domain.notify import compile_notify, reminding_route
from tests.unit.domain.test_notify_domain import _notify

_ROUTES = """
[[notify.routes]]
rules = ["cold"]
receivers = ["a"]
group_by = ["device"]

[[notify.routes]]
rules = ["hot"]
receivers = ["a"]
group_by = ["device"]
repeat_interval_s = 3600

[[notify.routes]]
rules = ["warm"]
receivers = ["a"]

[[notify.routes]]
rules = ["dull"]
receivers = ["a"]
group_by = ["device"]
repeat_interval_s = 0
"""


def _body(rule: str) -> dict[str, object]:
    return {"event": "alarm.created", "rule_key": rule, "device_id": "d-1", "severity": "MAJOR"}


def test_reminding_route_by_the_grouping_route_that_sends_it_now() -> None:
    routes = compile_notify(_notify(_ROUTES)).routes
    assert reminding_route(routes, "a", _body("hot")) is routes[1]  # moved: still grouped
    assert reminding_route(routes, "b", _body("hot")) is None  # not this receiver's
    assert reminding_route(routes, "a", _body("warm")) is None  # its route does not group
    assert reminding_route(routes, "a", _body("dull")) is None  # its route does not repeat
    assert reminding_route(routes, "a", _body("gone")) is None  # no route sends it
