"""CPU counters of the benchmark's parties, read from this machine's /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from sim.cpu import (
    CpuWindow,
    command_parties,
    machine_cpu_s,
    named_cpu_s,
    pid_deltas,
    process_cpu_s,
    processes_cpu_s,
)


def _spin(seconds: float) -> None:
    deadline = time.process_time() + seconds
    while time.process_time() < deadline:
        pass


def test_a_process_counter_grows_with_the_work_it_does_and_reads_zero_once_gone() -> None:
    before = process_cpu_s(os.getpid())
    _spin(0.3)
    assert process_cpu_s(os.getpid()) - before >= 0.2
    with subprocess.Popen([sys.executable, "-c", "pass"]) as child:
        assert child.wait() == 0
    assert process_cpu_s(child.pid) == 0.0  # reaped: gone from /proc
    assert process_cpu_s(2**22 + 1) == 0.0  # above the kernel's pid limit: never a process
    assert processes_cpu_s([]) == 0.0


def test_a_name_nothing_runs_under_is_unknown_not_zero() -> None:
    assert named_cpu_s("no-such-process-here") is None
    me = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    found = named_cpu_s(me)
    assert found is not None
    assert found > 0


def test_a_window_splits_the_cpu_between_parties_and_sees_the_machine_busy() -> None:
    busy, total = machine_cpu_s()
    assert 0 < busy <= total
    window = CpuWindow(command_parties(lambda: [os.getpid()], broker_pid=None))
    window.start()
    _spin(0.4)
    split = window.stop()
    # The gateway's "processes" are this one here, the simulator is this process too.
    assert (split.seconds["gateway"] or 0.0) >= 0.3
    assert (split.seconds["simulator"] or 0.0) >= 0.3
    assert split.seconds["broker"] is None
    assert split.wall_s >= 0.3
    assert 0 < split.busy <= 1
    per = split.per_unit_us(1_000)
    assert (per["simulator"] or 0.0) >= 300
    assert per["broker"] is None


def test_a_process_that_ends_inside_a_window_never_makes_a_party_negative() -> None:
    # Per-pid readings of a party whose processes come and go (other clients' backends on a
    # shared PostgreSQL): one that ended took its time with it, one born inside counts whole.
    before = {10: 5.0, 11: 100.0}
    after = {10: 5.5, 12: 0.25}  # 11 ended, 12 was born
    assert pid_deltas(before, after) == 0.75
    readings = iter([before, after])
    window = CpuWindow({"postgres": lambda: next(readings)})
    window.start()
    assert window.stop().seconds["postgres"] == 0.75
