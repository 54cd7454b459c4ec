"""Audit: config.example.toml's pointers to the docs lead somewhere.

The file is where an operator reads a key; its comments send them on (`docs/deploying.md,
"Message size at the broker"`). Two said "see README, Deploying": the README has no such
section (it moved to docs/deploying.md), so the setting the broker's limit must match was a
dead end. Every `docs/PAGE.md, "Heading"`, `docs/PAGE.md#anchor` and `README, Heading` of the
file must name a page that exists and a heading it has (a quoted heading may be the start of
a longer one); comments wrapped across lines are read joined.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = re.compile(
    r"(?P<page>docs/[a-z-]+\.md|README)(?:#(?P<anchor>[a-z0-9-]+)|, \"?(?P<heading>[^\".;:)]+))?"
)


def _headings(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [h.strip().replace("`", "") for h in re.findall(r"^#+ (.*)$", text, re.M)]


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_pointer_to_the_docs_names_a_page_and_a_heading_it_has() -> None:
    text = (ROOT / "config.example.toml").read_text()
    joined = re.sub(r"\s*\n#\s*", " ", text)  # a comment wrapped over lines, read as one
    broken: list[str] = []
    for match in REFERENCE.finditer(joined):
        page = ROOT / ("README.md" if match["page"] == "README" else match["page"])
        if not page.is_file():
            broken.append(f"{match[0]}: no such page")
            continue
        headings = _headings(page)
        if match["anchor"] and match["anchor"] not in {_anchor(h) for h in headings}:
            broken.append(f"{match[0]}: no such heading")
        heading = (match["heading"] or "").strip().replace("`", "")
        if heading and not any(h.startswith(heading) for h in headings):
            broken.append(f"{match[0]}: no such heading")
    assert not broken, f"config.example.toml: {broken}"
