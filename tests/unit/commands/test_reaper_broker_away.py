"""How long a node whose broker session is down holds the other nodes' ack-window timeouts
back (``Reaper.unheard_s``, the age of the mark it writes for them): until its session has been
up an ack window again, or it has been down past the session's expiry (the broker dropped what
it kept) or past ``BROKER_AWAY_HELD_S`` (taken for gone, as a stopped node is). Held up to the
expiry alone (a day by default), a node cut from the broker by a partition held every realtime
command's TIMEOUT in the group back for a day. The two daemons' behaviour is
tests/integration/acceptance/test_commands_audit_receipt_held_at_broker.py; here the clock."""

from __future__ import annotations

from typing import cast

import asyncpg

from gateway.commands.reaper import BROKER_AWAY_HELD_S, Reaper
from gateway.support.broker_link import BrokerLink
from gateway.support.metrics import Metrics

ACK_WINDOW_S = 10.0


class World:
    def __init__(self, *, session_expiry_s: float) -> None:
        self.now = 1000.0
        self.up = True
        self.reaper = Reaper(
            pool=cast(asyncpg.Pool, None),  # the pass's clock only: no statement is sent
            node_id="node-b",
            ack_window_s=ACK_WINDOW_S,
            sent_timeout_s=86400.0,
            interval_s=1.0,
            metrics=Metrics(),
            broker=BrokerLink(up=lambda: self.up),
            clock=lambda: self.now,
            session_expiry_s=session_expiry_s,
        )

    def unheard_after(self, seconds: float) -> float:
        """Passes every second for ``seconds``; the last one's ``unheard_s``."""
        unheard = 0.0
        for _ in range(int(seconds)):
            self.now += 1.0
            self.reaper.heard_for_s()
            unheard = self.reaper.unheard_s()
        return unheard


def test_a_node_cut_from_the_broker_is_taken_for_gone_after_five_minutes() -> None:
    world = World(session_expiry_s=86400.0)
    assert world.unheard_after(ACK_WINDOW_S + 5) == 0.0  # up a window: it hears everything
    world.up = False
    cut_at = world.now
    # Down: its mark stays where it last heard everything, for the other nodes to wait.
    assert world.unheard_after(60) >= 60
    assert world.unheard_after(BROKER_AWAY_HELD_S - 60 - 1) >= BROKER_AWAY_HELD_S - 1
    # Past BROKER_AWAY_HELD_S from the first pass that found it down: gone, whatever the
    # session's expiry (a day here).
    assert world.now - cut_at < BROKER_AWAY_HELD_S
    assert world.unheard_after(3) == 0.0
    assert world.unheard_after(3600) == 0.0


def test_a_short_session_expiry_ends_the_hold_sooner() -> None:
    world = World(session_expiry_s=30.0)
    world.unheard_after(ACK_WINDOW_S + 5)
    world.up = False
    assert world.unheard_after(20) >= 20
    assert world.unheard_after(15) == 0.0


def test_back_within_the_hold_the_mark_waits_an_ack_window_for_what_the_broker_kept() -> None:
    world = World(session_expiry_s=86400.0)
    world.unheard_after(ACK_WINDOW_S + 5)
    world.up = False
    world.unheard_after(120)
    world.up = True
    # What the broker kept comes now: until the session has been up an ack window, the mark
    # stays where it last heard everything.
    assert world.unheard_after(ACK_WINDOW_S - 2) >= 120
    assert world.unheard_after(3) == 0.0
