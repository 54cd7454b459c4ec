"""Who used the machine's CPU during a benchmark phase: the gateway, PostgreSQL, the broker and
the simulator itself, read from ``/proc`` (Linux) before and after the phase.

Throughput on a machine that every party shares is bounded by the CPU each unit of work costs
all of them together: at ``c`` µs per command over ``n`` cores, no more than ``n / c`` commands
a second. A phase's figures are therefore reported with this split, which says where a target
is out of reach and who would have to get cheaper.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

PROC: Final = Path("/proc")
# The parties of a command phase, in the order the report shows them.
PARTIES: Final = ("gateway", "postgres", "broker", "simulator")


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def process_cpu_s(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used so far; 0 once it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    # The fields after the parenthesised command name: utime and stime are the 14th and 15th
    # of the whole line, the 12th and 13th after it.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _ticks()


def processes_cpu_s(pids: Iterable[int]) -> float:
    return sum(process_cpu_s(pid) for pid in pids)


def named_cpu_by_pid(name: str) -> dict[int, float] | None:
    """CPU time used so far by each running process called ``name`` (its ``comm``), by pid;
    None when none runs here (a database on another host, say)."""
    found: dict[int, float] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != name:
                continue
        except OSError:
            continue
        found[int(entry.name)] = process_cpu_s(int(entry.name))
    return found or None


def named_cpu_s(name: str) -> float | None:
    """CPU time used so far by every running process called ``name``, together; None when
    none runs here."""
    found = named_cpu_by_pid(name)
    return None if found is None else sum(found.values())


def pid_deltas(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU used between two per-pid readings: each process still running counts from its
    first reading (a process born in between counts whole); one that ended in between takes
    its time with it, but never makes the sum go back (on a server other clients use too,
    their backends come and go: a plain difference of the sums went negative)."""
    return sum(max(used - before.get(pid, 0.0), 0.0) for pid, used in after.items())


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of every core since boot, from the first line of /proc/stat."""
    values = [int(v) for v in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    idle = values[3] + values[4]
    total = sum(values[:8])
    return (total - idle) / _ticks(), total / _ticks()


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """CPU seconds each party used over a window, and how busy the whole machine was."""

    seconds: Mapping[str, float | None]  # None: that party is not on this machine
    wall_s: float
    busy: float  # share of all cores' time that was not idle, 0..1

    def per_unit_us(self, units: int) -> dict[str, float | None]:
        """Each party's CPU per unit of work (a command, a message), in µs."""
        return {
            party: None if used is None or units <= 0 else used / units * 1e6
            for party, used in self.seconds.items()
        }


# A party's CPU reading: seconds so far, per pid (read as deltas pid by pid), or None.
PartyReading = float | Mapping[int, float] | None


class CpuWindow:
    """Reads every party's CPU counter at :meth:`start` and again at :meth:`stop`."""

    def __init__(self, parties: Mapping[str, Callable[[], PartyReading]]) -> None:
        self.parties = parties
        self._before: dict[str, PartyReading] = {}
        self._machine = (0.0, 0.0)
        self._started = 0.0

    def start(self) -> None:
        self._before = {party: read() for party, read in self.parties.items()}
        self._machine = machine_cpu_s()
        self._started = time.monotonic()

    def stop(self) -> CpuSplit:
        wall = time.monotonic() - self._started
        busy, total = machine_cpu_s()
        seconds: dict[str, float | None] = {}
        for party, read in self.parties.items():
            before, after = self._before[party], read()
            if before is None or after is None:
                seconds[party] = None
            elif isinstance(before, Mapping) and isinstance(after, Mapping):
                seconds[party] = pid_deltas(before, after)
            elif isinstance(before, float | int) and isinstance(after, float | int):
                seconds[party] = max(after - before, 0.0)
            else:
                raise TypeError(f"{party}: one reading per pid and one total")
        elapsed = total - self._machine[1]
        share = (busy - self._machine[0]) / elapsed if elapsed > 0 else 0.0
        # Busy time is part of the total; on a machine busy throughout, the two deltas are
        # equal but for float rounding (1.0000000000005 was seen): a share, at most 1.
        return CpuSplit(seconds=seconds, wall_s=wall, busy=min(share, 1.0))


def command_parties(
    gateway_pids: Callable[[], Iterable[int]], broker_pid: int | None
) -> dict[str, Callable[[], PartyReading]]:
    """The four parties of a command phase: the gateway's processes, every PostgreSQL process
    on this machine (pid by pid), the broker, and this process (the simulated devices and the
    client)."""
    return {
        "gateway": lambda: processes_cpu_s(gateway_pids()),
        "postgres": lambda: named_cpu_by_pid("postgres"),
        "broker": lambda: None if broker_pid is None else process_cpu_s(broker_pid),
        "simulator": time.process_time,
    }


# The PostgreSQL processes that work for one database: its backends ("backends"), and the
# server's own ("server": WAL writer, checkpointer, background writer, autovacuum launcher
# and workers, WAL senders; the postmaster is added as their parent). The server's serve every
# database of the server: on a server others use too, their time is counted whole, an upper
# bound (on the embedded server, or a primary of one site, it is exact).
POSTGRES_PIDS_SQL: Final = """
SELECT pid, CASE WHEN datname IS NULL THEN 'server' ELSE 'backends' END AS part
FROM pg_stat_activity
WHERE datname = current_database() OR datname IS NULL
"""


def _parent_pid(pid: int) -> int | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _is_postgres(pid: int) -> bool:
    try:
        return (PROC / str(pid) / "comm").read_text().strip() == "postgres"
    except OSError:
        return False


class PostgresCpu:
    """CPU a PostgreSQL server on this machine spent over a window, by part ("backends" of one
    database, the "server"'s own processes; see ``POSTGRES_PIDS_SQL``).

    The pids are read at :meth:`start` and again at :meth:`stop`, before the clients close
    their connections. A backend born inside the window counts whole; one that ended inside
    it takes its time with it (the gateway's pools keep theirs open). A part is ``None`` when
    the server is not on this machine (its pids are not postgres processes here)."""

    def __init__(self) -> None:
        self._before: dict[str, dict[int, float]] = {}

    @staticmethod
    def read(pids: Iterable[int], *, parent: bool) -> dict[int, float] | None:
        local = [pid for pid in pids if _is_postgres(pid)]
        if not local:
            return None
        if parent:
            parents = {_parent_pid(pid) for pid in local}
            local += [pid for pid in parents if pid is not None and _is_postgres(pid)]
        return {pid: process_cpu_s(pid) for pid in set(local)}

    def start(self, parts: Mapping[str, Iterable[int]]) -> None:
        self._before = {
            part: self.read(pids, parent=part == "server") or {} for part, pids in parts.items()
        }

    def stop(self, parts: Mapping[str, Iterable[int]]) -> dict[str, float | None]:
        used: dict[str, float | None] = {}
        for part, before in self._before.items():
            pids = list(parts.get(part, ())) + list(before)
            after = self.read(pids, parent=part == "server")
            used[part] = (
                None
                if after is None or not before
                else sum(max(cpu - before.get(pid, 0.0), 0.0) for pid, cpu in after.items())
            )
        return used
