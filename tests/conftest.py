"""Shared fixtures: a real PostgreSQL (GATEWAY_TEST_DSN or the embedded one), a database per
test cloned from a migrated template, and a mosquitto per test on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.support.dsn import with_database
from tests.support.events import assert_outbox_decodes
from tests.support.fake_llm import FakeLlm
from tests.support.mosquitto import Mosquitto

TEST_DSN_ENV = "GATEWAY_TEST_DSN"


@pytest.fixture(scope="session")
def pg_server_dsn() -> Iterator[str]:
    """Admin DSN of the server the tests use; starts the embedded one when none is given."""
    dsn = os.environ.get(TEST_DSN_ENV)
    if dsn:
        yield dsn
        return
    from gateway.embedded.postgres import EmbeddedPostgres

    # Not under pytest's tmp_path: a concurrent pytest run resets that tree to mode 0700,
    # which locks the embedded server's own (non-root) user out of its data directory.
    state_dir = Path(tempfile.mkdtemp(prefix="gw-test-pg-"))
    server = EmbeddedPostgres(state_dir)
    started = server.start()
    try:
        yield with_database(started, "postgres")
    finally:
        server.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


async def _admin(dsn: str) -> asyncpg.Connection:
    return await asyncpg.connect(dsn)


@pytest.fixture(scope="session")
def template_db(pg_server_dsn: str) -> Iterator[str]:
    """A migrated database that each test clones (cheaper than migrating per test)."""
    name = f"gw_tmpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"

    async def create() -> None:
        from storage.migrate import migrate

        admin = await _admin(pg_server_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(with_database(pg_server_dsn, name))
        try:
            await migrate(conn)
        finally:
            await conn.close()

    async def drop() -> None:
        admin = await _admin(pg_server_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    asyncio.run(create())
    try:
        yield name
    finally:
        asyncio.run(drop())


@contextlib.asynccontextmanager
async def _fresh_database(server_dsn: str, prefix: str, template: str | None) -> AsyncIterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    clause = f' TEMPLATE "{template}"' if template else ""
    admin = await _admin(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"{clause}')
    finally:
        await admin.close()
    try:
        yield with_database(server_dsn, name)
    finally:
        admin = await _admin(server_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@pytest.fixture
async def db_dsn(
    pg_server_dsn: str, template_db: str, request: pytest.FixtureRequest
) -> AsyncIterator[str]:
    """A fresh, migrated database for one test.

    Afterwards every outbox event the test made the gateway write must decode into its
    type's Struct (protocol/events.py): every test that raises alarms, finishes commands or
    runs campaigns checks the event catalogue. A test that writes placeholder events of the
    catalogue's types on purpose is marked ``synthetic_events``."""
    async with _fresh_database(pg_server_dsn, "gw_t", template_db) as dsn:
        yield dsn
        if request.node.get_closest_marker("synthetic_events") is None:
            await assert_outbox_decodes(dsn)


@pytest.fixture
async def empty_db_dsn(pg_server_dsn: str) -> AsyncIterator[str]:
    """A database with no schema at all (for migration tests)."""
    async with _fresh_database(pg_server_dsn, "gw_e", None) as dsn:
        yield dsn


@pytest.fixture
async def db(db_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(db_dsn)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def pool(db_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A small pool on the test's database (for code that takes a pool, like the services)."""
    from storage.pool import create_pool

    pool = await create_pool(db_dsn, min_size=1, max_size=4)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path / "mosquitto", max_inflight_messages=100)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
async def llm_server() -> AsyncIterator[FakeLlm]:
    """A model server on a loopback port, speaking the chat-completions API (scripted)."""
    async with FakeLlm() as server:
        yield server
