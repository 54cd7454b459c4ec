"""The delivery latency is measured on the database's clock, not on the sending node's.

`gateway_notify_delivery_seconds` (docs/notifications.md, Metrics) is what a team alerts on
when notifications get slow: from the event's creation (stamped by the database) to the
receiver's acceptance. The node that sent it measured the acceptance on its own clock: one of
three nodes 10 minutes ahead (its NTP broken) put every delivery it sent at 600 s, in the top
buckets, and the alert fired for notifications that took a second; one behind put them at 0.
Real PostgreSQL and a real HTTP receiver; the node's wall clock, as the worker reads it
(``datetime.now``), is set ahead, the database's is not."""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg
import pytest

import gateway.notify.worker
from tests.integration.services.test_notify import (
    Notifier,
    _config,
    _drain,
    _event,
    _route,
    _status_is,
    _webhook,
)
from tests.support.receivers import webhook_server
from tests.support.waiting import wait_until

AHEAD = timedelta(minutes=10)


class _NodeClock(datetime):
    """The node's wall clock, 10 minutes ahead of the database's and the world's."""

    @classmethod
    def now(cls, tz=None):  # type: ignore[no-untyped-def,override]  # datetime's signature
        return datetime.now(tz) + AHEAD


async def test_a_node_whose_clock_is_ahead_measures_a_prompt_delivery_as_prompt(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway.notify.worker, "datetime", _NodeClock, raising=False)
    async with webhook_server() as server:
        config = _config(_webhook("hook", server.url("/hook")), _route(["hook"]))
        node = Notifier(pool, db_dsn, config)
        await _event(db, 1)
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT"), message="delivery SENT")
    [family] = node.metrics.latency.collect()
    observed = {
        sample.name.removeprefix(family.name): sample.value
        for sample in family.samples
        if sample.labels.get("receiver") == "hook" and "le" not in sample.labels
    }
    assert observed["_count"] == 1
    assert observed["_sum"] < 60, f"observed {observed['_sum']:.1f} s for one prompt delivery"
