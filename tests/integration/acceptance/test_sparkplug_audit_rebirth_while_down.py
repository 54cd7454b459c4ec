"""The rebirth loop takes no request while the node's broker session is down, even a pass that
looked at the session before it had to wait.

A rebirth pass asks the session (inside its connection), then ends the births of edge nodes
whose devices were not born again (``end_births``: their devices set offline, which waits for
those devices' rows when a batch or a person holds them), then takes the due requests, marking
them sent (``rebirth_sent_at``, ``rebirth_requests + 1``), and publishes. The session could go
down while the births were ended: the pass then took the requests for a broker it could not
reach, every NCMD raised ``SessionDown``, and each request, counted and marked sent, was not
asked again for ``[sparkplug] rebirth_retry_s`` (30 s) after the session came back: an edge
node whose stream the host could not follow stayed untrusted that long (its data stored, not
judged by the rules), instead of being asked at the next pass.

Forced deterministically with a real mosquitto behind a TCP proxy, the real daemon and real
PostgreSQL: the test holds the row of a device whose births the pass ends, cuts the link while
the pass waits for it, then lets it go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiomqtt
import asyncpg
import pytest

from gateway.sparkplug.rebirth import RebirthRequester
from storage import ingest as ingest_repo
from storage import sparkplug as sparkplug_repo
from tests.support.daemon import make_config, running_daemon, session_down, session_up
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

SPARKPLUG = (
    '[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["G"]\ninterval_s = 0.2\n'
    "rebirth_retry_s = 30\n"
)
NCMD = "spBv1.0/G/NCMD/E1"


class Passes:
    """The node's rebirth passes, counted: begun, over; births ended begun and over; and the
    requests' takes started."""

    def __init__(self) -> None:
        self.begun = 0
        self.over = 0
        self.ending = 0
        self.ended = 0
        self.takes = 0


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Passes:
    counted = Passes()
    run_once: Callable[[RebirthRequester], Any] = RebirthRequester.run_once
    end_births: Callable[[RebirthRequester, asyncpg.Connection], Any] = RebirthRequester.end_births
    take_rebirths = sparkplug_repo.take_rebirths

    async def counted_pass(self: RebirthRequester) -> list[tuple[str, str]]:
        counted.begun += 1
        try:
            return list(await run_once(self))
        finally:
            counted.over += 1

    async def counted_end(self: RebirthRequester, conn: asyncpg.Connection) -> list[str]:
        counted.ending += 1
        try:
            return list(await end_births(self, conn))
        finally:
            counted.ended += 1

    async def counted_take(*args: Any, **kwargs: Any) -> Any:
        counted.takes += 1
        return await take_rebirths(*args, **kwargs)

    monkeypatch.setattr(RebirthRequester, "run_once", counted_pass)
    monkeypatch.setattr(RebirthRequester, "end_births", counted_end)
    monkeypatch.setattr(sparkplug_repo, "take_rebirths", counted_take)
    return counted


async def _request(db: asyncpg.Connection) -> tuple[Any, ...]:
    row = await db.fetchrow(
        "SELECT rebirth_requests, rebirth_sent_at IS NOT NULL FROM sparkplug_node"
        " WHERE group_id = 'G' AND edge_node_id = 'E1'"
    )
    assert row is not None
    return tuple(row)


async def test_a_pass_that_waited_while_ending_births_takes_no_request_once_the_session_went_down(
    db_dsn: str, mosquitto: Mosquitto, passes: Passes
) -> None:
    db = await asyncpg.connect(db_dsn)
    holder = await asyncpg.connect(db_dsn)
    asked: list[str] = []
    try:
        async with (
            aiomqtt.Client("127.0.0.1", mosquitto.port, identifier="edge-e1") as edge,
            TcpProxy("127.0.0.1", mosquitto.port) as proxy,
        ):
            await edge.subscribe(NCMD, qos=0)

            async def listen() -> None:
                async for message in edge.messages:
                    asked.append(str(message.topic))

            listening = asyncio.create_task(listen())
            config = make_config(
                dsn=db_dsn, mqtt_port=proxy.port, node_id="node-a", extra=SPARKPLUG
            )
            async with running_daemon(config) as daemon:
                # A device of edge node E2, whose row the test holds from now on.
                await ingest_repo.record_presence(db, {"G/E2/d1": "online"})
                await holder.execute(
                    "BEGIN; SELECT 1 FROM device WHERE device_id = 'G/E2/d1' FOR UPDATE"
                )
                # E1's stream could not be followed: a rebirth wanted. E2 was born again a
                # minute ago without d1: its births are over, d1 is to be set offline.
                async with db.transaction():
                    await db.execute(
                        "INSERT INTO sparkplug_node (group_id, edge_node_id, born,"
                        " rebirth_reason, rebirth_wanted_at) VALUES ('G', 'E1', true,"
                        " 'seq gap', now())"
                    )
                    await db.execute(
                        "INSERT INTO sparkplug_node (group_id, edge_node_id, born, unborn,"
                        " born_at) VALUES ('G', 'E2', true, '{d1}', now() - interval '1 min')"
                    )
                takes = passes.takes
                # A pass found the session up and waits for d1's row, ending E2's births,
                # before it takes E1's request.
                await wait_until(
                    lambda: passes.ending == passes.ended + 1 and passes.takes == takes,
                    timeout=30, message="a pass waiting while ending births",
                )  # fmt: skip
                waiting = passes.begun
                await proxy.cut()
                await wait_until(lambda: session_down(daemon), timeout=30, message="session down")
                await holder.execute("ROLLBACK")
                await wait_until(
                    lambda: passes.over >= waiting, timeout=30, message="the waiting pass over"
                )
                offline = await db.fetchval(
                    "SELECT presence FROM device WHERE device_id = 'G/E2/d1'"
                )
                assert offline == "offline"  # the births were ended
                assert await _request(db) == (0, False), (
                    "the rebirth request taken (counted, marked sent) while the session was down"
                )
                # The link back: the next pass asks E1 for its rebirth.
                await proxy.resume()
                await wait_until(lambda: session_up(daemon), timeout=30, message="session back")
                await wait_until(lambda: asked == [NCMD], timeout=10, message="E1 asked")
                assert await _request(db) == (1, True)
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
    finally:
        await holder.close()
        await db.close()
