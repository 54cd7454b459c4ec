"""Sparkplug B on the wire (protocol/sparkplug.py): topics, payload values, STATE, commands."""

from __future__ import annotations

import random

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigErrors
from protocol import sparkplug
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType, MessageType, SparkplugError


def _payload(*metrics: dict[str, object], seq: int | None = 4, ts: int | None = 1000) -> bytes:
    message = pb.Payload()
    if ts is not None:
        message.timestamp = ts
    if seq is not None:
        message.seq = seq
    for fields in metrics:
        metric = message.metrics.add()
        for key, value in fields.items():
            setattr(metric, key, value)
    return message.SerializeToString()


def test_topics_parse_into_group_type_node_and_device() -> None:
    topic = sparkplug.parse_topic("spBv1.0/Plant1/DDATA/Line4/Oven")
    assert topic == sparkplug.SparkplugTopic("Plant1", MessageType.DDATA, "Line4", "Oven")
    assert topic.node_key == "Plant1/Line4"
    assert topic.device_key == "Plant1/Line4/Oven"
    node = sparkplug.parse_topic("spBv1.0/Plant1/NBIRTH/Line4")
    assert node.device is None
    assert node.device_key == "Plant1/Line4"
    assert sparkplug.topic("Plant1", MessageType.NCMD, "Line4") == "spBv1.0/Plant1/NCMD/Line4"


@pytest.mark.parametrize(
    ("topic", "code"),
    [
        ("spBv1.0/Plant1/NDATA", "BAD_TOPIC"),
        ("spBv1.0/Plant1/XDATA/Line4", "BAD_TOPIC"),
        ("spBv1.0/Plant1/DDATA/Line4", "BAD_TOPIC"),  # a device message needs its device
        ("spBv1.0/Plant1/NDATA/Line4/Oven", "BAD_TOPIC"),
        ("spBv1.0/Plant1/NDATA/Line4/Oven/x", "BAD_TOPIC"),
        ("spBv1.0/Plant 1/NDATA/Line4", "BAD_DEVICE_ID"),
        ("spBv1.0/Plant1/DDATA/Line4/", "BAD_DEVICE_ID"),
    ],
)
def test_bad_topics_are_refused_with_a_dead_letter_reason(topic: str, code: str) -> None:
    with pytest.raises(SparkplugError) as caught:
        sparkplug.parse_topic(topic)
    assert caught.value.code == code


def test_device_keys_are_two_or_three_native_ids() -> None:
    assert sparkplug.split_device_key("Plant1/Line4/Oven") == ("Plant1", "Line4", "Oven")
    assert sparkplug.split_device_key("Plant1/Line4") == ("Plant1", "Line4", None)
    for native_or_bad in ("dev-1", "a/b/c/d", "a//b", "a b/c"):
        assert not sparkplug.is_device_key(native_or_bad)


def test_values_are_read_with_the_datatype_of_the_metric_or_of_its_birth() -> None:
    decoded = sparkplug.decode_payload(
        _payload(
            {"name": "i8", "datatype": DataType.INT8, "int_value": 0xFFFFFFFF},  # -1, 32-bit
            {"name": "i8b", "datatype": DataType.INT8, "int_value": 0xFE},  # -2, own width
            {"name": "i16", "datatype": DataType.INT16, "int_value": 0xFFFF8000},
            {"name": "i64", "datatype": DataType.INT64, "long_value": 2**64 - 5},
            {"name": "u32", "datatype": DataType.UINT32, "int_value": 0xFFFFFFFF},
            {"name": "u64", "datatype": DataType.UINT64, "long_value": 2**64 - 1},
            {"name": "d", "datatype": DataType.DOUBLE, "double_value": 21.5},
            {"name": "b", "datatype": DataType.BOOLEAN, "boolean_value": True},
            {"name": "s", "datatype": DataType.STRING, "string_value": "on"},
            {"name": "t", "datatype": DataType.DATETIME, "long_value": 1767225600000},
            {"name": "n", "datatype": DataType.DOUBLE, "is_null": True},
            {"name": "raw", "datatype": DataType.BYTES, "bytes_value": b"\x01"},
            {"alias": 7, "int_value": 0xFFFFFFFD},  # data by alias: no datatype of its own
        )
    )
    assert decoded.seq == 4
    assert decoded.timestamp == 1000
    values = {m.name: sparkplug.metric_value(m, None) for m in decoded.metrics if m.name}
    assert values == {
        "i8": -1,
        "i8b": -2,
        "i16": -32768,
        "i64": -5,
        "u32": 2**32 - 1,
        "u64": 2**64 - 1,
        "d": 21.5,
        "b": True,
        "s": "on",
        "t": 1767225600000,
        "n": None,
        "raw": None,
    }
    by_alias = decoded.metrics[-1]
    assert by_alias.name is None
    assert by_alias.alias == 7
    assert sparkplug.metric_value(by_alias, DataType.INT32) == -3  # the birth said Int32
    assert sparkplug.metric_value(by_alias, DataType.UINT32) == 2**32 - 3


