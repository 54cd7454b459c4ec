"""``gateway dead-letters replay`` takes the live path: the configured rules raise alarms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import asyncpg

from protocol import Topics, decode_telemetry, telemetry_event_id
from storage import ingest as repo
from storage.ingest import DeadLetterRow

TOPICS = Topics("iot")
DOOR_RULE = """
[[rules]]
key = "door-open"
kind = "event"
event = "DOOR_OPEN"
severity = "MAJOR"
"""


def _gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


async def test_a_replayed_door_open_raises_its_alarm_once(db_dsn: str, tmp_path: Path) -> None:
    door = b'{"ts": 1767225600000, "events": [{"type": "DOOR_OPEN", "zone": "hall"}]}'
    event_id = telemetry_event_id("door-1", decode_telemetry(door))
    conn = await asyncpg.connect(db_dsn)
    try:
        # Dead-lettered earlier, say because PostgreSQL refused it then: valid bytes.
        letter = DeadLetterRow.whole(
            TOPICS.telemetry("door-1"), door, "STORAGE_REJECTED", "refused at the time"
        )
        await repo.insert_dead_letters(conn, [letter], "gw-1")
        letter_id = await conn.fetchval("SELECT id FROM dead_letter")
    finally:
        await conn.close()
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[node]\nid = "replayer"\n[database]\ndsn = "{db_dsn}"\n[log]\nformat = "json"\n'
        + DOOR_RULE
    )

    async def alarms() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(db_dsn)
        try:
            rows = await conn.fetch(
                "SELECT rule_key, device_id, telemetry_event_id, severity FROM alarm"
            )
            created = await conn.fetchval(
                "SELECT count(*) FROM outbox_event WHERE event_type = 'alarm.created'"
            )
        finally:
            await conn.close()
        return [(*r, created) for r in rows]

    first = _gateway("dead-letters", "replay", "--config", str(config), "--all")
    assert first.returncode == 0, first.stderr
    assert f"{letter_id}\tstored" in first.stdout
    assert await alarms() == [("door-open", "door-1", event_id, "MAJOR", 1)]

    # Again (by id: it is not pending any more): a duplicate, which raises nothing.
    again = _gateway("dead-letters", "replay", "--config", str(config), "--id", str(letter_id))
    assert again.returncode == 0, again.stderr
    assert f"{letter_id}\tduplicate" in again.stdout
    assert await alarms() == [("door-open", "door-1", event_id, "MAJOR", 1)]
