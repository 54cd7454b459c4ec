"""What the CONNACK's capabilities refuse (no broker here sends Shared Subscription Available 0
or Wildcard Subscription Available 0: mosquitto always offers both)."""

from __future__ import annotations

from gateway.mqtt.capabilities import (
    CAPABLE_BROKER_SETTING,
    SHARED_GROUP_SETTING,
    BrokerCapabilities,
    incapable,
)
from gateway.mqtt.session import _probe_topic

PLAIN = ["iot/devices/+/telemetry", "iot/devices/+/acks", "iot/devices/+/status"]
SHARED = ["$share/g/iot/devices/+/telemetry", "$share/g/iot/devices/+/acks", PLAIN[2]]


def test_a_broker_saying_nothing_is_taken_at_its_word() -> None:
    assert incapable(BrokerCapabilities(protocol="3.1.1"), SHARED) is None
    assert incapable(BrokerCapabilities(protocol="5", max_qos=2), SHARED) is None


def test_shared_group_without_shared_subscriptions_names_shared_group() -> None:
    caps = BrokerCapabilities(protocol="5", shared_subscriptions=False)
    why = incapable(caps, SHARED)
    assert why is not None
    assert why.setting == SHARED_GROUP_SETTING
    assert "'$share/g/iot/devices/+/telemetry'" in why.reason
    assert incapable(caps, PLAIN) is None  # no shared_group: nothing is missing


def test_qos_0_only_and_no_wildcards_name_the_broker() -> None:
    for caps in (
        BrokerCapabilities(protocol="5", max_qos=0),
        BrokerCapabilities(protocol="5", wildcard_subscriptions=False),
    ):
        why = incapable(caps, PLAIN)
        assert why is not None
        assert why.setting == CAPABLE_BROKER_SETTING


def test_the_probe_topic_is_one_each_filter_matches() -> None:
    assert _probe_topic(SHARED[0]) == "iot/devices/gateway-probe/telemetry"
    assert _probe_topic(PLAIN[2]) == "iot/devices/gateway-probe/status"
