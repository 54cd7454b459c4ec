from __future__ import annotations

import pickle

import pytest

from protocol import (
    DEVICE_ID_RE,
    DeviceTopic,
    InvalidDeviceIdError,
    TopicError,
    TopicKind,
    Topics,
    is_valid_device_id,
    validate_device_id,
)

VALID_IDS = ["a", "dev-1", "A_b.c:d-e", "0", "x" * 64, "site:7.door-2_b"]
INVALID_IDS = [
    "",
    "x" * 65,
    "a/b",
    "a+b",
    "a#b",
    "a b",
    "dév",
    "dev-1\n",
    "\ndev-1",
    "dev\x00",
    "+",
    "#",
    "\uff44\uff45\uff56",  # fullwidth "dev": `\w` would accept it, our class must not
]


@pytest.mark.parametrize("device_id", VALID_IDS)
def test_valid_device_ids(device_id: str) -> None:
    assert is_valid_device_id(device_id)
    assert validate_device_id(device_id) == device_id


@pytest.mark.parametrize("device_id", INVALID_IDS)
def test_invalid_device_ids(device_id: str) -> None:
    assert not is_valid_device_id(device_id)
    with pytest.raises(InvalidDeviceIdError) as info:
        validate_device_id(device_id)
    assert info.value.device_id == device_id
    assert isinstance(info.value, ValueError)


def test_device_id_regex_rejects_trailing_newline_even_with_match() -> None:
    assert DEVICE_ID_RE.match("dev-1\n") is None
    assert DEVICE_ID_RE.search("dev-1\n") is None


def test_invalid_device_id_error_pickles() -> None:
    error = pickle.loads(pickle.dumps(InvalidDeviceIdError("a/b")))  # noqa: S301 - our own bytes
    assert error.device_id == "a/b"


def test_device_topics_default_prefix() -> None:
    topics = Topics()
    assert topics.prefix == "iot"
    assert topics.telemetry("dev-1") == "iot/devices/dev-1/telemetry"
    assert topics.acks("dev-1") == "iot/devices/dev-1/acks"
    assert topics.commands("dev-1") == "iot/devices/dev-1/commands"
    assert topics.device_status("dev-1") == "iot/devices/dev-1/status"


def test_multi_level_prefix() -> None:
    topics = Topics("acme/site-1")
    assert topics.telemetry("d") == "acme/site-1/devices/d/telemetry"
    assert topics.event("alarm", "42") == "acme/site-1/events/alarm/42"
    assert topics.gateway_status("gw-1") == "acme/site-1/gateways/gw-1/status"


@pytest.mark.parametrize("device_id", INVALID_IDS)
@pytest.mark.parametrize("kind", ["telemetry", "acks", "commands", "device_status"])
def test_bad_device_id_never_builds_a_topic(device_id: str, kind: str) -> None:
    with pytest.raises(InvalidDeviceIdError):
        getattr(Topics(), kind)(device_id)


@pytest.mark.parametrize(
    "prefix", ["", "a/+/b", "a/#", "+", "$SYS", "$share/x", "/iot", "iot/", "a//b", "a\x00"]
)
def test_bad_prefixes(prefix: str) -> None:
    with pytest.raises(ValueError, match="topic prefix"):
        Topics(prefix)


def test_topics_is_immutable() -> None:
    topics = Topics("iot")
    with pytest.raises(AttributeError):
        topics.prefix = "other"  # type: ignore[misc]  # frozen: the point of the test
    assert Topics("iot") == topics


@pytest.mark.parametrize(
    ("aggregate", "aggregate_id"),
    [("", "1"), ("alarm", ""), ("a/b", "1"), ("alarm", "1/2"), ("a+", "1"), ("alarm", "#")],
)
def test_event_topic_rejects_bad_levels(aggregate: str, aggregate_id: str) -> None:
    with pytest.raises(ValueError, match="event aggregate"):
        Topics().event(aggregate, aggregate_id)


@pytest.mark.parametrize("node_id", ["", "gw/1", "gw+", "gw 1", "x" * 65])
def test_gateway_status_rejects_bad_node_ids(node_id: str) -> None:
    with pytest.raises(ValueError, match="invalid node id"):
        Topics().gateway_status(node_id)


def test_subscriptions() -> None:
    topics = Topics("acme/site-1")
    assert topics.subscription(TopicKind.TELEMETRY) == "acme/site-1/devices/+/telemetry"
    assert topics.subscription(TopicKind.ACKS, "gateways") == (
        "$share/gateways/acme/site-1/devices/+/acks"
    )
    assert topics.subscription(TopicKind.STATUS, None) == "acme/site-1/devices/+/status"


@pytest.mark.parametrize("group", ["", "a/b", "a+", "#", "g\x00"])
def test_shared_subscription_rejects_bad_groups(group: str) -> None:
    with pytest.raises(ValueError, match="shared subscription group"):
        Topics().subscription(TopicKind.TELEMETRY, group)


@pytest.mark.parametrize("kind", list(TopicKind))
def test_parse_round_trips_every_kind(kind: TopicKind) -> None:
    topics = Topics("acme/site-1")
    topic = f"acme/site-1/devices/dev:1/{kind.value}"
    assert topics.parse_device_topic(topic) == DeviceTopic(kind, "dev:1")


def test_parse_inverts_building() -> None:
    topics = Topics()
    assert topics.parse_device_topic(topics.acks("x" * 64)) == DeviceTopic(TopicKind.ACKS, "x" * 64)


@pytest.mark.parametrize(
    "topic",
    [
        "",
        "iot",
        "iot/devices",
        "iot/devices/",
        "iot/devices/dev-1",
        "iot/devices/dev-1/",
        "other/devices/dev-1/telemetry",
        "iotx/devices/dev-1/telemetry",
        "io/devices/dev-1/telemetry",
        "/iot/devices/dev-1/telemetry",
        "iot/device/dev-1/telemetry",
        "iot/devices/dev-1/telemetry/extra",
        "iot/devices/dev-1/telemetry/",
        "iot/devices/dev-1/unknown",
        "iot/devices/dev-1/TELEMETRY",
        "iot/devices/dev-1/extra/telemetry",
        "iot/gateways/gw-1/status",
        "iot/events/alarm/1",
    ],
)
def test_parse_rejects_bad_topics(topic: str) -> None:
    with pytest.raises(TopicError) as info:
        Topics().parse_device_topic(topic)
    assert info.value.code == "BAD_TOPIC"
    assert info.value.topic == topic
    assert str(info.value).startswith("BAD_TOPIC: expected `iot/devices/{device_id}/{kind}`")


@pytest.mark.parametrize("device_id", ["", "+", "#", "a b", "dév", "x" * 65, "a\x00"])
def test_parse_rejects_bad_device_ids(device_id: str) -> None:
    topic = f"iot/devices/{device_id}/telemetry"
    with pytest.raises(TopicError) as info:
        Topics().parse_device_topic(topic)
    assert info.value.code == "BAD_DEVICE_ID"
    assert info.value.topic == topic
    assert repr(device_id) in str(info.value)


def test_topic_error_is_a_value_error_and_pickles() -> None:
    error = TopicError("BAD_TOPIC", "a/b", "why")
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))  # noqa: S301 - our own bytes
    assert (copy.code, copy.topic, str(copy)) == ("BAD_TOPIC", "a/b", str(error))
