"""The anti-corruption layer between a model's answer and a :class:`Summary`.

A model's text is untrusted input: strip one Markdown code fence around the whole answer, decode
it as JSON into :class:`Summary` (exactly its five fields, every one validated), and refuse
anything else with :class:`OutputInvalid`. The caller fails the task with
``LLM_OUTPUT_INVALID`` and keeps the raw response; nothing here repairs or guesses.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from gateway.domain.ai_task import AiTaskError, ErrorCode, Summary

MAX_RAW_BYTES: Final = 64 * 1024

# The whole answer is one fence: ```json ... ``` or ``` ... ```. Prose around a fence is not
# stripped: an answer that talks is not the answer the prompt asked for.
_FENCE: Final = re.compile(r"\A```(?:json)?[ \t]*\n?(?P<body>.*?)\n?[ \t]*```\Z", re.S | re.I)
_DECODER: Final = msgspec.json.Decoder(Summary)


class OutputInvalid(AiTaskError):
    """The model's answer is not a valid :class:`Summary`; ``detail`` says precisely why."""

    code: Final = ErrorCode.LLM_OUTPUT_INVALID

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def strip_fence(raw: str) -> str:
    """The answer without surrounding whitespace and without one code fence around it all."""
    text = raw.strip().lstrip("\ufeff").strip()
    match = _FENCE.match(text)
    return match.group("body").strip() if match else text


def parse_summary(raw: str) -> Summary:
    """The :class:`Summary` in ``raw``, or :class:`OutputInvalid` saying what is wrong with it."""
    try:
        size = len(raw.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate, from a "\ud800" escape upstream
        raise OutputInvalid(f"response is not valid Unicode: {exc.reason}") from exc
    if size > MAX_RAW_BYTES:
        raise OutputInvalid(f"response is {size} bytes, more than {MAX_RAW_BYTES}")
    text = strip_fence(raw)
    if not text:
        raise OutputInvalid("response is empty")
    try:
        return _DECODER.decode(text)
    except msgspec.ValidationError as exc:
        raise OutputInvalid(f"invalid summary: {_readable(str(exc))}") from exc
    except msgspec.DecodeError as exc:
        raise OutputInvalid(f"not JSON: {exc}") from exc


def _readable(message: str) -> str:
    # msgspec spells the not-blank rule as its regex; say what it means.
    return message.replace("`str` matching regex '\\\\S'", "a non-blank `str`")
