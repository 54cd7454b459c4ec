"""A newer release's migration, applied as that release's `gateway run` or `gateway migrate`
would apply it: this release's migrations plus one more, numbered past them, through the same
migrator (its advisory lock, its record, its NOTIFY at the commit)."""

from __future__ import annotations

import asyncpg

from storage.migrate import Migration, migrate, shipped_migrations

# What a newer release might add: a column only its code fills.
FUTURE_SQL = "ALTER TABLE telemetry ADD COLUMN future_note text;\n"


def newer_release_migrations() -> list[Migration]:
    shipped = shipped_migrations()
    return [*shipped, Migration(shipped[-1].version + 1, "future_column", FUTURE_SQL)]


async def migrate_as_newer_release(dsn: str) -> int:
    """Migrate ``dsn`` as the next release would; the schema version it leaves."""
    migrations = newer_release_migrations()
    conn = await asyncpg.connect(dsn)
    try:
        assert await migrate(conn, migrations) == [migrations[-1].version]
    finally:
        await conn.close()
    return migrations[-1].version
