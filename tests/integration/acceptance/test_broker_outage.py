"""A broker maintenance window: no alarm flood, and what waited goes out when it is back.

Two daemons on the same devices and the same broker, as in production. The outage itself is
real (mosquitto stopped, then started on the same port with its persistence database); what the
tests wait for are conditions: both sessions seen down, the outage lasting as long as the old
behaviour needed to misbehave (on the database clock), the sessions back, the rows moved on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import aiomqtt
import asyncpg
import msgspec

from gateway.domain.command import Delivery
from gateway.runtime.daemon import Daemon
from protocol import Topics
from sim.responder import Responder, Script
from tests.support.commands import new_command
from tests.support.daemon import make_config, running_daemon, session_down
from tests.support.mosquitto import Mosquitto, events_subscriber
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
LEASE_S = 1.0
# Long enough for the old dispatcher to lose each claim several times over (claim, instant
# publish failure, lease, reaper pass): more than the 5 reclaims that raise the alarm.
OUTAGE_LEASES = 8
DEVICES = ["dev-a", "dev-b", "dev-c"]
COMMANDS = f"[commands]\nlease_s = {LEASE_S}\nack_window_s = 60\nreaper_interval_s = 0.2\n"


def _up(daemon: Daemon) -> bool:
    return daemon.session is not None and daemon.session.connected and daemon.ready.is_set()


async def _both_down(mosquitto: Mosquitto, daemons: tuple[Daemon, Daemon]) -> None:
    mosquitto.stop()
    await wait_until(
        lambda: all(session_down(d) for d in daemons), timeout=30, message="both sessions down"
    )


async def _create_commands(db: asyncpg.Connection) -> list[int]:
    ids = []
    async with db.transaction():
        for device in DEVICES:
            created = await new_command(
                db, device_id=device, name="set", params={"on": True},
                delivery=Delivery.REALTIME, idempotency_key=None, actor="test",
                node_id="test", expire_after_s=3600,
            )  # fmt: skip
            ids.append(created.command.id)
    return ids


def _outage_lasted(db: asyncpg.Connection) -> Callable[[], Awaitable[bool]]:
    async def lasted() -> bool:
        return bool(
            await db.fetchval(
                "SELECT bool_and(now() - created_at > make_interval(secs => $1)) FROM command",
                LEASE_S * OUTAGE_LEASES,
            )
        )

    return lasted


async def _where_they_stand(db: asyncpg.Connection) -> str:
    """Each command's row and audit trail, for a failure's message."""
    rows = await db.fetch(
        "SELECT id, device_id, status, claimed_node_id, claim_generation, reclaim_count"
        " FROM command ORDER BY id"
    )
    audit = await db.fetch(
        "SELECT command_id, action, from_status, to_status, node_id, note, at"
        " FROM command_audit ORDER BY id"
    )
    return f"commands: {[tuple(r) for r in rows]}; audit: {[tuple(r) for r in audit]}"


def _all_acked(db: asyncpg.Connection) -> Callable[[], Awaitable[bool]]:
    async def acked() -> bool:
        return bool(await db.fetchval("SELECT bool_and(status = 'ACKED') FROM command"))

    return acked


async def test_a_broker_outage_counts_no_reclaims_and_delivers_after_it(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=node, extra=COMMANDS)
        for node in ("node-a", "node-b")
    ]
    # The devices' persistent session survives the outage: downlinks queued for them are
    # delivered when they are back, whoever published them.
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=Script())
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop))
    db = await asyncpg.connect(db_dsn)
    try:
        await responder.wait_subscribed()
        async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
            await _both_down(mosquitto, (one, two))
            ids = await _create_commands(db)
            await wait_until(_outage_lasted(db), timeout=60, message="the outage lasted")
            during = await db.fetch(
                "SELECT status, claim_generation, reclaim_count FROM command ORDER BY id"
            )
            mosquitto.start()
            await wait_until(
                lambda: _up(one) and _up(two), timeout=30, message="both sessions back"
            )
            # The reconnect woke the dispatchers: the commands go out at once (under a second
            # here), not at a poll or a lease.
            await wait_until(_all_acked(db), timeout=20, message="every command ACKED")
        rows = await db.fetch("SELECT id, claim_generation, reclaim_count FROM command ORDER BY id")
        reclaim_alarms = await db.fetchval(
            "SELECT count(*) FROM alarm WHERE rule_key = 'command-reclaims'"
        )
        reclaims = await db.fetchval("SELECT count(*) FROM command_audit WHERE action = 'reclaim'")
    finally:
        stop.set()
        await answering
        await db.close()
    # While the broker was away nobody claimed: nothing to lose, nothing to count.
    assert [tuple(r) for r in during] == [("PENDING", 0, 0)] * len(DEVICES), during
    assert [r["id"] for r in rows] == ids
    assert all(r["reclaim_count"] == 0 for r in rows), rows
    assert reclaims == 0
    assert reclaim_alarms == 0
    # Claimed once, after the broker returned, and delivered on that claim.
    assert all(r["claim_generation"] == 1 for r in rows), rows
    assert responder.answered == len(DEVICES)


async def test_a_node_cut_off_from_the_broker_leaves_the_commands_to_one_that_is_not(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=Script())
    stop = asyncio.Event()
    answering = asyncio.create_task(responder.run(stop))
    db = await asyncpg.connect(db_dsn)
    try:
        await responder.wait_subscribed()
        async with TcpProxy("127.0.0.1", mosquitto.port) as proxy:
            cut_off = make_config(
                dsn=db_dsn, mqtt_port=proxy.port, node_id="node-cut", extra=COMMANDS
            )
            connected = make_config(
                dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-up", extra=COMMANDS
            )
            async with running_daemon(cut_off) as one:
                await proxy.cut()
                await wait_until(
                    lambda: session_down(one), timeout=30, message="node-cut's session down"
                )
                await _create_commands(db)
                # node-cut alone, for as long as it took the old dispatcher to lose its claims
                # again and again; then a node with a session of its own comes.
                await wait_until(_outage_lasted(db), timeout=60, message="the cut lasted")
                during = await db.fetch(
                    "SELECT status, claim_generation, reclaim_count FROM command ORDER BY id"
                )
                async with running_daemon(connected):
                    try:
                        await wait_until(_all_acked(db), timeout=20, message="every command ACKED")
                    except AssertionError as exc:
                        # Seen once in a fresh-clone CI run under load and not here in
                        # repeated runs: say where each command stood, and what the devices saw.
                        raise AssertionError(
                            f"{exc}; answered by the devices: {responder.answered}; "
                            f"{await _where_they_stand(db)}"
                        ) from exc
        rows = await db.fetch(
            "SELECT claimed_node_id, claim_generation, reclaim_count FROM command ORDER BY id"
        )
    finally:
        stop.set()
        await answering
        await db.close()
    assert [tuple(r) for r in during] == [("PENDING", 0, 0)] * len(DEVICES), during
    assert [tuple(r) for r in rows] == [("node-up", 1, 0)] * len(DEVICES), rows
    assert responder.answered == len(DEVICES)


SILENT_S = 1
# The outbox's retry backoff, set far above the test's deadline: an event that failed during
# the outage would wait at least RETRY_MIN_S / 2 after the broker is back.
RETRY_MIN_S = 120
PROMPT_S = 20.0


async def test_an_alarm_raised_during_an_outage_is_pushed_as_soon_as_the_broker_is_back(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    extra = (
        f"[outbox]\nretry_min_s = {RETRY_MIN_S}\nretry_max_s = 600\n"
        "[alarms]\ntimer_interval_s = 0.2\n"
        '[[rules]]\nkey = "held"\nkind = "threshold"\nmetric = "temp"\nop = ">"\nvalue = 30\n'
        f'for_seconds = {SILENT_S}\nseverity = "WARNING"\ndevices = "dev-quiet"\n'
    )
    configs = [
        make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id=node, extra=extra)
        for node in ("node-a", "node-b")
    ]
    # A person's app subscribed to the events, offline now: the broker keeps its session (and
    # saves it when stopped), so the alarm's event, published once the broker is back, reaches
    # someone and pushes the alarm (docs/behaviour.md §5).
    async with events_subscriber(mosquitto.port, persistent=True):
        pass
    db = await asyncpg.connect(db_dsn)
    try:
        async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
            sample = msgspec.json.encode({"ts": int(time.time() * 1000), "metrics": {"temp": 41.5}})
            async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
                await device.publish(TOPICS.telemetry("dev-quiet"), sample, qos=1)

            async def seen() -> bool:
                return (
                    await db.fetchval("SELECT count(*) FROM device WHERE device_id = 'dev-quiet'")
                    == 1
                )

            await wait_until(seen, timeout=30, message="the device was heard from")
            await _both_down(mosquitto, (one, two))

            # The device reported a violation and falls silent with the broker: the hold timer
            # fires its alarm while the broker is away (whichever node's timer passes first).
            # (Not an inactivity alarm: silence is not judged while nobody can listen.)
            async def raised() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT count(*) FROM alarm WHERE rule_key = 'held'"
                        " AND now() - created_at > interval '3 seconds'"
                    )
                )

            # Three seconds on: a publisher that claims while the broker is down (woken by the
            # alarm's NOTIFY, at once) has failed its publish by then and scheduled the retry.
            await wait_until(raised, timeout=60, message="the held alarm raised")
            status = await db.fetchval("SELECT status FROM alarm WHERE rule_key = 'held'")
            mosquitto.start()
            await wait_until(lambda: _up(one) or _up(two), timeout=30, message="a session back")

            async def pushed() -> bool:
                return (
                    await db.fetchval("SELECT status FROM alarm WHERE rule_key = 'held'")
                    == "PUSHED"
                )

            await wait_until(pushed, timeout=PROMPT_S, message="the alarm pushed promptly")
            event = await db.fetchrow(
                "SELECT status, retry_count FROM outbox_event"
                " WHERE aggregate_type = 'alarm' AND event_type = 'alarm.created'"
            )
    finally:
        await db.close()
    assert status == "NEW"
    assert event is not None
    assert event["status"] == "PUBLISHED"
    # No backoff was spent on the broker being away.
    assert event["retry_count"] == 0


SILENCE_S = 3
SILENCE = (
    f'[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = {SILENCE_S}\n'
    'severity = "MAJOR"\n'
)


async def _report(port: int, devices: list[str], n: int) -> None:
    async with aiomqtt.Client("127.0.0.1", port) as device:
        for name in devices:
            payload = f'{{"ts": {1_767_225_600_000 + n}, "metrics": {{"t": {n}}}}}'
            await device.publish(TOPICS.telemetry(name), payload.encode(), qos=1)


async def test_a_broker_outage_longer_than_a_silence_raises_no_inactivity_alarm(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Nobody can hear a device while the broker is away: silence is counted only while the
    node listens. Before, every device was alarmed `silent_seconds` into the outage."""
    configs = [
        make_config(
            dsn=db_dsn,
            mqtt_port=mosquitto.port,
            node_id=node,
            extra=SILENCE,
            mqtt_extra='shared_group = "silence"',
        )
        for node in ("node-a", "node-b")
    ]
    talking = ["dev-a", "dev-b", "dev-c"]
    db = await asyncpg.connect(db_dsn)

    async def silent_alarms(devices: list[str]) -> int:
        return int(
            await db.fetchval(
                "SELECT count(*) FROM alarm WHERE rule_key = 'silent' AND device_id = ANY($1)",
                devices,
            )
        )

    try:
        async with running_daemon(configs[0]) as one, running_daemon(configs[1]) as two:
            # A device that really went silent, the broker up: alarmed (the monitor works).
            await _report(mosquitto.port, ["gone", *talking], 0)

            async def gone_alarmed() -> bool:
                return await silent_alarms(["gone"]) == 1

            await wait_until(gone_alarmed, timeout=30, message="the silent device alarmed")

            # Those silent as long are alarmed too; a report clears them. Counted from here.
            async def heard() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT bool_and(now() - last_seen < make_interval(secs => $1))"
                        " FROM device WHERE device_id = ANY($2)",
                        SILENCE_S,
                        talking,
                    )
                )

            await _report(mosquitto.port, talking, 1)
            await wait_until(heard, timeout=30, message="the devices heard")
            before = await silent_alarms(talking)
            await _both_down(mosquitto, (one, two))

            async def outage_longer_than_silence() -> bool:
                return bool(
                    await db.fetchval(
                        "SELECT bool_and(now() - last_seen > make_interval(secs => $1))"
                        " FROM device WHERE device_id = ANY($2)",
                        2 * SILENCE_S,
                        talking,
                    )
                )

            await wait_until(outage_longer_than_silence, timeout=60, message="a long outage")
            during = await silent_alarms(talking) - before
            mosquitto.start()
            await wait_until(
                lambda: _up(one) and _up(two), timeout=30, message="both sessions back"
            )
            await _report(mosquitto.port, talking, 2)

            await wait_until(heard, timeout=30, message="the devices heard again")
            after = await silent_alarms(talking) - before
    finally:
        await db.close()
    assert during == 0
    assert after == 0


