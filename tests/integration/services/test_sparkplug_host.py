"""The Sparkplug host's judgement (gateway/sparkplug/host.py) against a real PostgreSQL, batch by
batch through the ingest store: the cases the edge-node tests do not reach (a device's death,
an older session's Will, an alias no birth has, a reset, redeliveries, the reorder window)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import asyncpg
import pytest

from gateway.alarms.engine import AlarmEngine
from gateway.domain.rules import DeviceClock, RuleConfig, compile_rules
from gateway.ingest import live_path
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.replay import pending_ids, replay
from gateway.ingest.store import StoreResult, store
from gateway.sparkplug.host import SparkplugHost
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType
from storage import ingest as ingest_repo
from storage import sparkplug as repo
from storage.ingest import DeadLetterRow
from tests.support.daemon import make_config

DECODER = MessageDecoder(Topics("iot"), Encoding.JSON, 65536, sparkplug=True)
NODE = "spBv1.0/G/{}/N"
DEVICE = "spBv1.0/G/{}/N/D"


def _payload(seq: int | None, *metrics: dict[str, object], ts: int = 1767225600000) -> bytes:
    message = pb.Payload(timestamp=ts)
    if seq is not None:
        message.seq = seq
    for fields in metrics:
        metric = message.metrics.add()
        for key, value in fields.items():
            setattr(metric, key, value)
    return message.SerializeToString()


def _bdseq(value: int) -> dict[str, object]:
    return {"name": "bdSeq", "datatype": DataType.INT64, "long_value": value}


def _temp(value: float, **extra: object) -> dict[str, object]:
    return {"alias": 1, "double_value": value, **extra}


def _births(ts: int = 1767225600000) -> list[tuple[str, str, bytes]]:
    """NBIRTH (bdSeq 3) and the device's DBIRTH; a rebirth has another time (other bytes)."""
    temp = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
    return [
        ("NBIRTH", NODE, _payload(0, _bdseq(3), ts=ts)),
        ("DBIRTH", DEVICE, _payload(1, temp, ts=ts)),
    ]


async def _batch(
    pool: asyncpg.Pool, host: SparkplugHost, messages: list[tuple[str, str, bytes]]
) -> StoreResult:
    items = [Inbound(topic=topic.format(kind), payload=body) for kind, topic, body in messages]
    batch = DECODER.classify(items)
    async with pool.acquire() as conn, conn.transaction():
        return await store(conn, batch, "test-node", sparkplug=host)


async def _state(pool: asyncpg.Pool) -> repo.StoredNode:
    async with pool.acquire() as conn:
        node = await repo.get_node(conn, "G", "N")
    assert node is not None
    return node


async def _presence(pool: asyncpg.Pool, device: str) -> str | None:
    value = await pool.fetchval("SELECT presence FROM device WHERE device_id = $1", device)
    return None if value is None else str(value)


async def test_device_death_and_an_older_sessions_will(pool: asyncpg.Pool) -> None:
    host = SparkplugHost()
    await _batch(pool, host, _births())
    assert await _presence(pool, "G/N/D") == "online"
    await _batch(pool, host, [("DDEATH", DEVICE, _payload(2))])
    assert await _presence(pool, "G/N/D") == "offline"
    assert (await _state(pool)).devices == []
    # An NDEATH of another bdSeq (a Will of an earlier connection) kills nothing.
    await _batch(pool, host, [("NDEATH", NODE, _payload(None, _bdseq(2)))])
    assert (await _state(pool)).born
    assert await _presence(pool, "G/N") == "online"
    await _batch(pool, host, [("NDEATH", NODE, _payload(None, _bdseq(3)))])
    state = await _state(pool)
    assert not state.born
    assert await _presence(pool, "G/N") == "offline"


