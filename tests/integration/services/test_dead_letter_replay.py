"""Dead letters replayed under field conditions: by two nodes at once, and through a mapping
whose payloads carry no time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import asyncpg
import pytest

from gateway.alarms.inactivity import InactivityMonitor
from gateway.ingest import live_path
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.replay import pending_ids, replay, replay_one
from gateway.ingest.store import store
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics
from storage import ingest as repo
from storage.ingest import DeadLetterRow
from tests.support.daemon import make_config
from tests.support.held_batch import lock_waiters
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
Z2M = '[[ingest.mappings]]\nname = "z2m"\nprofile = "zigbee2mqtt"\n'


async def test_a_letter_of_a_mapping_without_times_is_read_at_its_receive_time_on_every_node(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Zigbee2MQTT without last_seen: the time is the receive time cut to 1 s. A replay reads
    the letter at the time it was received, so every replay, on any node, is the same reading:
    it used to be read at the replay's time, stored at the wrong time and stored again by a
    second replay (another node's, or the same one's by id) in a later second."""
    topic = "zigbee2mqtt/0x00158d0001d8e1d2"
    payload = b'{"temperature": 30.5, "humidity": 50}'
    # Refused at the time (PostgreSQL away too long, say): valid bytes.
    letter = DeadLetterRow.whole(topic, payload, "STORAGE_REJECTED", "refused at the time")
    await repo.insert_dead_letters(db, [letter], "gw-1")
    received = datetime(2026, 1, 1, 12, 0, 0, 750_000, tzinfo=UTC)
    letter_id = await db.fetchval("UPDATE dead_letter SET received_at = $1 RETURNING id", received)

    outcomes = []
    for node in ("node-a", "node-b"):
        config = make_config(dsn=db_dsn, mqtt_port=1, node_id=node, extra=Z2M)
        path = live_path.for_replay(config, Metrics())
        outcome = await replay_one(pool, path, letter_id)
        assert outcome is not None
        outcomes.append(outcome.outcome)

    assert outcomes == ["stored", "duplicate"]
    rows = await db.fetch("SELECT device_id, ts, metrics::text AS metrics FROM telemetry")
    assert [(r["device_id"], r["ts"]) for r in rows] == [
        ("0x00158d0001d8e1d2", datetime(2026, 1, 1, 12, 0, tzinfo=UTC))
    ]


async def test_two_nodes_replaying_every_pending_letter_at_once_replay_each_once(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """`gateway dead-letters replay --all` on two nodes at once: both list the pending letters,
    one replays them all first (forced here: it runs to its end before the other starts). The
    other replays none of them again: they are not pending any more. It used to replay each
    again, counting a second replay, and its `offline` set the device offline a second time,
    after the device had come back online."""
    letters = [
        DeadLetterRow.whole(TOPICS.device_status("dev-1"), b"offline", "STORAGE_REJECTED", "x"),
        DeadLetterRow.whole(
            TOPICS.telemetry("dev-1"),
            b'{"ts": 1767225600000, "metrics": {"temp": 21.5}}',
            "STORAGE_REJECTED",
            "x",
        ),
    ]
    await repo.insert_dead_letters(db, letters, "gw-1")
    paths = {
        node: live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, node_id=node), Metrics())
        for node in ("node-a", "node-b")
    }
    listed = {node: await pending_ids(pool, None) for node in paths}
    assert listed["node-a"] == listed["node-b"] != []

    first = await replay(pool, paths["node-a"], listed["node-a"])
    assert [o.outcome for o in first] == ["presence", "stored"]
    await repo.record_presence(db, {"dev-1": "online"})  # the device is back, live

    assert await replay(pool, paths["node-b"], listed["node-b"]) == []
    rows = await db.fetch("SELECT replay_count, replay_outcome FROM dead_letter ORDER BY id")
    assert [(r["replay_count"], r["replay_outcome"]) for r in rows] == [
        (1, "presence"),
        (1, "stored"),
    ]
    assert await db.fetchval("SELECT presence FROM device WHERE device_id = 'dev-1'") == "online"


