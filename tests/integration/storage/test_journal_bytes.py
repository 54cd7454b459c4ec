"""Migration 0037: the crash-loop breaker's journal is one bytea of 16-byte digests. A journal
a node left when it died before the upgrade still counts a death for each of its messages at
the next start, and the journal is written and read back as the breaker wrote it."""

from __future__ import annotations

import asyncpg

from storage import breaker as repo
from storage.migrate import migrate
from tests.support.schema import schema_before, version_of

ONE_BYTEA = version_of("journal_as_one_bytea")
DIGESTS = [bytes([n]) * repo.DIGEST_BYTES for n in (3, 1, 2)]


async def test_a_journal_left_before_the_upgrade_counts_a_death_for_each_message(
    empty_db_dsn: str,
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await schema_before(conn, ONE_BYTEA)
        await conn.execute(
            "INSERT INTO ingest_journal (node_id, digests) VALUES ('died', $1), ('idle', '{}')",
            DIGESTS,
        )
        assert ONE_BYTEA in await migrate(conn)  # and every later one
        kept = await conn.fetch("SELECT node_id, digests FROM ingest_journal ORDER BY node_id")
        assert [(r["node_id"], bytes(r["digests"])) for r in kept] == [
            ("died", b"".join(DIGESTS)),  # in their order
            ("idle", b""),
        ]
        # Stored as it comes: out of line when large, never compressed (digests do not).
        assert (
            await conn.fetchval(
                "SELECT attstorage::text FROM pg_attribute"
                " WHERE attrelid = 'ingest_journal'::regclass AND attname = 'digests'"
            )
            == "e"
        )
        suspects = await repo.recover_journal(conn, "died", remember_days=7)
        assert suspects == dict.fromkeys(DIGESTS, 1)
        assert await repo.recover_journal(conn, "idle", remember_days=7) == suspects
    finally:
        await conn.close()


async def test_the_journal_is_read_back_as_written_and_each_death_counted_once(
    empty_db_dsn: str,
) -> None:
    conn = await asyncpg.connect(empty_db_dsn)
    try:
        await migrate(conn)
        many = [n.to_bytes(repo.DIGEST_BYTES, "big") for n in range(1, 1001)]
        assert await repo.write_journal(conn, "node-a", many, remember_days=7) == {}
        # replaced, not added to
        await repo.write_journal(conn, "node-a", [*many, many[0]], remember_days=7)
        assert bytes(
            await conn.fetchval("SELECT digests FROM ingest_journal WHERE node_id = 'node-a'")
        ) == b"".join([*many, many[0]])
        suspects = await repo.recover_journal(conn, "node-a", remember_days=7)
        assert suspects == dict.fromkeys(many, 1)  # the digest twice in flight: one death
        # The journal's answer: the deaths counted of what it holds that is a suspect.
        assert await repo.write_journal(conn, "node-a", many[:2], remember_days=7) == {
            many[0]: 1,
            many[1]: 1,
        }
        again = await repo.recover_journal(conn, "node-a", remember_days=7)
        assert again == {**suspects, many[0]: 2, many[1]: 2}
        assert await conn.fetchval("SELECT count(*) FROM ingest_journal") == 0
    finally:
        await conn.close()
