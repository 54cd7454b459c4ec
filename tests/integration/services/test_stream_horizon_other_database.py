"""A transaction open in another database of the same PostgreSQL server holds no console stream
back. The stream sends an event once every transaction that could have written an earlier one
has ended (its horizon). That horizon was the server's oldest running transaction: one write
left open anywhere on the server (another application's, a long migration, a psql session in
another database) stopped every console's live updates until it ended; new alarms were shown
to nobody. Only this database's transactions can write its events; they still hold it back."""

from __future__ import annotations

import asyncpg
import pytest

from gateway.api.stream import StreamHub
from storage import console as repo
from tests.integration.services.test_stream_hub import _Body, _cursor, _events, _passes_until
from tests.support.dsn import with_database

pytestmark = pytest.mark.synthetic_events


async def test_a_write_open_in_another_database_holds_no_stream_back_and_one_here_does(
    pool: asyncpg.Pool, db_dsn: str, pg_server_dsn: str
) -> None:
    hub = StreamHub(pool, db_dsn, node_id="node-a")
    assert await hub.run_once() == 0  # the first pass finds the head
    watcher = _Body(hub, None)
    assert await watcher.next() is None  # live

    elsewhere = await asyncpg.connect(with_database(pg_server_dsn, "postgres"))
    here = await asyncpg.connect(db_dsn)
    try:
        other = elsewhere.transaction()
        await other.start()
        await elsewhere.fetchval("SELECT pg_current_xact_id()")  # a write's xid, left open
        await _events(pool, ["after-the-other-database-opened"])
        await _passes_until(hub, 1)
        event = await watcher.event()
        assert event.data["aggregate_id"] == "after-the-other-database-opened"
        assert await repo.stream_tail(pool) == _cursor(event)

        # A transaction of this database still running may yet write an event below the
        # ones committed after it: those wait for it.
        mine = here.transaction()
        await mine.start()
        await here.fetchval("SELECT pg_current_xact_id()")
        await _events(pool, ["after-this-database-opened"])
        assert await hub.run_once() == 0
        assert await repo.stream_tail(pool) == _cursor(event)
        await mine.rollback()
        await _passes_until(hub, 1)
        assert (await watcher.event()).data["aggregate_id"] == "after-this-database-opened"
        await other.rollback()
    finally:
        await here.close()
        await elsewhere.close()
