"""Audit: Tasmota writes its `Time` in one of the formats its `Time` command sets
(arendst/Tasmota, `CmndTime`): `Time 1` (the default) `{"Time":"2019-09-04T14:31:29"}`, local
time without an offset; `Time 2` `{"Time":"2019-09-04T14:31:29","Epoch":1567600289}`, the same
with the UTC epoch beside it; `Time 3` `{"Time":1567600289}`, the UTC epoch alone; `Time 4`
with milliseconds. The `tasmota` profile read only the ISO string: a device set to `Time 3` had
every reading refused (`MAPPING_BAD_TIMESTAMP`, "not a string"), and one set to `Time 2` in
UTC+1 (the profile's zone is UTC unless the mapping names the devices') was dated an hour
ahead although the payload carried its instant, with `Epoch` stored as a metric of its own.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

import aiomqtt
import asyncpg

from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until

CONFIG: Final = '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'
# 2026-12-07T08:31:00Z, shown in UTC+1 (a device in Berlin) as 09:31:00.
EPOCH: Final = 1796632260
AT: Final = datetime.fromtimestamp(EPOCH, UTC)


async def test_every_time_format_of_tasmota_is_read_at_its_instant(
    db_dsn: str, db: asyncpg.Connection, mosquitto: Mosquitto
) -> None:
    port = mosquitto.port
    readings = {
        # `Time 2`: local time (UTC+1) and the UTC epoch.
        "plug-iso-epoch": f'{{"Time":"2026-12-07T09:31:00","Epoch":{EPOCH},'
        '"ENERGY":{"Power":12}}',
        # `Time 3`: the UTC epoch alone.
        "plug-epoch": f'{{"Time":{EPOCH},"ENERGY":{{"Power":13}}}}',
        # `Time 1` with `SetOption52 1` (the offset appended): read as before.
        "plug-iso": '{"Time":"2026-12-07T09:31:00+01:00","ENERGY":{"Power":14}}',
    }
    async with running_daemon(make_config(dsn=db_dsn, mqtt_port=port, extra=CONFIG)):
        async with aiomqtt.Client("127.0.0.1", port, identifier="tasmota-fleet") as fleet:
            for device, body in readings.items():
                await fleet.publish(f"tele/{device}/SENSOR", body.encode(), qos=1)

        async def all_read() -> bool:
            handled = await db.fetchval(
                "SELECT (SELECT count(*) FROM telemetry) + (SELECT count(*) FROM dead_letter)"
            )
            return bool(handled >= len(readings))

        await wait_until(all_read, timeout=30, message="the three readings handled")
    letters = await db.fetch("SELECT topic, reason, detail FROM dead_letter ORDER BY topic")
    assert [dict(r) for r in letters] == [], "a Tasmota time format refused"
    rows = await db.fetch("SELECT device_id, ts, metrics FROM telemetry ORDER BY device_id")
    assert {r["device_id"]: r["ts"] for r in rows} == dict.fromkeys(readings, AT)
    assert all("Epoch" not in r["metrics"] for r in rows), "the time stored as a metric"
