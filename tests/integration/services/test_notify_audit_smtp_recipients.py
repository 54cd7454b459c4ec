"""An SMTP server that takes the mail for some recipients of ``to`` and refuses the others
(a mailbox gone, a relay not allowed for that domain): the delivery is the mail the server
took, and the recipients it refused are not lost without a trace."""

from __future__ import annotations

from typing import Any

import asyncpg
from aiosmtpd.controller import Controller
from structlog.testing import capture_logs

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

GONE = "gone@example.com"


class _Refusing(_Handler):
    """Takes every recipient but ``GONE``, which it refuses for good (550)."""

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: Any
    ) -> str:
        if address == GONE:
            return "550 5.1.1 <gone@example.com>: mailbox unavailable"
        envelope.rcpt_tos.append(address)
        return "250 OK"


async def test_a_recipient_the_smtp_server_refuses_shows_on_the_delivery_and_in_the_log(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    handler = _Refusing()
    controller = Controller(handler, hostname="127.0.0.1", port=free_port())
    controller.start()
    try:
        receivers = _email(controller.port, to=f'"ops@example.com", "{GONE}"')
        node = Notifier(pool, db_dsn, _config(receivers, _route(["mail"])))
        _event_id, alarm_id = await _raised(db, "pump-7", "MAJOR")
        await _drain(node.consumer)
        with capture_logs() as logs:
            async with node.running():
                await wait_until(lambda: _status_is(db, "SENT", "FAILED"), message="finished")
    finally:
        controller.stop()
    # The server took the mail for ops: one person was reached, and the alarm says so.
    [mail] = handler.mails
    assert mail.rcpt_tos == ["ops@example.com"]
    [row] = await _deliveries(db)
    assert row["status"] == "SENT"
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"
    # The recipient it refused is not dropped silently: the delivery and the log name it.
    assert GONE in (row["last_error"] or ""), row["last_error"]
    assert "550" in row["last_error"]
    refused = [e for e in logs if e["event"] == "notify_recipients_refused"]
    assert [(e["receiver"], e["refused"]) for e in refused] == [("mail", [GONE])], logs
