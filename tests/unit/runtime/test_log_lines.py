"""In ``json`` every line the process writes parses, whoever wrote it; no line holds a secret.

A child process configures logging as the daemon does and then produces every kind of line a
daemon meets: its own events, the standard library's records of the libraries (with a traceback,
with a multi-line message), a warning, an exception in a thread, an exception ignored in a
finaliser, a forgotten task's exception, an ExceptionGroup. Each line of its stderr must parse as
one JSON object; each source must be there, tracebacks as the ``exception`` field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any, Final

SECRET: Final = "s3cret-Token-0123456789"

SCRIPT: Final = textwrap.dedent(
    f"""
    import asyncio, gc, logging, threading, warnings
    import structlog
    from gateway.runtime.logging import configure_logging, set_secrets

    configure_logging(node_id="n1", fmt=FORMAT, level="info")
    set_secrets([{SECRET!r}])
    log = structlog.get_logger("gateway.test")
    log.info("ours", token={SECRET!r})
    try:
        raise ValueError("bad {SECRET}")
    except ValueError:
        logging.getLogger("asyncpg.pool").warning("pool trouble\\nsecond line", exc_info=True)
        log.exception("ours_failed")
    logging.getLogger("aiomqtt").warning("There are %d pending publish calls.", 3)
    logging.getLogger("uvicorn.error").info("below the libraries' level: not shown")
    warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)

    def boom():
        raise RuntimeError("in a thread")

    thread = threading.Thread(target=boom, name="worker-1")
    thread.start()
    thread.join()

    class Finaliser:
        def __del__(self):
            raise OSError("in __del__")

    Finaliser()
    gc.collect()

    async def forgotten():
        raise KeyError("never awaited result")

    async def main():
        task = asyncio.get_running_loop().create_task(forgotten())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        del task
        gc.collect()

    asyncio.run(main())
    gc.collect()
    try:
        raise ExceptionGroup("fatal", [ValueError("a"), TypeError("b")])
    except ExceptionGroup:
        log.exception("daemon_failed")
    """
)


def _run(fmt: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", f"FORMAT = {fmt!r}\n{SCRIPT}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_every_line_is_json_with_tracebacks_as_fields() -> None:
    done = _run("json")
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    records: list[dict[str, Any]] = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(
                f"not JSON: {line!r}\n--- whole stderr ---\n{done.stderr}"
            ) from None
    events = {record["event"]: record for record in records}
    assert events["ours"]["token"] == "[redacted]"
    assert "ValueError: bad [redacted]" in events["ours_failed"]["exception"]
    pool = events["pool trouble\nsecond line"]
    assert pool["logger"] == "asyncpg.pool"
    assert pool["level"] == "warning"
    assert pool["node_id"] == "n1"
    assert "Traceback" in pool["exception"]
    assert "There are 3 pending publish calls." in events
    assert not any("below the libraries' level" in r["event"] for r in records)
    assert any(
        r.get("logger") == "py.warnings" and "deprecated thing" in r["event"] for r in records
    )
    assert "RuntimeError: in a thread" in events["thread_failed"]["exception"]
    assert events["thread_failed"]["thread"] == "worker-1"
    assert "OSError: in __del__" in events["exception_ignored"]["exception"]
    assert any(
        r.get("logger") == "asyncio" and "KeyError" in r.get("exception", "") for r in records
    ), done.stderr
    group = events["daemon_failed"]["exception"]
    assert "ExceptionGroup: fatal" in group
    assert "TypeError: b" in group
    assert all("timestamp" in r and "level" in r for r in records)
    assert SECRET not in done.stderr


def test_the_console_format_redacts_tracebacks_too() -> None:
    done = _run("console")
    assert "ValueError: bad [redacted]" in done.stderr
    assert "RuntimeError: in a thread" in done.stderr
    assert SECRET not in done.stderr
