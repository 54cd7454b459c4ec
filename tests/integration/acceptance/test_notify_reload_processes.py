"""Grouped reminders across a real SIGHUP: two gateway processes sharing the devices and the
notification work, their configuration files rewritten and each sent SIGHUP, as an operator
does. A route taken out stops reminding the receiver of its open alarm; put back, it reminds
again; a route left as it was keeps reminding all along (the control that each pass ran).

The reload's re-timing is tested pass by pass, two nodes in one process, in
tests/integration/services/test_notify_retime.py; this is the same path reached by the signal
in real daemons: the signal handler, the configuration read again, each node's consumer."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import aiomqtt
import asyncpg

from protocol import Topics
from sim.publisher import publish_many
from tests.integration.acceptance.test_process import _write_shared
from tests.support.daemon import DaemonProcess, http_healthy
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.receivers import WebhookServer, webhook_server
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
T0 = 1_767_225_600_000
RULES = (
    '[[rules]]\nkey = "door"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'
    '[[rules]]\nkey = "smoke"\nkind = "event"\nevent = "SMOKE"\nseverity = "MAJOR"\n'
)


def _route(rule: str) -> str:
    return f"""
[[notify.routes]]
events = ["alarm.created"]
rules = ["{rule}"]
receivers = ["hook"]
group_by = ["rule"]
group_wait_s = 0
group_interval_s = 300
repeat_interval_s = 3600
"""


def _notify(server: WebhookServer, routes: str) -> str:
    return f"""
[notify]
poll_s = 0.1
backoff_min_s = 0.05
backoff_max_s = 0.2
max_attempts = 20

[[notify.receivers]]
name = "hook"
kind = "webhook"
url = "{server.url("/hook")}"
{routes}"""


async def _windows(db: asyncpg.Connection, rule: str) -> list[asyncpg.Record]:
    """The rule's group windows (first, then repeats), oldest first."""
    return list(
        await db.fetch(
            "SELECT d.id, d.status, d.body FROM notify_delivery d "
            "WHERE d.event = 'notify.group' AND d.body -> 'group' ->> 'rule' = $1 ORDER BY d.id",
            rule,
        )
    )


async def _all_sent(db: asyncpg.Connection, rule: str, count: int) -> bool:
    windows = await _windows(db, rule)
    return len(windows) == count and all(w["status"] == "SENT" for w in windows)


async def _due_now(db: asyncpg.Connection) -> None:
    """repeat_interval_s has passed since every window was sent (as the clock would have it)."""
    await db.execute(
        "UPDATE notify_delivery SET finished_at = finished_at - interval '3601 s' "
        "WHERE event = 'notify.group'"
    )


async def _reload(processes: list[DaemonProcess]) -> None:
    before = [p.log_text().count("config_reloaded") for p in processes]
    for process in processes:
        process.signal(signal.SIGHUP)
    for process, seen in zip(processes, before, strict=True):

        def reloaded(process: DaemonProcess = process, seen: int = seen) -> bool:
            assert process.alive(), f"daemon exited:\n{process.log_tail()}"
            return process.log_text().count("config_reloaded") > seen

        await wait_until(reloaded, timeout=30, message="configuration reloaded")


async def test_a_route_taken_out_by_sighup_stops_reminding_and_put_back_reminds_again(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    ports = [free_port(), free_port()]
    paths = [tmp_path / f"node-{n}.toml" for n in range(2)]
    processes = [DaemonProcess(path, tmp_path / f"{path.stem}.log") for path in paths]
    async with webhook_server() as server:
        both = RULES + _notify(server, _route("door") + _route("smoke"))
        smoke_only = RULES + _notify(server, _route("smoke"))
        _write_shared(paths, ports, db_dsn, mosquitto, both)
        try:
            for process, port in zip(processes, ports, strict=True):
                process.start()

                async def healthy(process: DaemonProcess = process, port: int = port) -> bool:
                    assert process.alive(), f"daemon exited:\n{process.log_tail()}"
                    return await http_healthy(port)

                await wait_until(healthy, timeout=60, message="daemon healthy")
            events = [("door-1", "DOOR_OPEN"), ("smoke-1", "SMOKE")]
            messages = [
                (TOPICS.telemetry(d), json.dumps({"ts": T0, "events": [{"type": e}]}).encode())
                for d, e in events
            ]
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as client:
                await publish_many(client, messages, window=2)
            for rule in ("door", "smoke"):
                await wait_until(
                    lambda rule=rule: _all_sent(db, rule, 1), timeout=60, message="first window"
                )

            # Both routes as they are: each group reminds once its interval has passed.
            await _due_now(db)
            for rule in ("door", "smoke"):
                await wait_until(
                    lambda rule=rule: _all_sent(db, rule, 2), timeout=60, message="a reminder"
                )

            # The door route taken out on both nodes: its group reminds no more.
            _write_shared(paths, ports, db_dsn, mosquitto, smoke_only)
            await _reload(processes)
            await wait_until(
                lambda: db.fetchval(
                    "SELECT repeat_interval_s = 0 FROM notify_group WHERE group_key LIKE '%door%'"
                ),
                timeout=60,
                message="the door group re-timed by a reloaded node",
            )
            await _due_now(db)
            # The smoke group's reminder is made by the pass that would have made the door
            # group's (both due at once): once it is sent, none for the door came.
            await wait_until(lambda: _all_sent(db, "smoke", 3), timeout=60, message="control")
            assert len(await _windows(db, "door")) == 2, "a route taken out still reminds"

            # Put back: the group is the route's again. Its latest window was sent more than
            # repeat_interval_s ago (the clock moved on while it was out): it reminds at once,
            # once; the smoke group, reminded since, not before its own interval.
            _write_shared(paths, ports, db_dsn, mosquitto, both)
            await _reload(processes)
            await wait_until(lambda: _all_sent(db, "door", 3), timeout=60, message="reminded")
            assert json.loads((await _windows(db, "door"))[-1]["body"])["window"] == 3
            for process in processes:
                assert process.alive(), process.log_tail()
        finally:
            for process in processes:
                if process.alive():
                    process.terminate()
                process.cleanup()
    door = [json.loads(w["body"]) for w in await _windows(db, "door")]
    assert [(w["window"], w["repeat"]) for w in door] == [(1, False), (2, True), (3, True)]
    assert all(w["notifications"][0]["device_id"] == "door-1" for w in door)
    assert len(await _windows(db, "smoke")) == 3
    # One request per window sent: nothing doubled by the two nodes.
    assert len(server.on("/hook")) == 3 + 3
