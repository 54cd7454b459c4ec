"""``gateway``: run the daemon, migrate, check a config, inspect and replay dead letters."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import structlog

from gateway.config import Config, load_config
from gateway.domain.errors import ConfigError, StartupError
from gateway.runtime.logging import configure_logging
from gateway.support.version import gateway_version

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2

log = structlog.get_logger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gateway {gateway_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run the daemon")
    run.add_argument("--config", type=Path, help="TOML file (default: every default)")

    migrate = commands.add_parser("migrate", help="apply database migrations and exit")
    migrate.add_argument("--config", type=Path)

    check = commands.add_parser("check-config", help="validate a config file (exit 2 if not)")
    check.add_argument("path", type=Path)

    letters = commands.add_parser("dead-letters", help="list or replay dead letters")
    actions = letters.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="list dead letters, oldest first")
    listing.add_argument("--config", type=Path)
    listing.add_argument("--reason", help="only this reason code (e.g. MALFORMED)")
    listing.add_argument("--pending", action="store_true", help="only those not replayed yet")
    listing.add_argument("--after", type=int, default=0, help="ids greater than this")
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument("--json", action="store_true", help="JSON lines, payload in base64")
    again = actions.add_parser("replay", help="re-ingest dead letters through the normal path")
    again.add_argument("--config", type=Path)
    which = again.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=int, action="append", dest="ids", help="repeatable")
    which.add_argument("--all", action="store_true", help="every dead letter not yet replayed")
    again.add_argument("--reason", help="with --all: only this reason code")

    database = commands.add_parser(
        "embedded-db",
        help="start the embedded PostgreSQL, print its DSN, keep it running until Ctrl-C",
    )
    database.add_argument("--config", type=Path, help="its [node] state_dir is used")

    demo = commands.add_parser(
        "demo", help="the daemon, example rules and ~100 simulated devices; prints the console URL"
    )
    demo.add_argument("--http-port", type=int, default=8080, help="(default %(default)s; 0: any)")
    demo.add_argument("--mqtt-port", type=int, default=1883, help="embedded broker's port")
    demo.add_argument("--state-dir", type=Path, help="keep the data here (default: a temp dir)")
    demo.add_argument("--screenshots", type=Path, metavar="OUTDIR", help="photograph the console")

    units = commands.add_parser("install-systemd", help="install the systemd unit files")
    units.add_argument("--target", type=Path, default=Path("/etc/systemd/system"))
    units.add_argument("--executable", help="the gateway command the units run (default: this one)")
    units.add_argument("--force", action="store_true", help="overwrite differing unit files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.path)
    if args.command == "install-systemd":
        return _install_systemd(args)
    if args.command == "demo":
        return _demo(args)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(node_id=config.node_id, fmt=config.log.format, level=config.log.level)
    handlers: dict[str, Callable[[Config, argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "run": _run,
        "migrate": _migrate,
        "embedded-db": _embedded_db,
        "dead-letters": _dead_letters,
    }
    try:
        return _run_async(handlers[args.command](config, args))
    except StartupError as exc:
        log.error("startup_failed", error=str(exc))
        return EXIT_FAILURE


def _run_async(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _demo(args: argparse.Namespace) -> int:
    from gateway.runtime import demo

    settings = demo.DemoSettings(
        http_port=args.http_port, mqtt_port=args.mqtt_port, state_dir=args.state_dir
    )
    if args.screenshots is not None:
        return _run_async(demo.run_screenshots(settings, args.screenshots))
    return _run_async(demo.run_demo(settings))


def _install_systemd(args: argparse.Namespace) -> int:
    from gateway.runtime.install_systemd import install_units

    try:
        written = install_units(args.target, executable=args.executable, force=args.force)
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_FAILURE
    for path in written:
        print(f"installed {path}")
    print("next: systemctl daemon-reload && systemctl enable --now gateway")
    return EXIT_OK


def _check_config(path: Path) -> int:
    try:
        load_config(path)
    except ConfigError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{path}: ok")
    return EXIT_OK


async def _run(config: Config, args: argparse.Namespace) -> int:
    from gateway.runtime.daemon import Daemon

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    daemon = Daemon(config)

    def shutdown() -> None:
        daemon.notifier.stopping()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown)

    def reload() -> None:
        daemon.notifier.reloading()
        try:
            fresh = load_config(args.config)
        except ConfigError as exc:
            # The old configuration keeps running; the operator sees why in the journal.
            log.error("config_reload_refused", error=str(exc))
        else:
            daemon.reload(fresh)
        if daemon.ready.is_set():  # a SIGHUP during start-up must not announce readiness
            daemon.notifier.ready(daemon.status_line())
        else:
            daemon.notifier.status(daemon.status_line())

    loop.add_signal_handler(signal.SIGHUP, reload)
    await daemon.run(stop)
    return EXIT_OK


@asynccontextmanager
async def _database(config: Config) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the configured database, or on the embedded one under the state dir."""
    from storage.pool import create_pool

    dsn = config.database.dsn
    embedded = None
    if not dsn:
        from storage.embedded import EmbeddedPostgres

        embedded = EmbeddedPostgres(config.state_dir)
        dsn = await asyncio.to_thread(embedded.start)
    try:
        pool = await create_pool(dsn, min_size=1, max_size=2, application_name="gateway-cli")
        try:
            yield pool
        finally:
            await pool.close()
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


