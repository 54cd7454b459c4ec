from __future__ import annotations

import re

import pytest

from storage.sql import QueryNotFoundError, load_queries, parse_blocks, query_files


def test_blocks_are_split_by_name() -> None:
    blocks = parse_blocks("-- name: a\n-- $1 x\nSELECT $1;\n\n-- name: b\nSELECT 2;\n")
    assert blocks == {"a": "-- $1 x\nSELECT $1;", "b": "SELECT 2;"}


def test_duplicate_and_empty_blocks_are_errors() -> None:
    with pytest.raises(ValueError, match="twice"):
        parse_blocks("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")
    with pytest.raises(ValueError, match="empty"):
        parse_blocks("-- name: a\n-- only a comment\n")


def test_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(QueryNotFoundError, match=re.escape("no query named 'nope' in ingest.sql")):
        load_queries("ingest.sql")["nope"]


def test_every_file_has_blocks() -> None:
    assert "ingest.sql" in query_files()
    for name in query_files():
        assert load_queries(name).names()
