"""[ai] processing_timeout_s must exceed timeout_s.

A task PROCESSING longer than processing_timeout_s is taken as lost: the sweep (on every node)
fails it WORKER_LOST and queues the next attempt. With a model allowed a longer call (timeout_s
raised to 600 for a slow local model, processing_timeout_s left at 300) every call past five
minutes was swept while its worker still waited: the answer, when it came, was discarded, and
the next attempt asked the model again, alongside.
"""

from __future__ import annotations

import pytest

from gateway.config import parse_config
from gateway.domain.errors import ConfigError, ConfigErrors

AI = '[ai]\nenabled = true\nbase_url = "http://127.0.0.1:11434/v1"\nmodel = "llama3.1:8b"\n'


def _errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    error = caught.value
    return [str(e) for e in error.errors] if isinstance(error, ConfigErrors) else [str(error)]


@pytest.mark.parametrize(
    "keys", ["timeout_s = 600\n", "timeout_s = 60\nprocessing_timeout_s = 60\n"]
)
def test_a_processing_timeout_not_above_the_call_timeout_is_refused(keys: str) -> None:
    [error] = _errors(AI + keys)
    assert error.startswith("ai.processing_timeout_s: ")
    assert "timeout_s" in error


def test_the_defaults_and_a_longer_processing_timeout_are_accepted() -> None:
    assert parse_config(AI).ai.processing_timeout_s == 300
    assert parse_config(AI + "timeout_s = 600\nprocessing_timeout_s = 900\n").ai.timeout_s == 600
