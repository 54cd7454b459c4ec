"""What log lines and errors say of a DSN: where it points, never its credentials."""

from __future__ import annotations

import pytest

from storage.pool import describe, user_of


@pytest.mark.parametrize(
    ("dsn", "where"),
    [
        ("postgresql://gw:s3cret@db1.example:6432/gateway", "db1.example:6432/gateway"),
        ("postgresql://gw@db1/gateway", "db1:5432/gateway"),
        ("postgres://gw:pw@127.0.0.1/", "127.0.0.1:5432/gw"),
        ("postgresql:///gateway", "localhost:5432/gateway"),
        ("postgresql://postgres@/gateway?host=/var/lib/gw/pgsock", "/var/lib/gw/pgsock/gateway"),
        ("postgresql://u@h:notaport/x", "h:5432/x"),
        ("postgresql://u:p%40ss@h/my%20db", "h:5432/my db"),
        # A failover pair: every member, in order (libpq's default port where none is given).
        (
            "postgresql://gw:s3cret@db1:5432,db2:6432/gateway?target_session_attrs=read-write",
            "db1:5432,db2:6432/gateway",
        ),
        ("postgresql://gw@db1,db2:7/gateway", "db1:5432,db2:7/gateway"),
        ("postgresql://gw@[::1]:5,[::2]/gateway", "[::1]:5,[::2]:5432/gateway"),
    ],
)
def test_describe_names_host_port_and_database_only(dsn: str, where: str) -> None:
    assert describe(dsn) == where
    assert "s3cret" not in describe(dsn)


def test_user_of_reads_the_role() -> None:
    assert user_of("postgresql://gw:pw@db/x") == "gw"
    assert user_of("postgresql://db/x?user=other") == "other"
    assert user_of("postgresql://db/x") == ""
