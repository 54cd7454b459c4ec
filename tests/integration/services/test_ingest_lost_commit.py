"""PostgreSQL lost between its commit of a batch and the writer hearing of it: the writer asks
a new connection whether the transaction committed (pg_xact_status of its id) and, as it did,
takes the batch as stored; nothing it wrote may count twice."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
from structlog.testing import capture_logs

from gateway.alarms.engine import AlarmEngine
from gateway.ingest import live_path
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.store import StoreResult
from gateway.ingest.writer import IngestWriter
from gateway.support.backoff import Backoff
from gateway.support.metrics import Metrics
from protocol import Encoding, Topics
from storage import ingest as ingest_repo
from storage.migrate import migrate
from storage.pool import create_pool
from tests.support.daemon import make_config
from tests.support.dsn import proxy_for, through
from tests.support.ports import free_port
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

TOPICS = Topics("iot")
# asyncpg's COMMIT of a transaction: a simple query.
COMMIT = b"COMMIT;\x00"


def _lose_the_commit_answer(proxy: TcpProxy) -> None:
    """The next COMMIT goes through; PostgreSQL's answer, and everything after, is swallowed."""

    def commit_then_silence(chunk: bytes) -> bool:
        if COMMIT in chunk:
            proxy.black_hole()
        return True

    proxy.from_client = commit_then_silence


DOOR_RULE = '[[rules]]\nkey = "door"\nkind = "event"\nevent = "DOOR_OPEN"\nseverity = "MAJOR"\n'


LETTERS = "SELECT reason, seen_count FROM dead_letter"


def _writer(pool: asyncpg.Pool, engine: AlarmEngine | None = None) -> IngestWriter:
    return IngestWriter(
        pool=pool,
        decoder=MessageDecoder(TOPICS, Encoding.JSON, 65536),
        node_id="node-a",
        metrics=Metrics(),
        batch_size=10,
        linger_s=0.0,
        queue_max=100,
        retry=Backoff(0.01, 0.1),
        engine=engine,
    )


def _answers(writer: IngestWriter, status: str) -> float | None:
    """How many lost COMMIT answers PostgreSQL then told ``status`` of."""
    return writer.metrics.registry.get_sample_value(
        "gateway_ingest_lost_commits_total", {"status": status}
    )


def _a_letter_and_a_sample() -> list[Inbound]:
    return [
        Inbound(TOPICS.telemetry("dev-1"), b'{"ts": 1767225600000, "metrics": {"t": 1}}'),
        Inbound(TOPICS.telemetry("dev-1"), b"not json"),
    ]


async def _through_a_lost_commit(
    db_dsn: str, db: asyncpg.Connection, messages: list[Inbound], engine: AlarmEngine | None
) -> StoreResult:
    """Store ``messages`` (dev-1's among them) as one batch whose COMMIT reaches PostgreSQL
    and whose answer is lost: the connection is cut once the commit is visible (dev-1
    registered), as PostgreSQL restarting at that moment would."""
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    writer = _writer(pool, engine)
    batch = writer.decoder.classify(messages)

    _lose_the_commit_answer(proxy)
    try:
        storing = asyncio.create_task(writer.store_with_retry(batch))

        async def committed() -> bool:
            return bool(await db.fetchval("SELECT count(*) FROM device"))

        await wait_until(committed, timeout=30, message="the batch committed")
        proxy.from_client = None
        await proxy.cut()
        proxy.swallowing = False
        await proxy.resume()
        async with asyncio.timeout(30):
            return await storing
    finally:
        await pool.close()
        await proxy.stop()


async def test_a_batch_committed_before_the_connection_was_lost_raises_its_alarm_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    engine = live_path.alarm_engine(
        make_config(dsn=db_dsn, mqtt_port=1, extra=DOOR_RULE), Metrics()
    )
    door = b'{"ts": 1767225600000, "events": [{"type": "DOOR_OPEN"}]}'
    result = await _through_a_lost_commit(
        db_dsn, db, [Inbound(TOPICS.telemetry("dev-1"), door)], engine
    )
    # Known committed: the batch's own result (its one new row), nothing judged again.
    assert result.stored == 1
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
    assert await db.fetchval("SELECT count(*) FROM alarm") == 1
    created = "SELECT count(*) FROM outbox_event WHERE event_type = 'alarm.created'"
    assert await db.fetchval(created) == 1


