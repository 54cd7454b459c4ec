"""structlog setup: JSON lines for journald and pipes, a readable console on a TTY."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any, Final, Literal

import structlog

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


class RedactingFilter(logging.Filter):
    """The standard library's records (third-party libraries) cleaned the same way."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _SECRETS:
            record.msg = redact(record.getMessage())
            record.args = None
            if record.exc_info:
                record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
                record.exc_info = None
        return True


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
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())

    def add_node_id(
        _logger: object, _name: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        event.setdefault("node_id", node_id)
        return event

    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_node_id,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if as_json else _passthrough,
            _redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Third-party libraries log through the standard library; keep them to warnings.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def _passthrough(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    return event
