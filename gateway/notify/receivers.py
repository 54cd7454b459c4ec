"""The receivers' senders: a webhook (aiohttp) and e-mail (aiosmtplib).

A sender sends one delivery and returns, or raises :class:`SendError` with a message fit for
the delivery's ``last_error`` (no secret, no URL query, no password: only what went wrong; the
worker still cuts anything that looks like a credential out of it, see
:func:`gateway.domain.redaction.redact_credentials`).

A receiver's answer is never read whole: a 2xx is a delivery by its status alone (its body is
not read), and of a refusal only the first :data:`ERROR_BODY_MAX` bytes (what ``last_error``
shows); a body not read to its end is not drained, its connection is closed. One
receiver answering 500 with 100 MB took the gateway from 81 to 693 MB and slowed every other
receiver's sends from 3 to 46 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import format_datetime
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgspec

from gateway.domain.notify import (
    EVENT_ID_HEADER,
    SIGNATURE_HEADER,
    ReceiverConfig,
    receiver_secrets,
    signature,
)
from gateway.domain.redaction import redact_credentials, url_tokens
from gateway.support.retry_after import retry_after_s
from gateway.support.version import gateway_version
from storage.notify import ClaimedDelivery

if TYPE_CHECKING:
    # Both are imported where a sender first sends: a gateway with no receiver configured
    # never loads them (aiohttp alone is about 8 MB of resident memory; docs/performance.md).
    import aiohttp
    import aiosmtplib

DELIVERY_HEADER: Final = "X-Gateway-Delivery"
ATTEMPT_HEADER: Final = "X-Gateway-Attempt"
ERROR_MAX: Final = 500
# Of a refusal's body, what is read (and at most shown): enough for a receiver's message.
ERROR_BODY_MAX: Final = 2048
# How long an SMTP server's 4xx ("try again later") asks the gateway to wait: as long as the
# backoff allows (``backoff_max_s``, whose default is postgrey's greylisting delay, 300 s). A
# greylisting server refuses every try before its delay has passed: the backoff's own delays
# (up to 1, 2, 4, 8 s) spent the five attempts within 15 s, and the delivery ended FAILED.
SMTP_LATER_S: Final = math.inf


class SendError(Exception):
    """One attempt failed; ``str()`` is what the delivery records as its last error.
    ``retry_after_s``: how long the receiver asked to be left alone (its ``Retry-After``),
    if it said."""

    def __init__(self, text: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(text)
        self.retry_after_s = retry_after_s


def error_text(receiver: ReceiverConfig, text: str, limit: int = ERROR_MAX) -> str:
    """What may be stored and logged of an attempt's error: credentials cut out first (a
    secret cut in two by the limit would no longer be found), then at most ``limit``
    characters. A webhook URL's long path segments and query values count too (the URL may
    be the credential, and an error page may echo its path)."""
    secrets = receiver_secrets(receiver)
    if receiver.url:
        secrets = [*secrets, *url_tokens(receiver.url)]
    return redact_credentials(text, secrets)[:limit]


# What is left to do once an attempt has succeeded (an SMTP QUIT): the worker awaits it after
# the outcome is recorded, outside the attempt's timeout. Best effort: it bounds itself, never
# raises, and leaves no connection open.
Farewell = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Accepted:
    """An attempt the receiver accepted: what is left to do (``farewell``), and the recipients
    an SMTP server refused while it took the mail for the others (address: its answer). Those
    it refused for good (5xx) are not mailed again; the delivery is SENT (someone was reached)
    and says whom it missed. Those it refused for now (``later``: a 4xx, a greylisting 451,
    "try again later") are owed the mail: the next attempt is for them alone, no sooner than
    :data:`SMTP_LATER_S` allows."""

    farewell: Farewell | None = None
    refused: Mapping[str, str] = field(default_factory=dict)
    later: tuple[str, ...] = ()


@dataclass(slots=True)
class Refusal:
    """What a receiver refusing the attempt has said so far: its status (0: none yet), the
    wait it asked for, and the start of its body as it arrives. Kept by the worker: when the
    attempt's ``timeout_s`` runs out while the body is still coming, the delivery records the
    refusal, not "no answer" (and a 503's ``Retry-After`` is honoured, not lost)."""

    status: int = 0
    retry_after_s: float | None = None
    head: bytearray = field(default_factory=bytearray)
    # What the status means beside the body's words (a 413: the size refused), or "".
    note: str = ""

    def error(self, receiver: ReceiverConfig, cut: str = "") -> SendError:
        text = error_text(receiver, _printable(self.head.decode(errors="replace")), 200)
        if self.note:
            text = f"{self.note}: {text}"
        return SendError(
            f"HTTP {self.status}: {text}".strip() + cut, retry_after_s=self.retry_after_s
        )


class Sender(Protocol):
    async def send(self, delivery: ClaimedDelivery, refusal: Refusal) -> Accepted: ...


class WebhookSender:
    """POST the body as JSON; any 2xx answer is a delivery, anything else an error."""

    def __init__(self, receiver: ReceiverConfig, session: aiohttp.ClientSession) -> None:
        self.receiver = receiver
        self.session = session

    async def send(self, delivery: ClaimedDelivery, refusal: Refusal) -> Accepted:
        import aiohttp

        body = delivery.body.encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"mqtt-alarm-gateway/{gateway_version()}",
            **self.receiver.headers,
            EVENT_ID_HEADER: str(delivery.event_id),
            DELIVERY_HEADER: str(delivery.id),
            ATTEMPT_HEADER: str(delivery.attempts),
        }
        if self.receiver.secret:
            # Dated on the database's clock (the claim's time): a node whose clock is minutes
            # off signed with a time every receiver checking `t` refused, attempt after attempt.
            signed_at = int(delivery.claimed_at.timestamp())
            headers[SIGNATURE_HEADER] = signature(self.receiver.secret, signed_at, body)
        try:
            async with self.session.post(
                self.receiver.url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self.receiver.timeout_s),
            ) as response:
                if 200 <= response.status < 300:
                    # Accepted: the status says so, and the body is not waited for (one
                    # answering 200 and then stalling its body had the delivery recorded
                    # FAILED and sent again). Unless it is all here, the connection is closed.
                    if not response.content.is_eof():
                        response.close()
                    return Accepted()
                # Known before the body: kept whatever becomes of it (a body stalling past
                # timeout_s, or cut short, had the status and the Retry-After thrown away).
                refusal.status = response.status
                refusal.retry_after_s = retry_after_s(
                    response.headers.get("Retry-After"), date=response.headers.get("Date")
                )
                cut = await _head(response.content, ERROR_BODY_MAX, refusal.head)
                if not response.content.at_eof():
                    # Longer than what we read: closed rather than drained (a short answer
                    # read to its end leaves the connection for the next send).
                    response.close()
                if response.status == 413:  # nginx's client_max_body_size, and the like
                    refusal.note = too_large(delivery, len(body), "body")
                raise refusal.error(self.receiver, " (its body cut short)" if cut else "")
        except aiohttp.ClientError as exc:
            # The exception's text names host and port at most, never the path or query.
            raise SendError(error_text(self.receiver, f"{type(exc).__name__}: {exc}")) from exc


