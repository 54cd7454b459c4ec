"""The anti-corruption layer: only a clean Summary gets through, anything else says why."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.ai.output import MAX_RAW_BYTES, OutputInvalid, parse_summary, strip_fence
from gateway.domain.ai_task import TEXT_MAX_CHARS, AiTaskError, ErrorCode, RiskLevel, Summary

GOOD = (
    '{"summary": "Cold room 2 reached 9.5 °C at 08:00.", '
    '"possible_cause": "The door contact reported open for 20 minutes.", '
    '"inspection_suggestion": "Check that the door closes; then the compressor.", '
    '"risk_level": "HIGH", "confidence": 0.7}'
)
EXPECTED = Summary(
    summary="Cold room 2 reached 9.5 °C at 08:00.",
    possible_cause="The door contact reported open for 20 minutes.",
    inspection_suggestion="Check that the door closes; then the compressor.",
    risk_level=RiskLevel.HIGH,
    confidence=0.7,
)


def with_field(name: str, value: object) -> str:
    fields = msgspec.json.decode(GOOD)
    fields[name] = value
    return msgspec.json.encode(fields).decode()


def without_field(name: str) -> str:
    fields = msgspec.json.decode(GOOD)
    del fields[name]
    return msgspec.json.encode(fields).decode()


@pytest.mark.parametrize(
    "raw",
    [
        GOOD,
        f"\n  {GOOD}  \n",
        f"```json\n{GOOD}\n```",
        f"```JSON\n{GOOD}\n```\n",
        f"  ```json {GOOD} ```  ",
        f"```\n{GOOD}\n```",
        f"```{GOOD}```",
        f"\ufeff{GOOD}",
        GOOD.replace(", ", ",\n  "),
    ],
    ids=[
        "clean",
        "whitespace",
        "json-fence",
        "upper-json-fence",
        "one-line-fence",
        "bare-fence",
        "tight-bare-fence",
        "bom",
        "pretty",
    ],
)
def test_clean_and_fenced_json_parse(raw: str) -> None:
    assert parse_summary(raw) == EXPECTED


def test_integer_confidence_and_bounds_are_accepted() -> None:
    assert parse_summary(with_field("confidence", 1)).confidence == 1.0
    assert parse_summary(with_field("confidence", 0)).confidence == 0.0
    assert parse_summary(with_field("risk_level", "LOW")).risk_level is RiskLevel.LOW
    long = "s" * TEXT_MAX_CHARS
    assert parse_summary(with_field("summary", long)).summary == long


# (the raw response, what the detail must say)
INVALID: list[tuple[str, str]] = [
    (f"Here is the summary you asked for:\n{GOOD}", "not JSON"),
    (f"Here you go:\n```json\n{GOOD}\n```", "not JSON"),
    (f"{GOOD}\nHope this helps!", "not JSON"),
    (f"```python\n{GOOD}\n```", "not JSON"),
    ("The temperature is high. Risk: HIGH.", "not JSON"),
    ("", "response is empty"),
    ("  \n ", "response is empty"),
    ("```json\n```", "response is empty"),
    (GOOD[:-1], "not JSON"),
    (with_field("risk_level", "SEVERE"), "Invalid enum value 'SEVERE' - at `$.risk_level`"),
    (with_field("risk_level", "high"), "Invalid enum value 'high' - at `$.risk_level`"),
    (with_field("risk_level", None), "at `$.risk_level`"),
    (with_field("confidence", 1.7), "Expected `float` <= 1.0 - at `$.confidence`"),
    (with_field("confidence", -0.2), "Expected `float` >= 0.0 - at `$.confidence`"),
    (with_field("confidence", "0.7"), "Expected `float`, got `str` - at `$.confidence`"),
    (with_field("confidence", True), "Expected `float`, got `bool` - at `$.confidence`"),
    (GOOD.replace("0.7", "1e999"), "at `$.confidence`"),
    (GOOD.replace("0.7", "NaN"), "not JSON"),
    (without_field("confidence"), "missing required field `confidence`"),
    (without_field("summary"), "missing required field `summary`"),
    (with_field("extra", "x"), "unknown field `extra`"),
    (with_field("summary", ""), "Expected a non-blank `str` - at `$.summary`"),
    (with_field("possible_cause", "  \n"), "Expected a non-blank `str` - at `$.possible_cause`"),
    (with_field("summary", 5), "Expected `str`, got `int` - at `$.summary`"),
    (
        with_field("inspection_suggestion", "i" * (TEXT_MAX_CHARS + 1)),
        f"Expected `str` of length <= {TEXT_MAX_CHARS} - at `$.inspection_suggestion`",
    ),
    (f"[{GOOD}]", "Expected `object`, got `array`"),
    ('"just a string"', "Expected `object`, got `str`"),
    ("null", "Expected `object`, got `null`"),
    ("42", "Expected `object`, got `int`"),
    (f"{GOOD}{GOOD}", "not JSON"),
    ("\ud800", "not valid Unicode"),
    # A NUL PostgreSQL text cannot hold: in a field, invalid output (the raw response is kept).
    (with_field("summary", "door\x00open"), "summary holds U+0000"),
    (with_field("inspection_suggestion", "\x00"), "inspection_suggestion holds U+0000"),
]


@pytest.mark.parametrize(("raw", "detail"), INVALID)
def test_anything_else_is_invalid_with_a_precise_detail(raw: str, detail: str) -> None:
    with pytest.raises(OutputInvalid) as raised:
        parse_summary(raw)
    assert detail in raised.value.detail
    assert str(raised.value) == raised.value.detail


def test_huge_input_is_refused_before_parsing() -> None:
    padding = " " * (MAX_RAW_BYTES - len(GOOD.encode()))
    assert parse_summary(GOOD + padding) == EXPECTED  # exactly at the limit
    with pytest.raises(OutputInvalid, match=f"more than {MAX_RAW_BYTES}"):
        parse_summary(GOOD + padding + " ")
    # Bytes, not characters: 30 000 three-byte characters are 90 000 bytes.
    with pytest.raises(OutputInvalid, match="90000 bytes"):
        parse_summary("€" * 30_000)


def test_output_invalid_is_the_llm_output_invalid_outcome() -> None:
    assert OutputInvalid.code == ErrorCode.LLM_OUTPUT_INVALID
    assert issubclass(OutputInvalid, AiTaskError)
    assert OutputInvalid("x").detail == "x"


def test_strip_fence_only_strips_a_fence_around_everything() -> None:
    assert strip_fence("```json\n{}\n```") == "{}"
    assert strip_fence("  {}  ") == "{}"
    assert strip_fence("a ```json\n{}\n```") == "a ```json\n{}\n```"
    assert strip_fence("```json\n{}\n``` b") == "```json\n{}\n``` b"


# What a summary field may hold: not blank, no NUL and no lone surrogate (PostgreSQL text
# cannot hold either; a Summary holding one is refused, gateway.domain.ai_task).
_text = st.text(
    st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), min_size=1, max_size=50
).filter(lambda s: s.strip() != "")
_summaries = st.builds(
    Summary,
    summary=_text,
    possible_cause=_text,
    inspection_suggestion=_text,
    risk_level=st.sampled_from(RiskLevel),
    confidence=st.floats(min_value=0.0, max_value=1.0),
)


@given(value=_summaries, fenced=st.booleans())
def test_encoded_summaries_round_trip(value: Summary, fenced: bool) -> None:
    raw = msgspec.json.encode(value).decode()
    if fenced:
        raw = f"```json\n{raw}\n```"
    assert parse_summary(raw) == value


@given(st.text(max_size=200))
def test_arbitrary_text_parses_or_is_invalid_never_crashes(raw: str) -> None:
    detail = None
    try:
        parse_summary(raw)
    except OutputInvalid as exc:
        detail = exc.detail
    assert detail is None or detail
