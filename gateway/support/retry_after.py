"""An HTTP ``Retry-After`` header (RFC 9110 §10.2.3), as the seconds it asks a client to wait.

Read by the clients that talk to servers which rate-limit or go into maintenance: the
notification webhooks (gateway.notify.receivers) and the LLM client (gateway.ai.llm). The
standard library parses the HTTP date; the rest (digits only, a date without a zone, a date
past) is what the RFC leaves to the client.

An HTTP date is read against the answer's own ``Date`` (RFC 9110 §6.6.1: the server's clock,
as the retry date is): their difference is the wait the server asked for, whatever the node's
clock says. Read against the node's clock, a node whose NTP broke, minutes ahead, took a date
40 s on for one long past and retried at once, every attempt inside the server's maintenance.
The node's clock stands in only for an answer without a readable ``Date``.
"""

from __future__ import annotations

import email.utils
import math
import time


def retry_after_s(
    value: str | None, *, date: str | None = None, now: float | None = None
) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait: delay-seconds, or an HTTP date (from the
    answer's ``date`` header when readable, else from ``now``, epoch seconds, the clock by
    default; a date past is 0); None when it is absent or unreadable (not ASCII digits, no
    date, a date without its zone)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():  # str.isdigit() alone takes "²", float() not
        return float(text)
    when = _http_date(text)
    if when is None:
        return None
    sent = None if date is None else _http_date(date.strip())
    if sent is None:
        sent = time.time() if now is None else now
    seconds = when - sent
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _http_date(text: str) -> float | None:
    """Epoch seconds of an HTTP date; None when unreadable or without its zone (an HTTP date
    is GMT; a zone-less one is not read as such)."""
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return when.timestamp()