def too_large(delivery: ClaimedDelivery, size: int, what: str) -> str:
    """What a receiver's "too large" answer (HTTP 413, SMTP 552) means, in ``last_error``:
    the size it refused, and for a group's window the key that bounds it."""
    text = f"the receiver refused the {what} of {size} bytes as too large"
    if delivery.event == "notify.group":
        text += " (lower the route's group_max_notifications)"
    return text


async def _head(content: aiohttp.StreamReader, limit: int, head: bytearray) -> bool:
    """At most ``limit`` bytes of a body into ``head`` (fewer at its end), as they arrive;
    the rest stays unread. Whether the body was cut short (the connection lost mid-body):
    what came of it is kept."""
    import aiohttp

    while len(head) < limit:
        try:
            chunk = await content.read(limit - len(head))
        except aiohttp.ClientPayloadError:
            return True
        if not chunk:
            break
        head += chunk
    return False


def _printable(text: str) -> str:
    """One line: control characters (a receiver's newlines, escapes) as spaces."""
    return "".join(c if c.isprintable() else " " for c in text)


class EmailSender:
    """One message, a plain-text and an HTML part, to every address of ``to``."""

    def __init__(self, receiver: ReceiverConfig) -> None:
        self.receiver = receiver

    async def send(self, delivery: ClaimedDelivery, refusal: Refusal) -> Accepted:
        import aiosmtplib

        r = self.receiver
        # An attempt after some recipients took the mail is for those still owed it (and
        # still in ``to``: a reload may have taken one off), nobody else.
        owed = delivery.recipients_owed
        recipients = list(r.to) if owed is None else [a for a in r.to if a in owed]
        if not recipients:
            return Accepted()
        message = build_email(r, msgspec.json.decode(delivery.body), str(delivery.event_id))
        # RFC 5322's Date and Message-ID, which nothing on the way adds for us: a message
        # without them was refused by Gmail ("550 5.7.1 Messages missing a valid Message-ID
        # header are not accepted") and passed on bare by a relay on another host. Dated on
        # the database's clock (the claim), as a webhook's signature; the id is the same on
        # every attempt, so a mail the server took after the attempt's timeout and got again
        # is one message to the mailbox.
        message["Date"] = format_datetime(delivery.claimed_at)
        message["Message-ID"] = message_id(r, delivery)
        port = r.port or (465 if r.tls else 587 if r.starttls else 25)
        client = aiosmtplib.SMTP(
            hostname=r.host,
            port=port,
            username=r.username or None,
            password=r.password or None,
            use_tls=r.tls,
            start_tls=r.starttls,
            timeout=r.timeout_s,
        )
        try:
            try:
                await client.connect()  # with STARTTLS and the login, as configured
                # Some recipients refused and others taken is no exception (all refused is
                # SMTPRecipientsRefused): the refused ones are what it returns.
                refused, _answer = await client.send_message(message, recipients=recipients)
            except BaseException:
                client.close()
                raise
        except aiosmtplib.SMTPException as exc:
            text = f"{type(exc).__name__}: {exc}"
            if getattr(exc, "code", None) == 552:  # over the server's message size limit
                text = f"{too_large(delivery, len(message.as_bytes()), 'message')}: {text}"
            raise SendError(
                error_text(r, text),
                retry_after_s=SMTP_LATER_S if _for_now(exc) else None,
            ) from exc
        except OSError as exc:
            raise SendError(error_text(r, f"{type(exc).__name__}: {exc.strerror or exc}")) from exc
        # The server accepted the mail (250 to its DATA): this attempt is a delivery, whatever
        # the QUIT does. A server stalling on it had the mail recorded a failed attempt, and
        # mailed again, when the QUIT ran under the attempt's timeout.
        return Accepted(
            farewell=functools.partial(_quit, client, r.timeout_s),
            refused={
                address: f"{answer.code} {answer.message}".strip()
                for address, answer in refused.items()
            },
            later=tuple(a for a in recipients if a in refused and 400 <= refused[a].code < 500),
        )


