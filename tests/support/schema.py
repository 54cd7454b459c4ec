"""A database as an older release left it: for the tests of a migration that converts data."""

from __future__ import annotations

import re

import asyncpg

from storage.migrate import CREATE_TABLE, RECORD, shipped_migrations


def version_of(name: str) -> int:
    """The version of the shipped migration called ``name``."""
    return next(m.version for m in shipped_migrations() if m.name == name)


async def schema_before(conn: asyncpg.Connection, version: int) -> None:
    """Every shipped migration older than ``version`` applied and recorded, as the release
    before it left the schema (an empty database)."""
    await conn.execute(CREATE_TABLE)
    for step in shipped_migrations():
        if step.version < version:
            await conn.execute(step.sql)
            await conn.execute(RECORD, step.version, step.name, step.checksum)


def last_migration_table() -> str:
    """The table the last shipped migration alters, or one it makes an index on again (a lock
    on it holds that migration back, as a backup's or a long conversion's would)."""
    found = re.search(r"(?:ALTER TABLE|INDEX \w+ ON) (\w+)", shipped_migrations()[-1].sql)
    assert found, "the last migration alters no table: pick another lock"
    return found.group(1)
