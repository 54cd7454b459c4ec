"""Notifications against a real PostgreSQL, a real local HTTP receiver and a real SMTP server:
the consumer's exactness, retries and their headers, FAILED, e-mail, silences, quiet hours,
leases, and a hanging receiver that delays nobody else."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import msgspec
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from gateway.alarms.lifecycle import create_alarm
from gateway.alarms.timers import AlarmTimers
from gateway.config import Config, TokenConfig, apply_secrets, parse_config
from gateway.domain.notify import verify_signature
from gateway.domain.quiet_hours import QuietHoursConfig, QuietWindowConfig, compile_quiet_hours
from gateway.notify.consumer import NotifyConsumer
from gateway.notify.metrics import NotifyMetrics
from gateway.notify.service import NotifyService
from gateway.notify.worker import DeliveryWorker
from gateway.support.metrics import Metrics
from protocol.events import AlarmCreated
from storage import notify as repo
from storage import outbox
from tests.support import events
from tests.support.api_client import VIEWER, ApiClient
from tests.support.api_server import serve_api
from tests.support.credentials import make_ca, make_server_cert
from tests.support.receivers import (
    Answer,
    Logins,
    Received,
    always,
    echoing,
    smtp_server,
    webhook_server,
)
from tests.support.waiting import wait_until

SECRET = "webhook-signing-secret-0123"
FAST = """
[notify]
max_attempts = 5
backoff_min_s = 0.01
backoff_max_s = 0.05
poll_s = 0.05
lease_s = 30
"""


def _config(receivers: str, routes: str, notify: str = FAST) -> Config:
    return parse_config(notify + receivers + routes)


def _webhook(name: str, url: str, extra: str = "") -> str:
    return f'[[notify.receivers]]\nname = "{name}"\nkind = "webhook"\nurl = "{url}"\n{extra}\n'


def _email(
    port: int, *, host: str = "127.0.0.1", to: str = '"ops@example.com"', extra: str = ""
) -> str:
    return (
        f'[[notify.receivers]]\nname = "mail"\nkind = "email"\nhost = "{host}"\nport = {port}\n'
        f'from = "gateway@example.com"\nto = [{to}]\n{extra}\n'
    )


def _route(receivers: list[str], extra: str = "") -> str:
    names = ", ".join(f'"{r}"' for r in receivers)
    return f"[[notify.routes]]\nreceivers = [{names}]\n{extra}\n"


class Notifier:
    """A consumer and a delivery worker of one node, on the test's pool."""

    def __init__(self, pool: asyncpg.Pool, dsn: str, config: Config, node_id: str = "n1") -> None:
        self.metrics = NotifyMetrics(Metrics().registry)
        rules = config.notify_rules()
        self.worker = DeliveryWorker(
            pool=pool, node_id=node_id, metrics=self.metrics, settings=config.notify, rules=rules
        )
        self.consumer = NotifyConsumer(
            pool=pool,
            dsn=dsn,
            metrics=self.metrics,
            rules=rules,
            public_url="https://gw.example.com",
            quiet=config.quiet_hours(),
            batch=config.notify.batch,
            on_created=self.worker.wakeup.set,
        )

    def count(self, receiver: str, outcome: str) -> float:
        value = self.metrics.deliveries.labels(receiver, outcome)._value.get()
        return float(value)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(self.worker.run(stop))
        try:
            yield
        finally:
            stop.set()
            await task


def _alarm(
    alarm_id: int, *, device: str = "dev-1", rule: str = "hot", severity: str = "MAJOR"
) -> AlarmCreated:
    return events.created(
        alarm_id,
        device_id=device,
        rule_key=rule,
        severity=severity,
        trigger={"metric": "temp", "value": 91},
        rule_description="too hot",
    )


async def _event(db: asyncpg.Connection, alarm_id: int, **kw: str) -> uuid.UUID:
    return await outbox.add_event(
        db,
        aggregate_type="alarm",
        aggregate_id=str(alarm_id),
        event_type="alarm.created",
        payload=_alarm(alarm_id, **kw),
    )


