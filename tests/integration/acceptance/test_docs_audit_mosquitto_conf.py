"""Audit: the mosquitto.conf settings docs/deploying.md gives can be pasted into mosquitto.conf.

An operator copies the ```conf blocks of "Message size at the broker" and "mosquitto" as they
are. mosquitto 2.0 (Debian 12's 2.0.11) takes a `#` only at the start of a line: a comment line
indented under a setting is "Unknown configuration variable" and the broker does not start,
and a comment after a string setting is part of its value, so `persistence_location DIR  # ...`
is a directory named after the comment, the database is never saved and every session and
queued message is lost at a restart, the very thing the setting is there for.

Each block is run by a real mosquitto with the test's own listener, the documented
`/var/lib/mosquitto/` replaced by the test's directory: it must start, and with persistence on,
save its database in that directory at a clean stop.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.mosquitto import Mosquitto

DEPLOYING = Path(__file__).resolve().parents[3] / "docs" / "deploying.md"
DOCUMENTED_LOCATION = "/var/lib/mosquitto/"


def _conf_blocks() -> list[tuple[str, str]]:
    """Every ```conf block, with the heading it is under."""
    blocks: list[tuple[str, str]] = []
    heading = ""
    text = DEPLOYING.read_text()
    for match in re.finditer(r"^(#+ [^\n]*)$|^```conf\n(.*?)^```$", text, re.M | re.S):
        if match[1]:
            heading = match[1].lstrip("# ")
        else:
            blocks.append((heading, match[2]))
    return blocks


def test_the_blocks_are_found() -> None:
    headings = [heading for heading, _ in _conf_blocks()]
    assert "Message size at the broker" in headings
    assert "mosquitto" in headings


@pytest.mark.parametrize(("heading", "block"), _conf_blocks(), ids=lambda v: str(v)[:30])
def test_a_documented_mosquitto_conf_block_runs_as_documented(
    heading: str, block: str, tmp_path: Path
) -> None:
    location = f"{tmp_path}/"
    settings = block.replace(DOCUMENTED_LOCATION, location)
    broker = Mosquitto(tmp_path, persistence=False, extra_config=settings)
    broker.start()  # raises with mosquitto's own error if the block does not load
    broker.stop()
    if re.search(r"^persistence true", block, re.M):
        assert (tmp_path / "mosquitto.db").is_file(), (
            f"docs/deploying.md, {heading}: no database saved in {location}:\n{broker.log_tail()}"
        )
