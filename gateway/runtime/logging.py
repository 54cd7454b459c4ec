"""structlog setup: JSON lines for journald and pipes, a readable console on a TTY.

In JSON every line parses, whoever wrote it; no line carries a configured secret (``set_secrets``).
"""

from __future__ import annotations

import io
import logging
import sys
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, Literal, TextIO

import structlog

if TYPE_CHECKING:
    from sys import UnraisableHookArgs

REDACTED: Final = "[redacted]"
# Configured secrets (API tokens, passwords): no log line carries one, whatever a request sent.
_SECRETS: list[str] = []
_SHORTEST_SECRET: Final = 6


def set_secrets(values: Iterable[str]) -> None:
    """Replace the secrets every log line is cleaned of (at start and on SIGHUP)."""
    _SECRETS[:] = sorted({v for v in values if len(v) >= _SHORTEST_SECRET}, key=len, reverse=True)


def redact(text: str) -> str:
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_value(v) for v in value]
    return value


def _redact_event(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    if not _SECRETS:
        return event
    return {key: _redact_value(value) for key, value in event.items()}


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(
    *,
    node_id: str,
    fmt: Literal["auto", "json", "console"] = "auto",
    level: Literal["debug", "info", "warning", "error"] = "info",
) -> None:
    """One renderer for every line the process writes: ours, the libraries', warnings, and the
    exceptions nobody caught (in a thread, in a finaliser, in a forgotten task).

    The libraries (asyncpg, aiomqtt, amqtt, uvicorn, litestar, aiohttp, asyncio) log through the
    standard library: the root handler formats their records with structlog's
    ``ProcessorFormatter``, so in ``json`` a traceback is the ``exception`` field of one line.
    """
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())

    def add_node_id(
        _logger: object, _name: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        event.setdefault("node_id", node_id)
        return event

    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        # Colours only on a terminal: `console` under systemd (deploying.md: "plain text") put
        # ANSI sequences around every field of every line in the journal.
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=_redacted_traceback
        )
    )
    # A traceback as a field in JSON (then redacted like any field); the console renderer
    # prints it after the line, through _redacted_traceback.
    exceptions: structlog.typing.Processor = (
        structlog.processors.format_exc_info if as_json else _passthrough
    )
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_node_id,
            structlog.processors.add_log_level,
            timestamper,
            exceptions,
            _redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # One write() per line (PrintLogger writes the newline apart): a library's line from
        # another thread cannot land between a line and its end.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                add_node_id,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                timestamper,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                exceptions,
                _redact_event,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    # Replaced, not added to: a handler someone installed earlier would print plain text.
    root.handlers[:] = [handler]
    # Third-party libraries: warnings and worse (their info chatter is not ours to print).
    root.setLevel(max(logging.WARNING, _LEVELS[level]))
    logging.captureWarnings(True)
    sys.unraisablehook = _log_unraisable
    threading.excepthook = _log_thread_exception


_uncaught = structlog.get_logger("gateway.uncaught")


def _log_unraisable(unraisable: UnraisableHookArgs) -> None:
    """What Python would print as "Exception ignored in ..." (a failing ``__del__``, say)."""
    exc = unraisable.exc_value
    _uncaught.error(
        "exception_ignored",
        message=unraisable.err_msg or "Exception ignored in",
        object=repr(unraisable.object),
        exc_info=(type(exc), exc, unraisable.exc_traceback) if exc is not None else False,
    )


def _redacted_traceback(out: TextIO, exc_info: structlog.typing.ExcInfo) -> None:
    text = io.StringIO()
    structlog.dev.plain_traceback(text, exc_info)
    out.write(redact(text.getvalue()))


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    exc = args.exc_value
    _uncaught.error(
        "thread_failed",
        thread=None if args.thread is None else args.thread.name,
        exc_info=(args.exc_type, exc, args.exc_traceback) if exc is not None else False,
    )


def _passthrough(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    return event
