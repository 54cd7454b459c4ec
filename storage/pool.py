"""Connection pool setup."""

from __future__ import annotations

import asyncpg

from storage.audit import AuditFailureHook, audited_connection_class


async def create_pool(
    dsn: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    connect_timeout_s: float = 10.0,
    command_timeout_s: float | None = 60.0,
    application_name: str = "gateway",
    on_audit_failure: AuditFailureHook | None = None,
) -> asyncpg.Pool:
    """A pool whose connections are named after the node (visible in pg_stat_activity).

    Its connections notice audit rows PostgreSQL refuses (:mod:`storage.audit`) and report
    them to ``on_audit_failure``.
    """
    hooks = () if on_audit_failure is None else (on_audit_failure,)
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        timeout=connect_timeout_s,
        command_timeout=command_timeout_s,
        server_settings={"application_name": application_name},
        reset=_keep_session,
        connection_class=audited_connection_class(*hooks),
    )
    assert pool is not None
    return pool


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Return a connection to the pool without asyncpg's reset query.

    asyncpg still rolls back a transaction left open; its default reset adds a round trip
    (UNLISTEN, RESET ALL, CLOSE ALL, advisory unlock) to every release, for session state
    this code never leaves behind: LISTEN runs on dedicated connections, nothing SETs
    session settings, and the migration lock is released in a ``finally``.
    """
