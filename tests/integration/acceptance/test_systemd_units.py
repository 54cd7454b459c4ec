"""The shipped systemd units: `systemd-analyze verify` clean, sandboxed, in one place (the
top-level systemd/, built into the wheel as gateway.units), and installed with the executable
of the environment that installs them."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gateway.runtime.install_systemd import (
    DEFAULT_EXECUTABLE,
    UNIT_NAMES,
    install_units,
    render_unit,
)

ROOT = Path(__file__).resolve().parents[3]
PACKAGED_DIR = ROOT / "systemd"
# systemd-analyze security's exposure, times ten: 1.6 today; sandboxing may only get stricter.
MAX_EXPOSURE = 20
ANALYZE_TIMEOUT_S = 60


def _analyze() -> tuple[str, int]:
    """The systemd-analyze binary and systemd's version, or a skip saying why there is none."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    probe = _run([analyze, "--version"])
    if probe.returncode != 0:
        pytest.skip(f"systemd-analyze --version failed: {probe.stderr.strip()}")
    match = re.match(r"systemd (\d+)", probe.stdout)
    return analyze, int(match[1]) if match else 0


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_PAGER": "", "LC_ALL": "C"}
    return subprocess.run(
        argv, check=False, capture_output=True, text=True, env=env, timeout=ANALYZE_TIMEOUT_S
    )


def _fake_gateway(directory: Path) -> Path:
    # verify checks that ExecStart= binaries exist and are executable.
    executable = directory / "bin" / "gateway"
    executable.parent.mkdir(parents=True)
    executable.write_text("#!/bin/sh\nexit 0\n")
    executable.chmod(0o755)
    return executable


@pytest.fixture
def rendered(tmp_path: Path) -> dict[str, Path]:
    """Both units rendered for an existing executable, plus an instance of the template."""
    executable = _fake_gateway(tmp_path / "venv")
    units = tmp_path / "units"
    units.mkdir()
    paths = {}
    for name in UNIT_NAMES:
        paths[name] = units / name
        paths[name].write_text(render_unit(name, str(executable)))
    # A template is verified through an instance; the symlink is how systemd resolves one.
    instance = units / "gateway@node1.service"
    instance.symlink_to("gateway@.service")
    paths[instance.name] = instance
    return paths


@pytest.mark.parametrize("unit", ["gateway.service", "gateway@node1.service"])
def test_systemd_analyze_verify_is_clean(rendered: dict[str, Path], unit: str) -> None:
    analyze, _ = _analyze()
    result = _run([analyze, "verify", "--man=no", str(rendered[unit])])
    output = result.stdout + result.stderr
    # verify exits 0 on warnings such as "Unknown key"; anything said about our units counts.
    about_us = [line for line in output.splitlines() if "gateway" in line]
    assert result.returncode == 0, output
    assert about_us == [], output


@pytest.mark.parametrize("unit", ["gateway.service", "gateway@node1.service"])
def test_a_configuration_error_is_not_restarted_forever(
    rendered: dict[str, Path], unit: str
) -> None:
    """Exit code 2 is a configuration error (docs/operations.md): restarting cannot fix it."""
    lines = [line.strip() for line in rendered[unit].read_text().splitlines()]
    assert "Restart=on-failure" in lines
    assert "RestartPreventExitStatus=2" in lines