async def test_an_unknown_alias_or_a_seq_reset_distrusts_until_the_next_birth(
    pool: asyncpg.Pool,
) -> None:
    host = SparkplugHost()
    await _batch(pool, host, _births())
    result = await _batch(
        pool, host, [("DDATA", DEVICE, _payload(2, _temp(5.0), {"alias": 9, "int_value": 1}))]
    )
    assert result.sparkplug is not None
    assert [why for _, why in result.sparkplug.distrusted] == ["alias 9 is in no birth of G/N/D"]
    # The known metric is stored, not judged.
    assert len(result.sparkplug.untrusted) == 1
    state = await _state(pool)
    assert not state.trusted
    assert state.rebirth_reason == "alias 9 is in no birth of G/N/D"
    assert state.rebirth_wanted_at is not None
    rows = await pool.fetch(
        "SELECT metrics::text FROM telemetry WHERE device_id = 'G/N/D' ORDER BY ts"
    )
    assert {"temp": 5.0} in [json.loads(r[0]) for r in rows]

    await _batch(pool, host, _births(ts=1767225601000))  # the rebirth
    state = await _state(pool)
    assert state.trusted
    assert state.rebirth_wanted_at is None
    # A seq going back is a reset.
    result = await _batch(pool, host, [("DDATA", DEVICE, _payload(0, _temp(6.0)))])
    assert result.sparkplug is not None
    assert [why for _, why in result.sparkplug.distrusted] == ["seq 0 after 1"]


async def test_a_redelivered_message_is_skipped_and_moves_nothing(pool: asyncpg.Pool) -> None:
    host = SparkplugHost()
    await _batch(pool, host, _births())
    data = ("DDATA", DEVICE, _payload(2, _temp(7.0)))
    first = await _batch(pool, host, [data])
    again = await _batch(pool, host, [data])  # committed, then delivered again (no PUBACK seen)
    assert first.stored == 1
    assert again.sparkplug is not None
    assert again.sparkplug.duplicates == 1
    assert again.stored == 0
    state = await _state(pool)
    assert state.trusted, state.rebirth_reason
    assert state.seq == 2


async def test_the_reorder_window_takes_late_seqs_and_expires_missing_ones(
    pool: asyncpg.Pool,
) -> None:
    host = SparkplugHost(reorder_window_s=30)
    await _batch(pool, host, _births())
    # 3 before 2: another node of the group still committing 2.
    await _batch(pool, host, [("DDATA", DEVICE, _payload(3, _temp(3.0)))])
    assert json.loads(await pool.fetchval("SELECT missing::text FROM sparkplug_node")).keys() == {
        "2"
    }
    await _batch(pool, host, [("DDATA", DEVICE, _payload(2, _temp(2.0)))])
    state = await _state(pool)
    assert state.trusted
    assert state.seq == 3
    assert await pool.fetchval("SELECT missing::text FROM sparkplug_node") == "{}"
    # 5 with 4 never coming: a gap once 4 has been missing longer than the window.
    await _batch(pool, host, [("DDATA", DEVICE, _payload(5, _temp(5.0)))])
    async with pool.acquire() as conn:
        assert await repo.expire_missing(conn, 30) == []
        await conn.execute("UPDATE sparkplug_node SET missing = '{\"4\": 0}'::jsonb")  # long ago
        assert await repo.expire_missing(conn, 30) == [("G", "N")]
    state = await _state(pool)
    assert not state.trusted
    assert state.rebirth_reason == "seq gap"
    async with pool.acquire() as conn, conn.transaction():
        assert await repo.take_rebirths(conn, 30, 10) == [("G", "N", "seq gap")]
        assert await repo.take_rebirths(conn, 30, 10) == []  # sent: again after the retry


