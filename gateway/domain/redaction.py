"""Cutting credentials out of text that came from outside (a receiver's answer, an exception).

A delivery's ``last_error`` is shown to every viewer (``GET /deliveries``) and logged; what a
receiver answered may echo the request it got, with our ``Authorization`` header in it. So the
text loses, before it is stored: the values given (the receiver's configured header values and
secrets), anything that looks like a credential (an ``Authorization`` value, a ``Bearer`` or
``Basic`` token, a ``password=`` / ``token=`` / ``api_key:`` pair) and a URL's userinfo.

Pure and conservative: a false positive costs a few characters of an error message, a miss
hands a credential to every viewer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final
from urllib.parse import urlsplit, urlunsplit

REDACTED: Final = "[redacted]"
# Shorter values are left alone: "1" or "on" would cut the message to pieces.
SHORTEST_SECRET: Final = 4

# `Authorization: Bearer abc`, `"authorization": "Basic abc"`, `Proxy-Authorization=...`: the
# whole value up to the end of the line, a quote, a comma or a closing brace.
_AUTHORIZATION: Final = re.compile(
    r"""((?:proxy-)?authorization["']?\s*[:=]\s*["']?)[^"'\r\n,}]+""", re.IGNORECASE
)
# A scheme and its credentials anywhere else (`Bearer abc`, `token abc`).
_SCHEME: Final = re.compile(
    r"\b(bearer|basic|digest|token|apikey)(\s+)[A-Za-z0-9._~+/=:-]{4,}", re.IGNORECASE
)
# `password=x`, `"api_key": "x"`, `client_secret: x`, `access-token=x` (query strings, JSON,
# YAML): the value after the name.
_PAIR: Final = re.compile(
    r"""(\b(?:[a-z0-9]+[_-])*(?:password|passwd|pwd|pass|secret|token|api[_-]?key|apikey|"""
    r"""access[_-]?key|auth|credentials?|signature|session[_-]?id|cookie)"""
    r"""["']?\s*[:=]\s*["']?)[^\s"'&,;}]+""",
    re.IGNORECASE,
)
# `scheme://user:password@host`: the userinfo.
_USERINFO: Final = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@", re.IGNORECASE)


def redact_credentials(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every value of ``secrets`` and everything that looks like a credential
    replaced by ``[redacted]``."""
    values = {s for secret in secrets for s in (secret, *secret.split())}
    for value in sorted(values, key=len, reverse=True):
        if len(value) >= SHORTEST_SECRET and value in text:
            text = text.replace(value, REDACTED)
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    text = _AUTHORIZATION.sub(rf"\1{REDACTED}", text)
    text = _SCHEME.sub(rf"\1\2{REDACTED}", text)
    return _PAIR.sub(rf"\1{REDACTED}", text)


def url_credentials(url: str) -> list[str]:
    """The userinfo of ``url`` (``user:password``) and each of its two parts; none without."""
    try:
        userinfo = urlsplit(url).netloc.rpartition("@")[0]
    except ValueError:  # "http://[::1": an invalid IPv6 address
        found = _USERINFO.match(url)
        userinfo = found.group()[len(found.group(1)) : -1] if found else ""
    if not userinfo:
        return []
    return list(dict.fromkeys(s for s in (userinfo, *userinfo.split(":", 1)) if s))


def without_userinfo(url: str) -> str:
    """``url`` as a message or a log line may show it: without its userinfo (credentials)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # "http://[::1": an invalid IPv6 address
        return _USERINFO.sub(r"\1", url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
