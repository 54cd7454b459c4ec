"""An SMTP server that greylists a recipient (``451``: "try again later", the usual defence of
a mail server against spam, keyed on sender, recipient and client) while it takes the mail for
the others: the greylisted recipient is mailed again, later, and the others are not mailed
twice. A ``451`` is no refusal: the server asks for the mail again."""

from __future__ import annotations

from typing import Any

import asyncpg
from aiosmtpd.controller import Controller

from tests.integration.services.test_notify import (
    Notifier,
    _config,
    _deliveries,
    _drain,
    _email,
    _raised,
    _route,
    _status_is,
)
from tests.support.ports import free_port
from tests.support.receivers import _Handler
from tests.support.waiting import wait_until

ONCALL = "oncall@example.com"
GONE = "gone@example.com"


class _Greylisting(_Handler):
    """Greylists ``ONCALL`` the first ``times`` times it is asked for (451), then takes it;
    refuses ``GONE`` for good (550); takes every other recipient at once."""

    def __init__(self, times: int = 1) -> None:
        super().__init__()
        self.left = times
        self.asked: list[str] = []

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: Any
    ) -> str:
        self.asked.append(address)
        if address == GONE:
            return "550 5.1.1 <gone@example.com>: mailbox unavailable"
        if address == ONCALL and self.left > 0:
            self.left -= 1
            return "451 4.7.1 <oncall@example.com>: greylisted, try again later"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    def mailed(self, address: str) -> int:
        return sum(mail.rcpt_tos.count(address) for mail in self.mails)


async def _mail_through(
    handler: _Greylisting, pool: asyncpg.Pool, dsn: str, db: asyncpg.Connection, to: str
) -> tuple[int, asyncpg.Record]:
    """One alarm mailed to ``to`` through a server with ``handler``: its id and its delivery
    once finished."""
    controller = Controller(handler, hostname="127.0.0.1", port=free_port())
    controller.start()
    try:
        node = Notifier(pool, dsn, _config(_email(controller.port, to=to), _route(["mail"])))
        _event_id, alarm_id = await _raised(db, "pump-7", "MAJOR")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT", "FAILED"), message="finished")
    finally:
        controller.stop()
    [row] = await _deliveries(db)
    return alarm_id, row


async def test_a_greylisted_recipient_is_mailed_again_and_the_others_once(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    handler = _Greylisting()
    alarm_id, row = await _mail_through(handler, pool, db_dsn, db, f'"ops@example.com", "{ONCALL}"')
    # The on-call person gets the alarm, once, at the retry the server asked for; ops, who
    # got it at the first attempt, is not mailed again.
    assert handler.mailed(ONCALL) == 1, [m.rcpt_tos for m in handler.mails]
    assert handler.mailed("ops@example.com") == 1, [m.rcpt_tos for m in handler.mails]
    assert row["status"] == "SENT"
    assert row["attempts"] == 2
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"


async def test_a_recipient_greylisted_on_every_attempt_is_named_and_the_delivery_stays_sent(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    # Greylisted at every attempt (5): ops had it at the first, so the delivery is SENT (as
    # when a server refuses a recipient for good), naming the one it missed; the recipient
    # refused for good (550) was asked for once only.
    handler = _Greylisting(times=99)
    alarm_id, row = await _mail_through(
        handler, pool, db_dsn, db, f'"ops@example.com", "{ONCALL}", "{GONE}"'
    )
    assert handler.mailed("ops@example.com") == 1
    assert handler.mailed(ONCALL) == 0
    assert handler.asked.count(ONCALL) == 5, handler.asked
    assert handler.asked.count(GONE) == 1, handler.asked
    assert row["status"] == "SENT"
    missed = row["last_error"]
    assert ONCALL in missed, missed
    assert "451" in missed, missed
    assert GONE in missed, missed
    assert "550" in missed, missed
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"
