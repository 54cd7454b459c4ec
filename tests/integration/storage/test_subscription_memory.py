"""The subscription memory (migrations 0023 and 0038): each filter a client id subscribed to on
a broker, and whether it was proven to deliver there. A filter is unproven until its probe comes
back, stays proven when remembered again, and one probe that comes back empty withdraws the
proof of every filter it covered."""

from __future__ import annotations

import asyncpg

from storage import subscriptions

CLIENT = "gateway-node-1"
BROKER = "127.0.0.1:1883"
TELEMETRY = "iot/devices/+/telemetry"
ACKS = "iot/devices/+/acks"


async def test_a_filter_is_proven_once_its_probe_came_back_and_until_one_does_not(
    db: asyncpg.Connection,
) -> None:
    first = await subscriptions.remember(db, CLIENT, BROKER, [TELEMETRY])
    assert first == {TELEMETRY: False}
    await subscriptions.prove(db, CLIENT, BROKER, [TELEMETRY], proven=True)
    # Remembered again with a new filter: the old one keeps its proof, the new one has none.
    assert await subscriptions.remember(db, CLIENT, BROKER, [TELEMETRY, ACKS]) == {
        TELEMETRY: True,
        ACKS: False,
    }
    await subscriptions.prove(db, CLIENT, BROKER, [TELEMETRY, ACKS], proven=True)
    assert await subscriptions.remember(db, CLIENT, BROKER, [TELEMETRY]) == {
        TELEMETRY: True,
        ACKS: True,  # remembered until unsubscribed, whatever this connect asks for
    }
    # Another broker, another client id: nothing proven there.
    assert await subscriptions.remember(db, CLIENT, "10.0.0.2:1883", [TELEMETRY]) == {
        TELEMETRY: False
    }
    assert await subscriptions.remember(db, "gateway-node-2", BROKER, [TELEMETRY]) == {
        TELEMETRY: False
    }
    await subscriptions.prove(db, CLIENT, BROKER, [TELEMETRY, ACKS], proven=False)
    assert await subscriptions.remember(db, CLIENT, BROKER, [TELEMETRY, ACKS]) == {
        TELEMETRY: False,
        ACKS: False,
    }
    await subscriptions.forget(db, CLIENT, BROKER, [ACKS])
    assert await subscriptions.remember(db, CLIENT, BROKER, [TELEMETRY]) == {TELEMETRY: False}
