"""The telemetry a prompt carries is bounded in characters as well as in samples: a device of
large payloads (a vibration spectrum of 2,000 points a message, 50 of them, about 3 MB) made
a prompt larger than every model's context, refused the same way at every attempt (no summary
ever), and paid for and stored at each. Failed before: 904,201 characters of telemetry JSON
(the first test's 50 samples)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from gateway.domain.ai_prompt import (
    MAX_TELEMETRY_CHARS,
    MAX_TELEMETRY_SAMPLES,
    AlarmFacts,
    build_request,
    recent_samples,
)

T0 = datetime(2026, 12, 6, 2, 0, tzinfo=UTC)
FACTS = AlarmFacts(
    alarm_id=7, device_id="pump-3", rule_key="vibration-high", severity="MAJOR",
    status="NEW", triggered_at=T0, reason="rms 9.1 > 8", cleared_at=None,
)  # fmt: skip


def _sample(n: int, *, points: int) -> dict[str, object]:
    return {
        "ts": T0 - timedelta(seconds=n),
        "metrics": {"rms": 9.1 - n / 100, "spectrum": [0.123456] * points},
        "events": None,
    }


def _telemetry_json(request: dict[str, object]) -> str:
    messages = request["messages"]
    assert isinstance(messages, list)
    user = messages[1]["content"]
    return str(user.split("):\n", 2)[2].split("\n\nReply with", 1)[0])


def test_large_payloads_fill_the_budget_newest_first_with_their_scalars_kept() -> None:
    telemetry = [_sample(n, points=2_000) for n in range(MAX_TELEMETRY_SAMPLES)]
    request = build_request(
        version="v1", model="m", facts=FACTS, telemetry=telemetry, json_mode=True
    )
    text = _telemetry_json(request)
    assert len(text) <= MAX_TELEMETRY_CHARS, f"{len(text)} characters of telemetry"
    samples = json.loads(text)
    assert samples[0]["ts"] == T0.isoformat()  # the newest, the one that raised the alarm
    assert samples[0]["metrics"]["rms"] == 9.1
    assert samples[0]["metrics"]["spectrum"].startswith("<left out: ")
    # Small once their arrays are notes: all 50 fit.
    assert len(samples) == MAX_TELEMETRY_SAMPLES


def test_samples_beyond_the_budget_are_left_out_oldest_first() -> None:
    # Each sample about 900 characters (under the per-value bound): the budget holds ~17.
    telemetry = [_sample(n, points=100) for n in range(MAX_TELEMETRY_SAMPLES)]
    samples = recent_samples(telemetry)
    assert 10 < len(samples) < MAX_TELEMETRY_SAMPLES
    assert [s["ts"] for s in samples] == [
        (T0 - timedelta(seconds=n)).isoformat() for n in range(len(samples))
    ]
    assert len(json.dumps(samples, separators=(",", ":"))) <= MAX_TELEMETRY_CHARS


def test_small_samples_are_sent_whole() -> None:
    telemetry = [_sample(n, points=3) for n in range(5)]
    samples = recent_samples(telemetry)
    assert len(samples) == 5
    assert samples[0]["metrics"] == {"rms": 9.1, "spectrum": [0.123456] * 3}
