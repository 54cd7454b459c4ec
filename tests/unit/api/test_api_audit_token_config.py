"""The API's tokens as the configuration gives them: every token at least 16 characters,
whether written in the file or read from `token_env`, and no secret configured twice. Two
`[[api.tokens]]` with the same secret (a copy-paste, or two `token_env` naming variables that
hold the same value) made the caller's name and role depend on the tables' order: the holder
of the `viewer` one was `admin`, and the audit trail named whichever came first."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.api.auth import BearerAuth, Role
from gateway.config import load_config
from gateway.domain.errors import ConfigError

SECRET = "shared-secret-0123456789"


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def test_a_token_from_the_environment_is_at_least_16_characters(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[[api.tokens]]\ntoken_env = "GW_TOKEN"\nrole = "admin"\nname = "root"\n',
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, {"GW_TOKEN": "abc"})
    assert "api.tokens[0]" in str(caught.value)
    assert "16" in str(caught.value)
    assert "abc" not in str(caught.value)  # the secret is never in the message


def test_one_secret_configured_twice_is_refused(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        f'[[api.tokens]]\ntoken = "{SECRET}"\nrole = "admin"\nname = "root"\n'
        f'[[api.tokens]]\ntoken = "{SECRET}"\nrole = "viewer"\nname = "wall-screen"\n',
    )
    with pytest.raises(ConfigError) as caught:
        # Before the fix: loaded, and `Bearer <secret>` identified as root, an admin.
        load_config(path, {})
    assert "api.tokens[1]" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_the_same_value_in_two_variables_is_refused(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[[api.tokens]]\ntoken_env = "GW_ADMIN"\nrole = "admin"\nname = "root"\n'
        '[[api.tokens]]\ntoken_env = "GW_WALL"\nrole = "viewer"\nname = "wall-screen"\n',
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, {"GW_ADMIN": SECRET, "GW_WALL": SECRET})
    assert "api.tokens[1]" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_distinct_tokens_load(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        '[[api.tokens]]\ntoken_env = "GW_ADMIN"\nrole = "admin"\nname = "root"\n'
        f'[[api.tokens]]\ntoken = "{SECRET}"\nrole = "viewer"\nname = "wall-screen"\n',
    )
    config = load_config(path, {"GW_ADMIN": "admin-secret-0123456789"})
    auth = BearerAuth(config.api.tokens)
    assert auth.identify(f"Bearer {SECRET}").role is Role.VIEWER
    assert auth.identify("Bearer admin-secret-0123456789").role is Role.ADMIN