def test_properties_and_flags_are_kept() -> None:
    message = pb.Payload(timestamp=1, seq=0)
    metric = message.metrics.add()
    metric.name = "temp"
    metric.datatype = DataType.FLOAT
    metric.float_value = 1.5
    metric.is_historical = True
    metric.properties.keys.extend(["engUnit", "engHigh"])
    unit = metric.properties.values.add()
    unit.type = DataType.STRING
    unit.string_value = "degC"
    high = metric.properties.values.add()
    high.type = DataType.INT32
    high.int_value = 0xFFFFFFFF
    [decoded] = sparkplug.decode_payload(message.SerializeToString()).metrics
    assert decoded.is_historical
    assert decoded.properties == {"engUnit": "degC", "engHigh": -1}


def test_a_payload_that_is_not_sparkplug_is_malformed() -> None:
    with pytest.raises(SparkplugError) as caught:
        sparkplug.decode_payload(b"\xff\xff\xff")
    assert caught.value.code == "MALFORMED"
    with pytest.raises(SparkplugError) as caught:
        sparkplug.decode_payload(_payload({"name": "bad\x00name", "int_value": 1}))
    assert caught.value.code == "INVALID"


def test_bdseq_is_read_from_births_and_deaths() -> None:
    decoded = sparkplug.decode_payload(
        _payload({"name": "bdSeq", "datatype": DataType.INT64, "long_value": 3})
    )
    assert decoded.bdseq() == 3
    assert sparkplug.decode_payload(_payload()).bdseq() is None


def test_state_is_sparkplug_3_json() -> None:
    assert sparkplug.state_topic("gw-host") == "spBv1.0/STATE/gw-host"
    birth = sparkplug.state_payload(True, 1767225600000)
    assert birth == b'{"online":true,"timestamp":1767225600000}'
    assert sparkplug.parse_state(birth) == (True, 1767225600000)
    assert sparkplug.parse_state(b"OFFLINE") is None  # Sparkplug 2.x's plain strings
    assert sparkplug.parse_state(b'{"online":1,"timestamp":1}') is None


def test_rebirth_request_is_an_ncmd_writing_node_control_rebirth() -> None:
    message = pb.Payload()
    message.ParseFromString(sparkplug.encode_rebirth(1234))
    assert message.timestamp == 1234
    [metric] = message.metrics
    assert metric.name == "Node Control/Rebirth"
    assert metric.datatype == DataType.BOOLEAN
    assert metric.boolean_value is True


def test_writes_encode_each_datatype_and_refuse_what_does_not_fit() -> None:
    message = pb.Payload()
    message.ParseFromString(
        sparkplug.encode_write(
            5,
            [
                ("setpoint", 10, DataType.DOUBLE, 21),
                ("mode", None, DataType.STRING, "auto"),
                ("offset", None, DataType.INT16, -2),
                ("on", None, DataType.BOOLEAN, True),
            ],
        )
    )
    decoded = sparkplug.decode_payload(message.SerializeToString())
    assert [sparkplug.metric_value(m, None) for m in decoded.metrics] == [21.0, "auto", -2, True]
    assert decoded.metrics[0].alias == 10
    for value, datatype in ((True, DataType.INT32), (300, DataType.UINT8), ("x", DataType.DOUBLE)):
        with pytest.raises(ValueError, match="setpoint"):
            sparkplug.encode_write(5, [("setpoint", None, datatype, value)])


def test_subscriptions_cover_the_configured_groups_or_all() -> None:
    assert sparkplug.subscriptions([]) == ["spBv1.0/#"]
    assert sparkplug.subscriptions(["A", "B"]) == ["spBv1.0/A/#", "spBv1.0/B/#"]