async def test_a_batch_committed_before_the_connection_was_lost_counts_its_letters_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    result = await _through_a_lost_commit(db_dsn, db, _a_letter_and_a_sample(), None)
    # One arrival, seen once.
    letters = await db.fetch(LETTERS)
    assert [tuple(r) for r in letters] == [("MALFORMED", 1)]
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
    # The batch was not stored again: its result is the committed transaction's.
    assert result.stored == 1
    assert len(result.dead_letters) == 1


async def test_a_batch_whose_commit_never_arrived_is_stored_again_and_counts_its_letters_once(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The connection is lost with the COMMIT itself: PostgreSQL rolls the transaction back,
    says so (aborted), and the writer stores the batch again, as before."""
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    writer = _writer(pool)
    sent = asyncio.Event()

    def commit_lost(chunk: bytes) -> bool:
        if COMMIT in chunk:
            proxy.black_hole()
            sent.set()
            return False  # never reaches PostgreSQL
        return True

    proxy.from_client = commit_lost
    try:
        storing = asyncio.create_task(
            writer.store_with_retry(writer.decoder.classify(_a_letter_and_a_sample()))
        )
        async with asyncio.timeout(30):
            await sent.wait()
        proxy.from_client = None
        await proxy.cut()
        proxy.swallowing = False
        await proxy.resume()
        async with asyncio.timeout(30):
            result = await storing
    finally:
        await pool.close()
        await proxy.stop()
    assert [tuple(r) for r in await db.fetch(LETTERS)] == [("MALFORMED", 1)]
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
    assert result.stored == 1  # stored by the second transaction
    assert _answers(writer, "aborted") == 1
    assert _answers(writer, "committed") is None


async def test_a_commit_still_under_way_when_the_connection_was_lost_is_waited_for(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """The COMMIT reached PostgreSQL, which has not finished it when the connection is lost
    (here a deferred trigger waits for a lock the test holds; in the field, a synchronous
    standby's flush): the writer is told 'in progress', asks again, and once it is committed
    takes the batch as stored."""
    await db.execute(
        """
        CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_advisory_xact_lock_shared(4711); RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON dead_letter
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_commit();
        """
    )
    holder = await asyncpg.connect(db_dsn)
    await holder.execute("SELECT pg_advisory_lock(4711)")
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    writer = _writer(pool)

    _lose_the_commit_answer(proxy)
    try:
        storing = asyncio.create_task(
            writer.store_with_retry(writer.decoder.classify(_a_letter_and_a_sample()))
        )

        async def committing() -> bool:
            waiting = (
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            return bool(await db.fetchval(waiting))

        await wait_until(committing, timeout=30, message="the COMMIT waits in its trigger")
        proxy.from_client = None
        await proxy.cut()
        proxy.swallowing = False
        await proxy.resume()

        async def asked() -> bool:
            status = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND query LIKE '%pg_xact_status%'"
            )
            return bool(await db.fetchval(status))

        await wait_until(asked, timeout=30, message="the writer asked while it was under way")
        assert not storing.done()
        await holder.execute("SELECT pg_advisory_unlock(4711)")
        async with asyncio.timeout(30):
            result = await storing
    finally:
        await holder.close()
        await pool.close()
        await proxy.stop()
    assert [tuple(r) for r in await db.fetch(LETTERS)] == [("MALFORMED", 1)]
    assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
    assert result.stored == 1
    assert _answers(writer, "committed") == 1


async def test_only_the_server_that_gave_the_id_not_restarted_since_is_asked(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """After a failover the promoted standby goes on with the same ids, and one it never
    received may have been given to another of its transactions: its "committed" would make
    the writer acknowledge a batch it never stored. The statement that returns a batch's id
    returns when its server started; another server (or the same restarted) is not asked,
    and the batch is stored again."""
    async with db.transaction():
        _, _, xact = await ingest_repo.insert_telemetry_at(db, [], "node-a", ["dev-asked"])
    assert xact is not None
    assert await ingest_repo.xact_status(db, xact) == (True, "committed")
    elsewhere = xact._replace(server_started=xact.server_started - timedelta(hours=1))
    assert await ingest_repo.xact_status(db, elsewhere) == (False, None)

    pool = await create_pool(db_dsn, min_size=1, max_size=1)
    try:
        writer = _writer(pool)
        lost = ConnectionResetError("the answer to the COMMIT never came")
        assert await writer._committed(xact, lost, Backoff(0.01, 0.1)) is True
        assert await writer._committed(elsewhere, lost, Backoff(0.01, 0.1)) is False
    finally:
        await pool.close()
    assert _answers(writer, "committed") == 1
    assert _answers(writer, "other_server") == 1


async def test_a_connection_lost_mid_batch_is_logged_as_what_ended_it(
    db_dsn: str, db: asyncpg.Connection
) -> None:
    """PostgreSQL's connection reset while a batch waits on a lock: the writer logs the loss
    (the connection closed) and stores the batch on its next try. The log line used to name
    the writer's own clean-up instead (asyncpg refusing to remove the statement counter from
    a connection already released with its socket), which hid what happened from whoever read
    the log."""
    proxy = proxy_for(db_dsn)
    await proxy.start()
    pool = await create_pool(through(db_dsn, proxy), min_size=1, max_size=2)
    writer = _writer(pool)
    blocker = await asyncpg.connect(db_dsn)
    try:
        await blocker.execute("BEGIN; LOCK TABLE telemetry IN ACCESS EXCLUSIVE MODE")
        with capture_logs() as logs:
            storing = asyncio.create_task(
                writer.store_with_retry(writer.decoder.classify(_a_letter_and_a_sample()))
            )
            await wait_until(
                lambda: writer.in_db_call_since is not None, timeout=30, message="waiting"
            )
            await proxy.cut()
            await wait_until(
                lambda: any(e["event"] == "database_unavailable" for e in logs),
                timeout=30, message="the loss logged",
            )  # fmt: skip
            await blocker.execute("ROLLBACK")
            await proxy.resume()
            result = await asyncio.wait_for(storing, 60)
    finally:
        await blocker.close()
        await pool.close()
        await proxy.stop()
    assert result.stored == 1
    [first, *_] = [e for e in logs if e["event"] == "database_unavailable"]
    assert "remove_query_logger" not in first["error"], first
    assert "ConnectionDoesNotExistError" in f"{first['error']} {first['during']}", first


PG_BIN = Path("/usr/lib/postgresql/15/bin")


async def _reachable(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=2)
    except (OSError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


def _start_server(home: Path, settings: str = "") -> tuple[subprocess.Popen[bytes], int]:
    """initdb and start a PostgreSQL of its own under ``home`` (its transaction ids start
    low), with ``settings`` in its postgresql.auto.conf; the server and its port."""
    user = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
    if user is not None:
        os.chown(home, user.pw_uid, user.pw_gid)
    as_user = {} if user is None else {"user": user.pw_uid, "group": user.pw_gid}
    data = home / "data"
    subprocess.run(
        [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
         "-E", "UTF8", "--locale=C", "--no-sync"],
        check=True, capture_output=True, **as_user,  # type: ignore[call-overload]
    )  # fmt: skip
    if settings:
        with (data / "postgresql.auto.conf").open("a") as conf:
            conf.write(settings)
    port = free_port()
    server = subprocess.Popen(
        [str(PG_BIN / "postgres"), "-D", str(data), "-p", str(port), "-k", str(home),
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **as_user,  # type: ignore[call-overload]
    )  # fmt: skip
    return server, port


def _start_waiting_server(home: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A PostgreSQL of its own whose commits wait for a synchronous standby named ``ghost``,
    which never comes. In the file, not on the command line (which no ALTER SYSTEM can
    override): the test brings the standby "back" by emptying it."""
    return _start_server(home, "synchronous_commit = on\nsynchronous_standby_names = 'ghost'\n")


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.send_signal(signal.SIGINT)  # fast shutdown: waiting commits are let go
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture
async def sync_rep_dsn() -> AsyncIterator[str]:
    """A migrated database on a PostgreSQL of the test's own whose commits wait for a
    synchronous standby that is not there (``synchronous_standby_names``, as under Patroni's
    ``synchronous_mode_strict`` with the standby gone): every COMMIT that wrote waits."""
    if not (PG_BIN / "postgres").exists():
        pytest.skip(f"{PG_BIN / 'postgres'} missing")
    home = Path(tempfile.mkdtemp(prefix="gw-syncrep-"))
    server, port = await asyncio.to_thread(_start_waiting_server, home)
    try:
        base = f"postgresql://postgres@127.0.0.1:{port}"
        await wait_until(lambda: _reachable(f"{base}/postgres"), timeout=60, message="up")
        # Migrated without waiting for the standby (this session's commits are local only).
        local = {"synchronous_commit": "local"}
        admin = await asyncpg.connect(f"{base}/postgres", server_settings=local)
        try:
            await admin.execute("CREATE DATABASE gw")
        finally:
            await admin.close()
        conn = await asyncpg.connect(f"{base}/gw", server_settings=local)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        yield f"{base}/gw"
    finally:
        await asyncio.to_thread(_stop, server)
        shutil.rmtree(home, ignore_errors=True)


async def test_a_commit_not_yet_on_the_synchronous_standby_is_not_taken_as_stored(
    sync_rep_dsn: str,
) -> None:
    """Synchronous replication (docs/deploying.md): a commit returns, and the batch is
    acknowledged, only once the standby has it. The standby is gone, the batch's COMMIT waits
    for it, and the call times out (the pool's command timeout; a connection lost alike): the
    transaction is committed on the primary alone (pg_xact_status says 'committed' as soon as
    it is marked there, the wait for the standby after). Taken as stored on that answer, the
    batch was acknowledged, and lost with the primary should it die before the standby is back,
    where "with no synchronous standby, commits wait. Nothing is acknowledged to the broker
    meanwhile". It must wait as a commit does, until the standby has it."""
    pool = await create_pool(sync_rep_dsn, min_size=1, max_size=2, command_timeout_s=1.0)
    writer = _writer(pool)
    db = await asyncpg.connect(sync_rep_dsn, server_settings={"synchronous_commit": "local"})
    try:
        storing = asyncio.create_task(
            writer.store_with_retry(writer.decoder.classify(_a_letter_and_a_sample()))
        )

        def retried_or_done() -> bool:
            retries = writer.metrics.registry.get_sample_value("gateway_db_retries_total")
            return storing.done() or (retries or 0) >= 2

        await wait_until(retried_or_done, timeout=30, message="the batch's commit asked about")
        assert not storing.done(), "acknowledged though the standby does not have it"
        # The standby back (here: none required any more): the waiting commits return.
        await db.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
        await db.execute("SELECT pg_reload_conf()")
        async with asyncio.timeout(30):
            result = await storing
        assert [tuple(r) for r in await db.fetch(LETTERS)] == [("MALFORMED", 1)]
        assert await db.fetchval("SELECT count(*) FROM telemetry") == 1
        assert result.stored == 1
        assert _answers(writer, "committed") == 1
    finally:
        await db.close()
        await pool.close()


async def test_a_server_crash_restarted_since_the_batch_is_not_asked(
    sync_rep_dsn: str,
) -> None:
    """A backend killed (the OOM killer) makes PostgreSQL restart every process but the
    postmaster: the WAL not flushed then is lost and its transaction ids are given out again,
    so a lost COMMIT's id may now be another transaction's, 'committed'. The postmaster's
    start time does not change; the statement returns the last crash-restart's too, and a
    server crash-restarted since the batch is not asked (the batch is stored again)."""
    local = {"synchronous_commit": "local"}
    conn = await asyncpg.connect(sync_rep_dsn, server_settings=local)
    victim = await asyncpg.connect(sync_rep_dsn, server_settings=local)
    try:
        async with conn.transaction():
            _, _, xact = await ingest_repo.insert_telemetry_at(conn, [], "node-a", ["dev-crash"])
        assert xact is not None
        assert await ingest_repo.xact_status(conn, xact) == (True, "committed")
        postmaster = await conn.fetchval("SELECT pg_postmaster_start_time()")
        # Every process of the server restarts; the postmaster lives on.
        os.kill(await victim.fetchval("SELECT pg_backend_pid()"), signal.SIGKILL)
    finally:
        victim.terminate()
        conn.terminate()

    async def restarted() -> bool:
        try:
            again = await asyncpg.connect(sync_rep_dsn, server_settings=local, timeout=2)
        except (OSError, asyncpg.PostgresError):
            return False
        try:
            reset = await again.fetchval("SELECT pg_stat_get_bgwriter_stat_reset_time()")
        except (OSError, asyncpg.PostgresError):
            # A connection accepted before the postmaster saw its child die is ended by the
            # crash-restart itself: not restarted yet.
            return False
        finally:
            again.terminate()
        return bool(reset > xact.server_started)

    await wait_until(restarted, timeout=60, message="the server crash-restarted")
    conn = await asyncpg.connect(sync_rep_dsn, server_settings=local)
    try:
        assert await conn.fetchval("SELECT pg_postmaster_start_time()") == postmaster
        assert await ingest_repo.xact_status(conn, xact) == (False, None)
    finally:
        await conn.close()
