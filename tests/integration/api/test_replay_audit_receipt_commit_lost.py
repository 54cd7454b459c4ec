"""A command receipt dead-lettered, replayed over the API, the answer to the replay's COMMIT
lost (the database restarted, a failover, the link cut: the server committed, the node cannot
tell): the API answers 503 "retry", and the operator retries, on this node or another (or
double-clicks, or runs `gateway dead-letters replay --id` after the console's). A receipt has
no event id: the retry applied it a second time, a second `command_receipt` row for the one
answer the device sent (judged `duplicated`, counted and logged `receipt_not_applied`), and
the replay said `receipt` as if it had just been applied. A letter replayed successfully
already is done: its receipt is not applied again, and the replay says `duplicate`, as a
telemetry letter's does.

Two API nodes on one database, the first behind a PostgreSQL-reading proxy
(tests/support/pg_cut.py) that cuts when the replay's COMMIT is answered."""

from __future__ import annotations

import aiohttp
import asyncpg

from storage import ingest
from storage.ingest import DeadLetterRow
from tests.integration.api.test_console_api import TOKENS
from tests.integration.services.test_poison_isolation import _acked, _sent_command
from tests.support.api_client import ADMIN, ApiClient
from tests.support.api_server import serve_api
from tests.support.dsn import proxy_for, through
from tests.support.pg_cut import PgCut, Statement


async def test_a_receipt_replay_retried_after_its_commit_answer_was_lost_is_applied_once(
    db: asyncpg.Connection, db_dsn: str
) -> None:
    command = await _sent_command(db)
    acked = _acked(command)
    letter = DeadLetterRow.whole(acked.topic, acked.payload, "STORAGE_REJECTED", "refused")
    await ingest.insert_dead_letters(db, [letter], "node-a")
    letter_id = await db.fetchval("SELECT id FROM dead_letter")
    database = proxy_for(db_dsn)
    await database.start()
    cut = PgCut(database)
    # The letter's replay record written, then the transaction's COMMIT: run, its answer lost.
    cut.arm(Statement("replay_count = replay_count + 1"), Statement("COMMIT"), at="answered")
    try:
        async with (
            serve_api(through(db_dsn, database), TOKENS, '[node]\nid = "node-a"\n') as a,
            serve_api(db_dsn, TOKENS, '[node]\nid = "node-b"\n') as b,
            aiohttp.ClientSession() as http,
        ):
            lost = await ApiClient(a.base, http).call(
                "POST", f"/dead-letters/{letter_id}/replay", token=ADMIN
            )
            assert cut.fired.is_set()
            assert lost.status == 503, lost.body
            retried = await ApiClient(b.base, http).call(
                "POST", f"/dead-letters/{letter_id}/replay", token=ADMIN
            )
    finally:
        await database.stop()
    assert retried.status == 200, retried.body
    assert await db.fetchval("SELECT status FROM command WHERE id = $1", command.id) == "ACKED"
    logged = await db.fetch(
        "SELECT outcome FROM command_receipt WHERE command_id = $1 ORDER BY id", command.id
    )
    assert [r["outcome"] for r in logged] == ["accepted"]
    assert (retried.body["outcome"], retried.body["succeeded"]) == ("duplicate", True)
    row = await db.fetchrow("SELECT replay_count, replay_outcome, replayed_at FROM dead_letter")
    assert (row["replay_count"], row["replay_outcome"]) == (2, "duplicate")
    assert row["replayed_at"] is not None
