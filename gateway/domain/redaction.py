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
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

REDACTED: Final = "[redacted]"
# Shorter values are left alone: "1" or "on" would cut the message to pieces.
SHORTEST_SECRET: Final = 4
# Of a URL's path segments and query values, those this long or longer may be a credential
# (`/services/T0/B0/<token>`, `?key=<key>`); "hook", "v1" or "ops" are not cut out.
SHORTEST_URL_TOKEN: Final = 8

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


def url_tokens(url: str) -> list[str]:
    """What of ``url`` besides its userinfo may be a credential: its path segments and query
    values of :data:`SHORTEST_URL_TOKEN` characters or more, as written and decoded. Chat
    services' webhook URLs are their credential (Slack's and Discord's a token in the path,
    Google Chat's a ``key`` and a ``token`` in the query), and a receiver's error page may
    echo the path it was asked for ("Cannot POST /services/...")."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = [*parts.path.split("/"), *(v for _, v in parse_qsl(parts.query))]
    found += [p for pair in parts.query.split("&") for p in pair.split("=", 1)[1:]]
    tokens = {t for part in found for t in (part, unquote(part))}
    return sorted(t for t in tokens if len(t) >= SHORTEST_URL_TOKEN)


def userinfo_cut(url: str) -> bool:
    """Whether an ``@`` comes after ``url``'s host part (in its path, query or fragment): a
    ``/``, ``?`` or ``#`` written as is in a password ended the host part there
    (``http://u:2024/secret@host/v1`` is host ``u``, port 2024), and the rest of the password
    is in the path, where no redaction looks for it."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return "@" in parts.path or "@" in parts.query or "@" in parts.fragment


def without_userinfo(url: str) -> str:
    """``url`` as a message or a log line may show it: without its userinfo (credentials)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # "http://[::1": an invalid IPv6 address
        return _USERINFO.sub(r"\1", url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