async def test_aliases_and_metric_types_are_written_back_only_by_a_batch_with_a_birth(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edge node's aliases and metric types (kilobytes for a node with many metrics) are
    encoded and written with its row only when a birth of the batch changed them; a batch
    of data leaves them as stored, and the next batch reads them from there."""
    written: list[list[repo.NodeWrite]] = []
    write_nodes = repo.write_nodes

    async def watched(conn: asyncpg.Connection, writes: Sequence[repo.NodeWrite]) -> None:
        written.append(list(writes))
        await write_nodes(conn, writes)

    monkeypatch.setattr(repo, "write_nodes", watched)
    host = SparkplugHost()
    await _batch(pool, host, _births())
    await _batch(pool, host, [("DDATA", DEVICE, _payload(2, _temp(7.0)))])
    # A second metric born for the device (a DBIRTH again), then data by its alias.
    hum = {"name": "hum", "alias": 2, "datatype": DataType.DOUBLE, "double_value": 40.0}
    temp = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 7.5}
    await _batch(pool, host, [("DBIRTH", DEVICE, _payload(3, temp, hum))])
    result = await _batch(
        pool, host, [("DDATA", DEVICE, _payload(4, {"alias": 2, "double_value": 41.0}))]
    )

    assert [(w.aliases is None, w.metrics is None) for (w,) in written] == [
        (False, False), (True, True), (False, False), (True, True)
    ]  # fmt: skip
    state = await _state(pool)
    assert json.loads(state.aliases) == {
        "1": ["D", "temp", DataType.DOUBLE], "2": ["D", "hum", DataType.DOUBLE]
    }  # fmt: skip
    assert json.loads(state.metrics) == {
        "": {"bdSeq": DataType.INT64},
        "D": {"temp": 10, "hum": 10},
    }
    assert state.trusted, state.rebirth_reason
    assert result.sparkplug is not None
    assert result.sparkplug.distrusted == []
    assert [message.metrics for message in result.sparkplug.decoded] == [{"hum": 41.0}]


async def _committed(
    pool: asyncpg.Pool, host: SparkplugHost, messages: list[tuple[str, str, bytes]]
) -> StoreResult:
    """A batch committed, then told to the host, as the writer does."""
    result = await _batch(pool, host, messages)
    assert result.sparkplug is not None
    host.committed(result.sparkplug)
    return result


async def _rolled_back(
    pool: asyncpg.Pool, host: SparkplugHost, messages: list[tuple[str, str, bytes]]
) -> StoreResult:
    """A batch stored, then rolled back (as by a failure after it): never told to the host."""
    items = [Inbound(topic=topic.format(kind), payload=body) for kind, topic, body in messages]
    async with pool.acquire() as conn:
        transaction = conn.transaction()
        await transaction.start()
        try:
            return await store(conn, DECODER.classify(items), "test-node", sparkplug=host)
        finally:
            await transaction.rollback()


def _data(seq: int, alias: int, value: float) -> tuple[str, str, bytes]:
    return ("DDATA", DEVICE, _payload(seq, {"alias": alias, "double_value": value}))


def _dbirth(seq: int, *names: tuple[str, int]) -> tuple[str, str, bytes]:
    metrics = [
        {"name": name, "alias": alias, "datatype": DataType.DOUBLE, "double_value": 1.0}
        for name, alias in names
    ]
    return ("DBIRTH", DEVICE, _payload(seq, *metrics))


@pytest.fixture
def births_sent(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per batch: whether its edge node's births came from PostgreSQL (not held)."""
    sent: list[bool] = []
    lock_nodes = repo.lock_nodes

    async def watched(
        conn: asyncpg.Connection,
        keys: Sequence[tuple[str, str]],
        held: Mapping[tuple[str, str], str] | None = None,
    ) -> dict[tuple[str, str], repo.NodeRow]:
        rows = await lock_nodes(conn, keys, held)
        sent.append(all(row.aliases is not None for row in rows.values()))
        return rows

    monkeypatch.setattr(repo, "lock_nodes", watched)
    return sent


async def test_births_are_sent_again_only_when_another_writer_changed_them(
    pool: asyncpg.Pool, births_sent: list[bool]
) -> None:
    """Two gateways on one edge node (two hosts): each holds the births it read or wrote, and
    is sent them again only after the other changed them (a DBIRTH), or after a gateway of an
    earlier version wrote them (it writes them with every batch)."""
    a, b = SparkplugHost(), SparkplugHost()
    await _committed(pool, a, _births())
    await _committed(pool, a, [_data(2, 1, 20.0)])
    assert births_sent == [True, False]

    await _committed(pool, b, [_dbirth(3, ("temp", 1), ("hum", 2))])
    result = await _committed(pool, a, [_data(4, 2, 41.0)])  # by the alias b's birth added
    assert births_sent[2:] == [True, True]
    assert result.sparkplug is not None
    assert result.sparkplug.distrusted == []
    assert [message.metrics for message in result.sparkplug.decoded] == [{"hum": 41.0}]
    await _committed(pool, a, [_data(5, 2, 42.0)])
    assert births_sent[4:] == [False]

    await pool.execute("UPDATE sparkplug_node SET aliases = aliases, metrics = metrics")
    await _committed(pool, a, [_data(6, 2, 43.0)])
    await _committed(pool, a, [_data(7, 2, 44.0)])
    assert births_sent[5:] == [True, False]
    assert (await _state(pool)).trusted


async def test_a_birth_rolled_back_is_never_held(
    pool: asyncpg.Pool, births_sent: list[bool]
) -> None:
    """A batch whose DBIRTH was rolled back leaves the host holding the births as committed:
    when another gateway then writes other births (the same version number the rolled-back
    write would have reached), this one is sent them."""
    a, b = SparkplugHost(), SparkplugHost()
    await _committed(pool, a, _births())
    rolled_back = await _rolled_back(pool, a, [_dbirth(2, ("temp", 1), ("hum", 2))])
    assert rolled_back.sparkplug is not None
    assert list(rolled_back.sparkplug.births_written) == [("G", "N")]

    await _committed(pool, b, [_dbirth(2, ("temp", 1), ("pressure", 3))])
    result = await _committed(pool, a, [_data(3, 2, 41.0)])
    assert births_sent[-1] is True
    assert result.sparkplug is not None
    assert [why for _, why in result.sparkplug.distrusted] == ["alias 2 is in no birth of G/N/D"]


async def test_a_birth_rolled_back_leaves_the_births_held_as_they_were(
    pool: asyncpg.Pool, births_sent: list[bool]
) -> None:
    """The rolled-back DBIRTH was judged against the very dicts the host holds: they are not
    changed in place, so a metric only that birth named is still unknown after it."""
    host = SparkplugHost()
    await _committed(pool, host, _births())
    await _rolled_back(pool, host, [_dbirth(2, ("temp", 1), ("hum", 2))])

    by_name = ("DDATA", DEVICE, _payload(2, {"name": "hum", "double_value": 41.0}))
    result = await _committed(pool, host, [by_name])
    assert births_sent[-1] is False  # judged against what the host holds
    assert result.sparkplug is not None
    assert [why for _, why in result.sparkplug.distrusted] == [
        "metric 'hum' is in no birth of G/N/D"
    ]


async def test_every_node_of_a_batch_is_written_by_one_statement(pool: asyncpg.Pool) -> None:
    """write_nodes sends the batch's nodes as columns (lines, a node's devices and recent ids
    joined by `,`): each row gets its own values, empty lists and nulls included, and the
    rebirth's times follow the reason (kept while wanted, cleared when none)."""
    keys = [("G", "A"), ("G", "B"), ("H", "A")]
    async with pool.acquire() as conn, conn.transaction():
        await repo.lock_nodes(conn, keys)
        await repo.write_nodes(
            conn,
            [
                repo.NodeWrite(
                    "G", "A", True, 3, 7, '{"5": 1.5}', True, None, None,
                    ["D1", "D.2:x"], ["00ab", "00cd"], None, True,
                ),
                repo.NodeWrite(
                    "G", "B", False, None, None, "{}", False, None, None, [], [],
                    "seq 9 after 7", False,
                ),
                repo.NodeWrite(
                    "H", "A", True, 0, 0, "{}", True, None, None, ["D1"], [], None, False,
                ),
            ],
        )  # fmt: skip
    async with pool.acquire() as conn:
        rows = {
            (r["group_id"], r["edge_node_id"]): r
            for r in await conn.fetch(
                "SELECT group_id, edge_node_id, born, bdseq, seq, missing::text, trusted,"
                " devices, recent, rebirth_reason, rebirth_wanted_at IS NOT NULL AS wanted,"
                " born_at IS NOT NULL AS born_now FROM sparkplug_node"
            )
        }
    assert set(rows) == set(keys)
    a, b, h = rows["G", "A"], rows["G", "B"], rows["H", "A"]
    assert (a["born"], a["bdseq"], a["seq"], json.loads(a["missing"])) == (True, 3, 7, {"5": 1.5})
    assert (a["devices"], a["recent"], a["rebirth_reason"], a["wanted"]) == (
        ["D1", "D.2:x"], ["00ab", "00cd"], None, False,
    )  # fmt: skip
    assert a["born_now"]
    assert (b["born"], b["bdseq"], b["seq"], b["trusted"]) == (False, None, None, False)
    assert (b["devices"], b["recent"], b["rebirth_reason"], b["wanted"]) == (
        [], [], "seq 9 after 7", True,
    )  # fmt: skip
    assert not b["born_now"]
    assert (h["bdseq"], h["seq"], h["devices"], h["recent"]) == (0, 0, ["D1"], [])
    async with pool.acquire() as conn:
        with pytest.raises(ValueError, match="holds a ','"):
            await repo.write_nodes(
                conn,
                [
                    repo.NodeWrite(
                        "G", "A", True, 3, 7, "{}", True, None, None, ["a,b"], [], None, False
                    )
                ],
            )


# --- the rules on a Sparkplug device: its seq wraps -------------------------------------------

TEMP_HIGH = compile_rules([
    RuleConfig(key="temp-high", kind="threshold", metric="temp", op=">", value=80,
               clear_value=75, severity="CRITICAL"),
])  # fmt: skip
T0 = 1767225600000


def _engine(node_id: str) -> AlarmEngine:
    return AlarmEngine(rules=TEMP_HIGH, node_id=node_id, metrics=Metrics(), clock=DeviceClock())


def _births_at(seq: int) -> list[tuple[str, str, bytes]]:
    """NBIRTH at ``seq``, the device's DBIRTH (temp 1.0, alias 1) at the next, both at T0."""
    temp = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 1.0}
    return [
        ("NBIRTH", NODE, _payload(seq, _bdseq(3), ts=T0)),
        ("DBIRTH", DEVICE, _payload((seq + 1) % 256, temp, ts=T0)),
    ]


