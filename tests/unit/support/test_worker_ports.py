"""Each pytest-xdist worker hands out test ports from its own slice of the range outside the
kernel's ephemeral ports (sim.ports)."""

from __future__ import annotations

from sim import ports
from sim.ports import ephemeral_range
from tests.support.ports import TURNS, free_port, worker_slice


def test_each_worker_has_its_own_slice() -> None:
    whole = range(61_000, 65_536)
    slices = [worker_slice(whole, f"gw{i}", "3") for i in range(3)]
    seen: set[int] = set()
    for share in slices:
        assert len(share) == len(whole) // 3
        assert share.start >= whole.start
        assert share.stop <= whole.stop
        assert not seen & set(share)
        seen |= set(share)
    assert worker_slice(whole, None, None) == whole


def test_the_tests_and_the_simulator_take_ports_from_this_workers_slice() -> None:
    for port in (free_port(), ports.free_port()):
        assert port in TURNS.ports
        assert port not in ephemeral_range()
