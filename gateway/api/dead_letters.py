"""Dead letters over HTTP (behaviour §3), for admins: the list, and a replay through the same
path as ``gateway dead-letters replay`` (:mod:`gateway.ingest.replay`)."""

from __future__ import annotations

from typing import Annotated, Any, Final

import structlog
from litestar import Request
from litestar.params import Parameter

from gateway.api.auth import CallDep, Role
from gateway.api.errors import DEAD_LETTER_NOT_FOUND, UNAVAILABLE, ApiError
from gateway.api.params import Before, DeadLetterId, Limit, page
from gateway.api.routes import route
from gateway.api.schemas import (
    LIMIT_DEFAULT,
    DeadLetter,
    DeadLetterPage,
    Replayed,
    exact,
    from_row,
)
from gateway.api.services import Pool, services_of
from gateway.ingest.replay import replay_one
from storage import console as repo

log = structlog.get_logger(__name__)

TAG: Final = "dead-letters"


@route(
    "GET",
    "/dead-letters",
    summary="List dead letters, newest first (keyset pagination by id)",
    operation_id="listDeadLetters",
    tag=TAG,
    role=Role.ADMIN,
)
async def list_dead_letters(
    pool: Pool,
    *,
    reason: Annotated[
        str | None,
        Parameter(
            pattern=r"^[A-Z_]{1,64}$",
            schema_extra=exact("string"),
            description="Only this reason code (e.g. `MALFORMED`).",
        ),
    ] = None,
    limit: Limit = LIMIT_DEFAULT,
    before: Before = None,
) -> DeadLetterPage:
    rows = await repo.dead_letter_page(pool, reason=reason, before=before, limit=limit + 1)
    items, next_before = page(rows, limit, lambda r: from_row(DeadLetter, r))
    return DeadLetterPage(dead_letters=items, next_before=next_before)


@route(
    "POST",
    "/dead-letters/{id:str}/replay",
    summary="Replay the dead letter through the normal ingest path",
    operation_id="replayDeadLetter",
    tag=TAG,
    role=Role.ADMIN,
    errors=[DEAD_LETTER_NOT_FOUND],
    description=(
        "Decoded again with today's decoder and, if it passes now, stored as live traffic is "
        "(rules, receipts, presence) in one transaction with the letter's replay record. A "
        "letter replayed by another request at this very moment answers 503 (retry)."
    ),
)
async def replay_dead_letter(
    request: Request[Any, Any, Any], pool: Pool, call: CallDep, id: DeadLetterId
) -> Replayed:
    path = services_of(request).replay()
    outcome = await replay_one(pool, path, id)
    if outcome is None:
        if not await repo.dead_letter_exists(pool, id):
            raise ApiError(DEAD_LETTER_NOT_FOUND, f"no dead letter {id}", dead_letter_id=id)
        raise ApiError(UNAVAILABLE, "another replay holds this dead letter right now; retry")
    log.info(
        "dead_letter_replayed",
        dead_letter_id=id,
        outcome=outcome.outcome,
        actor=call.caller.name,
        request_id=call.request_id,
    )
    return Replayed(dead_letter_id=id, outcome=outcome.outcome)


HANDLERS: Final = [list_dead_letters, replay_dead_letter]
