"""Errors raised by the storage layer."""

from __future__ import annotations

from typing import Final

import asyncpg

# The one definition of "the database is away, not refusing the data": after any of these the
# same transaction may succeed later, so callers retry with backoff (ingest keeps the broker's
# messages unacknowledged meanwhile) instead of failing or dead-lettering anything.
TRANSIENT_DB_ERRORS: Final[tuple[type[BaseException], ...]] = (
    # The network, or a call that took too long.
    OSError,
    TimeoutError,
    # Class 08: the connection failed or was lost (ConnectionDoesNotExistError among them).
    asyncpg.PostgresConnectionError,
    # The driver: "connection is closed", "another operation is in progress"...
    asyncpg.InterfaceError,
    # ... and a connection whose backend was terminated mid-protocol: "cannot switch to
    # state 15; another operation (2) is in progress" (pg_terminate_backend under load).
    asyncpg.exceptions.InternalClientError,
    # Class 57: admin or crash shutdown, "the database system is starting up / shutting
    # down" (CannotConnectNowError), a cancelled statement.
    asyncpg.exceptions.OperatorInterventionError,
    # Class 53: disk full, out of memory, too many connections.
    asyncpg.exceptions.InsufficientResourcesError,
    # Class 40: serialization failure, deadlock: retrying is the documented answer.
    asyncpg.exceptions.TransactionRollbackError,
    # Class 58: I/O errors of the server.
    asyncpg.exceptions.PostgresSystemError,
    # A standby after a failover, a lock timeout, a database closed to connections
    # (ALLOW_CONNECTIONS false), a prepared statement invalidated by a migration.
    asyncpg.exceptions.ReadOnlySQLTransactionError,
    asyncpg.exceptions.ObjectNotInPrerequisiteStateError,
    asyncpg.exceptions.InvalidCachedStatementError,
    # Refused at connect or by a privilege taken away: an operator has to act, and until
    # then the messages wait in the broker rather than being dead-lettered one by one.
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
    asyncpg.exceptions.InvalidCatalogNameError,
    asyncpg.exceptions.InsufficientPrivilegeError,
)

# Anything the database or its driver can raise: what a background loop must survive (with
# backoff), whatever it means for the data.
DB_ERRORS: Final[tuple[type[BaseException], ...]] = (*TRANSIENT_DB_ERRORS, asyncpg.PostgresError)


class StorageError(Exception):
    """Root of the storage layer's errors."""


class SchemaTooNewError(StorageError):
    """The database was migrated by a newer release than this one."""

    def __init__(self, database_version: int, known_version: int) -> None:
        super().__init__(
            f"the database schema is at version {database_version}, but this release knows "
            f"migrations up to {known_version} only: install the new release on this node and "
            "start it again; refusing to start against a schema it does not understand"
        )
        self.database_version = database_version
        self.known_version = known_version


class MigrationChecksumError(StorageError):
    """An applied migration differs from the file shipped with this release."""

    def __init__(self, version: int, name: str) -> None:
        super().__init__(
            f"migration {version:04d}_{name} was applied with different contents than the file "
            "shipped now; migrations are immutable once released"
        )
        self.version = version
        self.name = name
