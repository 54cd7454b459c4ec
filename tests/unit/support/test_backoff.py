from __future__ import annotations

import random

import pytest

from gateway.support.backoff import Backoff


def test_delays_grow_exponentially_up_to_the_cap() -> None:
    backoff = Backoff(0.1, 5.0, rng=random.Random(7))
    ceilings = []
    for _ in range(12):
        ceilings.append(backoff.ceiling())
        delay = backoff.next_delay()
        assert 0.05 <= delay <= ceilings[-1]
    assert ceilings[:4] == [0.1, 0.2, 0.4, 0.8]
    assert ceilings[-1] == 5.0


def test_jitter_spreads_nodes_that_failed_together() -> None:
    delays = {
        Backoff(1.0, 30.0, rng=random.Random(seed), attempt=4).next_delay() for seed in range(20)
    }
    assert len(delays) == 20


def test_reset_starts_over_and_huge_attempts_do_not_overflow() -> None:
    backoff = Backoff(0.5, 10.0, attempt=5000)
    assert backoff.ceiling() == 10.0
    backoff.reset()
    assert backoff.ceiling() == 0.5


def test_invalid_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="base_s"):
        Backoff(2.0, 1.0)
