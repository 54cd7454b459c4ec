"""Audit: `gateway install-systemd` with an executable that is not there says which flag names
another one (`--executable`), not the Python keyword of the function behind the command."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.commands import main


def test_a_missing_executable_names_the_flag_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere" / "gateway"
    code = main(
        ["install-systemd", "--target", str(tmp_path / "units"), "--executable", str(missing)]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert f"{missing} is not an executable file" in err
    assert "--executable" in err, err
    assert "executable=" not in err, err
    assert not (tmp_path / "units").exists()