@pytest.mark.parametrize("unit", ["gateway.service", "gateway@node1.service"])
def test_sandbox_exposure_stays_low(rendered: dict[str, Path], unit: str) -> None:
    analyze, version = _analyze()
    if version < 250:
        pytest.skip("systemd-analyze security --offline needs systemd 250")
    result = _run(
        [
            analyze,
            "security",
            "--offline=yes",
            f"--threshold={MAX_EXPOSURE}",
            "--no-pager",
            str(rendered[unit]),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Overall exposure level" in result.stdout


def test_the_package_list_names_every_package_of_the_tree() -> None:
    """pyproject.toml lists its packages (to map gateway.units onto systemd/): a package added
    to the tree and not to the list would be missing from the wheel."""
    import tomllib

    from setuptools import find_packages

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = find_packages(str(ROOT), include=["protocol*", "storage*", "gateway*", "sim*"])
    assert sorted(listed) == sorted([*found, "gateway.units"])


def test_the_units_are_read_from_the_installed_package() -> None:
    from importlib import resources

    for name in UNIT_NAMES:
        shipped = resources.files("gateway.units").joinpath(name).read_text(encoding="utf-8")
        assert shipped == (PACKAGED_DIR / name).read_text(encoding="utf-8")


def test_the_units_exist_once_in_the_wheel() -> None:
    packaged = sorted(path.name for path in PACKAGED_DIR.glob("*.service"))
    assert packaged == sorted(UNIT_NAMES)
    elsewhere = [
        p for p in ROOT.rglob("*.service") if ".venv" not in p.parts and p.parent != PACKAGED_DIR
    ]
    assert elsewhere == []


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_render_rewrites_only_the_gateway_executable(name: str) -> None:
    original = (PACKAGED_DIR / name).read_text()
    text = render_unit(name, "/srv/gw/venv/bin/gateway")
    exec_lines = [line for line in text.splitlines() if re.match(r"#?ExecStart(Pre)?=", line)]
    assert exec_lines, "the unit starts something"
    assert all(line.split("=", 1)[1].startswith("/srv/gw/venv/bin/gateway ") for line in exec_lines)
    assert "ExecReload=/bin/kill -HUP $MAINPID" in text
    # Only the Exec lines changed; the install instructions in the comments still name /opt.
    changed = [
        (old, new)
        for old, new in zip(original.splitlines(), text.splitlines(), strict=True)
        if old != new
    ]
    assert [old for old, _ in changed] == [
        line for line in original.splitlines() if re.match(r"#?ExecStart(Pre)?=", line)
    ]
    assert all(DEFAULT_EXECUTABLE in old for old, _ in changed)


@pytest.mark.parametrize(
    "executable", ["gateway", "bin/gateway", "/opt/my venv/bin/gateway", "/opt/%i/gateway", "/a$b"]
)
def test_render_refuses_paths_systemd_would_misread(executable: str) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        render_unit("gateway.service", executable)


def test_render_refuses_unknown_units() -> None:
    with pytest.raises(ValueError, match="unknown unit"):
        render_unit("postgresql.service", "/usr/bin/true")


# pytest's tmp_path is under /tmp, which install_units refuses unless allow_tmp (below).


def test_install_writes_every_unit_with_the_given_executable(tmp_path: Path) -> None:
    executable = _fake_gateway(tmp_path / "venv")
    target = tmp_path / "etc" / "systemd" / "system"
    written = install_units(target, executable=str(executable), allow_tmp=True)
    assert written == [target / name for name in UNIT_NAMES]
    for path in written:
        assert path.read_text() == render_unit(path.name, str(executable))
        assert f"ExecStart={executable} run --config" in path.read_text()
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in target.iterdir()) == sorted(UNIT_NAMES)  # no temp files left
    # Installing the same thing again is a no-op, not a conflict.
    assert install_units(target, executable=str(executable), allow_tmp=True) == written


def test_install_defaults_to_the_console_script_next_to_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executable = _fake_gateway(tmp_path / "venv")
    monkeypatch.setattr(sys, "executable", str(executable.parent / "python"))
    (written, *_) = install_units(tmp_path / "units", allow_tmp=True)
    assert f"ExecStart={executable} run" in written.read_text()


def test_install_refuses_a_different_existing_unit_unless_forced(tmp_path: Path) -> None:
    executable = str(_fake_gateway(tmp_path / "venv"))
    target = tmp_path / "units"
    target.mkdir()
    edited = target / "gateway@.service"
    edited.write_text("[Service]\nExecStart=/usr/bin/local-edit\n")

    with pytest.raises(FileExistsError, match=r"gateway@\.service.*force"):
        install_units(target, executable=executable, allow_tmp=True)
    # All or nothing: the unit without a conflict was not written either.
    assert sorted(p.name for p in target.iterdir()) == ["gateway@.service"]
    assert edited.read_text() == "[Service]\nExecStart=/usr/bin/local-edit\n"

    install_units(target, executable=executable, force=True, allow_tmp=True)
    assert edited.read_text() == render_unit("gateway@.service", executable)


def test_install_refuses_a_missing_executable(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not an executable"):
        install_units(tmp_path / "units", executable=str(tmp_path / "nowhere" / "gateway"))
    assert not (tmp_path / "units").exists()


@pytest.mark.parametrize("private", ["/tmp", "/var/tmp"])
def test_install_refuses_an_executable_the_private_tmp_hides(private: str) -> None:
    # PrivateTmp=yes gives the service an empty /tmp and /var/tmp: an ExecStart= there is
    # unstartable, so nothing is written, and the error says where and why.
    if not os.access(private, os.W_OK):
        pytest.skip(f"{private} is not writable here")
    with tempfile.TemporaryDirectory(dir=private) as directory:
        executable = str(_fake_gateway(Path(directory) / "venv"))
        target = Path(directory) / "units"
        with pytest.raises(
            ValueError, match=rf"{re.escape(executable)} is inside {private}.*PrivateTmp"
        ):
            install_units(target, executable=executable)
        assert not target.exists()
        # The override, for a drop-in that sets PrivateTmp=no.
        assert install_units(target, executable=executable, allow_tmp=True)


def test_the_cli_refuses_a_tmp_executable_with_exit_1(tmp_path: Path) -> None:
    executable = _fake_gateway(tmp_path / "venv")
    if not executable.resolve().is_relative_to("/tmp"):
        pytest.skip("pytest's tmp_path is not under /tmp here")
    argv = [sys.executable, "-m", "gateway", "install-systemd", "--target", str(tmp_path / "u")]
    refused = _run([*argv, "--executable", str(executable)])
    assert refused.returncode == 1
    assert f"{executable} is inside /tmp" in refused.stderr
    assert "--allow-tmp" in refused.stderr
    assert not (tmp_path / "u").exists()
    allowed = _run([*argv, "--executable", str(executable), "--allow-tmp"])
    assert allowed.returncode == 0, allowed.stderr
    assert (tmp_path / "u" / "gateway.service").exists()
