"""Numbered plain-SQL migrations, applied in order under a PostgreSQL advisory lock."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from typing import Final

import asyncpg

from storage.errors import MigrationChecksumError, SchemaTooNewError
from storage.sql import load_queries

# Any constant works as long as every node uses the same one: "gw-migr" in ASCII.
MIGRATION_LOCK_KEY: Final = 0x67772D6D69677200
# The bound of a migration's calls (and of the wait for another node's migration), instead of
# the pool's command timeout (60 s), which is meant for ordinary calls: a migration that
# converts a large table takes longer (0012: about 20 s per million rows), and one cancelled
# at that bound was rolled back and retried, cancelled again, for ever. No practical bound:
# a week (asyncpg cannot lift a connection's command timeout for one call).
MIGRATION_TIMEOUT_S: Final = 7 * 24 * 3600.0
# Notified (payload: the version) at the commit of every migration applied: the running nodes
# LISTEN on it, and one whose release knows fewer migrations stops (gateway.runtime.schema_watch).
MIGRATED_CHANNEL: Final = "schema_migrated"
_FILE_NAME: Final = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_Q = load_queries("migrations.sql")
CREATE_TABLE, LOCK, UNLOCK, APPLIED, RECORD = (
    _Q["create_migration_table"],
    _Q["lock"],
    _Q["unlock"],
    _Q["applied"],
    _Q["record"],
)


# Checksums these migrations were recorded with before their comments' section references
# were reworded to name docs/behaviour.md. Only comment lines changed, so a database that
# recorded the earlier text holds the same schema.
EARLIER_CHECKSUMS: Final[dict[int, frozenset[str]]] = {
    2: frozenset({"2bc1bfe09274e66fbc35398ce30669cc3af345e3de52092078ab61b959182871"}),
    4: frozenset({"103daaa92b91a954ab2c106af39d62d8ea4f537c45825ced9b91faf1c9bbca77"}),
    5: frozenset({"e0609501d9c741588d2f89af0aa77796610df0a2e11cf5ff58df3e52d33187b7"}),
}


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def shipped_migrations() -> list[Migration]:
    migrations = []
    for entry in resources.files("storage.migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            migrations.append(
                Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8"))
            )
    migrations.sort(key=lambda m: m.version)
    versions = [m.version for m in migrations]
    # A release ships every migration: a gap means a file went missing from the package.
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"migration versions must be 1..n without gaps, found {versions}")
    return migrations


def latest_version() -> int:
    shipped = shipped_migrations()
    return shipped[-1].version if shipped else 0


async def migrate(conn: asyncpg.Connection, migrations: list[Migration] | None = None) -> list[int]:
    """Apply every missing migration (``migrations``: this release's, unless given); return
    the versions applied by this call.

    Several nodes may start at once: the advisory lock makes all but one wait, and they
    then find nothing left to do. Each migration commits together with its record and a
    NOTIFY on ``MIGRATED_CHANNEL``, which the running nodes hear at that commit.
    """
    shipped = shipped_migrations() if migrations is None else migrations
    await conn.execute(LOCK, MIGRATION_LOCK_KEY, timeout=MIGRATION_TIMEOUT_S)
    try:
        await conn.execute(CREATE_TABLE)
        applied = {row["version"]: row for row in await conn.fetch(APPLIED)}
        newest = max(applied, default=0)
        latest = shipped[-1].version if shipped else 0
        if newest > latest:
            raise SchemaTooNewError(newest, latest)
        done: list[int] = []
        for migration in shipped:
            row = applied.get(migration.version)
            if row is not None:
                earlier = EARLIER_CHECKSUMS.get(migration.version, frozenset())
                if row["checksum"] != migration.checksum and row["checksum"] not in earlier:
                    raise MigrationChecksumError(migration.version, migration.name)
                continue
            async with conn.transaction():
                await conn.execute(migration.sql, timeout=MIGRATION_TIMEOUT_S)
                await conn.execute(
                    RECORD,
                    migration.version,
                    migration.name,
                    migration.checksum,
                    timeout=MIGRATION_TIMEOUT_S,
                )
                await conn.execute(_Q["notify_migrated"], MIGRATED_CHANNEL, str(migration.version))
            done.append(migration.version)
        return done
    finally:
        await conn.execute(UNLOCK, MIGRATION_LOCK_KEY)


async def schema_version(conn: asyncpg.Connection) -> int:
    if not await conn.fetchval(_Q["migration_table_exists"]):
        return 0
    return int(await conn.fetchval(_Q["schema_version"]))
