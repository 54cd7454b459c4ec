"""Reading PostgreSQL plans (EXPLAIN (FORMAT JSON)) in tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``node`` and every node below it, depth first (subplans and init plans included)."""
    yield node
    for child in node.get("Plans", ()):
        yield from plan_nodes(child)
