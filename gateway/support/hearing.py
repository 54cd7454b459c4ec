"""What a node has heard: how long its broker session has listened, and its breaks.

A device's silence means something only while someone listened (inactivity rules). The
session records each break of its subscriptions here; the first one starts at the process's
start, or rather before anything: nothing before this node first subscribed was listened to
by it (a daemon started while the broker is away, after a site power cut or during a broker
maintenance, has heard nothing of the silence before).

What the node received but has not stored yet is not heard either, not by the monitor: it
judges silence from the stored ``last_seen``. So the time since the oldest message the node
holds unstored was received (the writer's lag: PostgreSQL slow or away, a lock, a backlog
after an outage) is a break too, until that message is stored (``hearing(unstored_since=)``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

# How long the inactivity monitor's pass waits for the broker's answer to a PINGREQ (or
# anything else from it) before it judges silence: a link that gives none in that time is
# taken as heard only up to what it last carried.
HEAR_WAIT_S = 2.0

# Breaks kept at most: beyond, the oldest ones join the first break (the one from before the
# process), which only counts more as unheard (a silence judged later, never one too many).
BREAKS_KEPT = 256


@dataclass(frozen=True, slots=True)
class Hearing:
    """``listening_s``: seconds subscribed without a break (0 while not subscribed; inf: a
    node without a session, always listening). ``breaks``: each break as (began, ended)
    seconds before now, oldest first; the first may have begun ``inf`` ago (before the
    process), the current one, while not subscribed, ends 0 s ago."""

    listening_s: float
    breaks: tuple[tuple[float, float], ...] = ()


ALWAYS = Hearing(math.inf)


def will_windows(heard: Hearing, grace_s: float) -> tuple[tuple[float, float], ...]:
    """When a Will `offline` read by this node says nothing of its device's death, as
    (earliest, latest) receipts in seconds before now: a broker going down publishes every
    connected device's Will as it closes the node's connection too (mosquitto 2.0 does), and
    what the node reads as it connects (its resumed session, the retained statuses) was
    published while it did not listen. From `grace_s` before each break of its session to
    `grace_s` after it; before the node's first subscribe (the break from before the
    process), all it read then (what a start reads of its session and the retained statuses
    comes before its subscribe is done, whose last answer follows them on the connection).
    The link's quiet tail while the node listens (the time since its last packet, or the
    writer's lag) is no break here unless it has lasted `HEAR_WAIT_S`, the pass's wait for an
    answer: then the link is stalled, as a broker going down keeps it between writing its
    Wills and closing."""
    breaks = list(heard.breaks)
    if (
        len(breaks) > 1
        and heard.listening_s > 0
        and breaks[-1][1] == 0.0
        and breaks[-1][0] < HEAR_WAIT_S
    ):
        breaks.pop()
    return tuple(
        (began + grace_s, ended - grace_s) if math.isfinite(began) else (began, ended)
        for began, ended in breaks
    )


class Listening:
    """The breaks of a node's listening, as loop time (``clock``): ``subscribed()`` ends
    the current break, ``lost()`` begins one. ``hearing(keep_s)`` forgets what no silence
    of up to ``keep_s`` can need: a break followed by ``keep_s`` of listening joins the first
    break (every device silent since before it has been listened to for that long).
    ``hearing(unstored_since=t)``: the node holds messages unstored, the oldest received at
    ``t`` (the same clock); from then to now is a break (merged with those it overlaps), and
    the listening stops at ``t``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # When each break began and ended (None: not yet), oldest first; the first began
        # before the process.
        self._began: list[float] = [-math.inf]
        self._ended: list[float | None] = [None]
        self._subscribed_at: float | None = None

    def subscribed(self) -> None:
        if self._subscribed_at is None:
            self._subscribed_at = self._ended[-1] = self._clock()

    def lost(self, heard_at: float | None = None) -> None:
        """A break begins: now, or when the connection last carried anything (``heard_at``,
        the same clock), if that was earlier and after the subscribe: a link that stalled
        was not listened to from the stall on, though its end was seen only later."""
        subscribed_at = self._subscribed_at
        if subscribed_at is not None:
            self._subscribed_at = None
            began = self._clock()
            if heard_at is not None:
                began = max(subscribed_at, min(began, heard_at))
            self._began.append(began)
            self._ended.append(None)

    def hearing(self, keep_s: float = math.inf, *, unstored_since: float | None = None) -> Hearing:
        now = self._clock()
        # Heard up to here: what came after the oldest message held unstored is not known.
        heard_until = now if unstored_since is None else min(unstored_since, now)
        self._forget(heard_until, keep_s)
        subscribed_at = self._subscribed_at
        listening = 0.0 if subscribed_at is None else max(heard_until - subscribed_at, 0.0)
        breaks: list[tuple[float, float | None]] = list(zip(self._began, self._ended, strict=True))
        if heard_until < now:
            # The lag is a break from the oldest receipt on; a break it overlaps joins it
            # (never counted twice), the one before the process included.
            start = heard_until
            while breaks:
                last_began, last_ended = breaks[-1]
                if last_ended is not None and last_ended < heard_until:
                    break
                start = min(start, last_began)
                breaks.pop()
            breaks.append((start, None))
        return Hearing(
            listening,
            tuple((now - began, 0.0 if ended is None else now - ended) for began, ended in breaks),
        )

    def _forget(self, heard_until: float, keep_s: float) -> None:
        began, ended = self._began, self._ended
        listened, after = 0.0, heard_until
        for index in range(len(began) - 1, 0, -1):
            end = ended[index]
            if end is not None and end < after:
                listened += after - end
                if listened >= keep_s:
                    # Every device silent since before this break was listened to for keep_s.
                    ended[0] = end
                    del began[1 : index + 1], ended[1 : index + 1]
                    break
            after = min(after, began[index])
        while len(began) > BREAKS_KEPT:
            ended[0] = ended[1]
            del began[1], ended[1]
