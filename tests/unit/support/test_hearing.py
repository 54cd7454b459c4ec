from __future__ import annotations

import math

from gateway.support.hearing import BREAKS_KEPT, Hearing, Listening


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _after_a_break() -> tuple[Clock, Listening]:
    """Listened 50 s, lost the broker for 10 s, subscribed again just now."""
    clock = Clock()
    listening = Listening(clock)
    listening.subscribed()
    clock.now += 50
    listening.lost()
    clock.now += 10
    listening.subscribed()
    return clock, listening


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
    clock, listening = _after_a_break()
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


def test_what_the_node_holds_unstored_is_a_break_from_its_receipt_until_it_is_stored() -> None:
    """The writer's lag: the oldest message received and not stored yet. A device silent
    since before it was listened to only up to that receipt; once stored, no break is left."""
    clock = Clock()
    listening = Listening(clock)
    clock.now += 10
    listening.subscribed()
    clock.now += 600
    received = clock.now
    clock.now += 40  # the writer stalled since
    assert listening.hearing(300, unstored_since=received) == Hearing(
        600.0, ((math.inf, 640.0), (40.0, 0.0))
    )
    clock.now += 1  # stored
    assert listening.hearing(300) == Hearing(641.0, ((math.inf, 641.0),))


def test_the_lag_and_the_broker_breaks_it_overlaps_are_one_break_never_counted_twice() -> None:
    clock = Clock()
    listening = Listening(clock)
    listening.subscribed()
    clock.now += 500
    listening.lost()  # a break over before the lag began: kept as it is
    clock.now += 20
    listening.subscribed()
    clock.now += 100
    received = clock.now
    clock.now += 30
    listening.lost()  # the broker lost under the lag
    clock.now += 10
    listening.subscribed()
    clock.now += 5
    listening.lost()  # and lost again: the lag still began first
    clock.now += 15
    assert listening.hearing(unstored_since=received) == Hearing(
        0.0, ((math.inf, 680.0), (180.0, 160.0), (60.0, 0.0))
    )
    listening.subscribed()
    clock.now += 10
    # Held since before the node subscribed again: nothing heard since the last subscribe.
    assert listening.hearing(unstored_since=received).listening_s == 0.0
    # A break under way since before the receipt takes the lag in: one break, from its start.
    listening.lost()
    clock.now += 10
    assert listening.hearing(unstored_since=clock.now - 5).breaks[-1] == (10.0, 0.0)


def test_before_the_first_subscribe_the_lag_joins_the_first_break() -> None:
    clock = Clock()
    listening = Listening(clock)
    clock.now += 10
    assert listening.hearing(unstored_since=clock.now - 5) == Hearing(0.0, ((math.inf, 0.0),))


def test_the_time_held_unstored_is_not_listening_that_forgets_a_break() -> None:
    """A break is forgotten once ``keep_s`` was listened to after it: listened, not merely
    passed while the node held what it received unstored."""
    clock, listening = _after_a_break()
    clock.now += 200
    received = clock.now
    clock.now += 150  # 350 s since the break, 200 of them heard
    assert listening.hearing(300, unstored_since=received).breaks == (
        (math.inf, 410.0),
        (360.0, 350.0),
        (150.0, 0.0),
    )
    # Stored: 350 s listened since the break, which joins the first.
    assert listening.hearing(300) == Hearing(350.0, ((math.inf, 350.0),))
