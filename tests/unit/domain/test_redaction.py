"""What ``last_error`` loses before it is stored, shown and logged."""

from __future__ import annotations

import pytest

from gateway.domain.notify import ReceiverConfig, receiver_secrets
from gateway.domain.redaction import (
    REDACTED,
    redact_credentials,
    url_credentials,
    without_userinfo,
)


@pytest.mark.parametrize(
    ("text", "kept", "cut"),
    [
        ("Authorization: Bearer abc.def-123", "Authorization: ", "abc.def-123"),
        ('{"authorization": "Basic dXNlcjpwYXNz", "n": 1}', '"n": 1', "dXNlcjpwYXNz"),
        ("proxy-authorization=Digest x1y2z3", "proxy-authorization=", "x1y2z3"),
        ("sent with Bearer tok_0123456789 ok", "sent with Bearer ", "tok_0123456789"),
        ("see http://bob:hunter22@hook.example/x", "http://", "bob:hunter22"),
        ("?user=bob&password=hunter22&x=1", "user=bob", "hunter22"),
        ('{"api_key": "k-0123", "client_secret": "s-0123"}', '"api_key": ', "k-0123"),
        ("client_secret: s-9876 access-token=t-5432", "client_secret: ", "s-9876"),
        ("X-Token: tok-5432", "X-Token: ", "tok-5432"),
    ],
)
def test_what_looks_like_a_credential_is_cut(text: str, kept: str, cut: str) -> None:
    redacted = redact_credentials(text)
    assert cut not in redacted
    assert kept in redacted
    assert REDACTED in redacted


def test_given_values_are_cut_whole_and_word_by_word_and_plain_text_stays() -> None:
    given = ["Bearer s3cr3t-value", "key-0123"]
    assert redact_credentials("got s3cr3t-value and key-0123", given) == (
        f"got {REDACTED} and {REDACTED}"
    )
    plain = "HTTP 503: Service Unavailable (retry in 3 s) ClientConnectorError: 127.0.0.1:1"
    assert redact_credentials(plain, ["on", "x"]) == plain


def test_a_receivers_secrets_are_its_secret_password_headers_and_userinfo() -> None:
    receiver = ReceiverConfig(
        name="hook",
        kind="webhook",
        url="https://bob:hunter22@hook.example/in",
        secret="signing-secret",
        headers={"X-Api-Key": "key-0123"},
    )
    assert set(receiver_secrets(receiver)) == {
        "signing-secret", "key-0123", "bob:hunter22", "bob", "hunter22",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("url", "shown", "credentials"),
    [
        ("https://bob:hunter22@llm.example/v1", "https://llm.example/v1",
         ["bob:hunter22", "bob", "hunter22"]),
        ("http://token-0123@10.0.0.5:8000/v1", "http://10.0.0.5:8000/v1", ["token-0123"]),
        ("http://localhost:11434/v1", "http://localhost:11434/v1", []),
        ("http://bob:pw@[::1/v1", "http://[::1/v1", ["bob:pw", "bob", "pw"]),  # not a URL
        ("", "", []),
    ],
)  # fmt: skip
def test_a_url_is_shown_without_its_userinfo_whose_parts_are_its_credentials(
    url: str, shown: str, credentials: list[str]
) -> None:
    assert without_userinfo(url) == shown
    assert url_credentials(url) == credentials
