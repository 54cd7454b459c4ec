"""A receiver refusing a delivery as too large: an SMTP server over its message size limit
(``552``, Postfix's ``message_size_limit``) is recorded in ``last_error`` naming the size it
refused and, for a group's window, the key that bounds it; not a bare exception text."""

from __future__ import annotations

import re

import asyncpg

from tests.integration.services.test_notify import (
    Notifier,
    _config,
    _deliveries,
    _drain,
    _email,
    _event,
    _route,
    _status_is,
)
from tests.support.receivers import smtp_server
from tests.support.waiting import wait_until

FEW = """
[notify]
max_attempts = 2
backoff_min_s = 0.01
backoff_max_s = 0.05
poll_s = 0.05
lease_s = 30
"""


async def test_an_smtp_server_refusing_a_windows_digest_as_too_large_is_named_so(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    with smtp_server(data_size_limit=4000) as smtp:
        grouped = 'group_by = ["rule"]\ngroup_wait_s = 0\ngroup_max_notifications = 50'
        node = Notifier(pool, db_dsn, _config(_email(smtp.port), _route(["mail"], grouped), FEW))
        for alarm_id in range(1, 6):
            await _event(db, alarm_id, device=f"pump-{alarm_id}", rule="pressure")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "FAILED"), message="window FAILED")
        assert smtp.handler.mails == []
    [window] = await _deliveries(db)
    error = window["last_error"]
    size = re.match(r"the receiver refused the message of (\d+) bytes as too large", error)
    assert size is not None, error
    assert int(size.group(1)) > 4000
    assert "group_max_notifications" in error
    assert "552" in error
