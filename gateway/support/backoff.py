"""Capped exponential backoff with full jitter (one small, tested function)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """Delays ``uniform(base / 2, min(cap, base * 2**attempt))``; ``reset()`` after success.

    Full jitter spreads a fleet of nodes that lost the same broker or database at the same
    moment, so they do not come back in lock step.
    """

    base_s: float
    cap_s: float
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError("need 0 < base_s <= cap_s")

    def ceiling(self) -> float:
        # Bound the exponent: 2**1100 overflows a float long before anyone waits that long.
        return min(self.cap_s, self.base_s * 2.0 ** min(self.attempt, 64))

    def next_delay(self) -> float:
        delay = self.rng.uniform(self.base_s / 2, self.ceiling())
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
