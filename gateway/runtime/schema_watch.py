"""A running node's watch on the database schema's version, for rolling upgrades.

A cluster is upgraded one node at a time: the first node restarted on the new release migrates
the schema (storage.migrate), while the others still run the old release. Checked at start
only, an old node never noticed: it went on ingesting, deciding rules, claiming commands and
publishing the outbox against a schema whose meaning it does not know (a column only the new
code fills, a changed invariant). Now each migration's commit sends a NOTIFY on
``MIGRATED_CHANNEL``, which every node LISTENs on; at it (and at every ``SCHEMA_POLL_S``, the
fallback for a notification missed while the LISTEN connection was down, or a migration by a
release that sends none) the node reads the schema's version, and one newer than its release
knows stops the node as a SIGTERM would (``on_newer``). The same version, a migration by the
same release, changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

import asyncpg

from gateway.support.loops import drain_on_notify
from storage.migrate import MIGRATED_CHANNEL, latest_version, schema_version

# The fallback's period: one cheap query (the newest version recorded) per node.
SCHEMA_POLL_S: Final = 30.0
# The exit status of a node stopped by a newer schema: a failure to systemd's Restart=on-failure
# (not 2, which the units do not restart), so the unit is started again. Where the new release
# is installed already (gateway@ instances sharing one virtualenv) that start runs it; where it
# is not, that start refuses the schema with exit 2 (not restarted) until the node is upgraded.
EXIT_SCHEMA_UPGRADED: Final = 3


class SchemaWatch:
    """Calls ``on_newer(database_version)`` once the schema is newer than ``known`` (this
    release's newest migration); the caller stops the node."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        dsn: str,
        *,
        on_newer: Callable[[int], None],
        known: int | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.dsn = dsn
        self.on_newer = on_newer
        self.known = latest_version() if known is None else known
        self.poll_s = SCHEMA_POLL_S if poll_s is None else poll_s
        self.checks = 0  # passes done (the tests wait on it)

    async def check_once(self) -> int | None:
        """The schema's version if a newer release migrated it, else None."""
        async with self.pool.acquire() as conn:
            version = await schema_version(conn)
        self.checks += 1
        return version if version > self.known else None

    async def run(self, stop: asyncio.Event) -> None:
        async def step() -> int:
            newer = await self.check_once()
            if newer is not None:
                self.on_newer(newer)
            return 0

        await drain_on_notify(
            dsn=self.dsn,
            channel=MIGRATED_CHANNEL,
            stop=stop,
            step=step,
            poll_s=lambda: self.poll_s,
            name="schema-watch",
        )
