"""The wheel installs the generic top-level names gateway, storage, protocol and sim
(docs/architecture.md, "Top-level names"): no other distribution in the environment may ship
one of them, or one would silently shadow the other."""

from __future__ import annotations

import importlib.metadata

import pytest

OURS = "mqtt-alarm-gateway"


@pytest.mark.parametrize("name", ["gateway", "storage", "protocol", "sim"])
def test_only_this_distribution_provides_the_name(name: str) -> None:
    providers = set(importlib.metadata.packages_distributions().get(name, []))
    assert providers == {OURS}, f"{name!r} is also installed by {sorted(providers - {OURS})}"