async def _raised(db: asyncpg.Connection, device: str, severity: str) -> tuple[uuid.UUID, int]:
    """A real alarm (its row and its alarm.created event): its event id and alarm id."""
    async with db.transaction():
        creation = await create_alarm(
            db, device_id=device, rule_key="hot", severity=severity,
            telemetry_event_id=uuid.uuid4().hex * 2, reason="test", node_id="n0",
            now=await db.fetchval("SELECT now()"),
        )  # fmt: skip
    assert creation.alarm is not None
    event_id = await db.fetchval(
        "SELECT event_id FROM outbox_event WHERE aggregate_id = $1 AND event_type = $2",
        str(creation.alarm.id),
        "alarm.created",
    )
    return event_id, creation.alarm.id


async def _deliveries(db: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(await db.fetch("SELECT * FROM notify_delivery ORDER BY id"))


async def _drain(consumer: NotifyConsumer) -> None:
    while await consumer.run_once():
        pass


async def test_a_receiver_failing_twice_then_succeeding_gets_one_delivery_in_three_attempts(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server(hook=lambda n, _r: 500 if n < 2 else 200) as server:
        config = _config(
            _webhook(
                "hook",
                server.url("/hook"),
                f'secret = "{SECRET}"\nheaders = {{ "X-Site" = "north-3", "X-Tenant" = "acme" }}',
            ),
            _route(["hook"]),
        )
        node = Notifier(pool, db_dsn, config)
        event_id = await _event(db, 1)
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT"), message="delivery SENT")
    got = server.on("/hook")
    assert len(got) == 3
    assert {r.event_id for r in got} == {str(event_id)}
    now = int(time.time())
    for request in got:
        header = request.headers["X-Gateway-Signature"]
        assert verify_signature(SECRET, header, request.body, now=now, tolerance_s=300)
        assert not verify_signature("wrong", header, request.body, now=now, tolerance_s=300)
    assert [r.headers["X-Gateway-Attempt"] for r in got] == ["1", "2", "3"]
    # The receiver's own extra headers, on every attempt.
    assert {(r.headers["X-Site"], r.headers["X-Tenant"]) for r in got} == {("north-3", "acme")}
    body = got[-1].json
    assert body["event"] == "alarm.created"
    assert body["alarm_id"] == 1
    assert body["device_id"] == "dev-1"
    assert body["link"] == "https://gw.example.com/#/alarms/1"
    assert body["payload"]["alarm"]["trigger"] == {"metric": "temp", "value": 91}
    assert body["payload"]["alarm"]["rule_description"] == "too hot"
    [row] = await _deliveries(db)
    assert (row["status"], row["attempts"], row["sent_by"]) == ("SENT", 3, "n1")
    assert node.count("hook", "RETRY") == 2
    assert node.count("hook", "SENT") == 1
    assert SECRET not in (row["last_error"] or "")


async def _status_is(db: asyncpg.Connection, *statuses: str) -> bool:
    rows = await _deliveries(db)
    return bool(rows) and all(r["status"] in statuses for r in rows)


async def test_after_max_attempts_the_delivery_is_failed_with_its_last_error(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server(down=always(503)) as server:
        notify = FAST.replace("max_attempts = 5", "max_attempts = 3")
        config = _config(_webhook("down", server.url("/down")), _route(["down"]), notify)
        node = Notifier(pool, db_dsn, config)
        await _event(db, 1)
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "FAILED"), message="delivery FAILED")
        assert len(server.on("/down")) == 3
    [row] = await _deliveries(db)
    assert row["attempts"] == 3
    assert row["last_error"].startswith("HTTP 503")
    assert node.count("down", "FAILED") == 1
    assert node.count("down", "RETRY") == 2
    service = NotifyService(pool)
    [listed] = await service.deliveries(
        status="FAILED", receiver="down", event=None, before=None, limit=10
    )
    assert listed["id"] == row["id"]


HOOK_TOKEN = "hook-bearer-token-0123456789abcdef"
HOOK_KEY = "hook-api-key-9876543210"


async def test_a_receiver_echoing_the_request_gets_no_credential_into_last_error_or_the_log(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """A receiver answering 400 with the headers it got (ours: its Authorization, its API key)
    has them in the first bytes of its answer; ``last_error`` is shown to every viewer and
    logged, so neither carries them."""
    async with webhook_server(echo=always(400)) as server:
        server.answers["/echo"] = echoing()
        headers = f'{{ "Authorization" = "Bearer {HOOK_TOKEN}", "X-Api-Key" = "{HOOK_KEY}" }}'
        config = _config(
            _webhook("echo", server.url("/echo"), f'secret = "{SECRET}"\nheaders = {headers}'),
            _route(["echo"]),
            FAST.replace("max_attempts = 5", "max_attempts = 2"),
        )
        node = Notifier(pool, db_dsn, config)
        await _event(db, 1)
        await _drain(node.consumer)
        with capture_logs() as logs:
            async with node.running():
                await wait_until(lambda: _status_is(db, "FAILED"), message="delivery FAILED")
    # The receiver did get (and echo) the credentials: what follows means something.
    assert [r.headers["Authorization"] for r in server.on("/echo")] == [f"Bearer {HOOK_TOKEN}"] * 2
    viewer = [TokenConfig(token=VIEWER, role="viewer", name="wall")]
    async with serve_api(db_dsn, viewer) as served, aiohttp.ClientSession() as http:
        listed = await ApiClient(served.base, http).get("/deliveries")
    [item] = listed.body["items"]
    assert item["last_error"].startswith("HTTP 400: you sent")
    assert "Authorization: [redacted]" in item["last_error"]
    failures = [
        e for e in logs if e["event"] in ("notify_attempt_failed", "notify_delivery_failed")
    ]
    assert [e["event"] for e in failures] == ["notify_attempt_failed", "notify_delivery_failed"]
    shown = [msgspec.json.encode(listed.body).decode(), *(repr(e) for e in failures)]
    for text in shown:
        for secret in (HOOK_TOKEN, HOOK_KEY, SECRET):
            assert secret not in text, text


def _stalling(first: bytes, answering: list[web.Request]) -> Answer:
    """An answer whose status line comes, then ``first`` of a 10,000-byte body, then nothing
    (until the client hangs up or the server stops); each request answered so is noted."""

    async def stall(request: web.Request, _got: Received, status: int) -> web.StreamResponse:
        response = web.StreamResponse(status=status)
        response.content_length = 10_000
        await response.prepare(request)
        await response.write(first)
        answering.append(request)
        await asyncio.Event().wait()
        return response

    return stall


async def test_an_answer_whose_body_stalls_is_ended_by_the_receivers_timeout(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """The status line came, then a few bytes, then nothing: ``timeout_s`` bounds the reading
    of the body too, and the slot is free again."""
    answering: list[web.Request] = []
    stall = _stalling(b"partial ", answering)

    async with webhook_server(stall=always(500)) as server:
        server.answers["/stall"] = stall
        config = _config(
            _webhook("stall", server.url("/stall"), "timeout_s = 0.5"),
            _route(["stall"]),
            FAST.replace("max_attempts = 5", "max_attempts = 2"),
        )
        node = Notifier(pool, db_dsn, config)
        await _event(db, 1)
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "FAILED"), message="delivery FAILED")
            # The slot frees when the send's task ends, just after its FAILED commits (the
            # connection goes back to the pool in between): waited for, not raced.
            await wait_until(lambda: node.worker.in_flight == {"stall": 0}, message="slot free")
    assert answering
    [row] = await _deliveries(db)
    assert row["attempts"] == 2
    assert "0.5" in row["last_error"] or "Timeout" in row["last_error"], row["last_error"]


async def test_a_webhook_answering_2xx_is_a_delivery_even_if_its_body_then_stalls(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """Any 2xx is a delivery: the receiver took the notification once its status came, so its
    body (a few bytes, then nothing) is not waited for. The delivery is SENT at the first
    attempt and pushes its alarm; the connection is closed rather than left to the stall."""
    answering: list[web.Request] = []
    stall = _stalling(b"accepted ", answering)

    async with webhook_server(ok=always(200)) as server:
        server.answers["/ok"] = stall
        config = _config(
            _webhook("ok", server.url("/ok"), "timeout_s = 0.5"),
            _route(["ok"]),
            FAST.replace("max_attempts = 5", "max_attempts = 3"),
        )
        node = Notifier(pool, db_dsn, config)
        _, alarm_id = await _raised(db, "dev-1", "MAJOR")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT", "FAILED"), message="finished")
            await wait_until(lambda: node.worker.in_flight == {"ok": 0}, message="slot free")
        assert len(server.on("/ok")) == 1, "sent again"
        [request] = answering
        transport = request.transport
        await wait_until(
            lambda: transport is None or transport.is_closing(), message="connection closed"
        )
    [row] = await _deliveries(db)
    assert (row["status"], row["attempts"], row["last_error"]) == ("SENT", 1, None)
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"
    assert node.count("ok", "SENT") == 1


async def test_an_event_whose_transaction_commits_late_is_still_consumed_exactly_once(
    pool: asyncpg.Pool, db_dsn: str, db_dsn_conn: asyncpg.Connection
) -> None:
    """E1 takes the lower id but commits after E2: a consumer reading "id > last seen" would
    lose it. Forced deterministically: E1's transaction is held open across a pass."""
    config = _config(_webhook("hook", "http://127.0.0.1:9/hook"), _route(["hook"]))
    node = Notifier(pool, db_dsn, config)
    early = await asyncpg.connect(db_dsn)
    try:
        transaction = early.transaction()
        await transaction.start()
        first = await _event(early, 1)  # the lower outbox id, not committed yet
        second = await _event(db_dsn_conn, 2)  # a higher id, committed now
        ids = await db_dsn_conn.fetch("SELECT event_id, id FROM outbox_event ORDER BY id")
        assert [r["event_id"] for r in ids] == [second]  # the first is not visible yet
        await _drain(node.consumer)
        assert await _consumed(db_dsn_conn) == {second}
        await transaction.commit()
    finally:
        await early.close()
    order = await db_dsn_conn.fetch("SELECT event_id FROM outbox_event ORDER BY id")
    assert [r["event_id"] for r in order] == [first, second]  # first has the lower id
    await _drain(node.consumer)
    await _drain(node.consumer)  # again: nothing more
    assert await _consumed(db_dsn_conn) == {first, second}
    rows = await _deliveries(db_dsn_conn)
    assert sorted(str(r["event_id"]) for r in rows) == sorted([str(first), str(second)])
    # The horizon moved (how far depends on every transaction of the server, other
    # databases' included: it never passes one still running).
    assert await db_dsn_conn.fetchval("SELECT horizon > '0'::xid8 FROM notify_consumer")


@pytest.fixture
async def db_dsn_conn(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(db_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def _consumed(db: asyncpg.Connection) -> set[uuid.UUID]:
    return {r["event_id"] for r in await db.fetch("SELECT event_id FROM consumed_event")}


async def test_racing_consumers_turn_each_event_into_deliveries_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    config = _config(
        _webhook("a", "http://127.0.0.1:9/a") + _webhook("b", "http://127.0.0.1:9/b"),
        _route(["a", "b"]),
    )
    events = [await _event(db, n) for n in range(1, 41)]
    pools = [await asyncpg.create_pool(db_dsn, min_size=1, max_size=2) for _ in range(4)]
    try:
        nodes = [Notifier(p, db_dsn, config, node_id=f"n{i}") for i, p in enumerate(pools)]
        for node in nodes:
            node.consumer.batch = 7  # several passes each, overlapping
        barrier = asyncio.Barrier(len(nodes))

        async def race(node: Notifier) -> int:
            await barrier.wait()  # all released at once
            total = 0
            while n := await node.consumer.run_once():
                total += n
            return total

        counts = await asyncio.gather(*(race(n) for n in nodes))
    finally:
        for p in pools:
            await p.close()
    assert await _consumed(db) == set(events)
    rows = await _deliveries(db)
    assert len(rows) == 2 * len(events)
    assert len({(r["event_id"], r["receiver"]) for r in rows}) == len(rows)
    consumed_by_metric = sum(n.metrics.events_consumed._value.get() for n in nodes)
    assert consumed_by_metric == len(events), counts


async def test_email_has_subject_both_parts_and_recipients(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    with smtp_server() as smtp:
        receivers = _email(smtp.port, to='"ops@example.com", "oncall@example.com"')
        node = Notifier(pool, db_dsn, _config(receivers, _route(["mail"])))
        event_id = await _event(db, 5, device="pump-7", rule="pressure", severity="CRITICAL")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT"), message="mail SENT")
        [mail] = smtp.handler.mails
    assert mail.mail_from == "gateway@example.com"
    assert sorted(mail.rcpt_tos) == ["oncall@example.com", "ops@example.com"]
    message = mail.message
    assert message["Subject"] == "[CRITICAL] pressure on pump-7: alarm.created"
    assert message["X-Gateway-Event-Id"] == str(event_id)
    assert message.get_content_type() == "multipart/alternative"
    plain = message.get_body(("plain",))
    html = message.get_body(("html",))
    assert plain is not None
    assert html is not None
    text = plain.get_content()
    assert "Device: pump-7" in text
    assert "Rule description: too hot" in text
    assert "https://gw.example.com/#/alarms/5" in text
    assert "<td>pump-7</td>" in html.get_content()


async def test_a_grouped_email_is_one_digest_of_its_windows_notifications(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    with smtp_server() as smtp:
        grouped = 'group_by = ["rule"]\ngroup_wait_s = 0'
        node = Notifier(pool, db_dsn, _config(_email(smtp.port), _route(["mail"], grouped)))
        first = await _event(db, 5, device="pump-7", rule="pressure", severity="MAJOR")
        second = await _event(db, 6, device="pump-8", rule="pressure", severity="CRITICAL")
        await _drain(node.consumer)  # one pass, one transaction: both in the first window
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT"), message="mail SENT")
        [mail] = smtp.handler.mails
    [window] = await _deliveries(db)
    message = mail.message
    assert message["Subject"] == "[CRITICAL] 2 notifications: rule=pressure"
    assert message["X-Gateway-Event-Id"] == str(window["event_id"])
    plain = message.get_body(("plain",))
    html = message.get_body(("html",))
    assert plain is not None
    assert html is not None
    text = plain.get_content()
    assert "== [MAJOR] pressure on pump-7: alarm.created" in text
    assert "== [CRITICAL] pressure on pump-8: alarm.created" in text
    assert text.index("pump-7") < text.index("pump-8")  # oldest first
    assert "https://gw.example.com/#/alarms/6" in text
    assert "<td>pump-8</td>" in html.get_content()
    body = msgspec.json.decode(window["body"])
    assert [n["event_id"] for n in body["notifications"]] == [str(first), str(second)]


async def test_a_mail_the_server_accepted_is_a_delivery_even_if_it_then_stalls_on_quit(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """250 to the DATA: the server has the mail. Its QUIT is a goodbye, said after the
    delivery is recorded SENT (and the alarm pushed), bounded by ``timeout_s`` of its own: the
    gateway hangs up and the slot is free again."""
    with smtp_server(stall_quit=True) as smtp:
        config = _config(
            _email(smtp.port, extra="timeout_s = 0.5"),
            _route(["mail"]),
            FAST.replace("max_attempts = 5", "max_attempts = 2"),
        )
        node = Notifier(pool, db_dsn, config)
        _, alarm_id = await _raised(db, "dev-1", "MAJOR")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT", "FAILED"), message="finished")
            await wait_until(lambda: node.worker.in_flight == {"mail": 0}, message="slot free")
        handler = smtp.handler
        assert len(handler.mails) == 1, "mailed again"
        await wait_until(lambda: handler.hung_up == handler.quits == 1, message="hung up")
    [row] = await _deliveries(db)
    assert (row["status"], row["attempts"], row["last_error"]) == ("SENT", 1, None)
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "PUSHED"
    assert node.count("mail", "SENT") == 1


def _server_tls(tmp_path: Path) -> tuple[ssl.SSLContext, Path]:
    """A TLS context for a server on 127.0.0.1 with a certificate of a test CA, and that CA."""
    ca_cert, ca_key = make_ca(tmp_path / "pki", "smtp-test-ca")
    cert, key = make_server_cert(tmp_path / "pki", ca_cert, ca_key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context, ca_cert


@pytest.mark.parametrize("mode", ["starttls", "tls"])
async def test_email_over_starttls_or_implicit_tls_with_a_login_from_the_environment(
    pool: asyncpg.Pool,
    db_dsn: str,
    db: asyncpg.Connection,
    tmp_path: Path,
    *,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """The server refuses mail without TLS and AUTH before it (aiosmtpd's auth_require_tls);
    the password comes from `password_env`; the server's certificate is checked against the
    trusted CAs (here the test CA, through OpenSSL's SSL_CERT_FILE)."""
    context, ca_cert = _server_tls(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_cert))
    logins = Logins("gateway", "mail-password-0123")
    if mode == "starttls":
        smtp_options: dict[str, Any] = {
            "tls_context": context, "require_starttls": True, "auth_require_tls": True,
        }  # fmt: skip
    else:
        # aiosmtpd counts only STARTTLS as TLS for auth_require_tls: on an implicit TLS port
        # it would offer no AUTH at all. The whole connection is TLS there anyway.
        smtp_options = {"ssl_context": context, "auth_require_tls": False}
    with smtp_server(authenticator=logins, **smtp_options) as smtp:
        login = f'{mode} = true\nusername = "gateway"\npassword_env = "GW_TEST_SMTP_PASSWORD"'
        receivers = _email(smtp.port, host="localhost", extra=login)
        config = apply_secrets(
            _config(receivers, _route(["mail"])),
            {"GW_TEST_SMTP_PASSWORD": logins.expected[1].decode()},
        )
        node = Notifier(pool, db_dsn, config)
        await _event(db, 6, device="pump-8", rule="pressure", severity="MAJOR")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT"), message="mail SENT")
        [mail] = smtp.handler.mails
    assert [login for login, _ in logins.tried] == ["gateway"]
    assert mail.rcpt_tos == ["ops@example.com"]
    assert mail.message["Subject"] == "[MAJOR] pressure on pump-8: alarm.created"


async def test_an_email_server_whose_certificate_is_not_trusted_gets_nothing(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    context, _ = _server_tls(tmp_path)  # its CA is not among the trusted ones
    with smtp_server(tls_context=context, require_starttls=True) as smtp:
        receivers = _email(smtp.port, host="localhost", extra="starttls = true")
        config = _config(
            receivers, _route(["mail"]), FAST.replace("max_attempts = 5", "max_attempts = 1")
        )
        node = Notifier(pool, db_dsn, config)
        await _event(db, 7)
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "FAILED"), message="mail FAILED")
        assert smtp.handler.mails == []
    [row] = await _deliveries(db)
    assert (
        "CERTIFICATE_VERIFY_FAILED" in row["last_error"]
        or "certificate" in row["last_error"].lower()
    )


async def test_silences_by_rule_and_device_make_silenced_rows_and_expiry_ends_them(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    service = NotifyService(pool)
    later = datetime.now(UTC) + timedelta(hours=1)
    by_rule = await service.create_silence(
        rules=["hot"], devices=None, severities=None, ends_at=later, comment="", created_by="t"
    )
    by_device = await service.create_silence(
        rules=None, devices="lab-*", severities=None, ends_at=later, comment="", created_by="t"
    )
    async with webhook_server() as server:
        config = _config(_webhook("hook", server.url("/hook")), _route(["hook"]))
        node = Notifier(pool, db_dsn, config)
        hot = await _event(db, 1, rule="hot", device="pump")
        lab = await _event(db, 2, rule="cold", device="lab-3")
        loud = await _event(db, 3, rule="cold", device="pump")
        await _drain(node.consumer)
        await service.expire_silence(by_rule["id"], "t")
        after = await _event(db, 4, rule="hot", device="pump")
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: _status_is(db, "SENT", "SILENCED"), message="all finished")
    rows = {r["event_id"]: r for r in await _deliveries(db)}
    assert rows[hot]["status"] == "SILENCED"
    assert rows[hot]["silence_id"] == by_rule["id"]
    assert rows[lab]["status"] == "SILENCED"
    assert rows[lab]["silence_id"] == by_device["id"]
    assert rows[loud]["status"] == "SENT"
    assert rows[after]["status"] == "SENT"  # the rule's silence was expired before
    assert {r.event_id for r in server.on("/hook")} == {str(loud), str(after)}
    assert node.count("hook", "SILENCED") == 2


async def test_quiet_hours_delay_the_send_except_for_exempt_severities(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    config = _config(_webhook("hook", "http://127.0.0.1:9/hook"), _route(["hook"]))
    node = Notifier(pool, db_dsn, config)
    # A window covering the whole day, every day: quiet now, ending within a day.
    node.consumer.quiet = compile_quiet_hours(
        QuietHoursConfig(windows=[QuietWindowConfig(start="00:00", end="23:59")])
    )
    quiet, quiet_alarm = await _raised(db, "dev-1", "MAJOR")
    exempt, _ = await _raised(db, "dev-2", "CRITICAL")
    await _drain(node.consumer)
    rows = {r["event_id"]: r for r in await _deliveries(db)}
    now = await db.fetchval("SELECT now()")
    assert rows[quiet]["next_attempt_at"] > now + timedelta(seconds=30)
    assert rows[exempt]["next_attempt_at"] <= now
    # Held because its alarm is: the consumer took the alarm's quiet-hours decision.
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", quiet_alarm) == "DELAYED"
    # Claims take only what is due.
    async with pool.acquire() as conn:
        claimed = await repo.claim_due(conn, receiver="hook", node_id="n1", lease_s=30, limit=10)
    assert [c.event_id for c in claimed] == [exempt]


async def test_notifications_held_by_a_node_are_released_when_the_quiet_hours_go(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """A reload reaching the nodes one after another: the consumer of a node that already has
    a window decides the new alarm's quiet hours (DELAYED) and holds its notifications. Timers
    under quiet hours that still hold it leave them held; the timers of a node without the
    window wake the alarm, and the wake releases them, once."""
    config = _config(_webhook("hook", "http://127.0.0.1:9/hook"), _route(["hook"]))
    window = compile_quiet_hours(
        QuietHoursConfig(windows=[QuietWindowConfig(start="00:00", end="23:59")])
    )
    node = Notifier(pool, db_dsn, config)
    node.consumer.quiet = window
    held, alarm_id = await _raised(db, "dev-1", "MAJOR")
    await _drain(node.consumer)
    now = await db.fetchval("SELECT now()")
    [row] = await _deliveries(db)
    assert (row["event_id"], row["status"], row["attempts"]) == (held, "PENDING", 0)
    assert row["next_attempt_at"] > now + timedelta(seconds=30)

    still = AlarmTimers(pool=pool, node_id="n2", quiet=window, escalate_after_s=0,
                        repeat_interval_s=0)  # fmt: skip
    assert (await still.run_once()).released == 0
    [row] = await _deliveries(db)
    assert row["next_attempt_at"] > now + timedelta(seconds=30)

    gone = AlarmTimers(pool=pool, node_id="n2", quiet=None, escalate_after_s=0,
                       repeat_interval_s=0)  # fmt: skip
    assert (await gone.run_once()).released == 1
    [row] = await _deliveries(db)
    assert row["next_attempt_at"] <= await db.fetchval("SELECT now()")
    assert (await gone.run_once()).released == 0  # once per change of the quiet hours
    assert await db.fetchval("SELECT status FROM alarm WHERE id = $1", alarm_id) == "NEW"
    async with pool.acquire() as conn:
        claimed = await repo.claim_due(conn, receiver="hook", node_id="n1", lease_s=30, limit=10)
    assert [c.event_id for c in claimed] == [held]


async def test_a_finish_after_the_lease_was_taken_over_changes_nothing(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    async with webhook_server() as server:
        config = _config(_webhook("hook", server.url("/hook")), _route(["hook"]))
        first = Notifier(pool, db_dsn, config, node_id="n1")
        second = Notifier(pool, db_dsn, config, node_id="n2")
        await _event(db, 1)
        await _drain(first.consumer)
        receiver = config.notify_rules().receivers["hook"]
        async with pool.acquire() as conn:
            [mine] = await repo.claim_due(conn, receiver="hook", node_id="n1", lease_s=30, limit=1)
            # n1 stalls past its lease; n2 takes the delivery over.
            await conn.execute("UPDATE notify_delivery SET lease_until = now() - interval '1 s'")
            [theirs] = await repo.claim_due(
                conn, receiver="hook", node_id="n2", lease_s=30, limit=1
            )
        assert (mine.attempts, theirs.attempts) == (1, 2)
        await first.worker.deliver(receiver, mine)  # sent, but no longer n1's to finish
        [row] = await _deliveries(db)
        assert (row["status"], row["lease_owner"]) == ("SENDING", "n2")
        assert first.count("hook", "LEASE_LOST") == 1
        await second.worker.deliver(receiver, theirs)
        await first.worker.close()
        await second.worker.close()
    [row] = await _deliveries(db)
    assert (row["status"], row["sent_by"], row["attempts"]) == ("SENT", "n2", 2)
    # At least once, with the same idempotency header both times.
    assert len({r.event_id for r in server.on("/hook")}) == 1
    assert len(server.on("/hook")) == 2


async def test_a_hanging_receiver_delays_no_other_receiver(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    # One pooled connection for everything: a send that held it would stop every other send.
    pool = await asyncpg.create_pool(db_dsn, min_size=1, max_size=1)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(pool.close)
        server = await stack.enter_async_context(webhook_server(hang=lambda _n, _r: None))
        receivers = _webhook("hang", server.url("/hang"), "concurrency = 2\ntimeout_s = 20") + (
            _webhook("ok", server.url("/ok"))
        )
        node = Notifier(pool, db_dsn, _config(receivers, _route(["hang", "ok"])))
        events = [await _event(db, n) for n in range(1, 21)]
        await _drain(node.consumer)
        async with node.running():
            await wait_until(lambda: len(server.on("/ok")) == len(events), message="ok got all")
            await wait_until(lambda: server.in_flight.get("/hang") == 2, message="hang holds 2")
            # Every ok send finished (its row written) while the hang sends still run.
            await wait_until(
                lambda: node.worker.in_flight == {"hang": 2, "ok": 0}, message="ok finished"
            )
            # Counts, not timing: the hanging receiver holds its two slots and no more.
            assert server.in_flight["/hang"] == 2
            assert server.peak_in_flight["/hang"] == 2
            by_status = dict(
                await db.fetch(
                    "SELECT status, count(*) FROM notify_delivery WHERE receiver = 'hang' "
                    "GROUP BY status"
                )
            )
            assert by_status == {"SENDING": 2, "PENDING": len(events) - 2}
            server.release.set()
            await wait_until(
                lambda: _status_is(db, "SENT"), timeout=60, message="hang drained once released"
            )
    assert {r.event_id for r in server.on("/ok")} == {str(e) for e in events}
    assert server.peak_in_flight["/hang"] == 2


async def test_hanging_sends_beyond_a_hundred_still_leave_other_receivers_a_connection(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """The webhooks share one HTTP client: a cap on its connections in total (aiohttp's default
    is 100) would let receivers that hang take them all, and every other send would queue
    behind them. Only each receiver's own slots bound its sends."""
    hanging = 110
    async with webhook_server(hang=lambda _n, _r: None) as server:
        receivers = _webhook(
            "hang", server.url("/hang"), f"concurrency = {hanging}\ntimeout_s = 20"
        ) + _webhook("ok", server.url("/ok"))
        node = Notifier(pool, db_dsn, _config(receivers, _route(["hang", "ok"])))
        events = [await _event(db, n) for n in range(1, hanging + 11)]
        await _drain(node.consumer)
        async with node.running():
            await wait_until(
                lambda: server.in_flight.get("/hang") == hanging, message="hang holds its slots"
            )
            await wait_until(lambda: len(server.on("/ok")) == len(events), message="ok got all")
            server.release.set()
    assert {r.event_id for r in server.on("/ok")} == {str(e) for e in events}


async def test_the_consumer_reads_only_event_types_a_route_sends_on(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    """A finished command (here ACKED, and FAILED) is no notification for routes on
    alarm.created: the consumer neither records it nor lets it hold the horizon back."""
    config = _config(
        _webhook("a", "http://127.0.0.1:9/a"), _route(["a"], 'events = ["alarm.created"]')
    )
    node = Notifier(pool, db_dsn, config)
    for status in ("ACKED", "FAILED"):
        await outbox.add_event(
            db,
            aggregate_type="command",
            aggregate_id="7",
            event_type="command.finished",
            payload=events.command(status, device_id="dev-1"),
        )
    alarm = await _event(db, 1)
    await _drain(node.consumer)
    assert await _consumed(db) == {alarm}
    assert [r["event_id"] for r in await _deliveries(db)] == [alarm]
    # The horizon passes the command events' transactions although nothing consumed them.
    await _horizon_passes_every_event(db, node.consumer)


async def test_without_routes_nothing_is_read_and_the_horizon_moves_on(
    pool: asyncpg.Pool, db_dsn: str, db: asyncpg.Connection
) -> None:
    node = Notifier(pool, db_dsn, _config(_webhook("a", "http://127.0.0.1:9/a"), ""))
    await _event(db, 1)
    await _drain(node.consumer)
    assert await _consumed(db) == set()
    assert await _deliveries(db) == []
    await _horizon_passes_every_event(db, node.consumer)
    # A route added later (a reload) sends what is written after it, not what came before.
    later = Notifier(pool, db_dsn, _config(_webhook("a", "http://127.0.0.1:9/a"), _route(["a"])))
    fresh = await _event(db, 2)
    await _drain(later.consumer)
    assert await _consumed(db) == {fresh}


async def _horizon_passes_every_event(db: asyncpg.Connection, consumer: NotifyConsumer) -> None:
    """The horizon never passes a transaction still running anywhere on the server (another
    database's included), so passes repeat until it is past the newest event's."""
    newest = str(await db.fetchval("SELECT max(xid) FROM outbox_event"))

    async def passed() -> bool:
        await _drain(consumer)
        return bool(
            await db.fetchval("SELECT horizon > $1::text::xid8 FROM notify_consumer", newest)
        )

    await wait_until(passed, timeout=30, message="the horizon passes every event")
