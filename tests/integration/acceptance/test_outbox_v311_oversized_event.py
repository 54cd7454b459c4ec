"""An outbox event over the broker's packet limit on MQTT 3.1.1, with no `[mqtt]
max_packet_size` set: mosquitto's `max_packet_size` closes the connection, without a word (3.1.1
has no reason codes). The event was released as if the broker had gone away by chance, due
again at once, and dropped the connection again at every reconnect, for ever (and that of any
other node that took it): ingest, downlinks and the node's presence with it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from gateway.runtime.daemon import Daemon
from protocol.events import Aggregate, CommandFinished, EventType
from storage import outbox
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

LIMIT = 4096
# gateway.outbox.publisher.IN_DOUBT_LIMIT: the connections such an event may end.
IN_DOUBT_LIMIT = 3


@pytest.fixture
def closing_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path / "mosquitto", extra_config=f"max_packet_size {LIMIT}\n")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def _connections(daemon: Daemon) -> int:
    assert daemon.session is not None
    return daemon.session.connections


async def _finished(db: asyncpg.Connection, command_id: int, blob: str) -> None:
    """A ``command.finished`` event, as a command's end writes it (the command carries its
    params: a large one makes the event large)."""
    async with db.transaction():
        await outbox.add_event(
            db,
            aggregate_type=Aggregate.COMMAND,
            aggregate_id=str(command_id),
            event_type=EventType.COMMAND_FINISHED,
            payload=CommandFinished(
                command={"id": command_id, "name": "set", "params": {"blob": blob}},
                actor="device",
            ),
        )


async def _status(db: asyncpg.Connection, command_id: int) -> str:
    return str(
        await db.fetchval(
            "SELECT status FROM outbox_event WHERE aggregate_id = $1", str(command_id)
        )
    )


async def test_an_event_the_broker_hangs_up_on_is_dead_after_a_few_connections_not_a_loop(
    db_dsn: str, db: asyncpg.Connection, closing_broker: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=closing_broker.port, protocol="3.1.1")
    async with running_daemon(config) as daemon:
        await _finished(db, 1, "x" * (2 * LIMIT))

        async def given_up() -> bool:
            # Before: PENDING for ever, retry_count 0, a new connection every second or so.
            row = await db.fetchrow("SELECT status, retry_count, last_error FROM outbox_event")
            connections = _connections(daemon)
            assert connections <= IN_DOUBT_LIMIT + 1, f"{connections} connections, {dict(row)}"
            return bool(row["status"] == "DEAD")

        await wait_until(given_up, timeout=60, message="the oversized event DEAD")
        row = await db.fetchrow(
            "SELECT retry_count, in_doubt_count, last_error, published_at FROM outbox_event"
        )
        assert row["published_at"] is None
        assert row["retry_count"] == 0
        assert row["last_error"].startswith("CONNECTION_CLOSED: ")
        assert "maximum packet size" in row["last_error"]

        # The connection it ended the last time is made again, once.
        async def back() -> bool:
            assert daemon.session is not None
            return daemon.session.connected and _connections(daemon) == IN_DOUBT_LIMIT + 1

        await wait_until(back, timeout=30, message="connected again")
        dropped = _connections(daemon)

        # What fits still goes out, and on the connection now up.
        await _finished(db, 2, "small")

        async def published() -> bool:
            return await _status(db, 2) == "PUBLISHED"

        await wait_until(published, timeout=30, message="the small event PUBLISHED")
        assert _connections(daemon) == dropped
