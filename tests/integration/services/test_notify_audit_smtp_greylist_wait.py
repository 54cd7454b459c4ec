"""An SMTP server that greylists (postgrey, greylistd, rspamd: ``451`` "try again later" to a
sender and recipient it has not seen, until its delay has passed since the first try, 300 s
by default): the gateway's retries wait for it (``backoff_max_s``), or every attempt comes too
soon and the delivery ends FAILED with nobody mailed."""

from __future__ import annotations

import time
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

# The server's greylisting delay, and the gateway's settings: the backoff alone (up to
# 0.01 · 2^(n-1) s) would spend the three attempts inside it.
DELAY_S = 1.0
NOTIFY = """
[notify]
max_attempts = 3
backoff_min_s = 0.01
backoff_max_s = 1.5
poll_s = 0.05
lease_s = 30
"""


class _Greylist(_Handler):
    """Refuses (451) each recipient of ``greylisted`` until ``DELAY_S`` after it was first
    asked for, as a greylisting server does; takes every other at once."""

    def __init__(self, *greylisted: str) -> None:
        super().__init__()
        self.greylisted = set(greylisted)
        self.seen: dict[str, float] = {}
        self.asked: list[str] = []

    async def handle_RCPT(
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: Any
    ) -> str:
        self.asked.append(address)
        first = self.seen.setdefault(address, time.monotonic())
        if address in self.greylisted and time.monotonic() - first < DELAY_S:
            return f"451 4.7.1 <{address}>: greylisted, try again later"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    def mailed(self, address: str) -> int:
        return sum(mail.rcpt_tos.count(address) for mail in self.mails)


async def _mailed(
    handler: _Greylist, pool: asyncpg.Pool, dsn: str, db: asyncpg.Connection, to: str
) -> asyncpg.Record:
    controller = Controller(handler, hostname="127.0.0.1", port=free_port())
    controller.start()
    try:
        config = _config(_email(controller.port, to=to), _route(["mail"]), NOTIFY)
        node = Notifier(pool, dsn, config)
        await _raised(db, "freezer-2", "CRITICAL")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(
                lambda: _status_is(db, "SENT", "FAILED"), timeout=20, message="finished"
            )
    finally:
        controller.stop()
    [row] = await _deliveries(db)
    return row


async def test_a_greylisting_server_gets_the_mail_at_a_retry_after_its_delay(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    handler = _Greylist("ops@example.com")
    row = await _mailed(handler, pool, db_dsn, db, '"ops@example.com"')
    assert handler.mailed("ops@example.com") == 1, (row["status"], row["last_error"])
    assert row["status"] == "SENT"
    assert row["attempts"] == 2, handler.asked


async def test_a_recipient_greylisted_beside_one_taken_gets_the_mail_after_the_delay(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    handler = _Greylist("oncall@example.org")
    row = await _mailed(handler, pool, db_dsn, db, '"ops@example.com", "oncall@example.org"')
    assert handler.mailed("oncall@example.org") == 1, (row["status"], row["last_error"])
    assert handler.mailed("ops@example.com") == 1
    assert row["status"] == "SENT"
    assert row["last_error"] is None
    assert row["attempts"] == 2, handler.asked
