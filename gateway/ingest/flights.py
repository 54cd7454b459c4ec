"""Which messages of a batch may be stored beside the transactions already in flight.

The writer keeps up to ``[ingest] transactions_in_flight`` transactions open at once, so that
one batch's rule evaluation and statements overlap another's instead of queueing behind
them (on two cores the gateway and PostgreSQL otherwise take turns). What must not change
is the order per device: a device's messages are stored in the order the broker delivered
them, as with one transaction at a time. So a transaction only starts beside others that
hold none of its devices; a message of a device already in flight waits, with everything
of that device behind it, and is planned again once something lands. Acknowledgements stay
in delivery order whatever order the transactions commit in (the writer's sequencer).

A message keeps order with its device as the topic names it: the gateway's own topics, a
mapping's topic wildcards, or for Sparkplug B the edge node (whose state is judged with its
own and all its devices' messages). What cannot be placed from the topic alone is a
*barrier*: a vendor mapping that names the device from the payload (``device_path``). A
barrier waits until nothing is in flight, and nothing starts beside it: those messages are
stored exactly as with one transaction at a time.

Plain functions over what the writer holds, so the rules are tested without a database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Flight(Generic[T]):
    """Messages stored in one transaction, and the devices they hold (None: a barrier)."""

    items: list[T]
    keys: frozenset[str] | None
    started_at: float = 0.0
    task: asyncio.Task[None] | None = field(default=None)


def plan(
    items: Sequence[T],
    key: Callable[[T], str | None],
    in_flight: Sequence[Flight[T]],
) -> tuple[Flight[T] | None, list[T]]:
    """``(flight, waiting)``: what of ``items`` (in delivery order) starts now beside
    ``in_flight``, and what waits, still in delivery order.

    ``key(item)`` is the device an item must stay in order with, ``""`` for none, None for a
    barrier. With nothing in flight everything starts, as one flight (a barrier among them
    makes it one). Beside other flights: an item whose device is in flight waits, and so
    does every later item of that device; a barrier and everything after it waits; the rest
    start together."""
    if not items:
        return None, []
    if not in_flight:
        return _alone(items, key), []
    busy: set[str] = set()
    for flight in in_flight:
        if flight.keys is None:
            return None, list(items)
        busy |= flight.keys
    going: list[T] = []
    waiting: list[T] = []
    going_keys: set[str] = set()
    for index, item in enumerate(items):
        k = key(item)
        if k is None:
            waiting.extend(items[index:])
            break
        if k and k in busy:
            waiting.append(item)
        else:
            going.append(item)
            if k:
                going_keys.add(k)
    if not going:
        return None, waiting
    return Flight(going, frozenset(going_keys)), waiting


def _alone(items: Sequence[T], key: Callable[[T], str | None]) -> Flight[T]:
    """Every item as one flight, nothing else in flight: a barrier if any item is one."""
    keys: set[str] = set()
    for item in items:
        k = key(item)
        if k is None:
            return Flight(list(items), None)
        if k:
            keys.add(k)
    return Flight(list(items), frozenset(keys))