def test_sparkplug_config_is_checked() -> None:
    config = parse_config('[sparkplug]\nenabled = true\nhost_id = "gw"\ngroups = ["Plant1"]\n')
    assert config.sparkplug.enabled
    with pytest.raises(ConfigErrors) as caught:
        parse_config(
            '[mqtt]\nbroker_family = "nats"\n'
            '[sparkplug]\nenabled = true\ngroups = ["ok", "bad group", "ok"]\n'
        )
    paths = sorted(e.key_path for e in caught.value.errors)
    assert paths == [
        "sparkplug.enabled",  # `spBv1.0` holds a `.`: not on a broker that maps it
        "sparkplug.groups[1]",
        "sparkplug.groups[2]",
        "sparkplug.host_id",  # required when enabled
    ]


def test_rules_take_sparkplug_ids_and_metric_names() -> None:
    config = parse_config(
        """
[[rules]]
key = "oven"
kind = "threshold"
metric = "Inputs/temp C"
op = ">"
value = 80
severity = "MAJOR"
devices = ["Plant1/Line4/Oven", "Plant1/*"]
"""
    )
    rule = config.rule_set().rules[0]
    assert rule.selector.matches("Plant1/Line4/Oven")
    assert rule.selector.matches("Plant1/Line9/Press")
    assert not rule.selector.matches("Plant2/Line4/Oven")


_VALUES: dict[str, list[object]] = {
    "int_value": [0, 1, 255, 2**31, 2**32 - 1],
    "long_value": [0, 7, 2**63, 2**64 - 1],
    "float_value": [0.0, -1.5, float("inf")],
    "double_value": [0.0, 23.96, float("nan")],
    "boolean_value": [False, True],
    "string_value": ["", "on", "a\x00b"],
    "bytes_value": [b"", b"\x01\x02"],
}


def _random_payload(draw: random.Random) -> bytes:
    message = pb.Payload()
    if draw.random() < 0.8:
        message.timestamp = draw.choice([0, 1767225600000])
    if draw.random() < 0.8:
        message.seq = draw.randrange(256)
    for _ in range(draw.randrange(6)):
        metric = message.metrics.add()
        if draw.random() < 0.5:
            metric.name = draw.choice(["temp", "Node Control/Rebirth", "bdSeq", "a/b c"])
        if draw.random() < 0.6:
            metric.alias = draw.choice([0, 1, 37, 2**64 - 1])
        if draw.random() < 0.3:
            metric.timestamp = draw.choice([0, 1767225600001])
        if draw.random() < 0.5:
            metric.datatype = draw.choice([0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 17, 22])
        for flag in ("is_null", "is_historical", "is_transient"):
            if draw.random() < 0.2:
                setattr(metric, flag, draw.random() < 0.5)  # set, to either value
        if draw.random() < 0.8:
            which = draw.choice(sorted(_VALUES))
            setattr(metric, which, draw.choice(_VALUES[which]))
        if draw.random() < 0.15:
            metric.properties.keys.append("engUnit")
            value = metric.properties.values.add()
            value.type = DataType.STRING
            value.string_value = "°C"
    return message.SerializeToString()


def _reference(data: bytes) -> sparkplug.SparkplugPayload:
    """The payload read field by field (HasField, WhichOneof): what decode_payload answers."""
    message = pb.Payload()
    message.ParseFromString(data)
    metrics = []
    for metric in message.metrics:
        which = metric.WhichOneof("value")
        metrics.append(
            sparkplug.RawMetric(
                name=metric.name if metric.HasField("name") else None,
                alias=metric.alias if metric.HasField("alias") else None,
                timestamp=metric.timestamp if metric.HasField("timestamp") else None,
                datatype=metric.datatype if metric.HasField("datatype") else None,
                is_null=metric.is_null,
                is_historical=metric.is_historical,
                is_transient=metric.is_transient,
                which=which,
                raw=None if which is None else getattr(metric, which),
                properties={"engUnit": "°C"} if metric.HasField("properties") else {},
            )
        )
    return sparkplug.SparkplugPayload(
        message.timestamp if message.HasField("timestamp") else None,
        message.seq if message.HasField("seq") else None,
        tuple(metrics),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_payloads_decode_as_read_field_by_field(seed: int) -> None:
    """decode_payload reads each metric from the fields present (one ListFields): every field
    present, at any value (an alias of 0, a flag set to false, a default value in the oneof),
    and none absent, as HasField and WhichOneof read them (replay: the seed is in the id)."""
    draw = random.Random(seed)
    for _ in range(2000):
        data = _random_payload(draw)
        # NaN is not equal to itself: compare what the values are, not the floats.
        assert repr(sparkplug.decode_payload(data)) == repr(_reference(data)), data.hex()
