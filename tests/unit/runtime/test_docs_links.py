"""Every relative link of the README and docs/ reaches a file, and its #anchor a heading there.

A link to an anchor that no heading makes (a bold paragraph's words, a heading renamed) opens
the page at its top, and the reader is left to search for what the sentence points at.
Anchors are made as GitHub makes them: the heading's text lower-cased, backticks and other
punctuation dropped, spaces as `-`, a repeated one suffixed `-1`, `-2`, ...
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        if anchor in seen:
            seen[anchor] += 1
            anchor = f"{anchor}-{seen[anchor]}"
        else:
            seen[anchor] = 0
        found.add(anchor)
    return found


def test_every_relative_link_and_anchor_resolves() -> None:
    broken: list[str] = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for path, anchor in LINK.findall(text):
            if re.match(r"[a-z]+:", path):
                continue  # http:, https:, mailto:
            target = (page.parent / path).resolve() if path else page
            name = f"{page.relative_to(ROOT)}: ({path}#{anchor})"
            if not target.exists():
                broken.append(f"{name}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{name}: no such heading")
    assert not broken, broken
