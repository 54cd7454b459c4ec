"""Ports for the servers the simulator and the tests start come from outside the kernel's
ephemeral range (which every outgoing connection takes its local port from), in turn, each
checked free."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sim import ports
from sim.ports import PortTurns, candidate_range, ephemeral_range, free_port


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


def test_a_free_port_is_outside_the_ephemeral_range_and_not_handed_out_twice() -> None:
    ephemeral = ephemeral_range()
    taken = [free_port() for _ in range(50)]
    assert len(set(taken)) == len(taken)
    assert not any(port in ephemeral for port in taken)
    for port in taken:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # each one free


def test_a_port_someone_holds_is_skipped_and_the_turn_wraps() -> None:
    turns = PortTurns(range(62_000, 62_003))
    turns.next = 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("127.0.0.1", 62_001))
        except OSError:
            pytest.skip("port 62001 is taken already")
        holder.listen()
        taken = [turns.take() for _ in range(3)]
    assert 62_001 not in taken
    assert taken[0] == 62_000
    assert taken[1] == 62_002
    assert taken[2] == 62_000  # round again


def test_no_ports_is_refused() -> None:
    with pytest.raises(ValueError, match="no ports"):
        PortTurns(range(0))
