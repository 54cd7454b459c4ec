"""Whether a receiver is still reminded of a group member's alarm by some grouping route
(gateway.domain.notify.still_reminded): the route choosing the receiver now, wherever it
stands."""

from __future__ import annotations

from gateway.domain.notify import compile_notify, still_reminded
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


def test_still_reminded_by_the_grouping_route_that_sends_it_now() -> None:
    routes = compile_notify(_notify(_ROUTES)).routes
    assert still_reminded(routes, "a", _body("hot"))  # moved to place 1: still grouped
    assert not still_reminded(routes, "b", _body("hot"))  # not this receiver's
    assert not still_reminded(routes, "a", _body("warm"))  # its route does not group
    assert not still_reminded(routes, "a", _body("dull"))  # its route does not repeat
    assert not still_reminded(routes, "a", _body("gone"))  # no route sends it
