"""Audit: `[log] format = "console"` writes plain text where stderr is no terminal.

deploying.md, Logs: the journal gets JSON lines, "Or set `[log] format = "console"` for plain
text." Under systemd stderr is the journal, not a terminal, and every console line carried
ANSI colour sequences (`ESC[2m...ESC[0m`, `ESC[31mESC[1merror`): `journalctl -o cat` and a grep
of the journal showed escape codes around every field. Colours are for a terminal only.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import logging, structlog
    from gateway.runtime.logging import configure_logging

    configure_logging(node_id="n1", fmt="console", level="info")
    structlog.get_logger("gateway.test").error("startup_failed", setting="[database] dsn")
    logging.getLogger("asyncpg.pool").warning("pool trouble")
    """
)


def test_console_lines_to_a_pipe_hold_no_escape_sequence() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    assert "startup_failed" in done.stderr, done.stderr
    assert "setting='[database] dsn'" in done.stderr, done.stderr
    assert "pool trouble" in done.stderr, done.stderr
    assert "\x1b[" not in done.stderr, repr(done.stderr)
