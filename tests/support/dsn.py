"""DSN helpers for tests."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit, urlunsplit

from tests.support.tcp_proxy import TcpProxy


def with_database(dsn: str, database: str) -> str:
    """The same server and credentials, another database (URL-form DSNs only)."""
    parts = urlsplit(dsn)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ValueError(f"GATEWAY_TEST_DSN must be a postgresql:// URL, got {dsn!r}")
    return urlunsplit(parts._replace(path=f"/{database}"))


def proxy_for(dsn: str) -> TcpProxy:
    """A TCP proxy in front of the server of ``dsn`` (TCP host or unix socket directory)."""
    parts = urlsplit(dsn)
    socket_dir = parse_qs(parts.query).get("host", [""])[0]
    port = parts.port or 5432
    if socket_dir.startswith("/"):
        return TcpProxy("", 0, target_unix=f"{socket_dir}/.s.PGSQL.{port}")
    return TcpProxy(parts.hostname or "127.0.0.1", port)


def through(dsn: str, proxy: TcpProxy) -> str:
    """``dsn`` rewritten to reach its server through ``proxy`` (over TCP)."""
    parts = urlsplit(dsn)
    user = parts.username or "postgres"
    return urlunsplit(("postgresql", f"{user}@127.0.0.1:{proxy.port}", parts.path, "", ""))
