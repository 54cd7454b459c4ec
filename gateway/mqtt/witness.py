"""Does the broker close a connection for subscribing, or was the gateway's client id taken?

Two brokers' answers look the same from the gateway's side: RabbitMQ closes the connection on a
subscription its topic permissions deny (instead of answering SUBACK 0x80), and mosquitto 2.0
closes a connection, without a reason code even on MQTT 5, when another client connects with its
client id. Two nodes started with the same id can take each other's connections over while each
is subscribing, twice in a row, which the gateway then took for a denied subscription and exited
on at start, naming the ACL instead of the node id.

A witness tells them apart: a second, short-lived connection with the same credentials under
another client id does what the gateway did while it lost its connections (subscribe to each
filter, publish a probe) and disconnects. The broker's permissions are the credentials', so a
witness the broker lets do all of it shows the losses were not the subscription's.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

import aiomqtt
import structlog

from gateway.mqtt.v5_connection import Mqtt5Connection, MqttTimeoutError
from gateway.mqtt.v311_client import ConnectionSettings, SubscriptionRefusedError
from gateway.mqtt.v311_connection import Mqtt311Connection
from gateway.support.publish_refusal import PublishRefused
from protocol.topics import unshared

log = structlog.get_logger(__name__)

# What the witness's client id ends with (before a random part: two nodes sharing an id must not
# take each other's witness over).
WITNESS_SUFFIX = "-acl-check"


async def closes_subscribing(
    settings: ConnectionSettings,
    filters: Sequence[str],
    probe: tuple[str, bytes] | None,
) -> bool | None:
    """Whether the broker ends a connection of ``settings``' credentials that subscribes to
    ``filters`` (and publishes ``probe``, a topic and a payload, when the gateway probes): True
    when it closed the witness's connection or refused a subscription; False when it granted each
    and took the probe; None when the witness could not tell (it could not connect, or an answer
    did not come in time).

    The witness subscribes at QoS 0 and without a ``$share/<group>/`` prefix, so it never takes
    a message from the gateway's group (a copy at most, which it drops unread), and its session
    is clean and has no Will: nothing of it outlives the check."""
    witness = dataclasses.replace(
        settings,
        client_id=f"{settings.client_id}{WITNESS_SUFFIX}-{secrets.token_hex(3)}",
        persistent_session=False,
        session_expiry_s=0,
        will_topic="",
        will_payload=b"",
    )
    kind = Mqtt5Connection if settings.protocol == "5" else Mqtt311Connection
    connection = kind(witness, buffer_high_bytes=1 << 20)
    try:
        await connection.__aenter__()
    except aiomqtt.MqttError as exc:
        log.info("subscription_witness_unknown", client_id=witness.client_id, error=str(exc))
        return None
    # Whatever the filters deliver is dropped unread (QoS 0 copies); replies are still read.
    connection.stop_intake()
    try:
        for topic_filter in filters:
            await connection.subscribe(unshared(topic_filter), qos=0)
        if probe is not None:
            await connection.publish(probe[0], probe[1], qos=1)
    except SubscriptionRefusedError:
        return True
    except PublishRefused:
        # An MQTT 5 refusal in the PUBACK: answered, not closed (the gateway does not hold a
        # refused probe against its subscriptions either).
        return False
    except MqttTimeoutError as exc:
        log.info("subscription_witness_unknown", client_id=witness.client_id, error=str(exc))
        return None
    except aiomqtt.MqttError:
        return True  # the connection was lost while subscribing or publishing
    finally:
        await connection.close()
    return False