async def _embedded_db(config: Config, _args: argparse.Namespace) -> int:
    """The zero-setup database on its own: for psql, backups, or a benchmark's database."""
    from storage.embedded import EmbeddedPostgres

    if config.database.dsn:
        print("[database] dsn is set: the embedded PostgreSQL is not used", file=sys.stderr)
        return EXIT_CONFIG
    embedded = EmbeddedPostgres(config.state_dir)
    dsn = await asyncio.to_thread(embedded.start)
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        print(dsn, flush=True)
        await stop.wait()
    finally:
        await asyncio.to_thread(embedded.stop)
    return EXIT_OK


async def _migrate(config: Config, _args: argparse.Namespace) -> int:
    from storage.errors import StorageError
    from storage.migrate import migrate

    async with _database(config) as pool, pool.acquire() as conn:
        try:
            applied = await migrate(conn)
        except StorageError as exc:
            raise StartupError(str(exc)) from exc
    print(f"applied migrations: {applied}" if applied else "database schema is up to date")
    return EXIT_OK


async def _dead_letters(config: Config, args: argparse.Namespace) -> int:
    from gateway.ingest import live_path
    from gateway.ingest.replay import pending_ids, replay
    from gateway.support.metrics import Metrics
    from storage import ingest as repo

    async with _database(config) as pool:
        if args.action == "list":
            async with pool.acquire() as conn:
                letters = await repo.list_dead_letters(
                    conn,
                    reason=args.reason,
                    pending_only=args.pending,
                    after_id=args.after,
                    limit=args.limit,
                )
            for letter in letters:
                if args.json:
                    row = {
                        "id": letter.id,
                        "topic": letter.topic,
                        "reason": letter.reason,
                        "detail": letter.detail,
                        "received_at": letter.received_at.isoformat(),
                        "last_seen_at": letter.last_seen_at.isoformat(),
                        "seen_count": letter.seen_count,
                        "node_id": letter.node_id,
                        "replay_count": letter.replay_count,
                        "replay_outcome": letter.replay_outcome,
                        "payload_size": letter.payload_size,
                        "payload_sha256": letter.payload_sha256,
                        "truncated": letter.truncated,
                        "payload_base64": base64.b64encode(letter.payload).decode(),
                    }
                    print(json.dumps(row))
                else:
                    size = f"{letter.payload_size} bytes"
                    if letter.truncated:
                        size += f" (first {len(letter.payload)} kept)"
                    seen = f"seen {letter.seen_count}x, last {letter.last_seen_at.isoformat()}"
                    print(
                        f"{letter.id}\t{letter.received_at.isoformat()}\t{letter.reason}\t"
                        f"{letter.topic}\t{size}\tsha256 {letter.payload_sha256}\t{seen}\t"
                        f"{letter.detail}"
                        + (f"\t[replayed: {letter.replay_outcome}]" if letter.replay_count else "")
                    )
            return EXIT_OK
        # Exactly the daemon's path: its rules raise the alarms the telemetry would have raised
        # live, receipts and presence are applied as the daemon applies them.
        path = live_path.for_replay(config, Metrics())
        ids = args.ids if args.ids else await pending_ids(pool, args.reason)
        outcomes = await replay(pool, path, ids)
        for outcome in outcomes:
            print(f"{outcome.dead_letter_id}\t{outcome.outcome}")
        failed = sum(not o.succeeded for o in outcomes)
        print(
            f"replayed {len(outcomes)}: {len(outcomes) - failed} ingested, {failed} still invalid"
        )
        return EXIT_OK
