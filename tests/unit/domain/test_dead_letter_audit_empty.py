"""A letter of zero bytes (a cleared retained message an earlier release dead-lettered,
``MALFORMED`` on a native telemetry or acks topic) is replayable: a replay resolves it as
``empty``. The console hid its Replay button (``MALFORMED``: "the bytes never change")."""

from __future__ import annotations

import pytest

from gateway.domain.dead_letter import why_never_replayable


@pytest.mark.parametrize("reason", ["MALFORMED", "BAD_DEVICE_ID", "INVALID"])
def test_an_empty_letter_is_replayable(reason: str) -> None:
    assert why_never_replayable(reason, size=0, kept=0) is None


def test_a_malformed_letter_with_bytes_is_still_not() -> None:
    assert why_never_replayable("MALFORMED", size=3, kept=3) is not None
