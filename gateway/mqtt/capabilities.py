"""What the broker can do, and what the gateway cannot run without.

MQTT 5 says it in the CONNACK's properties (3.2.2.3): shared subscriptions, wildcard
subscriptions, the maximum QoS, retained messages, the maximum packet size. MQTT 3.1.1 says
nothing; there the session proves each subscription with a probe (``gateway.mqtt.session``).

A broker that cannot carry what the configuration asks is refused with one line naming the
setting, rather than run healthy while storing nothing (issue 28): ``shared_group`` on a broker
without shared subscriptions (it would accept the ``$share/...`` filter and deliver nothing), a
broker whose maximum QoS is 0 (the gateway's exactly-once ingest needs QoS 1), a broker
without wildcard subscriptions (every filter of the gateway has a ``+``).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Final

from gateway.mqtt.v311_client import ConnectionSettings

SHARED_GROUP_SETTING: Final = "[mqtt] shared_group (empty: no shared subscription)"
PROTOCOL_SETTING: Final = '[mqtt] protocol ("3.1.1" for a broker without MQTT 5)'
CAPABLE_BROKER_SETTING: Final = (
    "[mqtt] host, [mqtt] port (a broker that can carry QoS 1 and wildcards)"
)


@dataclass(frozen=True, slots=True)
class BrokerCapabilities:
    """What the broker's CONNACK says it can do (MQTT 5, 3.2.2.3); None where it cannot say
    (every field but ``protocol`` on MQTT 3.1.1). An absent MQTT 5 property means "yes", or
    "no limit": the codec reports it so."""

    protocol: str
    shared_subscriptions: bool | None = None
    wildcard_subscriptions: bool | None = None
    max_qos: int | None = None
    retain: bool | None = None
    max_packet_size: int | None = None
    receive_maximum: int | None = None
    session_expiry_s: int | None = None
    server_keep_alive_s: int | None = None
    session_present: bool | None = None

    def fields(self) -> dict[str, object]:
        """For one structured log line (what the protocol cannot say is left out)."""
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True, slots=True)
class Incapable:
    """Why the broker cannot run this configuration, and the setting to change."""

    reason: str
    setting: str


def incapable(caps: BrokerCapabilities, subscriptions: Sequence[str]) -> Incapable | None:
    """The first thing the configuration needs that the broker said it cannot do."""
    shared = [topic for topic in subscriptions if topic.startswith("$share/")]
    if shared and caps.shared_subscriptions is False:
        return Incapable(
            f"the broker has no shared subscriptions (CONNACK: Shared Subscription Available"
            f" 0), so {shared[0]!r} would deliver nothing",
            SHARED_GROUP_SETTING,
        )
    if caps.max_qos == 0:
        return Incapable(
            "the broker's maximum QoS is 0 (CONNACK: Maximum QoS 0); the gateway needs QoS 1"
            " to store every message exactly once",
            CAPABLE_BROKER_SETTING,
        )
    if caps.wildcard_subscriptions is False and any("+" in t or "#" in t for t in subscriptions):
        return Incapable(
            "the broker has no wildcard subscriptions (CONNACK: Wildcard Subscription Available"
            " 0); the gateway subscribes to every device with one `+` filter",
            CAPABLE_BROKER_SETTING,
        )
    return None


_V311_CONNECT_HEADER: Final = b"\x00\x04MQTT\x04\x02"  # protocol name, level 4, clean session
_CONNACK_311: Final = b"\x20\x02"


def _remaining_length(length: int) -> bytes:
    encoded = bytearray()
    while True:
        length, byte = divmod(length, 128)
        encoded.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(encoded)


async def speaks_mqtt311(settings: ConnectionSettings) -> bool:
    """Whether the broker answers an MQTT 3.1.1 CONNECT with a CONNACK (of any return code).

    Asked once, when an MQTT 5 CONNECT got no CONNACK at all: some 3.1.1-only brokers (amqtt)
    wait forever for the rest of a packet they cannot parse. The check connects under another
    client id with a clean session, sends no credentials and disconnects at once, so it never
    touches the gateway's own session."""
    client_id = f"{settings.client_id}-protocol-check".encode()
    payload = _V311_CONNECT_HEADER + struct.pack(">H", 10) + struct.pack(">H", len(client_id))
    packet = b"\x10" + _remaining_length(len(payload) + len(client_id)) + payload + client_id
    ssl_context = settings.tls.context() if settings.tls is not None else None
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(settings.timeout_s):
            reader, writer = await asyncio.open_connection(
                settings.host,
                settings.port,
                ssl=ssl_context,
                server_hostname=settings.host if ssl_context is not None else None,
            )
            writer.write(packet)
            answer = await reader.readexactly(4)
            if answer[:2] != _CONNACK_311:
                return False
            if answer[3] == 0:
                writer.write(b"\xe0\x00")  # DISCONNECT
            return True
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(1):
                    await writer.wait_closed()
