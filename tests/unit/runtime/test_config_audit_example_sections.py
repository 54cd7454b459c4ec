"""config.example.toml documents every key in its own section.

test_config.py checks that each key's name appears somewhere in the file: a key of one section
passed on another section's line of the same name (`interval_s` in [retention] stood for
[alarms.figures] and [sparkplug] as well, `enabled` in [mqtt.tls] for [ai] and [sparkplug]).
Here each key of each struct, those of the array tables ([[rules]], [[ingest.mappings]] and its
metrics and events, [[notify.receivers]], ...) included, must be named in the part of the file
for its section: from the section's header to the next one, an array table's being the part
where its commented `[[...]]` example is.
"""

from __future__ import annotations

import re
from pathlib import Path

from msgspec import inspect

from gateway.config import Config

EXAMPLE = Path(__file__).resolve().parents[3] / "config.example.toml"


def _blocks() -> list[str]:
    """The file cut at each header that is not commented out, each part with its header."""
    parts: list[str] = [""]
    for line in EXAMPLE.read_text().splitlines():
        if re.match(r"^\[+[a-z_.]+\]+\s*$", line):
            parts.append("")
        parts[-1] += line + "\n"
    return parts


def _struct(t: inspect.Type) -> inspect.StructType | None:
    if isinstance(t, inspect.UnionType):
        members = [m for m in t.types if not isinstance(m, inspect.NoneType)]
        return _struct(members[0]) if len(members) == 1 else None
    if isinstance(t, inspect.ListType):
        return _struct(t.item_type)
    return t if isinstance(t, inspect.StructType) else None


def _keys() -> list[tuple[str, str]]:
    """(section path, key) of every key that holds no table of its own."""
    found: list[tuple[str, str]] = []

    def walk(struct: inspect.StructType, path: str) -> None:
        for field in struct.fields:
            inner = _struct(field.type)
            name = field.encode_name
            if inner is None:
                found.append((path, name))
            else:
                walk(inner, f"{path}.{name}" if path else name)

    root = _struct(inspect.type_info(Config))
    assert root is not None
    walk(root, "")
    return found


def _block_of(section: str, blocks: list[str]) -> str:
    header = re.compile(rf"^#?\s*\[\[?{re.escape(section)}\]\]?(\s|$)", re.M)
    holding = [block for block in blocks if header.search(block)]
    assert holding, f"config.example.toml has no [{section}] (nor a commented [[{section}]])"
    return "".join(holding)


def test_every_key_is_named_in_its_sections_part_of_the_example() -> None:
    blocks = _blocks()
    missing = [
        f"{section}.{key}"
        for section, key in _keys()
        if not re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", _block_of(section, blocks))
    ]
    assert not missing, f"config.example.toml does not document in their section: {missing}"
