"""``gateway-sim publish --format sparkplug``: the stream decodes with the gateway's own
Sparkplug codec (protocol/sparkplug) into births that define every alias, then data by alias
whose seq follows on per edge node; each message one sample at a time of its own."""

from __future__ import annotations

from collections import Counter

from protocol import sparkplug
from protocol.sparkplug import DataType, MessageType
from sim.sparkplug import DEVICES_PER_NODE, GROUP, device_key, edge_nodes, sparkplug_stream
from sim.telemetry import device_ids


def test_births_then_data_by_alias_with_seq_per_edge_node() -> None:
    devices = device_ids(23)  # three edge nodes: 10, 10 and 3 devices
    count = 700  # past 256 messages a node: seq wraps
    messages = list(sparkplug_stream(devices, count, seed=3, epoch_ms=1_000_000, bdseq=9))
    assert len(messages) == count
    nodes = edge_nodes(devices)
    assert [len(n.devices) for n in nodes] == [DEVICES_PER_NODE, DEVICES_PER_NODE, 3]

    aliases: dict[str, dict[int, tuple[str, int]]] = {}  # device key -> alias -> name, type
    node_aliases: dict[str, set[int]] = {}  # edge node -> every alias its births define
    born_nodes: set[str] = set()
    last_seq: dict[str, int] = {}
    kinds: Counter[MessageType] = Counter()
    times: list[int] = []
    data_by_device: Counter[str] = Counter()
    for topic_name, payload in messages:
        topic = sparkplug.parse_topic(topic_name)
        decoded = sparkplug.decode_payload(payload)
        kinds[topic.type] += 1
        assert topic.group == GROUP
        assert decoded.timestamp is not None
        times.append(decoded.timestamp)
        assert decoded.seq is not None
        if topic.type is MessageType.NBIRTH:
            assert decoded.seq == 0
            assert decoded.bdseq() == 9
            born_nodes.add(topic.node)
            node_aliases[topic.node] = {m.alias for m in decoded.metrics if m.alias is not None}
        else:
            assert topic.node in born_nodes, "no data or device birth before its node's birth"
            assert decoded.seq == (last_seq[topic.node] + 1) % 256
        last_seq[topic.node] = decoded.seq
        if topic.type is MessageType.DBIRTH:
            assert topic.device is not None
            defined = {}
            for metric in decoded.metrics:
                assert metric.name is not None
                assert metric.alias is not None
                assert metric.datatype is not None
                defined[metric.alias] = (metric.name, metric.datatype)
                assert sparkplug.metric_value(metric, metric.datatype) is not None
            aliases[topic.device_key] = defined
            # An alias is unique within the edge node and its devices (Sparkplug 3.0).
            assert not node_aliases[topic.node] & set(defined)
            node_aliases[topic.node] |= set(defined)
            assert {name for name, _ in defined.values()} == {"temp", "humidity", "count"}
        elif topic.type is MessageType.DDATA:
            birth = aliases[topic.device_key]  # its device was born before
            data_by_device[topic.device_key] += 1
            values = {}
            for metric in decoded.metrics:
                assert metric.name is None
                assert metric.datatype is None
                assert metric.alias is not None
                name, datatype = birth[metric.alias]
                values[name] = sparkplug.metric_value(metric, datatype)
            assert isinstance(values["temp"], float)
            assert isinstance(values["count"], int)
            assert DataType.DOUBLE in {datatype for _, datatype in birth.values()}
    assert kinds == {
        MessageType.NBIRTH: 3,
        MessageType.DBIRTH: 23,
        MessageType.DDATA: count - 26,
    }
    assert max(last_seq.values()) < 256
    # One sample per message, each at a time of its own, in order.
    assert times == sorted(set(times))
    assert set(data_by_device) == {device_key(GROUP, d, devices) for d in devices}
    assert device_key(GROUP, devices[12], devices) == f"{GROUP}/edge-00001/{devices[12]}"


def test_a_stream_shorter_than_its_births_and_a_reproducible_one() -> None:
    devices = device_ids(5)
    short = list(sparkplug_stream(devices, 3))
    assert [sparkplug.parse_topic(t).type for t, _ in short] == [
        MessageType.NBIRTH, MessageType.DBIRTH, MessageType.DBIRTH,
    ]  # fmt: skip
    first = list(sparkplug_stream(devices, 40, seed=5, group="Plant9"))
    assert first == list(sparkplug_stream(devices, 40, seed=5, group="Plant9"))
    assert first != list(sparkplug_stream(devices, 40, seed=6, group="Plant9"))
    assert all(t.startswith("spBv1.0/Plant9/") for t, _ in first)
    # Going on from a reading: births again (a new session), then later data.
    later = list(sparkplug_stream(devices, 40, seed=5, group="Plant9", start_seq=1000))
    assert [t for t, _ in later[:6]] == [t for t, _ in first[:6]]
    assert later[6:] != first[6:]
