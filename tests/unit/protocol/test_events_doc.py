"""docs/topics-and-payloads.md documents every domain event's payload; the tables there must
be the payload Structs' fields (protocol/events.py), so the doc cannot drift from the code.

Run as a script to print the tables' first two columns from the Structs."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
from msgspec import inspect

from protocol.events import PAYLOADS, AlarmSnapshot, EventType

DOC = Path(__file__).parents[3] / "docs" / "topics-and-payloads.md"
SECTION = "## Domain events"
# How a nested Struct is called in the doc's type column.
NAMES: dict[type, str] = {AlarmSnapshot: "alarm"}


SIMPLE: dict[type[inspect.Type], str] = {
    inspect.NoneType: "null",
    inspect.StrType: "string",
    inspect.IntType: "integer",
    inspect.BoolType: "boolean",
    inspect.DateTimeType: "timestamp",
}


def type_name(t: inspect.Type) -> str:
    """A field's type as the doc writes it."""
    match t:
        case inspect.UnionType(types=types):
            return " or ".join(type_name(member) for member in types)
        case inspect.DictType(value_type=inspect.IntType()):
            return "object of integers"
        case inspect.DictType():
            return "object"
        case inspect.ListType(item_type=inspect.IntType()):
            return "array of integers"
        case inspect.StructType(cls=cls):
            return NAMES[cls]
    return SIMPLE[type(t)]


def fields_of(struct: type[msgspec.Struct]) -> list[tuple[str, str]]:
    """(wire name, type) of each field; "omitted when …" for one left out at its default."""
    info = inspect.type_info(struct)
    assert isinstance(info, inspect.StructType)
    rows = []
    for f in info.fields:
        kind = type_name(f.type)
        if not f.required and struct.__struct_config__.omit_defaults:
            kind += f", omitted when {msgspec.json.encode(f.default).decode()}"
        rows.append((f.encode_name, kind))
    return rows


def documented() -> dict[str, tuple[list[str], list[tuple[str, str]]]]:
    """Each subsection of the doc's section: its Struct's name → (the event types its heading
    names, the (field, type) rows of its table)."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    end = section.find("\n## ", len(SECTION))
    section = section if end < 0 else section[:end]
    found: dict[str, tuple[list[str], list[tuple[str, str]]]] = {}
    for block in section.split("\n### ")[1:]:
        heading, _, body = block.partition("\n")
        struct = re.search(r"^Struct: `(\w+)`", body, re.MULTILINE)
        assert struct is not None, f"no 'Struct: `Name`' line under ### {heading}"
        rows = [
            (m.group(1), m.group(2).strip())
            for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+) \|", body, re.MULTILINE)
        ]
        found[struct.group(1)] = (re.findall(r"`([a-z_]+\.[a-z_]+)`", heading), rows)
    return found


def test_each_event_type_is_documented_under_its_struct() -> None:
    doc = documented()
    for event_type in EventType:
        struct = PAYLOADS[event_type].__name__
        assert struct in doc, f"{struct} ({event_type}) is not documented"
        assert event_type.value in doc[struct][0], f"{event_type} not in {struct}'s heading"
    headed = [name for types, _ in doc.values() for name in types]
    assert sorted(headed) == sorted(t.value for t in EventType)


def test_each_documented_table_is_its_structs_fields() -> None:
    doc = documented()
    structs = {s.__name__: s for s in [*PAYLOADS.values(), *NAMES]}
    assert set(doc) == set(structs)
    for name, (_, rows) in doc.items():
        assert rows == fields_of(structs[name]), f"docs/topics-and-payloads.md: {name}"


if __name__ == "__main__":
    for struct in dict.fromkeys([*PAYLOADS.values(), *NAMES]):
        print(f"Struct: `{struct.__name__}`\n\n| field | type | |\n|---|---|---|")
        for field_name, kind in fields_of(struct):
            print(f"| `{field_name}` | {kind} | |")
        print()
