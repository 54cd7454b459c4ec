"""What the crash-loop breaker's journal holds for a node, as the digests it wrote."""

from __future__ import annotations

import asyncpg

from storage.breaker import DIGEST_BYTES


async def journal_digests(conn: asyncpg.Connection, node_id: str) -> list[bytes]:
    """The node's journal, digest by digest, in order ([] when it has none)."""
    joined = await conn.fetchval("SELECT digests FROM ingest_journal WHERE node_id = $1", node_id)
    if joined is None:
        return []
    return [bytes(joined[at : at + DIGEST_BYTES]) for at in range(0, len(joined), DIGEST_BYTES)]
