"""storage.sql.lines: the ids a batch sends as one text, split again by PostgreSQL."""

from __future__ import annotations

import pytest

from storage.sql import lines


def test_values_become_one_line_each_and_none_is_an_empty_text() -> None:
    assert lines(["dev-1", "G/N/D", "a:b.c_d-e"]) == "dev-1\nG/N/D\na:b.c_d-e"
    assert lines(["only"]) == "only"
    assert lines([]) == ""


@pytest.mark.parametrize("values", [["dev-1", "dev\n2"], ["\n"], ["a\n"]])
def test_a_value_holding_a_newline_is_refused(values: list[str]) -> None:
    with pytest.raises(ValueError, match="newline"):
        lines(values)
