"""An audit row PostgreSQL refuses to write: the change rolls back, the API says why, and the
daemon counts it (/health audit_failures, gateway_audit_failures_total).

The refusal is real: a trigger on the audit tables raises for one actor, as a broken constraint,
a revoked privilege or a full disk would make PostgreSQL refuse the row.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import aiomqtt
import asyncpg

from protocol import Topics
from tests.support.api_client import OPERATOR, ApiClient
from tests.support.daemon import make_config, metric, running_daemon
from tests.support.mosquitto import Mosquitto, events_subscriber
from tests.support.waiting import wait_until

MALLORY = "mallory-token-0123456789abcdef"
REFUSE_AUDIT = """
CREATE FUNCTION refuse_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.actor = 'mallory' THEN
        RAISE EXCEPTION 'audit rows of % are refused here', NEW.actor;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER refuse_audit BEFORE INSERT ON alarm_audit
    FOR EACH ROW EXECUTE FUNCTION refuse_audit();
CREATE TRIGGER refuse_audit BEFORE INSERT ON command_audit
    FOR EACH ROW EXECUTE FUNCTION refuse_audit();
"""
CONFIG = f"""
[[api.tokens]]
token = "{OPERATOR}"
role = "operator"
name = "console"

[[api.tokens]]
token = "{MALLORY}"
role = "operator"
name = "mallory"

[commands]
ack_window_s = 0

[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
"""


async def _snapshot(db: asyncpg.Connection) -> tuple[Any, ...]:
    return (
        [dict(r) for r in await db.fetch("SELECT * FROM alarm ORDER BY id")],
        [dict(r) for r in await db.fetch("SELECT * FROM command ORDER BY id")],
        await db.fetchval("SELECT count(*) FROM alarm_audit"),
        await db.fetchval("SELECT count(*) FROM command_audit"),
        await db.fetchval("SELECT count(*) FROM outbox_event"),
    )


async def test_a_refused_audit_row_rolls_the_action_back_and_is_counted(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    await db.execute(REFUSE_AUDIT)
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, extra=CONFIG)
    async with (
        events_subscriber(mosquitto.port),  # a person's app: the alarm below is pushed
        running_daemon(config) as daemon,
        aiohttp.ClientSession() as http,
    ):
        api = ApiClient(base=f"http://127.0.0.1:{daemon.http_port}", http=http)

        async def audit_failures() -> tuple[int, float]:
            health = await api.get("/health", token=None)
            assert health.status == 200, health.body
            # The snake_case key, and the same count under the old camelCase one (kept).
            assert health.body["audit_failures"] == health.body["auditFailures"], health.body
            return health.body["audit_failures"], metric(daemon, "gateway_audit_failures_total")

        assert await audit_failures() == (0, 0)

        # An alarm, pushed (so that nothing else moves it meanwhile).
        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as device:
            await device.publish(
                Topics("iot").telemetry("door-1"),
                b'{"ts": 1767225600000, "events": [{"type": "DOOR_OPEN"}]}',
                qos=1,
            )

        async def pushed() -> bool:
            return await db.fetchval("SELECT status FROM alarm") == "PUSHED"

        await wait_until(pushed, message="the alarm raised and pushed")
        alarm_id = await db.fetchval("SELECT id FROM alarm")

        # A command, sent (nobody answers; no ack window).
        created = await api.call("POST", "/devices/pump-1/commands", token=OPERATOR,
                                 json={"name": "open_valve"})  # fmt: skip
        assert created.status == 201, created.body
        command_id = created.body["command"]["id"]

        async def sent() -> bool:
            return await db.fetchval("SELECT status FROM command WHERE id = $1", command_id) == (
                "SENT"
            )

        await wait_until(sent, message="the command sent")

        before = await _snapshot(db)
        # The token named mallory acts (the actor is the token's name, not the body's).
        refused = await api.call("POST", f"/alarms/{alarm_id}/confirm", token=MALLORY,
                                 json={"note": "on my way"})  # fmt: skip
        assert refused.status == 500, refused.body
        assert refused.body["error"] == "AUDIT_FAILED"
        assert "rolled back" in refused.body["message"]
        assert await _snapshot(db) == before
        assert await audit_failures() == (1, 1)

        refused = await api.call("POST", f"/commands/{command_id}/cancel", token=MALLORY)
        assert (refused.status, refused.body["error"]) == (500, "AUDIT_FAILED")
        assert await _snapshot(db) == before
        assert await audit_failures() == (2, 2)

        # Anyone else's changes are audited and made as before; nothing more is counted.
        confirmed = await api.call("POST", f"/alarms/{alarm_id}/confirm", token=OPERATOR,
                                   json={"actor": "alice"})  # fmt: skip
        assert (confirmed.status, confirmed.body["status"]) == (200, "CONFIRMED")
        cancelled = await api.call("POST", f"/commands/{command_id}/cancel", token=OPERATOR)
        assert (cancelled.status, cancelled.body["status"]) == (200, "CANCELLED")
        assert await audit_failures() == (2, 2)
        async with http.get(f"{api.base}/metrics") as response:
            assert "gateway_audit_failures_total 2.0" in await response.text()
