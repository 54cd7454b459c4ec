"""The alarm e-mail as mail systems judge it: RFC 5322 asks every message for a ``Date`` and a
``Message-ID``, and neither the gateway's message nor aiosmtplib added them. Gmail's servers
refuse such a mail at the end of its DATA ("550-5.7.1 Messages missing a valid Message-ID
header are not accepted"), and a relay on another host (Postfix, by default) does not add
them. And a mail the server took after the attempt's timeout (at least once: it is sent
again) is only told from its copy, by the mailbox, by the same ``Message-ID``."""

from __future__ import annotations

import asyncio
import re
from datetime import timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import asyncpg
from aiosmtpd.controller import Controller

from tests.integration.services.test_notify import (
    FAST,
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

# RFC 5322 §3.6.4: "<" id-left "@" id-right ">", as Gmail checks it.
MESSAGE_ID_RE = re.compile(r"<[^<>@\s]+@[^<>@\s]+>")


class _Rfc5322Checking(_Handler):
    """Refuses, at the end of DATA, a message without a valid ``Message-ID`` or a ``Date``, in
    the words of Gmail's inbound servers; takes the others."""

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        content = envelope.content.decode(errors="replace")
        head = content.split("\r\n\r\n", 1)[0]
        headers = {line.split(":", 1)[0].lower() for line in head.splitlines() if ":" in line}
        if "message-id" not in headers:
            return (
                "550 5.7.1 Messages missing a valid Message-ID header are not accepted."
                " https://support.google.com/mail/?p=RfcMessageNonCompliant"
            )
        if "date" not in headers:
            return "550 5.7.1 Messages missing a Date header are not accepted (RFC 5322)."
        return await super().handle_DATA(server, session, envelope)


class _SlowToAnswer(_Handler):
    """Takes the mail (it is in ``mails``) and answers its DATA only ``delay_s`` later, the
    first time: the client gave up by then, and sends it again."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        answer = await super().handle_DATA(server, session, envelope)
        if len(self.mails) == 1:
            await asyncio.sleep(self.delay_s)  # the server's slowness, not a test's wait
        return answer


def _controller(handler: _Handler) -> Controller:
    controller = Controller(handler, hostname="127.0.0.1", port=free_port())
    controller.start()
    return controller


async def test_a_server_refusing_mail_without_message_id_or_date_takes_the_alarm_mail(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    handler = _Rfc5322Checking()
    controller = _controller(handler)
    try:
        notify = FAST.replace("max_attempts = 5", "max_attempts = 2")
        node = Notifier(pool, db_dsn, _config(_email(controller.port), _route(["mail"]), notify))
        _event_id, alarm_id = await _raised(db, "pump-7", "MAJOR")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT", "FAILED"), message="finished")
    finally:
        controller.stop()
    [row] = await _deliveries(db)
    assert (row["status"], row["last_error"]) == ("SENT", None), row["last_error"]
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"
    [mail] = handler.mails
    message_id = mail.message["Message-ID"]
    assert MESSAGE_ID_RE.fullmatch(message_id), message_id
    assert message_id.endswith("@example.com>"), message_id  # the sender's domain
    # Dated by the database's clock (the claim), not the sending node's.
    dated = parsedate_to_datetime(mail.message["Date"])
    assert abs(dated - row["finished_at"]) < timedelta(seconds=5), (dated, row["finished_at"])


async def test_a_mail_sent_again_after_a_late_answer_has_the_same_message_id(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    handler = _SlowToAnswer(delay_s=2.0)
    controller = _controller(handler)
    try:
        receivers = _email(controller.port, extra="timeout_s = 0.5")
        node = Notifier(pool, db_dsn, _config(receivers, _route(["mail"])))
        await _raised(db, "pump-7", "MAJOR")
        await _raised(db, "pump-8", "MAJOR")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT", "FAILED"), message="finished")
    finally:
        controller.stop()
    rows = await _deliveries(db)
    assert [r["status"] for r in rows] == ["SENT", "SENT"]
    # The server got one of them twice (the copy it took before answering late, and the
    # retry): the two carry one Message-ID, which the mailbox deduplicates on; the other
    # alarm's mail has its own.
    ids = [mail.message["Message-ID"] for mail in handler.mails]
    assert len(ids) == 3, ids
    assert len(set(ids)) == 2, ids
    assert all(MESSAGE_ID_RE.fullmatch(i) for i in ids), ids
