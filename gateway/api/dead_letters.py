"""Dead letters over HTTP (behaviour §3), for admins: the list, one letter with its payload, a
replay through the same path as ``gateway dead-letters replay`` (:mod:`gateway.ingest.replay`),
and a discard (deleted, with its audit row in ``dead_letter_audit``)."""

from __future__ import annotations

from typing import Annotated, Any, Final

import structlog
from litestar import Request
from litestar.params import Parameter

from gateway.api.auth import CallDep, Role
from gateway.api.errors import (
    DEAD_LETTER_BUSY,
    DEAD_LETTER_DISCARDED,
    DEAD_LETTER_NOT_FOUND,
    REPLAY_CRASHED,
    UNAVAILABLE,
    ApiError,
)
from gateway.api.params import Before, DeadLetterId, Limit, page
from gateway.api.routes import route
from gateway.api.schemas import (
    LIMIT_DEFAULT,
    DeadLetter,
    DeadLetterDetail,
    DeadLetterDiscarded,
    DeadLetterPage,
    Replayed,
    exact,
)
from gateway.api.services import Pool, services_of
from gateway.domain.dead_letter import why_never_replayable
from gateway.ingest.breaker import QUARANTINED
from gateway.ingest.replay import ReplayOutcome, replay_one
from gateway.ingest.replay_process import ReplayCrashedError
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
    items, next_before = page(rows, limit, _letter)
    return DeadLetterPage(items=items, dead_letters=items, next_before=next_before)


def _fields(row: Any) -> dict[str, Any]:
    why = why_never_replayable(row["reason"], size=row["size"], kept=row["kept"])
    return {
        **{name: row[name] for name in DeadLetter.__struct_fields__ if name in row},
        "replayable": why is None,
        "not_replayable_because": why,
    }


def _letter(row: Any) -> DeadLetter:
    return DeadLetter(**_fields(row))


def _text(payload: bytes) -> str | None:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        return None


@route(
    "GET",
    "/dead-letters/{id:str}",
    summary="One dead letter with its payload (hex, and text when it is UTF-8)",
    operation_id="getDeadLetter",
    tag=TAG,
    role=Role.ADMIN,
    errors=[DEAD_LETTER_NOT_FOUND],
    description=(
        "The payload as kept (at most `[ingest] dead_letter_max_bytes`; `kept` < `size` means "
        "it was truncated): every byte in `payload_hex`, and `payload_text`, the same bytes "
        "read as UTF-8, or null when they are not UTF-8."
    ),
)
async def get_dead_letter(pool: Pool, id: DeadLetterId) -> DeadLetterDetail:
    row = await repo.dead_letter(pool, id)
    if row is None:
        raise ApiError(DEAD_LETTER_NOT_FOUND, f"no dead letter {id}", dead_letter_id=id)
    payload = bytes(row["payload"])
    return DeadLetterDetail(
        **_fields(row),
        payload_hex=payload.hex(),
        payload_text=_text(payload),
        payload_sha256=row["payload_sha256"],
        seen_count=row["seen_count"],
        last_seen_at=row["last_seen_at"],
    )


