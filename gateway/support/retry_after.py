"""An HTTP ``Retry-After`` header (RFC 9110 §10.2.3), as the seconds it asks a client to wait.

Read by the clients that talk to servers which rate-limit or go into maintenance: the
notification webhooks (gateway.notify.receivers) and the LLM client (gateway.ai.llm). The
standard library parses the HTTP date; the rest (digits only, a date without a zone, a date
past) is what the RFC leaves to the client.
"""

from __future__ import annotations

import email.utils
import math
import time


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait: delay-seconds, or an HTTP date (from
    ``now``, epoch seconds; the clock by default; a date past is 0); None when it is absent
    or unreadable (not ASCII digits, no date, a date without its zone)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():  # str.isdigit() alone takes "²", float() not
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; a zone-less one is read as such
        return None
    seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None