async def test_a_presence_letter_older_than_what_the_device_said_since_changes_nothing(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """An `offline` dead-lettered an hour ago and replayed once the cause is fixed, while the
    device has been online and reporting since: it is superseded, the device stays online.
    It used to be stored as the device's presence now, and the inactivity monitor raised a
    "presence offline" alarm for a device that was talking."""
    offline = DeadLetterRow.whole(
        TOPICS.device_status("dev-2"), b"offline", "STORAGE_REJECTED", "x"
    )
    online = DeadLetterRow.whole(TOPICS.device_status("dev-3"), b"online", "STORAGE_REJECTED", "x")
    await repo.insert_dead_letters(db, [offline, online], "gw-1")
    await db.execute("UPDATE dead_letter SET received_at = now() - interval '1 hour'")
    await repo.record_presence(db, {"dev-2": "online"})  # heard since, live
    silence = (
        '[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = 600\nseverity = "MAJOR"\n'
    )
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=silence), Metrics())

    outcomes = await replay(pool, path, await pending_ids(pool, None))

    # dev-3 was never heard since: its presence is applied as before.
    assert [(o.outcome, o.succeeded) for o in outcomes] == [
        ("presence_superseded", True),
        ("presence", True),
    ]
    rows = await db.fetch("SELECT device_id, presence FROM device ORDER BY device_id")
    assert [tuple(r) for r in rows] == [("dev-2", "online"), ("dev-3", "online")]
    # A node listening all along judges both devices: neither is offline. dev-3, heard only
    # by its `online` an hour ago, has been silent since then (the replay counts as heard when
    # the letter was received, not now); dev-2, heard since, is not silent.
    raised = await InactivityMonitor(pool=pool, engine=path.engine).run_once()
    received = await db.fetchval("SELECT received_at FROM dead_letter LIMIT 1")
    rows = await db.fetch("SELECT id, device_id, trigger->>'silent_since' AS since FROM alarm")
    assert [(r["id"], r["device_id"], datetime.fromisoformat(r["since"])) for r in rows] == [
        (raised[0], "dev-3", received)
    ]


SILENT = (
    '[[rules]]\nkey = "silent"\nkind = "inactivity"\nsilent_seconds = 600\nseverity = "MAJOR"\n'
)


def _reading(device_id: str, at: datetime) -> DeadLetterRow:
    ms = int(at.timestamp() * 1000)
    payload = b'{"ts": %d, "metrics": {"temp": 21.5}}' % ms
    return DeadLetterRow.whole(TOPICS.telemetry(device_id), payload, "STORAGE_REJECTED", "x")


async def test_an_old_letter_replayed_counts_as_heard_when_it_was_received_not_now(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """Telemetry dead-lettered hours ago and replayed now, of devices silent since: dev-9 was
    heard after the letter (a newer last_seen), dev-10 last before it. The replay counts as
    heard when the letter was received: dev-9's last_seen and its inactivity alarm stay,
    dev-10's last_seen moves to the letter's receipt only, and it is still silent (alarmed
    again, from there). It used to count as heard now: both last_seen moved to the replay's
    time, the alarms were cleared, and the dead devices looked alive for another 600 s."""
    now = await db.fetchval("SELECT now()")
    hours = [now - timedelta(hours=h) for h in (1, 2, 3)]
    await db.execute(
        "INSERT INTO device (device_id, first_seen, last_seen) VALUES"
        " ('dev-9', $2, $1), ('dev-10', $2, $2)",
        hours[0],
        hours[2],
    )
    await repo.insert_dead_letters(db, [_reading("dev-9", hours[1])], "gw-1")
    await repo.insert_dead_letters(db, [_reading("dev-10", hours[1])], "gw-1")
    await db.execute("UPDATE dead_letter SET received_at = $1", hours[1])
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=SILENT), Metrics())
    monitor = InactivityMonitor(pool=pool, engine=path.engine)
    assert len(await monitor.run_once()) == 2  # both silent for hours, listened to all along

    outcomes = await replay(pool, path, await pending_ids(pool, None))

    assert [o.outcome for o in outcomes] == ["stored", "stored"]
    seen = dict(await db.fetch("SELECT device_id, last_seen FROM device"))
    assert seen == {"dev-9": hours[0], "dev-10": hours[1]}
    alarms = await db.fetch(
        "SELECT device_id, cleared_at IS NULL AS open, trigger->>'silent_since' AS since"
        " FROM alarm ORDER BY device_id, id"
    )
    # dev-10's silence since hours[2] was broken by the letter; dev-9's was not.
    assert [(a["device_id"], a["open"]) for a in alarms] == [("dev-10", False), ("dev-9", True)]
    # The next pass finds dev-10 silent since the letter's receipt, dev-9 alarmed already.
    assert len(await monitor.run_once()) == 1
    since = await db.fetchval(
        "SELECT trigger->>'silent_since' FROM alarm"
        " WHERE device_id = 'dev-10' AND cleared_at IS NULL"
    )
    assert datetime.fromisoformat(since) == hours[1]