@route(
    "POST",
    "/dead-letters/{id:str}/replay",
    summary="Replay the dead letter through the normal ingest path",
    operation_id="replayDeadLetter",
    tag=TAG,
    role=Role.ADMIN,
    errors=[DEAD_LETTER_NOT_FOUND, REPLAY_CRASHED],
    description=(
        "Decoded again with today's decoder and, if it passes now, stored as live traffic is "
        "(rules, receipts, presence) in one transaction with the letter's replay record. A "
        "letter replayed by another request at this very moment answers 503 (retry). A "
        "`QUARANTINED` letter (a message the process died of twice) is replayed in a process "
        "of its own, as `gateway dead-letters replay --id N` with the node's configuration "
        "file: if that process dies too (the cause is not fixed), 422 `REPLAY_CRASHED` says "
        "how it ended, the letter is unchanged, and this node goes on."
    ),
)
async def replay_dead_letter(
    request: Request[Any, Any, Any], pool: Pool, call: CallDep, id: DeadLetterId
) -> Replayed:
    services = services_of(request)
    letter = await repo.dead_letter(pool, id)
    if letter is None:
        raise ApiError(DEAD_LETTER_NOT_FOUND, f"no dead letter {id}", dead_letter_id=id)
    outcome: ReplayOutcome | None
    if letter["reason"] == QUARANTINED:
        # What killed the process twice may kill it again (only a replay tells whether the
        # cause is fixed): in a process of its own, never in the node serving ingest.
        try:
            outcome = await services.replay_apart().replay_one(id)
        except ReplayCrashedError as exc:
            raise ApiError(
                REPLAY_CRASHED,
                f"the process replaying dead letter {id} ended without an outcome "
                f"({exc.ended}). Nothing was changed: the letter is still QUARANTINED, and "
                "this node goes on",
                dead_letter_id=id,
                ended=exc.ended,
            ) from None
    else:
        outcome = await replay_one(pool, services.replay(), id)
    if outcome is None:
        if not await repo.dead_letter_exists(pool, id):
            raise ApiError(DEAD_LETTER_NOT_FOUND, f"no dead letter {id}", dead_letter_id=id)
        # Held: by a replay (another request, another node, the command), or by the live
        # path counting a repeat of its message, or by maintenance pruning it; it said "another
        # replay" whoever held it.
        raise ApiError(
            UNAVAILABLE,
            f"dead letter {id} is held by another transaction right now (a replay, the live "
            "path counting a repeat of its message, or maintenance); nothing changed, retry",
            dead_letter_id=id,
        )
    log.info(
        "dead_letter_replayed",
        dead_letter_id=id,
        outcome=outcome.outcome,
        actor=call.caller.name,
        request_id=call.request_id,
    )
    return Replayed(dead_letter_id=id, outcome=outcome.outcome, succeeded=outcome.succeeded)


@route(
    "DELETE",
    "/dead-letters/{id:str}",
    summary="Discard the dead letter: deleted, with an audit row naming who",
    operation_id="discardDeadLetter",
    tag=TAG,
    role=Role.ADMIN,
    writes=True,
    errors=[DEAD_LETTER_NOT_FOUND, DEAD_LETTER_DISCARDED, DEAD_LETTER_BUSY],
    description=(
        "The letter is deleted and `dead_letter_audit` keeps what it was (topic, reason, size, "
        "SHA-256 of the whole payload, its replays) with the token's name, in one transaction. "
        "A letter discarded already is 409 `ALREADY_DISCARDED` with who did it and when; one "
        "another transaction holds at this very moment (a replay, the live path counting a "
        "repeat of its message, maintenance) is 409 `DEAD_LETTER_BUSY`. No request body."
    ),
)
async def discard_dead_letter(
    request: Request[Any, Any, Any], pool: Pool, call: CallDep, id: DeadLetterId
) -> DeadLetterDiscarded:
    node_id = services_of(request).replay().node_id
    try:
        discarded, now = await repo.discard_dead_letter(
            pool, id, actor=call.caller.name, node_id=node_id, request_id=call.request_id
        )
    except repo.DiscardBusyError:
        raise ApiError(
            DEAD_LETTER_BUSY,
            f"dead letter {id} is held by another transaction right now (a replay, the live "
            "path counting a repeat of its message, or maintenance)",
            dead_letter_id=id,
        ) from None
    if discarded is None:
        raise ApiError(DEAD_LETTER_NOT_FOUND, f"no dead letter {id}", dead_letter_id=id)
    if not now:
        raise ApiError(
            DEAD_LETTER_DISCARDED,
            f"{discarded.actor} discarded dead letter {id} already",
            dead_letter_id=id,
            actor=discarded.actor,
            discarded_at=discarded.at,
        )
    log.info(
        "dead_letter_discarded",
        dead_letter_id=id,
        actor=call.caller.name,
        request_id=call.request_id,
    )
    return DeadLetterDiscarded(
        dead_letter_id=id, discarded_by=discarded.actor, discarded_at=discarded.at
    )


HANDLERS: Final = [list_dead_letters, get_dead_letter, replay_dead_letter, discard_dead_letter]
