"""``gateway`` whose process dies outright while judging a message with one event type, or
while decoding a payload that holds one marker.

A stand-in for what no ``except`` can catch — a crash in a C extension (the JSON or protobuf
decoder, say), memory exhausted, a hang the service manager's watchdog ends — wired to a
message the test chooses. Everything else is the real daemon. Run as
``python -m tests.support.dying_gateway run --config FILE``; importing this module (for its
constants) changes nothing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

DEADLY_EVENT = "DIE_NOW"
# A payload holding these bytes kills the process in the decoder, before any rule sees it.
DEADLY_WHILE_DECODING = b"DIE_WHILE_DECODING"
DEATH_CODE = 86
# A payload holding these bytes makes the decoder's process read address 0: a real SIGSEGV, as
# a crash in a C extension ends a process.
SEGFAULT_WHILE_DECODING = b"SEGFAULT_WHILE_DECODING"


def _install() -> None:
    from gateway.alarms import engine
    from gateway.ingest import decoder

    evaluate = engine.evaluate
    decode_telemetry = decoder.decode_telemetry

    def deadly(*args: Any, **kwargs: Any) -> Any:
        message = args[4]
        if DEADLY_EVENT in message.event_types():
            os._exit(DEATH_CODE)
        return evaluate(*args, **kwargs)

    def deadly_to_decode(payload: bytes, *args: Any, **kwargs: Any) -> Any:
        if DEADLY_WHILE_DECODING in payload:
            os._exit(DEATH_CODE)
        if SEGFAULT_WHILE_DECODING in payload:
            ctypes.string_at(0)
        return decode_telemetry(payload, *args, **kwargs)

    # The only changes: a deadly message, and deadly payloads.
    engine.evaluate = deadly  # type: ignore[assignment]
    decoder.decode_telemetry = deadly_to_decode  # type: ignore[assignment]


if __name__ == "__main__":
    from gateway.cli.entry import main

    _install()
    raise SystemExit(main())
