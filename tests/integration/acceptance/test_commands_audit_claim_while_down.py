"""The dispatcher claims nothing while the node's broker session is down, even a pass that
looked at the session before it had to wait.

A dispatcher pass asks the session first, then waits for one of its ``PIPELINE`` slots (every
one held by a batch waiting for its PUBACKs) and for a pooled database connection, then
claims. The session could go down during either wait: the pass then claimed a batch for a
broker it could not reach, released it unpublished at once (``broker session down: not
published, not a reclaim``: one more CLAIMED → PENDING audit pair per command, its generation
spent) and meanwhile held commands another node of the ``$share`` group could have sent.

Both waits are forced deterministically with a real mosquitto behind a TCP proxy and the real
daemon: the slots are held by four downlinks whose PUBACKs the proxy drops, the pool by the
test taking every connection of it; the link is then cut while the pass waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from gateway.commands.dispatcher import PIPELINE, Dispatcher
from gateway.domain.command import Delivery
from gateway.runtime.daemon import Daemon
from storage import commands as repo
from storage.commands import CommandRow
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon, session_down, session_up
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

# One command a claim: each of the first PIPELINE commands takes a slot of its own.
COMMANDS = "[commands]\nlease_s = 30\ndispatch_batch = 1\nreaper_interval_s = 0.2\n"


class WatchedSlots(asyncio.Semaphore):
    """The dispatcher's slots, counted: how many are held, and passes waiting for one."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.held = 0
        self.acquired = 0
        self.waiting = 0
        self.waited = 0  # acquires that had to wait
        # Claim statements the dispatcher started (see ``watched``): a pass that holds a slot
        # and has started none is still before its claim.
        self.claims = 0

    async def acquire(self) -> bool:
        if self.locked():
            self.waiting += 1
            try:
                await super().acquire()
            finally:
                self.waiting -= 1
            self.waited += 1
        else:
            await super().acquire()
        self.held += 1
        self.acquired += 1
        return True

    def release(self) -> None:
        self.held -= 1
        super().release()


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[WatchedSlots]:
    """Every dispatcher built from now on gets counted slots (its first pass included), and
    its claim statements are counted on them."""
    slots: list[WatchedSlots] = []
    original: Callable[..., None] = Dispatcher.__init__
    claim_due = repo.claim_due

    def init(self: Dispatcher, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._slots = WatchedSlots(PIPELINE)
        slots.append(self._slots)

    async def counted(*args: Any, **kwargs: Any) -> list[CommandRow]:
        for watched_slots in slots:
            watched_slots.claims += 1
        return await claim_due(*args, **kwargs)

    monkeypatch.setattr(Dispatcher, "__init__", init)
    monkeypatch.setattr(repo, "claim_due", counted)
    return slots


async def _create(db: asyncpg.Connection, device: str) -> int:
    created = await new_command(
        db, device_id=device, name="open_valve", params={"valve": 1},
        delivery=Delivery.DEFERRABLE, idempotency_key=None, actor="test", node_id="test",
        expire_after_s=3600,
    )  # fmt: skip
    return int(created.command.id)


async def _trail(db: asyncpg.Connection, command_id: int) -> list[tuple[Any, ...]]:
    return [
        tuple(r)
        for r in await db.fetch(
            "SELECT action, from_status, to_status, claim_generation, note"
            " FROM command_audit WHERE command_id = $1 ORDER BY id",
            command_id,
        )
    ]


async def _status(db: asyncpg.Connection, command_id: int) -> tuple[str, int]:
    row = await db.fetchrow(
        "SELECT status, claim_generation FROM command WHERE id = $1", command_id
    )
    return row["status"], row["claim_generation"]


async def _sent_once_after_the_reconnect(
    db: asyncpg.Connection, proxy: TcpProxy, daemon: Daemon, command_id: int
) -> None:
    """The link back: the reconnect wakes the dispatcher, which claims and sends the command
    once; its whole trail is that one claim."""
    proxy.from_client = None
    await proxy.resume()
    await wait_until(lambda: session_up(daemon), timeout=30, message="session back")

    async def sent() -> bool:
        return (await _status(db, command_id))[0] == "SENT"

    await wait_until(sent, timeout=30, message="the command sent after the reconnect")
    trail = await _trail(db, command_id)
    assert [t[:4] for t in trail] == [
        ("create", None, "PENDING", 0),
        ("claim", "PENDING", "CLAIMED", 1),
        ("sent", "CLAIMED", "SENT", 1),
    ], trail


async def test_a_pass_that_waited_for_a_slot_claims_nothing_once_the_session_went_down(
    db_dsn: str, mosquitto: Mosquitto, watched: list[WatchedSlots]
) -> None:
    """Every slot held by a batch waiting for its PUBACK, the next pass waits for one. The
    link dies: the batches end in doubt and free their slots, and the waiting pass must not
    claim the fifth command for a session that is down."""
    db = await asyncpg.connect(db_dsn)
    try:
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            config = make_config(dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=COMMANDS)
            async with running_daemon(config) as daemon:
                (slots,) = watched
                # Nothing the gateway writes reaches the broker from now on: no PUBACK comes.
                proxy.from_client = lambda _data: False
                async with db.transaction():
                    ids = [await _create(db, f"valve-{n}") for n in range(PIPELINE + 1)]

                async def held() -> bool:
                    claimed = await db.fetchval(
                        "SELECT count(*) FROM command WHERE status = 'CLAIMED'"
                    )
                    return claimed == PIPELINE and slots.waiting == 1

                await wait_until(
                    held, timeout=30, message="every slot held, the next pass waiting for one"
                )
                waiting = await db.fetchval(
                    "SELECT id FROM command WHERE status = 'PENDING' AND id = ANY($1)", ids
                )
                await proxy.cut()
                await wait_until(lambda: session_down(daemon), timeout=30, message="session down")
                # The batches ended (in doubt), the waiting pass had its slot, and it is over.
                await wait_until(
                    lambda: slots.waited == 1 and slots.waiting == 0 and slots.held == 0,
                    timeout=30, message="every slot free again",
                )  # fmt: skip
                trail = await _trail(db, waiting)
                assert await _status(db, waiting) == ("PENDING", 0), (
                    f"claimed while the session was down: {trail}"
                )
                await _sent_once_after_the_reconnect(db, proxy, daemon, waiting)
    finally:
        await db.close()


async def test_a_pass_that_waited_for_a_connection_claims_nothing_once_the_session_went_down(
    db_dsn: str, mosquitto: Mosquitto, watched: list[WatchedSlots]
) -> None:
    """The node's pool all in use (the test holds every connection), a pass that found the
    session up waits for one. The link dies meanwhile: once a connection is free, the pass
    must not claim for a session that is down."""
    db = await asyncpg.connect(db_dsn)
    try:
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            config = make_config(dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=COMMANDS)
            async with running_daemon(config) as daemon:
                (slots,) = watched
                pool = daemon.pool
                assert pool is not None
                async with contextlib.AsyncExitStack() as taken:
                    for _ in range(pool.get_max_size()):
                        await taken.enter_async_context(pool.acquire())
                    command_id = await _create(db, "valve-1")
                    # A pass (woken by the command's NOTIFY, or its poll) found the session
                    # up, took a slot, and has not started its claim: it waits for a
                    # connection, and goes on waiting while the test holds them all.
                    await wait_until(
                        lambda: slots.held == 1 and slots.acquired == slots.claims + 1,
                        timeout=30, message="a pass waiting for a connection",
                    )  # fmt: skip
                    await proxy.cut()
                    await wait_until(
                        lambda: session_down(daemon), timeout=30, message="session down"
                    )
                # The pool free again: the waiting pass goes on, and is over.
                await wait_until(
                    lambda: slots.held == 0, timeout=30, message="the waiting pass over"
                )
                trail = await _trail(db, command_id)
                assert await _status(db, command_id) == ("PENDING", 0), (
                    f"claimed while the session was down: {trail}"
                )
                await _sent_once_after_the_reconnect(db, proxy, daemon, command_id)
    finally:
        await db.close()
