from __future__ import annotations

import math

from gateway.support.hearing import BREAKS_KEPT, Hearing, Listening


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_node_that_never_subscribed_has_heard_nothing_since_before_it_started() -> None:
    clock = Clock()
    listening = Listening(clock)
    clock.now += 360  # the broker away since the start
    assert listening.hearing() == Hearing(0.0, ((math.inf, 0.0),))


def test_the_break_before_the_first_subscribe_and_every_later_one_are_kept() -> None:
    clock = Clock()
    listening = Listening(clock)
    clock.now += 360
    listening.subscribed()
    clock.now += 100
    listening.lost()
    clock.now += 170
    listening.subscribed()
    clock.now += 5
    listening.lost()
    clock.now += 175
    listening.subscribed()
    clock.now += 30
    assert listening.hearing(300) == Hearing(
        30.0, ((math.inf, 480.0), (380.0, 210.0), (205.0, 30.0))
    )


def test_a_break_followed_by_the_longest_silence_of_listening_joins_the_first() -> None:
    """Every device silent since before it has been listened to for that long: the break
    cannot change a decision, and the first break now ends where it ended (never dropped)."""
    clock = Clock()
    listening = Listening(clock)
    listening.subscribed()
    clock.now += 50
    listening.lost()
    clock.now += 10
    listening.subscribed()
    clock.now += 100
    listening.lost()
    clock.now += 20
    listening.subscribed()
    clock.now += 150
    assert listening.hearing(300).breaks == ((math.inf, 330.0), (280.0, 270.0), (170.0, 150.0))
    clock.now += 100  # 350 s of listening after the first later break, 250 after the second
    assert listening.hearing(300).breaks == ((math.inf, 370.0), (270.0, 250.0))
    clock.now += 50
    assert listening.hearing(300) == Hearing(300.0, ((math.inf, 300.0),))


def test_beyond_the_breaks_kept_the_oldest_join_the_first_and_count_as_unheard() -> None:
    clock = Clock()
    listening = Listening(clock)
    for _ in range(BREAKS_KEPT + 10):
        listening.subscribed()
        clock.now += 1
        listening.lost()
        clock.now += 1
    listening.subscribed()
    breaks = listening.hearing().breaks
    assert len(breaks) == BREAKS_KEPT
    assert breaks[0][0] == math.inf
    assert breaks[1][0] == breaks[0][1] - 1  # what came between counts as a break too
