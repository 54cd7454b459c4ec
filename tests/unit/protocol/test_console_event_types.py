"""The console's live stream listens for every event type of the catalogue: EventSource hands a
named event only to listeners of its name, so a type missing from the console's list never
reaches a page (the console's stream.js, protocol/events.py)."""

from __future__ import annotations

import re
from pathlib import Path

from protocol.events import EventType

STREAM_JS = Path(__file__).parents[3] / "gateway" / "api" / "console" / "stream.js"


def test_the_console_listens_for_every_event_type() -> None:
    text = STREAM_JS.read_text(encoding="utf-8")
    listed = re.search(r"export const EVENT_TYPES = \[(.*?)\];", text, re.DOTALL)
    assert listed is not None
    names = re.findall(r'"([^"]+)"', listed.group(1))
    assert sorted(names) == sorted([*(t.value for t in EventType), "message"])
