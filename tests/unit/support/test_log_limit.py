"""The cap on log lines a client can cause: so many per interval, the rest counted."""

from __future__ import annotations

from gateway.support.log_limit import LogLimit


def test_past_the_cap_lines_are_counted_and_the_next_line_written_says_how_many() -> None:
    now = [0.0]
    limit = LogLimit(lines=3, interval_s=60.0, clock=lambda: now[0])
    assert [limit.take() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] = 59.9
    assert limit.take() is None
    now[0] = 60.0  # a new interval: three more lines, the first counting the three left out
    assert [limit.take() for _ in range(4)] == [3, 0, 0, None]
    now[0] = 500.0
    assert limit.take() == 1