def _temp_at(seq: int, value: float, seconds: int) -> tuple[str, str, bytes]:
    return ("DDATA", DEVICE, _payload(seq, _temp(value), ts=T0 + 1000 * seconds))


async def _judged(
    pool: asyncpg.Pool,
    host: SparkplugHost,
    engine: AlarmEngine,
    messages: list[tuple[str, str, bytes]],
) -> StoreResult:
    """A batch stored and judged by the rules on ``engine``'s node, committed, as the writer
    does."""
    items = [Inbound(topic=topic.format(kind), payload=body) for kind, topic, body in messages]
    async with pool.acquire() as conn, conn.transaction():
        result = await store(
            conn, DECODER.classify(items), engine.node_id, engine=engine, sparkplug=host
        )
    assert result.sparkplug is not None
    assert result.alarms is not None
    host.committed(result.sparkplug)
    engine.committed(result.alarms)
    return result


async def test_a_seq_wrapping_after_255_is_no_reboot_to_the_rules(pool: asyncpg.Pool) -> None:
    """The edge node's seq goes 252..255, 0..3: its stream goes on (trusted), and the device's
    samples are not a new epoch of a rebooted device (no `seq_reset` counted on it)."""
    host, engine = SparkplugHost(), _engine("node-a")
    await _judged(pool, host, engine, _births_at(250))
    seqs = [252, 253, 254, 255, 0, 1, 2, 3]
    result = await _judged(
        pool, host, engine, [_temp_at(seq, 20.0, n + 1) for n, seq in enumerate(seqs)]
    )
    assert result.sparkplug is not None
    assert result.sparkplug.distrusted == []
    assert result.alarms is not None
    assert result.alarms.clock_adjustments == {}
    assert await pool.fetch("SELECT device_id, reason, count FROM device_clock") == []
    assert (await _state(pool)).seq == 3


