"""``gateway-sim size`` as a user runs it, at a small scale: it fills the state tables as the
gateway would, drives the gateway's own batch statements over a hot subset from several
connections, and reports sizes, HOT updates, lock waits and the inactivity sweep's plan for
each fillfactor. (The million-device figures are in docs/performance.md.)"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from sim.sizing import SizingPlan

DEVICES, RULES, HOT = 2_000, 3, 400


@pytest.mark.timeout(90)
async def test_size_fills_drives_and_reports_every_figure(
    pg_server_dsn: str, tmp_path: Path
) -> None:
    out = tmp_path / "size.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sim", "size", "--devices", str(DEVICES), "--rules", str(RULES),
        "--hot", str(HOT), "--workers", "2", "--batch", "50", "--seconds", "1",
        "--fillfactor", "100", "--fillfactor", "80", "--dsn", pg_server_dsn,
        "--json", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()[-3000:]
    result = json.loads(out.read_text())

    assert result["rule_state_rows"] == DEVICES * RULES
    assert [run["fillfactor"] for run in result["runs"]] == [100, 80]
    for run in result["runs"]:
        before, after, load = run["before"], run["after"], run["load"]
        # The fill: every device, one state row per (device, rule), nothing updated yet.
        assert before["device"]["live_rows"] == DEVICES
        assert before["rule_state"]["live_rows"] == DEVICES * RULES
        assert before["rule_state"]["updates"] == 0
        assert f"fillfactor={run['fillfactor']}" in after["rule_state"]["options"]
        assert f"fillfactor={run['fillfactor']}" in after["device"]["options"]
        # The migrated tables' indexes (0031 dropped rule_state_rule_key_idx: no plan used it).
        for table, indexes in (
            ("device", {"device_pkey"}),
            ("rule_state", {"rule_state_pkey", "rule_state_pending_idx"}),
        ):
            assert after[table]["heap_bytes"] >= before[table]["heap_bytes"] > 0
            assert set(after[table]["indexes"]) == indexes
            assert after[table]["index_bytes"] >= sum(after[table]["indexes"].values()) - 8192
        # The load: batches from both workers, every conditional write taken (the batch held
        # its rows' locks), each one an update of rule_state, HOT or not.
        assert load["batches"] >= 2
        assert load["refused_writes"] == 0
        assert load["rows_written"] == after["rule_state"]["updates"] > 0
        assert 0 < after["device"]["updates"] <= load["samples"]
        for table in ("device", "rule_state"):
            assert 0 <= after[table]["hot_ratio"] <= 1
            assert after[table]["hot_updates"] <= after[table]["updates"]
            assert after[table]["dead_rows"] >= 0
        assert 0 < load["batch_p50_ms"] <= load["batch_p99_ms"]
        assert 0 < load["lock_p50_ms"] <= load["lock_p99_ms"] <= load["lock_max_ms"]
        assert 0 < load["devices_p50_ms"] <= load["devices_p99_ms"]
        assert 0 <= load["lock_waiting_share"] <= 1
        # The sweep over the whole fleet: every device was heard from a minute ago.
        assert run["sweep"]["ms"] > 0
        assert run["sweep"]["rows"] == 0
        # Removing the last rule's state would delete one row per device (rolled back).
        assert run["drop_removed"]["rows_deleted"] == DEVICES
        assert run["drop_removed"]["ms"] > 0
        assert "Seq Scan" in run["drop_removed"]["scans"]
    table = stdout.decode()
    assert table.count("inactivity sweep") == 2
    assert "fillfactor 80" in table


def test_a_plan_the_tables_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="fillfactor"):
        SizingPlan(fillfactors=(5,))
    with pytest.raises(ValueError, match="hot"):
        SizingPlan(devices=100, hot=1_000)
    with pytest.raises(ValueError, match="rules"):
        SizingPlan(rules=4)
