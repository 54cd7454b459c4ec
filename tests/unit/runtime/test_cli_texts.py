"""The command line's texts and small parsers; the zero-setup admin token file."""

from __future__ import annotations

import argparse
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gateway.cli.commands import _duration, _parser
from gateway.config import parse_config
from gateway.runtime.admin_token import TOKEN_NAME, with_zero_setup_token

MARKUP = ("``", ":func:", ":class:", ":meth:", "\\n")


def _every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:  # argparse offers no public walk of its subcommands
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.extend(_every_parser(child))
    return found


def test_every_help_text_is_plain_and_describes_its_command() -> None:
    parsers = _every_parser(_parser())
    assert len(parsers) >= 11  # gateway, run, migrate, ..., rules check
    for parser in parsers:
        text = parser.format_help()
        assert not any(mark in text for mark in MARKUP), text
        assert parser.description, f"{parser.prog} --help has no description"
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{parser.prog} {action.option_strings} has no help"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90s", 90), ("30m", 1800), ("1h", 3600), ("2d", 172800), ("1.5h", 5400)],
)
def test_durations(text: str, expected: int) -> None:
    assert _duration(text) == timedelta(seconds=expected)


@pytest.mark.parametrize("text", ["", "1", "h", "0h", "-1h", "1w", "one hour"])
def test_bad_durations_say_what_is_expected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="s, m, h or d"):
        _duration(text)


def test_the_zero_setup_path_gets_one_private_admin_token(tmp_path: Path) -> None:
    config = parse_config(f'[node]\nstate_dir = "{tmp_path / "state"}"\n')
    results: list[str] = []
    start = threading.Barrier(8)

    def first_start() -> None:
        start.wait()
        (token,) = with_zero_setup_token(config).api.tokens
        results.append(token.token)

    threads = [threading.Thread(target=first_start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Eight starts at once: one token, the one in the file, for all of them.
    path = tmp_path / "state" / "admin-token"
    assert len(set(results)) == 1
    assert path.read_text().strip() == results[0]
    assert len(results[0]) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["admin-token"]  # no temporaries
    (again,) = with_zero_setup_token(config).api.tokens
    assert (again.token, again.role, again.name) == (results[0], "admin", TOKEN_NAME)


def test_a_configured_node_gets_no_token(tmp_path: Path) -> None:
    own_tokens = parse_config(
        f'[node]\nstate_dir = "{tmp_path}"\n'
        '[[api.tokens]]\ntoken = "0123456789abcdef0123"\nrole = "viewer"\nname = "ops"\n'
    )
    own_database = parse_config(
        f'[node]\nstate_dir = "{tmp_path}"\n[database]\ndsn = "postgresql://db/gw"\n'
    )
    assert with_zero_setup_token(own_tokens) is own_tokens
    assert with_zero_setup_token(own_database) is own_database
    assert not (tmp_path / "admin-token").exists()


def _replay_until(text: str) -> object:
    return _parser().parse_args(["rules", "replay", "--until", text]).until


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Berlin's hour that happens twice (2026-10-25): the offset says which pass.
        ("2026-10-25T02:30:00+02:00", datetime(2026, 10, 25, 0, 30, tzinfo=UTC)),
        ("2026-10-25T02:30:00+01:00", datetime(2026, 10, 25, 1, 30, tzinfo=UTC)),
        ("2026-10-25T01:30:00Z", datetime(2026, 10, 25, 1, 30, tzinfo=UTC)),
        ("2026-10-25T07:00:00+05:30", datetime(2026, 10, 25, 1, 30, tzinfo=UTC)),
    ],
)
def test_rules_replay_until_is_an_instant(text: str, expected: datetime) -> None:
    assert _replay_until(text) == expected


@pytest.mark.parametrize("text", ["2026-10-25T02:30:00", "2026-10-25", "tomorrow 7am"])
def test_rules_replay_until_without_an_offset_is_refused_with_a_clear_error(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wall time names no instant (02:30 on 2026-10-25 in Berlin names two): refused by the
    parser, saying what to give; it used to be taken, and the replay then stopped with a
    traceback (comparing a naive time with the aware ones of the stream)."""
    with pytest.raises(SystemExit) as exit_info:
        _replay_until(text)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--until" in err
    assert "offset" in err