HOT = (
    '[[rules]]\nkey = "hot"\nkind = "threshold"\nmetric = "temp"\nop = ">"\nvalue = 30\n'
    'clear_value = 25\nseverity = "MAJOR"\n'
)


def _temp(device_id: str, at: datetime, temp: float) -> DeadLetterRow:
    ms = int(at.timestamp() * 1000)
    payload = b'{"ts": %d, "metrics": {"temp": %r}}' % (ms, temp)
    return DeadLetterRow.whole(TOPICS.telemetry(device_id), payload, "STORAGE_REJECTED", "x")


async def test_an_old_reading_replayed_is_judged_at_its_receipt_not_the_replays(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """A reading of 35 received two hours ago and replayed now, after the device reported 20
    an hour ago: it is older than the newest judged by more than the reorder window, so it is
    judged at its receipt, which is when the gateway received it, two hours ago: late. It
    used to be judged at the replay's time, newer than the 20: a "hot" alarm opened now on a
    device back to normal, and the rule stayed firing. Late, it raises the alarm of its time,
    cleared by the 20 after it, as any late sample does."""
    now = await db.fetchval("SELECT now()")
    two_hours_ago, an_hour_ago = now - timedelta(hours=2), now - timedelta(hours=1)
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=HOT), Metrics())
    for at, temp in ((an_hour_ago, 20.0), (two_hours_ago, 35.0)):
        await repo.insert_dead_letters(db, [_temp("dev-hot", at, temp)], "gw-1")
        await db.execute("UPDATE dead_letter SET received_at = $1 WHERE replayed_at IS NULL", at)
        outcomes = await replay(pool, path, await pending_ids(pool, None))
        assert [o.outcome for o in outcomes] == ["stored"]

    # Late: the alarm of its time, raised and cleared by the 20 after it; nothing active.
    (alarm,) = await db.fetch("SELECT cleared_at, trigger->>'sample_ts' AS at FROM alarm")
    assert alarm["cleared_at"] is not None
    assert abs(datetime.fromisoformat(alarm["at"]) - two_hours_ago) < timedelta(seconds=1)
    firing = await db.fetchval("SELECT firing FROM rule_state WHERE device_id = 'dev-hot'")
    assert firing is False


async def test_a_letter_its_decoder_refuses_again_is_not_seen_again(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str
) -> None:
    """A replay is not a new sighting. A Zigbee2MQTT payload its mapping still cannot read
    and a native reading still invalid (a NUL in a metric name), each seen once and replayed
    twice: each stays pending with its reason, seen once, and no other letter is written (a
    decoder's refusal is reported before anything is stored)."""
    letters = [
        DeadLetterRow.whole("zigbee2mqtt/0x00158d0001d8e1d2", b"not json", "MAPPING_X", "x"),
        DeadLetterRow.whole(
            TOPICS.telemetry("dev-nul"),
            b'{"ts": "2026-01-01T00:00:00Z", "metrics": {"a\\u0000b": 1}}',
            "STORAGE_REJECTED",
            "x",
        ),
    ]
    await repo.insert_dead_letters(db, letters, "gw-1")
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=Z2M), Metrics())
    for _ in range(2):
        outcomes = await replay(pool, path, await pending_ids(pool, None))
        assert [(o.dead_letter_id, o.outcome, o.succeeded) for o in outcomes] == [
            (1, "still_invalid: MAPPING_MALFORMED", False),
            (2, "still_invalid: INVALID", False),
        ]
    rows = await db.fetch("SELECT seen_count, replay_count FROM dead_letter ORDER BY id")
    assert [tuple(r) for r in rows] == [(1, 2), (1, 2)]


# The loop's clock as on a machine up for longer than the receipts these tests date an hour
# back: on one booted minutes ago, `time.monotonic() - 3600` is below zero, a receipt no
# statement takes (storage.ingest.receipt_age: unknown), and the tests failed there.
_UP_FOR_S = 4000.0


@pytest.fixture
def loop_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[], float]:
    """The monotonic clock storage measures receipts' ages on, moved on by _UP_FOR_S."""

    def monotonic() -> float:
        return time.monotonic() + _UP_FOR_S

    monkeypatch.setattr(repo, "time", SimpleNamespace(monotonic=monotonic))
    return monotonic