async def test_a_late_sample_from_before_a_wrap_is_judged_late(pool: asyncpg.Pool) -> None:
    """Two nodes of a group: one judges the data after the wrap (seq 253..3, temp back to
    normal), the other then commits seq 252, sent before them and violating. It is a late
    sample, not a clock stepped back: its alarm is raised already cleared by the newer samples,
    never left active on a device that is back to normal."""
    host_a, host_b = SparkplugHost(reorder_window_s=30), SparkplugHost(reorder_window_s=30)
    node_a, node_b = _engine("node-a"), _engine("node-b")
    await _judged(pool, host_a, node_a, _births_at(250))
    after = [253, 254, 255, 0, 1, 2, 3]
    await _judged(pool, host_b, node_b, [_temp_at(seq, 20.0, n + 2) for n, seq in enumerate(after)])
    late = await _judged(pool, host_a, node_a, [_temp_at(252, 95.0, 1)])
    assert late.sparkplug is not None
    assert late.sparkplug.distrusted == []
    assert late.alarms is not None
    assert late.alarms.clock_adjustments == {}
    (alarm,) = await pool.fetch("SELECT device_id, rule_key, cleared_at FROM alarm")
    assert (alarm["device_id"], alarm["rule_key"]) == ("G/N/D", "temp-high")
    assert alarm["cleared_at"] is not None  # cleared by the newer samples: not active
    assert (await _state(pool)).trusted


