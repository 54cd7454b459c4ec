"""Test ports come from outside the kernel's ephemeral range (which every outgoing connection
takes its local port from), a slice per pytest-xdist worker, each checked free."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import ports
from tests.support.ports import candidate_range, ephemeral_range, free_port, worker_slice


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert ephemeral_range(setting) == range(40_000, 50_001)
    assert ephemeral_range(tmp_path / "missing") == range(32_768, 61_000)


def test_ports_are_taken_above_the_ephemeral_range_else_below_it() -> None:
    assert candidate_range(range(32_768, 61_000)) == range(61_000, 65_536)
    assert candidate_range(range(40_000, 65_000)) == range(ports.LOWEST, 40_000)
    with pytest.raises(RuntimeError, match="no room"):
        candidate_range(range(31_000, 64_000))


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


def test_a_free_port_is_outside_the_ephemeral_range_and_not_handed_out_twice() -> None:
    ephemeral = ephemeral_range()
    taken = [free_port() for _ in range(50)]
    assert len(set(taken)) == len(taken)
    assert not any(port in ephemeral for port in taken)
    for port in taken:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # each one free


def test_a_port_someone_holds_is_skipped() -> None:
    free_port()  # the worker's slice is chosen
    state = ports._PORTS
    assert state._slice is not None
    upcoming = state._slice[state._next % len(state._slice)]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("127.0.0.1", upcoming))
        except OSError:
            pytest.skip(f"port {upcoming} is taken already")
        holder.listen()
        assert free_port() != upcoming