# What may stand right of the "@" of a Message-ID (RFC 5322 dot-atom-text, as a domain is).
_ID_DOMAIN_RE: Final = re.compile(r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*")


def message_id(receiver: ReceiverConfig, delivery: ClaimedDelivery) -> str:
    """The delivery's ``Message-ID``: its event and its own id, at the sender's domain;
    unique to the (event, receiver) pair and the same on every attempt."""
    domain = receiver.from_.rpartition("@")[2]
    if _ID_DOMAIN_RE.fullmatch(domain) is None:
        domain = "mqtt-alarm-gateway.invalid"
    return f"<{delivery.event_id}.{delivery.id}@{domain}>"


def _for_now(exc: aiosmtplib.SMTPException) -> bool:
    """A refusal for now (a 4xx: to the connection, the sender, a recipient, the data), not
    for good (5xx) nor a connection lost or a timeout (no answer)."""
    import aiosmtplib

    if isinstance(exc, aiosmtplib.SMTPRecipientsRefused):
        return any(400 <= refused.code < 500 for refused in exc.recipients)
    return isinstance(exc, aiosmtplib.SMTPResponseException) and 400 <= exc.code < 500


async def _quit(client: aiosmtplib.SMTP, timeout_s: float) -> None:
    """Say goodbye to a server that accepted the mail: at most ``timeout_s``, any error
    ignored (the mail is the server's), the connection closed whatever happens."""
    try:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await client.quit()
    finally:
        client.close()


def subject_of(body: dict[str, Any]) -> str:
    """``[SEVERITY] rule on device: event``, with what the event has of these."""
    severity = body.get("severity") or "NOTICE"
    what = body.get("rule_key") or body.get("event")
    where = f" on {body['device_id']}" if body.get("device_id") else ""
    # Told at its shelf's end (docs/notifications.md, "A shelf's end tells its alarms again").
    back = " (shelf ended)" if body.get("returned_from_shelf") else ""
    return f"[{severity}] {what}{where}: {body.get('event')}{back}"


def _lines(body: dict[str, Any]) -> list[tuple[str, str]]:
    payload = body.get("payload") if isinstance(body.get("payload"), dict) else {}
    assert isinstance(payload, dict)
    alarm = payload.get("alarm") if isinstance(payload.get("alarm"), dict) else {}
    assert isinstance(alarm, dict)
    fields = [
        ("Event", body.get("event")),
        ("Alarm", body.get("alarm_id")),
        ("Device", body.get("device_id")),
        ("Rule", body.get("rule_key")),
        ("Rule description", payload.get("rule_description") or alarm.get("rule_description")),
        ("Severity", body.get("severity")),
        ("Status", body.get("status")),
        ("Trigger", payload.get("trigger") or alarm.get("trigger") or payload.get("reason")),
        ("Occurred at", body.get("occurred_at")),
        ("Returned from shelf", body.get("returned_from_shelf")),
    ]
    times = body.get("times") if isinstance(body.get("times"), dict) else {}
    assert isinstance(times, dict)
    fields += [
        (key.removesuffix("_at").replace("_", " ").capitalize(), v) for key, v in times.items()
    ]
    fields.append(("Link", body.get("link")))
    return [
        (label, v if isinstance(v, str) else msgspec.json.encode(v).decode())
        for label, v in fields
        if v is not None
    ]


_SEVERITY_RANK: Final = {"INFO": 0, "WARNING": 1, "MAJOR": 2, "CRITICAL": 3}


def digest_subject(body: dict[str, Any]) -> str:
    """A grouped delivery's subject: ``[WORST SEVERITY] N notifications: label=value, ...``."""
    items = [n for n in body.get("notifications", []) if isinstance(n, dict)]
    severities = [str(n["severity"]) for n in items if n.get("severity") in _SEVERITY_RANK]
    worst = max(severities, key=lambda s: _SEVERITY_RANK[s]) if severities else "NOTICE"
    group = body.get("group") if isinstance(body.get("group"), dict) else {}
    assert isinstance(group, dict)
    labels = ", ".join(f"{k}={v}" for k, v in group.items()) or "all"
    again = " (still open)" if body.get("repeat") else ""
    return f"[{worst}] {len(items)} notifications{again}: {labels}"


def build_email(receiver: ReceiverConfig, body: dict[str, Any], event_id: str) -> EmailMessage:
    """One notification's mail; for a grouped delivery, a digest: one section each."""
    message = EmailMessage()
    grouped = body.get("kind") == "group"
    message["Subject"] = digest_subject(body) if grouped else subject_of(body)
    message["From"] = receiver.from_
    message["To"] = ", ".join(receiver.to)
    message["X-Gateway-Event-Id"] = event_id
    sections = (
        [(subject_of(n), _lines(n)) for n in body.get("notifications", []) if isinstance(n, dict)]
        if grouped
        else [("", _lines(body))]
    )
    text = "\n".join(
        (f"== {head}\n" if head else "") + "".join(f"{label}: {value}\n" for label, value in lines)
        for head, lines in sections
    )
    message.set_content(text)
    parts = []
    for head, lines in sections:
        rows = "".join(
            f"<tr><th align='left'>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>"
            for label, value in lines
        )
        caption = f"<h3>{html.escape(head)}</h3>" if head else ""
        parts.append(f"{caption}<table>{rows}</table>")
    title = html.escape(message["Subject"])
    message.add_alternative(
        f"<html><body><h2>{title}</h2>{''.join(parts)}</body></html>", subtype="html"
    )
    return message


def sender_for(receiver: ReceiverConfig, session: aiohttp.ClientSession) -> Sender:
    if receiver.kind == "webhook":
        return WebhookSender(receiver, session)
    return EmailSender(receiver)