@pytest.mark.parametrize("replayed_by", ["node-a", "node-b"])
async def test_a_will_letter_replayed_after_the_device_said_online_again_changes_nothing(
    db: asyncpg.Connection,
    pool: asyncpg.Pool,
    db_dsn: str,
    replayed_by: str,
    loop_clock: Callable[[], float],
) -> None:
    """A device online for an hour drops and comes back: its Will `offline` is dead-lettered
    ten minutes ago (refused at the time), its new session's `online` a second later is
    stored by node A as the unchanged presence it is: only its receipt moves (presence_at
    stays an hour ago, a status is no telemetry: last_seen stays). Replayed once the cause
    is fixed, the Will is older than what the device said since: superseded, the device
    stays online. It was applied by node A's replay (the same node as the receipt stored:
    "its own order", though a replay is no order of the broker's), setting the device
    offline since ten minutes ago; node B's replay applied nothing yet reported `presence`."""
    device = "dev-back"
    decoder = MessageDecoder(TOPICS, Encoding.JSON, 65536)
    born = loop_clock() - 3600.0
    await store(db, decoder.classify([_status(device, "online", born)]), "node-a")
    await db.execute(
        "UPDATE device SET first_seen = now() - interval '1 hour', presence_at = now() -"
        " interval '1 hour', last_seen = now() - interval '1 hour' WHERE device_id = $1",
        device,
    )
    will = DeadLetterRow.whole(TOPICS.device_status(device), b"offline", "STORAGE_REJECTED", "x")
    await repo.insert_dead_letters(db, [will], "node-a")
    await db.execute("UPDATE dead_letter SET received_at = now() - interval '600 seconds'")
    back = loop_clock() - 599.0  # the new session's `online`, a second after the Will
    await store(db, decoder.classify([_status(device, "online", back)]), "node-a")
    path = live_path.for_replay(
        make_config(dsn=db_dsn, mqtt_port=1, node_id=replayed_by), Metrics()
    )

    outcomes = await replay(pool, path, await pending_ids(pool, None))

    assert await db.fetchval("SELECT presence FROM device WHERE device_id = $1", device) == (
        "online"
    )
    assert [(o.outcome, o.succeeded) for o in outcomes] == [("presence_superseded", True)]


async def test_a_will_letter_replayed_while_the_node_stores_the_devices_online_changes_nothing(
    db: asyncpg.Connection, pool: asyncpg.Pool, db_dsn: str, loop_clock: Callable[[], float]
) -> None:
    """The same Will letter, replayed on node A while node A's live batch stores the
    device's `online` of its new session (read a second after the Will, its receipt only):
    the replay looked for anything newer before that batch committed, found nothing, and
    then waited for the device's row. Once it got it, node A's `online` was there, read ten
    minutes after the Will; the replay was applied all the same, as node A's own order
    ("the same node": a replay is no order of the broker's), and the device went offline
    since ten minutes ago. Forced: the live batch's transaction is held open until the
    replay waits for its lock."""
    device = "dev-back"
    decoder = MessageDecoder(TOPICS, Encoding.JSON, 65536)
    await store(db, decoder.classify([_status(device, "online", loop_clock())]), "node-a")
    await db.execute(
        "UPDATE device SET first_seen = now() - interval '1 hour', presence_at = now() -"
        " interval '1 hour', last_seen = now() - interval '1 hour', presence_received_at ="
        " now() - interval '1 hour' WHERE device_id = $1",
        device,
    )
    will = DeadLetterRow.whole(TOPICS.device_status(device), b"offline", "STORAGE_REJECTED", "x")
    await repo.insert_dead_letters(db, [will], "node-a")
    await db.execute("UPDATE dead_letter SET received_at = now() - interval '600 seconds'")
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, node_id="node-a"), Metrics())
    live = await asyncpg.connect(db_dsn)
    try:
        held = live.transaction()
        await held.start()
        back = loop_clock() - 599.0  # the new session's `online`, a second after the Will
        await store(live, decoder.classify([_status(device, "online", back)]), "node-a")
        replaying = asyncio.create_task(replay(pool, path, await pending_ids(pool, None)))
        await wait_until(lambda: lock_waiters(db_dsn), message="the replay waits for the row")
        await held.commit()
        outcomes = await replaying
    finally:
        await live.close()

    assert await db.fetchval("SELECT presence FROM device WHERE device_id = $1", device) == (
        "online"
    )
    assert [o.succeeded for o in outcomes] == [True]


def _status(device: str, value: str, received_at: float) -> Inbound:
    return Inbound(TOPICS.device_status(device), value.encode(), received_at)
