"""Named SQL blocks of the simulator's own ``.sql`` files (``-- name: <block>`` headers).

The same file format as ``storage``'s queries; ``sim`` keeps its own small loader because it
may import nothing of ours but ``protocol``.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Final

_NAME_LINE: Final = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@cache
def blocks(filename: str) -> MappingProxyType[str, str]:
    """``{name: sql}`` of ``sim/<filename>``; a duplicate or empty block is an error."""
    text = resources.files("sim").joinpath(filename).read_text()
    found: dict[str, str] = {}
    matches = list(_NAME_LINE.finditer(text))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        code = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        if match.group(1) in found or not "".join(code).strip():
            raise ValueError(f"{filename}: block {match.group(1)!r} is duplicated or empty")
        found[match.group(1)] = body
    return MappingProxyType(found)
