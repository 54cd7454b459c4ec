"""Which failed statements are refused audit rows (storage.audit), on the real SQL blocks."""

from __future__ import annotations

import asyncpg
import pytest

from storage import commands, console
from storage.audit import audit_failure, audit_table_written, failed_audit_table
from storage.sql import load_queries, query_files


def test_the_statements_that_write_audit_rows_are_recognised() -> None:
    assert audit_table_written(commands.INSERT_AUDIT) == "command_audit"
    # One statement changing the command and auditing it.
    assert audit_table_written(commands.MARK_SENT) == "command_audit"
    assert audit_table_written(commands.CLAIM_DUE) == "command_audit"
    assert audit_table_written(commands.CANCEL) is None
    assert audit_table_written(commands.GET) is None
    written = {
        audit_table_written(queries[name])
        for queries in map(load_queries, query_files())
        for name in queries.names()
    }
    assert written == {None, "alarm_audit", "command_audit", "dead_letter_audit"}
    # A dead letter's discard: the delete and its audit row in one statement.
    assert audit_table_written(console.DISCARD_DEAD_LETTER) == "dead_letter_audit"
    assert audit_table_written(console.DEAD_LETTER_DISCARDED) is None
    assert audit_table_written("insert  into\n  Alarm_Audit (x) VALUES (1)") == "alarm_audit"
    assert audit_table_written("SELECT * FROM alarm_audit") is None


def _with_table(exc: asyncpg.PostgresError, table: str) -> asyncpg.PostgresError:
    exc.table_name = table  # what PostgreSQL reports for a constraint of that table
    return exc


@pytest.mark.parametrize(
    ("query", "exc", "expected"),
    [
        (commands.INSERT_AUDIT, asyncpg.RaiseError("refused by a trigger"), "command_audit"),
        (commands.INSERT_AUDIT, asyncpg.InsufficientPrivilegeError("revoked"), "command_audit"),
        (commands.INSERT_AUDIT, asyncpg.DiskFullError("no space"), "command_audit"),
        (
            commands.INSERT_AUDIT,
            _with_table(asyncpg.CheckViolationError("actor blank"), "command_audit"),
            "command_audit",
        ),
        # The same statement refused for the command row it changes: not the audit row.
        (commands.MARK_SENT, _with_table(asyncpg.CheckViolationError("x"), "command"), None),
        (commands.MARK_SENT, asyncpg.RaiseError("refused by a trigger"), "command_audit"),
        # Not the row's fault: the connection went, or the transaction had failed already.
        (commands.INSERT_AUDIT, asyncpg.ConnectionFailureError("gone"), None),
        (commands.INSERT_AUDIT, asyncpg.InFailedSQLTransactionError("aborted"), None),
        (commands.INSERT_AUDIT, TimeoutError(), None),
        (commands.CANCEL, asyncpg.RaiseError("refused by a trigger"), None),
    ],
)
def test_a_failure_is_an_audit_failure_only_when_the_audit_row_was_refused(
    query: str, exc: BaseException, expected: str | None
) -> None:
    assert failed_audit_table(query, exc) == expected


def test_an_unmarked_error_is_no_audit_failure() -> None:
    assert audit_failure(asyncpg.RaiseError("x")) is None
    assert audit_failure(ValueError("x")) is None
