"""Errors raised by the storage layer."""

from __future__ import annotations


class StorageError(Exception):
    """Root of the storage layer's errors."""


class SchemaTooNewError(StorageError):
    """The database was migrated by a newer release than this one."""

    def __init__(self, database_version: int, known_version: int) -> None:
        super().__init__(
            f"the database schema is at version {database_version}, but this release knows "
            f"migrations up to {known_version} only: run the newer release (or upgrade this one); "
            "refusing to start against a schema it does not understand"
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
