"""Replay of dead letters through the normal ingest path.

Each dead letter is decoded again with today's decoder and, if it now passes, stored by
the same ``store`` the live pipeline uses, in one transaction with the dead letter's replay
record. Event ids make a replay of something already stored a harmless duplicate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import asyncpg

from gateway.ingest import Inbound, MessageDecoder, ReceiptApplier, store
from storage import ingest as repo


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    dead_letter_id: int
    outcome: str
    succeeded: bool


async def replay_one(
    pool: asyncpg.Pool,
    decoder: MessageDecoder,
    node_id: str,
    dead_letter_id: int,
    receipts: ReceiptApplier | None = None,
) -> ReplayOutcome | None:
    """None when the id does not exist or another replayer holds it right now."""
    async with pool.acquire() as conn, conn.transaction():
        letter = await repo.lock_dead_letter(conn, dead_letter_id)
        if letter is None:
            return None
        classified = decoder.classify([Inbound(topic=letter.topic, payload=letter.payload)])
        if letter.truncated:
            # Only its first bytes were kept: there is nothing whole to ingest.
            outcome, succeeded = "truncated", False
        elif classified.dead_letters:
            outcome, succeeded = f"still_invalid: {classified.dead_letters[0].reason}", False
        else:
            result = await store(conn, classified, node_id, receipts=receipts)
            if result.telemetry:
                outcome = "stored" if result.stored else "duplicate"
            elif classified.receipts:
                outcome = "receipt"
            else:
                outcome = "presence"
            succeeded = True
        await repo.mark_dead_letter_replayed(conn, dead_letter_id, outcome, succeeded=succeeded)
        return ReplayOutcome(dead_letter_id, outcome, succeeded)


async def pending_ids(pool: asyncpg.Pool, reason: str | None) -> list[int]:
    ids: list[int] = []
    after = 0
    async with pool.acquire() as conn:
        while True:
            page = await repo.list_dead_letters(
                conn, reason=reason, pending_only=True, after_id=after, limit=1000
            )
            if not page:
                return ids
            ids.extend(letter.id for letter in page)
            after = page[-1].id


async def replay(
    pool: asyncpg.Pool,
    decoder: MessageDecoder,
    node_id: str,
    ids: Iterable[int],
    receipts: ReceiptApplier | None = None,
) -> list[ReplayOutcome]:
    outcomes = []
    for dead_letter_id in ids:
        outcome = await replay_one(pool, decoder, node_id, dead_letter_id, receipts)
        if outcome is not None:
            outcomes.append(outcome)
    return outcomes