async def test_nothing_is_sent_before_the_receipts_subscription_exists(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """Connected is not subscribed: in between (the subscription memory written, each SUBACK
    awaited) a downlink sent at once can be answered before the broker holds the receipts'
    filter for this session, and that receipt reaches nobody here: the command waits SENT for
    its ack window (seen in CI under load). Forced: the subscription memory's table is locked,
    so the session stays connected and unsubscribed while the dispatcher is asked to send."""
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="node-new", extra=COMMANDS)
    responder = Responder(host="127.0.0.1", port=mosquitto.port, topics=TOPICS, script=Script())
    stop_answering, stop = asyncio.Event(), asyncio.Event()
    answering = asyncio.create_task(responder.run(stop_answering))
    db = await asyncpg.connect(db_dsn)
    holder = await asyncpg.connect(db_dsn)
    daemon = Daemon(config)
    running: asyncio.Task[None] | None = None
    try:
        await responder.wait_subscribed()
        ids = await _create_commands(db)
        lock = holder.transaction()
        await lock.start()
        await holder.execute("LOCK TABLE mqtt_subscription IN SHARE MODE")
        running = asyncio.create_task(daemon.run(stop))

        def between() -> bool:
            session = daemon.session
            return session is not None and session.connected and not session.subscribed

        await wait_until(between, timeout=30, message="connected, not yet subscribed")
        assert daemon.components is not None
        assert not daemon.publisher.up()
        assert await daemon.components.dispatcher.run_once() == 0
        assert between()  # still in between: the lock held throughout
        statuses = await db.fetch("SELECT status FROM command ORDER BY id")
        assert [r["status"] for r in statuses] == ["PENDING"] * len(ids)

        await lock.rollback()  # the memory written, the filters subscribed: now they go out
        await wait_until(_all_acked(db), timeout=30, message="every command ACKED")
    finally:
        stop.set()
        if running is not None:
            async with asyncio.timeout(60):
                await running
        stop_answering.set()
        await answering
        await holder.close()
        await db.close()
    assert responder.answered == len(DEVICES)


