"""Noticing an audit row PostgreSQL refused to write.

Every audit row (``alarm_audit``, ``command_audit``, ``dead_letter_audit``) is written in the
transaction of the change it records, so when PostgreSQL refuses the row the change rolls back
with it: nothing happens unaudited. The change did not happen either, though, and operators
need to see that. Pooled connections are :class:`AuditedConnection`: when a statement that
writes audit rows is refused, the pool's hook hears of it (the daemon counts it) and the
exception is marked, so that the HTTP API can answer with a precise code (:func:`audit_failure`).

Statements are recognised by their SQL (``INSERT INTO alarm_audit`` / ``command_audit`` /
``dead_letter_audit``), not by the function that sent them: whoever writes audit rows, and
however the SQL is arranged (a CTE updating the row and auditing it in one statement), is
covered.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, ClassVar, Final

import asyncpg

AUDIT_TABLES: Final = ("alarm_audit", "command_audit", "dead_letter_audit")
_WRITES_AUDIT: Final = re.compile(
    r"\bINSERT\s+INTO\s+(" + "|".join(AUDIT_TABLES) + r")\b", re.IGNORECASE
)
# Not the audit row's fault: the connection went away, an earlier statement of the same
# transaction failed already (and was counted then, if it was an audit write), or the database
# rolled the transaction back (class 40: a deadlock, a serialization failure) while the row
# waited or was written. That one was named AUDIT_FAILED ("its audit row could not be
# written") and counted as a refused row; it is the rollback it is, as anywhere else. Nor is
# a lock wait that outlived the change's bound (55P03, storage.pool.bound_lock_wait): the
# statement waited for a lock another transaction holds (the audit table itself, held by a
# schema change or an index being built; a row the same statement locks, or the row its
# foreign key names), and PostgreSQL gave up waiting. That is the held row or table it is
# (503, retry), marked for the caller (:func:`audit_lock_wait`), never a refused row. Nor is
# a cancelled statement (57014: a DBA's statement_timeout on the role or the database, cut
# while the row waited for its table or a row; a cancel request): PostgreSQL stopped the
# statement, whatever it was writing. It was counted and answered AUDIT_FAILED.
_NOT_THE_ROW: Final = (
    asyncpg.PostgresConnectionError,
    asyncpg.InFailedSQLTransactionError,
    asyncpg.exceptions.TransactionRollbackError,
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.exceptions.QueryCanceledError,
)
_MARK: Final = "gateway_audit_table"
_WAITED: Final = "gateway_audit_table_waited"
_AT: Final = "gateway_lock_wait_at"

# Called with the audit table and the error, on the event loop, before the error propagates.
AuditFailureHook = Callable[[str, asyncpg.PostgresError], None]


@functools.lru_cache(maxsize=512)
def audit_table_written(query: str) -> str | None:
    """The audit table ``query`` inserts into, if any (SQL comes from a fixed set of blocks)."""
    found = _WRITES_AUDIT.search(query)
    return None if found is None else found.group(1).lower()


def failed_audit_table(query: str, exc: BaseException) -> str | None:
    """The audit table whose row ``exc`` kept ``query`` from writing; None when it was not that.

    A statement that also writes another table (an UPDATE and its audit row in one CTE) failed
    because of that other table when PostgreSQL names it (a constraint of the command row).
    """
    if not isinstance(exc, asyncpg.PostgresError) or isinstance(exc, _NOT_THE_ROW):
        return None
    table = audit_table_written(query)
    if table is None:
        return None
    named = getattr(exc, "table_name", None)
    if named and named != table:
        return None
    return table


def _marked(exc: BaseException, mark: str) -> str | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        table = getattr(current, mark, None)
        if isinstance(table, str):
            return table
        current = current.__cause__ or current.__context__
    return None


def audit_failure(exc: BaseException) -> str | None:
    """The audit table, if ``exc`` (or what caused it) is a refused audit row."""
    return _marked(exc, _MARK)


def mark_lock_wait(exc: BaseException, relation: str) -> None:
    """Mark a lock wait past its bound (``LockNotAvailableError``) with the relation whose
    lock its statement waited for (the innermost mark stands): its caller names that, not
    the row it holds already."""
    if isinstance(exc, asyncpg.exceptions.LockNotAvailableError) and not hasattr(exc, _AT):
        setattr(exc, _AT, relation)


def lock_wait_at(exc: BaseException) -> str | None:
    """The relation :func:`mark_lock_wait` marked ``exc`` (or what caused it) with."""
    return _marked(exc, _AT)


def audit_lock_wait(exc: BaseException) -> str | None:
    """The audit table, if ``exc`` (or what caused it) is a lock wait past its bound
    (``LockNotAvailableError``) of a statement that writes that table's rows: a statement
    that only inserts its audit row waited for the table (no row of it is shared)."""
    return _marked(exc, _WAITED)


class AuditedConnection(asyncpg.Connection):  # type: ignore[misc]  # asyncpg is untyped
    """A connection that reports refused audit rows to its class's :attr:`audit_hooks`.

    The statement methods the repositories use are wrapped; asyncpg runs its own statements
    (BEGIN, COMMIT) through ``execute`` too, which costs one ``try`` each.
    """

    # A tuple, not a plain attribute: a function stored on the class would bind as a method.
    audit_hooks: ClassVar[tuple[AuditFailureHook, ...]] = ()

    def _refused(self, query: str, exc: asyncpg.PostgresError) -> None:
        if isinstance(exc, asyncpg.exceptions.LockNotAvailableError):
            waited = audit_table_written(query)
            if waited is not None and not hasattr(exc, _WAITED):
                setattr(exc, _WAITED, waited)
            return
        table = failed_audit_table(query, exc)
        if table is None or hasattr(exc, _MARK):
            return
        setattr(exc, _MARK, table)
        for hook in self.audit_hooks:
            hook(table, exc)

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute(query, *args, **kwargs)
        except asyncpg.PostgresError as exc:
            self._refused(query, exc)
            raise

    async def executemany(self, command: str, args: Any, **kwargs: Any) -> Any:
        try:
            return await super().executemany(command, args, **kwargs)
        except asyncpg.PostgresError as exc:
            self._refused(command, exc)
            raise

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().fetch(query, *args, **kwargs)
        except asyncpg.PostgresError as exc:
            self._refused(query, exc)
            raise

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().fetchrow(query, *args, **kwargs)
        except asyncpg.PostgresError as exc:
            self._refused(query, exc)
            raise

    async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().fetchval(query, *args, **kwargs)
        except asyncpg.PostgresError as exc:
            self._refused(query, exc)
            raise

    async def fetchmany(self, query: str, args: Any, **kwargs: Any) -> Any:
        try:
            return await super().fetchmany(query, args, **kwargs)
        except asyncpg.PostgresError as exc:
            self._refused(query, exc)
            raise
