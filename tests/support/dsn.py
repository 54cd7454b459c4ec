"""DSN helpers for tests."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def with_database(dsn: str, database: str) -> str:
    """The same server and credentials, another database (URL-form DSNs only)."""
    parts = urlsplit(dsn)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ValueError(f"GATEWAY_TEST_DSN must be a postgresql:// URL, got {dsn!r}")
    return urlunsplit(parts._replace(path=f"/{database}"))
