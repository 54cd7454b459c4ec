"""Named SQL blocks loaded from the package's ``.sql`` files.

Each block starts with ``-- name: <block_name>`` followed by a one-line comment that names
its ``$n`` parameters. Blocks are looked up by name once, at import time of the module
that uses them, so a typo fails at start-up rather than on the first message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Final

_NAME_LINE: Final = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


class QueryNotFoundError(KeyError):
    def __init__(self, filename: str, name: str) -> None:
        super().__init__(f"no query named {name!r} in {filename}")
        self.filename = filename
        self.name = name


def parse_blocks(text: str, *, filename: str = "<sql>") -> dict[str, str]:
    """Split a ``.sql`` file into ``{name: sql}``; duplicate or empty blocks are errors."""
    blocks: dict[str, str] = {}
    matches = list(_NAME_LINE.finditer(text))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        name = match.group(1)
        if name in blocks:
            raise ValueError(f"{filename}: query {name!r} is defined twice")
        if not _strip_comments(body):
            raise ValueError(f"{filename}: query {name!r} is empty")
        blocks[name] = body
    return blocks


def _strip_comments(body: str) -> str:
    return "\n".join(
        line for line in body.splitlines() if not line.lstrip().startswith("--")
    ).strip()


class Queries:
    """The named blocks of one ``storage/queries/*.sql`` file."""

    def __init__(self, filename: str, blocks: dict[str, str]) -> None:
        self.filename = filename
        self._blocks = MappingProxyType(blocks)

    def __getitem__(self, name: str) -> str:
        try:
            return self._blocks[name]
        except KeyError:
            raise QueryNotFoundError(self.filename, name) from None

    def names(self) -> list[str]:
        return list(self._blocks)


@cache
def load_queries(filename: str) -> Queries:
    text = resources.files("storage.queries").joinpath(filename).read_text(encoding="utf-8")
    return Queries(filename, parse_blocks(text, filename=filename))


def query_files() -> list[str]:
    return sorted(
        entry.name
        for entry in resources.files("storage.queries").iterdir()
        if entry.name.endswith(".sql")
    )


def lines(values: Sequence[str], separator: str = "\n") -> str:
    """``values`` as one text, a value a line, for ``string_to_array($n, E'\\n')``.

    For the ids a batch sends by the hundred (device ids, rule keys, rule versions: no id
    holds a newline, every one is validated against a pattern first). asyncpg checks every
    element of an array parameter against ``collections.abc`` in Python, two calls a string;
    one text costs none (measured on 500 keys: 1.90 -> 1.51 µs of the gateway's CPU a key
    for lock_states, answer included). A newline in a value is a bug, refused here.
    ``separator``: another one (a list inside a line: ``string_to_array(line, ',')``), which
    no value may hold either.
    """
    text = separator.join(values)
    if text.count(separator) != max(len(values) - 1, 0):
        shown = "newline" if separator == "\n" else repr(separator)
        raise ValueError(f"a value sent as a line holds a {shown}")
    return text
