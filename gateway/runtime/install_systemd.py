"""Install the systemd units shipped in the wheel, pointed at this installation's ``gateway``.

The units in the top-level ``systemd/`` (built into the wheel as ``gateway.units``) name the
documented install location (:data:`DEFAULT_EXECUTABLE`); :func:`render_unit` swaps in the
console script actually installed, so that ``/opt/x/venv/bin/gateway install-systemd`` writes
units that start ``/opt/x/venv``.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_EXECUTABLE", "UNIT_NAMES", "install_units", "render_unit"]

DEFAULT_EXECUTABLE: Final = "/opt/gateway/venv/bin/gateway"
UNIT_NAMES: Final = ("gateway.service", "gateway@.service")
SYSTEMD_SYSTEM_DIR: Final = Path("/etc/systemd/system")
# The units set PrivateTmp=yes: the service sees empty private /tmp and /var/tmp of its own, so
# an ExecStart= under either cannot start (status 203/EXEC).
PRIVATE_TMP_DIRS: Final = (Path("/tmp"), Path("/var/tmp"))  # noqa: S108 - compared, not written

# The executable of ExecStart= and ExecStartPre=, commented out or not, after systemd's
# optional prefixes (-, @, :, +, !). ExecReload= (/bin/kill) is left alone.
_EXEC_LINE: Final = re.compile(
    r"^(?P<head>#?ExecStart(?:Pre)?=[-@:+!]*)(?P<path>\S+)", flags=re.MULTILINE
)
# Whitespace would split the command line; quotes, backslashes, % (specifiers) and $ (variable
# expansion) would be interpreted by systemd. No sane install path contains any of them.
_UNSAFE_PATH: Final = re.compile(r"[\s\"'\\%$;]")


def render_unit(name: str, executable: str) -> str:
    """The packaged unit ``name``, starting ``executable`` instead of the documented path."""
    if name not in UNIT_NAMES:
        raise ValueError(f"unknown unit {name!r}; the package ships {', '.join(UNIT_NAMES)}")
    if not os.path.isabs(executable) or _UNSAFE_PATH.search(executable):
        raise ValueError(
            f"executable must be an absolute path without whitespace, quotes, '\\', '%', '$' "
            f"or ';': {executable!r}"
        )
    text = resources.files("gateway.units").joinpath(name).read_text(encoding="utf-8")
    return _EXEC_LINE.sub(lambda match: match["head"] + executable, text)


def default_executable() -> str:
    """The ``gateway`` console script of the environment running this code."""
    # Not resolved: a virtualenv's bin/python is a symlink out of the virtualenv.
    return str(Path(sys.executable).parent / "gateway")


def install_units(
    target_dir: Path = SYSTEMD_SYSTEM_DIR,
    *,
    executable: str | None = None,
    force: bool = False,
    allow_tmp: bool = False,
) -> list[Path]:
    """Write every packaged unit into ``target_dir``; return the paths written.

    A unit already there with other content (an older version, local edits) is not replaced
    unless ``force``: nothing is written then, and :class:`FileExistsError` names the files.
    Local changes belong in drop-ins (``systemctl edit gateway``), which this never touches.

    An executable under ``/tmp`` or ``/var/tmp`` (a virtualenv made in a temporary directory)
    is refused with :class:`ValueError` unless ``allow_tmp`` (a drop-in setting
    ``PrivateTmp=no``): the units' ``PrivateTmp=yes`` hides it from the service.
    """
    executable = executable or default_executable()
    if not os.access(executable, os.X_OK):
        raise FileNotFoundError(
            f"{executable} is not an executable file: name the installed gateway script with "
            "--executable (e.g. --executable /opt/gateway/venv/bin/gateway)"
        )
    temporary = _under_private_tmp(executable)
    if temporary is not None and not allow_tmp:
        raise ValueError(
            f"{executable} is inside {temporary}, which the units' PrivateTmp=yes replaces with "
            "an empty directory of the service's own: systemd could not start it. Install the "
            "gateway outside /tmp and /var/tmp (e.g. /opt/gateway/venv), or, with a drop-in "
            "setting PrivateTmp=no, run gateway install-systemd --allow-tmp"
        )
    rendered = {target_dir / name: render_unit(name, executable) for name in UNIT_NAMES}
    if not force:
        conflicts = [path for path, text in rendered.items() if _differs(path, text)]
        if conflicts:
            names = ", ".join(str(path) for path in conflicts)
            raise FileExistsError(
                f"{names}: exists with different content; put local changes in drop-ins "
                "(systemctl edit gateway), or run gateway install-systemd --force to overwrite"
            )
    target_dir.mkdir(parents=True, exist_ok=True)
    for path, text in rendered.items():
        _write_atomically(path, text)
    return list(rendered)


def _under_private_tmp(executable: str) -> Path | None:
    """The private temporary directory ``executable`` lies in, as written or resolved."""
    for path in (Path(os.path.normpath(executable)), Path(os.path.realpath(executable))):
        for directory in PRIVATE_TMP_DIRS:
            if path.is_relative_to(directory):
                return directory
    return None


def _differs(path: Path, text: str) -> bool:
    try:
        return path.read_bytes() != text.encode("utf-8")
    except FileNotFoundError:
        return False


def _write_atomically(path: Path, text: str) -> None:
    # A reader (systemctl daemon-reload) sees the old unit or the new one, never half of one.
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