async def test_a_death_committed_before_its_own_birth_leaves_the_node_dead(
    pool: asyncpg.Pool,
) -> None:
    """An edge node connects (its Will bdSeq 5), births and loses its connection at once: the
    broker publishes its Will right after the NBIRTH, and another node of the `$share` group
    commits the Will first. The NBIRTH, committed after it, finds its session dead: the node
    and its device stay offline. The next session's birth is not held back by it."""
    host_a, host_b = SparkplugHost(), SparkplugHost()
    temp = {"name": "temp", "alias": 1, "datatype": DataType.DOUBLE, "double_value": 20.0}

    def births(bdseq: int, seconds: int) -> list[tuple[str, str, bytes]]:
        return [
            ("NBIRTH", NODE, _payload(0, _bdseq(bdseq), ts=T0 + 1000 * seconds)),
            ("DBIRTH", DEVICE, _payload(1, temp, ts=T0 + 1000 * seconds)),
        ]

    await _batch(pool, host_a, births(4, 0))
    # Session 5's Will, taken while session 4 is still born (its own Will not committed yet):
    # session 4 is over too (one connection at a time), the node offline at once.
    await _batch(pool, host_b, [("NDEATH", NODE, _payload(None, _bdseq(5)))])
    assert not (await _state(pool)).born
    assert await _presence(pool, "G/N") == "offline"
    assert await _presence(pool, "G/N/D") == "offline"
    await _batch(pool, host_b, [("NDEATH", NODE, _payload(None, _bdseq(4)))])
    assert await _presence(pool, "G/N") == "offline"
    # Session 5's births, committed after its death.
    result = await _batch(pool, host_a, births(5, 1))
    assert result.sparkplug is not None
    assert result.sparkplug.deaths == 1
    state = await _state(pool)
    assert (state.born, state.bdseq, state.trusted) == (False, 5, False)
    assert await _presence(pool, "G/N") == "offline"
    # Its device's birth came after the node's death: not online either.
    assert await _presence(pool, "G/N/D") == "offline"
    # Session 6 births: born, online, nothing of session 5's death held against it.
    await _batch(pool, host_b, births(6, 2))
    state = await _state(pool)
    assert (state.born, state.bdseq, state.trusted) == (True, 6, True)
    assert await _presence(pool, "G/N") == "online"
    assert await _presence(pool, "G/N/D") == "online"
    assert await pool.fetchval("SELECT dead_bdseq FROM sparkplug_node") is None


