"""What the broker's answers to our publishes mean, and what each caller does about them.

Every reason code MQTT 5 allows in a PUBACK or PUBREC (the same list, MQTT 5 3.4.2.1 and
3.5.2.1), and in a DISCONNECT sent by the server (3.14.2.1), is named here with what it means
for the message. A refusal is one of two kinds:

* **final** (``PublishRefused.final``): sending the same bytes again can never succeed — the
  packet is larger than the broker takes (0x95), its topic (0x90) or payload (0x99) is invalid.
  The caller gives the message up with this reason: a command fails at once, an outbox event
  becomes ``DEAD``. Never a retry, never a reconnect.
* **not final**: the broker refused it now (0x80, 0x83, 0x87 an ACL, 0x91, 0x97 a quota): the
  caller retries it later with its usual backoff; the connection stays up.

0x95 is not among the PUBACK codes MQTT 5 lists, yet mosquitto 2.0 answers it to a publish over
its ``message_size_limit``; it is understood the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import aiomqtt

PACKET_TOO_LARGE: Final = 0x95
# MQTT's own bound on any packet: a remaining length of at most four bytes (MQTT 5 1.5.5).
MQTT_MAX_PACKET: Final = 268_435_455 + 5


@dataclass(frozen=True, slots=True)
class Code:
    name: str
    meaning: str
    final: bool = False


# PUBACK and PUBREC (a QoS 2 answer; we never publish QoS 2, but the codes are the same).
PUBLISH_CODES: Final[dict[int, Code]] = {
    0x00: Code("SUCCESS", "accepted, and the broker had subscribers for it"),
    0x10: Code("NO_MATCHING_SUBSCRIBERS", "accepted; nobody was subscribed"),
    0x80: Code("UNSPECIFIED_ERROR", "refused, without a reason"),
    0x83: Code("IMPLEMENTATION_SPECIFIC_ERROR", "refused by a broker-specific rule"),
    0x87: Code("NOT_AUTHORIZED", "refused by the broker's ACL ([mqtt] username, the ACL)"),
    0x90: Code("TOPIC_NAME_INVALID", "the broker does not take this topic", final=True),
    0x91: Code("PACKET_ID_IN_USE", "the broker still holds this packet id"),
    0x97: Code("QUOTA_EXCEEDED", "over a broker quota (a rate or queue limit)"),
    0x99: Code("PAYLOAD_FORMAT_INVALID", "the broker refused the payload's format", final=True),
    PACKET_TOO_LARGE: Code(
        "PACKET_TOO_LARGE",
        "over the broker's maximum packet size (mosquitto: message_size_limit; set"
        " [mqtt] max_packet_size to it)",
        final=True,
    ),
}

# DISCONNECT from the server (MQTT 5 3.14.2.1): what it says, and the setting that may cause it.
DISCONNECT_CODES: Final[dict[int, Code]] = {
    0x00: Code("NORMAL_DISCONNECTION", "the broker closed the connection normally"),
    0x80: Code("UNSPECIFIED_ERROR", "the broker closed the connection without a reason"),
    0x81: Code("MALFORMED_PACKET", "the broker could not parse a packet of ours"),
    0x82: Code("PROTOCOL_ERROR", "the broker saw a protocol error from us"),
    0x83: Code("IMPLEMENTATION_SPECIFIC_ERROR", "a broker-specific rule"),
    0x87: Code("NOT_AUTHORIZED", "not authorized ([mqtt] username, the broker's ACL)"),
    0x89: Code("SERVER_BUSY", "the broker is busy"),
    0x8B: Code("SERVER_SHUTTING_DOWN", "the broker is shutting down"),
    0x8D: Code("KEEP_ALIVE_TIMEOUT", "the broker heard nothing from us in time"),
    0x8E: Code(
        "SESSION_TAKEN_OVER",
        "another client connected with our client id ([mqtt] client_id, [node] id)",
    ),
    0x8F: Code("TOPIC_FILTER_INVALID", "a topic filter of ours ([mqtt] topic_prefix)"),
    0x90: Code("TOPIC_NAME_INVALID", "a topic of ours ([mqtt] topic_prefix)"),
    0x93: Code("RECEIVE_MAXIMUM_EXCEEDED", "more unacknowledged publishes than it allowed"),
    0x94: Code("TOPIC_ALIAS_INVALID", "a topic alias (we send none)"),
    PACKET_TOO_LARGE: Code(
        "PACKET_TOO_LARGE",
        "a packet of ours was larger than the broker takes ([mqtt] max_packet_size)",
    ),
    0x96: Code("MESSAGE_RATE_TOO_HIGH", "we published faster than the broker allows"),
    0x97: Code("QUOTA_EXCEEDED", "over a broker quota"),
    0x98: Code("ADMINISTRATIVE_ACTION", "an administrator closed the connection"),
    0x99: Code("PAYLOAD_FORMAT_INVALID", "the broker refused a payload's format"),
    0x9A: Code("RETAIN_NOT_SUPPORTED", "the broker takes no retained messages"),
    0x9B: Code("QOS_NOT_SUPPORTED", "the broker does not take QoS 1"),
    0x9C: Code("USE_ANOTHER_SERVER", "the broker sends us elsewhere ([mqtt] host)"),
    0x9D: Code("SERVER_MOVED", "the broker moved ([mqtt] host)"),
    0x9E: Code(
        "SHARED_SUBSCRIPTIONS_NOT_SUPPORTED", "no shared subscriptions ([mqtt] shared_group)"
    ),
    0x9F: Code("CONNECTION_RATE_EXCEEDED", "we connected too often"),
    0xA0: Code("MAXIMUM_CONNECT_TIME", "the broker's connect-time limit passed"),
    0xA1: Code("SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED", "subscription identifiers (we send none)"),
    0xA2: Code(
        "WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED", "no wildcard subscriptions ([mqtt] topic_prefix)"
    ),
}


def publish_code(code: int) -> Code:
    """What a PUBACK/PUBREC reason code means; a code MQTT 5 does not list is a refusal (0x80
    and up) retried later, or an acceptance (below 0x80), as the specification reads them."""
    known = PUBLISH_CODES.get(code)
    if known is not None:
        return known
    if code >= 0x80:
        return Code("UNKNOWN", f"refused with a code MQTT 5 does not list ({code:#04x})")
    return Code("UNKNOWN", f"accepted with a code MQTT 5 does not list ({code:#04x})")


def disconnect_code(code: int) -> Code:
    unknown = Code("UNKNOWN", f"a code MQTT 5 does not list ({code:#04x})")
    return DISCONNECT_CODES.get(code) or unknown


class PublishRefused(aiomqtt.MqttError):
    """The broker refused this message, or would: its PUBACK's reason code (``reason_code``),
    or a packet larger than its maximum packet size (``reason_code`` 0x95, refused before
    sending). ``final``: the same message can never go out (see the module); the connection
    itself is fine either way. ``reason``: the code's name (``PACKET_TOO_LARGE``), the stable
    code a command or event given up for it records."""

    # Never None here; typed as Mqtt5Error has it (MqttPublishError is both).
    reason_code: int | None

    def __init__(self, message: str, *, reason_code: int, final: bool) -> None:
        super().__init__(message)
        self.reason_code = reason_code
        self.final = final
        self.reason = publish_code(reason_code).name


class PacketTooLarge(PublishRefused):
    """The packet is larger than the broker's maximum packet size: refused before sending."""

    def __init__(self, topic: str, size: int, limit: int, source: str) -> None:
        super().__init__(
            f"publish to {topic!r} is {size} bytes, over the broker's maximum packet size"
            f" {limit} ({source})",
            reason_code=PACKET_TOO_LARGE,
            final=True,
        )
        self.topic = topic
        self.size = size
        self.limit = limit


def publish_packet_size(topic: str, payload_size: int, *, qos: int, mqtt5: bool) -> int:
    """The size of a PUBLISH packet without properties (what the gateway sends): fixed header,
    topic, packet id (QoS 1) and, on MQTT 5, an empty property length."""
    remaining = 2 + len(topic.encode()) + (2 if qos else 0) + (1 if mqtt5 else 0) + payload_size
    header = 1
    length = remaining
    while True:
        header += 1
        length >>= 7
        if not length:
            break
    return header + remaining
