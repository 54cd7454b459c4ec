"""One ``database_failover`` line per change of the server the pool's connections reach."""

from __future__ import annotations

from structlog.testing import capture_logs

from gateway.runtime.startup import PrimaryWatch


def test_the_first_server_is_no_failover_and_each_change_is_one_line() -> None:
    watch = PrimaryWatch()
    with capture_logs() as logs:
        for server in ["db1:5432"] * 3 + ["db2:5432"] * 5 + ["db1:5432"]:
            watch(server)
    failovers = [e for e in logs if e["event"] == "database_failover"]
    assert [(e["old"], e["new"]) for e in failovers] == [
        ("db1:5432", "db2:5432"),
        ("db2:5432", "db1:5432"),
    ]
    assert [e["log_level"] for e in failovers] == ["warning", "warning"]
    assert (watch.server, watch.failovers) == ("db1:5432", 2)