async def test_a_death_or_birth_replayed_late_changes_no_presence(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """The node's NDEATH, its device's DDEATH and an older NBIRTH, dead-lettered an hour ago
    and replayed while the node is born and online: each is refused (`INVALID`, its moment
    has passed) and stays pending; the node and its device stay online, and nothing of the
    stream (births, bdSeq) moves. Only data is replayed (read with the births in force)."""
    live = SparkplugHost()
    await _batch(pool, live, _births())
    before = await _state(pool)
    letters = [
        DeadLetterRow.whole(NODE.format("NDEATH"), _payload(None, _bdseq(3)), "QUARANTINED", "x"),
        DeadLetterRow.whole(DEVICE.format("DDEATH"), _payload(2), "QUARANTINED", "x"),
        DeadLetterRow.whole(NODE.format("NBIRTH"), _births(ts=1)[0][2], "QUARANTINED", "x"),
    ]
    async with pool.acquire() as conn:
        await ingest_repo.insert_dead_letters(conn, letters, "gw-1")
        await conn.execute("UPDATE dead_letter SET received_at = now() - interval '1 hour'")
    extra = '[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["G"]\n'
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=extra), Metrics())

    outcomes = await replay(pool, path, await pending_ids(pool, None))

    assert [(o.outcome, o.succeeded) for o in outcomes] == [("still_invalid: INVALID", False)] * 3
    assert await _presence(pool, "G/N") == await _presence(pool, "G/N/D") == "online"
    after = await _state(pool)
    assert after == before


async def test_a_refused_replay_counts_its_letter_no_more_and_writes_no_letter(
    pool: asyncpg.Pool, db_dsn: str
) -> None:
    """A replay is not a new sighting of the message. An NDEATH (refused: its moment has
    passed) and a DDATA whose alias today's births do not define (refused: not born), each
    seen once, replayed twice: each is refused with its reason both times and stays pending,
    seen once. It used to count its pending letter again at each replay (`seen_count` 1, 2,
    3: the refusal was stored as a dead letter of the same bytes). And an NDEATH replayed
    successfully once (marked so) and replayed again by id is refused without writing a new
    letter of itself (it used to: no pending letter of those bytes to count)."""
    await _batch(pool, SparkplugHost(), _births())
    letters = [
        DeadLetterRow.whole(NODE.format("NDEATH"), _payload(None, _bdseq(3)), "QUARANTINED", "x"),
        DeadLetterRow.whole(
            DEVICE.format("DDATA"), _payload(2, _temp(20.0, alias=9)), "NOT_BORN", "x"
        ),
        DeadLetterRow.whole(NODE.format("NDEATH"), _payload(None, _bdseq(2)), "QUARANTINED", "x"),
    ]
    async with pool.acquire() as conn:
        await ingest_repo.insert_dead_letters(conn, letters, "gw-1")
        await conn.execute("UPDATE dead_letter SET replayed_at = now() WHERE id = 3")
    extra = '[sparkplug]\nenabled = true\nhost_id = "gw-host"\ngroups = ["G"]\n'
    path = live_path.for_replay(make_config(dsn=db_dsn, mqtt_port=1, extra=extra), Metrics())

    for _ in range(2):
        outcomes = await replay(pool, path, [1, 2, 3], again=True)
        assert [(o.dead_letter_id, o.outcome, o.succeeded) for o in outcomes] == [
            (1, "still_invalid: INVALID", False),
            (2, "still_invalid: SPARKPLUG_NOT_BORN", False),
            (3, "still_invalid: INVALID", False),
        ]

    rows = await pool.fetch("SELECT id, seen_count, replay_count FROM dead_letter ORDER BY id")
    assert [tuple(r) for r in rows] == [(1, 1, 2), (2, 1, 2), (3, 1, 2)]
    assert await pending_ids(pool, None) == [1, 2]