async def test_a_node_started_with_the_broker_away_heard_nothing_before_and_keeps_every_break(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    """What the inactivity monitor hears: a daemon started while the broker is away (a site
    power cut, a restart during a broker maintenance) has a break from before its start, not
    none; after two more breaks it has all three, not only the last."""
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port)
    mosquitto.stop()
    daemon = Daemon(config)
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))

    def subscribed() -> bool:
        return daemon.session is not None and daemon.session.subscribed

    try:
        await wait_until(lambda: session_down(daemon), timeout=30, message="the session trying")
        mosquitto.start()
        await wait_until(subscribed, timeout=60, message="subscribed")
        assert daemon.session is not None
        first = daemon.session.hearing(math.inf)
        assert [began for began, _ in first.breaks] == [math.inf]
        for _ in range(2):
            mosquitto.stop()
            await wait_until(lambda: session_down(daemon), timeout=30, message="the session down")
            mosquitto.start()
            await wait_until(subscribed, timeout=60, message="subscribed again")
        heard = daemon.session.hearing(math.inf)
    finally:
        stop.set()
        async with asyncio.timeout(60):
            await task
    breaks = heard.breaks
    assert len(breaks) == 3
    assert breaks[0][0] == math.inf
    assert all(began > ended for began, ended in breaks)
    assert all(breaks[n][1] > breaks[n + 1][0] for n in range(2))  # oldest first, apart
