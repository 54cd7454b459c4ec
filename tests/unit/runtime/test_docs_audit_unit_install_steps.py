"""Audit: the install steps in gateway.service's header are deploying.md's, command for command.

An operator reading the unit (`systemctl cat gateway`) and following its header's steps on a
fresh host ran `install -m 0644 config.example.toml /etc/gateway/gateway.toml`, which fails:
/etc/gateway does not exist before the service first starts (`ConfigurationDirectory=` makes it
then); deploying.md's `install -D` makes it. Every command the header lists must be one of
deploying.md's "Install" block, written the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
COMMAND = re.compile(r"^#   ((?:python3|/opt/|install|systemctl)\S*(?: \S+)*)")


def _normal(line: str) -> str:
    return " ".join(line.split("#", 1)[0].split())


def _install_block() -> set[str]:
    text = (ROOT / "docs" / "deploying.md").read_text()
    section = text[text.index("## Install") :]
    start = section.index("```sh\n") + len("```sh\n")
    block = section[start : section.index("\n```", start)]
    return {_normal(line) for line in block.splitlines()}


def test_every_install_step_of_the_unit_header_is_deploying_mds() -> None:
    header = (ROOT / "systemd" / "gateway.service").read_text().split("\n[Unit]")[0]
    steps = [_normal(m[1]) for m in map(COMMAND.match, header.splitlines()) if m]
    assert len(steps) >= 4, steps
    documented = _install_block()
    differing = [step for step in steps if step not in documented]
    assert not differing, f"systemd/gateway.service's steps not in docs/deploying.md: {differing}"
