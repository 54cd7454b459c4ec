"""The command tables of the docs are the CLI's: every command, and every flag it takes.

docs/operations.md, "Command line", is where an operator looks up what `gateway` can do: each
subcommand has a row, and the row names every flag the command takes (a flag hidden from
`--help` aside). docs/simulator.md's table does the same for `gateway-sim`'s subcommands, its
flags in detail below it. Every flag either table names must be one the command takes.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli.commands import _parser as gateway_parser
from sim.cli import _parser as sim_parser

DOCS = Path(__file__).resolve().parents[3] / "docs"
FLAG = re.compile(r"--[a-z][a-z-]*")


def _leaves(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield words, parser
        return
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*words, name))


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {
        option
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def _rows(doc: str, section: str, program: str) -> dict[tuple[str, ...], set[str]]:
    """The table's rows `| \\`program words [--flags ...]\\` | ...`: the command's words and
    the flags the row names."""
    text = (DOCS / doc).read_text()
    part = text[text.index(section) :]
    end = part.find("\n## ", len(section))
    part = part if end < 0 else part[:end]
    rows: dict[tuple[str, ...], set[str]] = {}
    for match in re.finditer(rf"^\| `{re.escape(program)} ([^`]*)`", part, re.M):
        words = tuple(w for w in match[1].split() if re.fullmatch(r"[a-z][a-z-]*", w))
        rows.setdefault(words, set()).update(FLAG.findall(match[1]))
    return rows


def _row_of(rows: dict[tuple[str, ...], set[str]], command: tuple[str, ...]) -> set[str] | None:
    for words, flags in rows.items():
        if words[: len(command)] == command:
            return flags
    return None


TABLES = [
    ("gateway", gateway_parser, "operations.md", "## Command line", True),
    ("gateway-sim", sim_parser, "simulator.md", "# The simulator", False),
    ("gateway-sim", sim_parser, "operations.md", "## Command line", False),
]


@pytest.mark.parametrize(("program", "make", "doc", "section", "every_flag"), TABLES)
def test_every_command_has_a_row_naming_flags_it_takes(
    program: str,
    make: object,
    doc: str,
    section: str,
    every_flag: bool,
) -> None:
    assert callable(make)
    rows = _rows(doc, section, program)
    missing: list[str] = []
    unknown: dict[str, list[str]] = {}
    unnamed: dict[str, list[str]] = {}
    for command, parser in _leaves(make()):
        name = " ".join((program, *command))
        flags = _row_of(rows, command)
        if flags is None:
            missing.append(name)
            continue
        if flags - _flags(parser):
            unknown[name] = sorted(flags - _flags(parser))
        if every_flag and _flags(parser) - flags:
            unnamed[name] = sorted(_flags(parser) - flags)
    assert not missing, f"docs/{doc}, {section}: no row for {missing}"
    assert not unknown, f"docs/{doc}, {section}: flags the command does not take: {unknown}"
    assert not unnamed, f"docs/{doc}, {section}: flags the row does not name: {unnamed}"
