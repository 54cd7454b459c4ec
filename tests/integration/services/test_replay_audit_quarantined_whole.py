"""A message that killed the process twice is quarantined: dead-lettered unprocessed, and
remembered, so that the same bytes coming back (retained, repeated) are quarantined again
until a successful replay of its letter forgets them (docs/behaviour.md §3). Its letter was
cut to `[ingest] dead_letter_max_bytes` like any other: with that set below
`[mqtt] max_payload_bytes` (or to 0, "size and SHA-256 only"), the letter of a message the
gateway had taken whole for processing was `truncated`, which no replay can ever ingest, so
once the cause was fixed nothing released the message: every arrival was quarantined again,
for as long as it kept coming. A quarantined letter keeps the whole payload (it was small
enough to be processed), and its replay releases it."""

from __future__ import annotations

import asyncpg

from gateway.alarms.engine import AlarmEngine
from gateway.commands.receipts import ReceiptApplier
from gateway.ingest.breaker import CrashLoopBreaker
from gateway.ingest.decoder import MessageDecoder
from gateway.ingest.live_path import LivePath
from gateway.ingest.replay import replay_one
from gateway.support.metrics import Metrics
from protocol import Encoding
from tests.integration.services.test_poison_isolation import RULES, TOPICS, _handle, _sos, _writer


def _decoder() -> MessageDecoder:
    # Payloads up to 64 KiB are taken; a dead letter keeps 16 bytes of its payload.
    return MessageDecoder(TOPICS, Encoding.JSON, 65536, dead_letter_max_bytes=16)


async def test_a_quarantined_message_keeps_its_bytes_and_its_replay_releases_it(
    pool: asyncpg.Pool, db: asyncpg.Connection
) -> None:
    killer = _sos("killer")
    assert len(killer.payload) > 16
    # Two runs die with it in flight, alone (as test_poison_isolation's deaths in a row).
    for _ in range(2):
        breaker = CrashLoopBreaker("node-a")
        await breaker.recover(db)
        await breaker.journal(db, [killer])
    third = _writer(pool, decoder=_decoder())
    await third.recover()
    await _handle(third, [killer])
    letter = await db.fetchrow("SELECT id, payload, payload_size, reason FROM dead_letter")
    assert letter["reason"] == "QUARANTINED"
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 0

    # The cause fixed: its replay stores it, and the message is not quarantined any more.
    metrics = Metrics()
    fixed = LivePath(
        _decoder(), "node-a",
        AlarmEngine(rules=RULES, node_id="node-a", metrics=metrics),
        ReceiptApplier(node_id="node-a", sent_timeout_s=60, metrics=metrics),
    )  # fmt: skip
    outcome = await replay_one(pool, fixed, letter["id"])
    assert outcome is not None
    assert (bytes(letter["payload"]), letter["payload_size"]) == (
        killer.payload,
        len(killer.payload),
    )
    assert (outcome.outcome, outcome.succeeded) == ("stored", True)
    assert await db.fetchval("SELECT count(*) FROM ingest_suspect") == 0
    # The same bytes again: processed (stored once: a redelivery), not quarantined.
    again = _writer(pool, decoder=_decoder())
    await again.recover()
    await _handle(again, [_sos("killer")])
    assert await db.fetchval("SELECT count(*) FROM dead_letter") == 1
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
