"""``gateway demo`` as a newcomer runs it: a line with the console's address and a token and
one with its state directory (which the other commands find with ``--config``), alarms from
the simulated devices within seconds but calm ones, devices with presence (a Will seen), the
demo's webhook receiver taking notifications, a chattering device, commands answered, and
Ctrl-C leaves nothing running (no child, no PostgreSQL, no temporary state). Its failures are
one line naming its own flag, exit 2, with nothing left behind."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from gateway.commands.service import CommandService
from gateway.demo.run import CHROMIUM
from gateway.demo.tasmota import DEVICES as TASMOTA
from gateway.domain.command import Delivery
from tests.support.ports import free_port
from tests.support.waiting import wait_until, wait_until_sync

LINE = re.compile(
    r"^Gateway demo: open (?P<url>http://\S+/) and sign in with the token (?P<token>\S+) "
)
STATE_LINE = re.compile(
    r"^State directory: (?P<dir>\S+), removed at the end; the other commands find the demo "
    r"with --config (?P<config>\S+) "
)
START_TIMEOUT_S = 120.0
# Over the whole test (about a minute of demo), the alarms of every device but the chattering
# one: the fleet's rules are calm (before them: about 75 a minute, most of them CRITICAL).
CALM_MAX_ALARMS = 12


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _all_devices(url: str, auth: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every device the API lists (no selector: its pattern takes no Sparkplug `/`)."""
    found: dict[str, dict[str, Any]] = {}
    after: str | None = None
    while True:
        params = {"limit": "500", **({"after": after} if after else {})}
        reply = httpx.get(f"{url}devices", params=params, headers=auth, timeout=10)
        assert reply.status_code == 200, reply.text
        page = reply.json()
        found.update({d["device_id"]: d for d in page["items"]})
        after = page["next_after"]
        if after is None:
            return found


def _latest_metrics(url: str, auth: dict[str, str], device: str) -> dict[str, Any]:
    reply = httpx.get(f"{url}devices/{device}", headers=auth, timeout=10)
    assert reply.status_code == 200, reply.text
    metrics: dict[str, Any] = reply.json()["device"]["latest_metrics"]
    return metrics


async def _sparkplug_state(dsn: str) -> dict[str, Any]:
    """The metric names stored for each Sparkplug device, and how many aliases the edge
    node's births defined (the API reads no Sparkplug id yet: read from its database)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT device_id, array_agg(DISTINCT key) AS names FROM telemetry, "
            "jsonb_object_keys(metrics) AS key WHERE device_id LIKE 'Demo/Line1/%' "
            "GROUP BY device_id"
        )
        aliases = await conn.fetchval(
            "SELECT count(*) FROM sparkplug_node, jsonb_object_keys(aliases) "
            "WHERE group_id = 'Demo' AND edge_node_id = 'Line1' AND born"
        )
    finally:
        await conn.close()
    return {**{r["device_id"]: set(r["names"]) for r in rows}, "aliases": aliases}


async def _write_setpoint(dsn: str, value: float) -> str:
    """Write the oven's Setpoint as a command would (DCMD); its final status."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        service = CommandService(pool, "demo-test", 300)
        created = await service.create(
            device_id="Demo/Line1/Oven",
            name="Setpoint",
            params={"value": value},
            delivery=Delivery.REALTIME,
            idempotency_key=None,
            actor="test",
        )

        async def finished() -> bool:
            status = await pool.fetchval(
                "SELECT status FROM command WHERE id = $1", created.command.id
            )
            return status in ("ACKED", "FAILED", "TIMEOUT", "CANCELLED")

        await wait_until(finished, timeout=30, message="the Setpoint write answered")
        status: str = await pool.fetchval(
            "SELECT status FROM command WHERE id = $1", created.command.id
        )
        return status
    finally:
        await pool.close()


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (session id, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found[int(entry.name)] = (os.getsid(int(entry.name)), cmdline)
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile
    return found


@pytest.fixture
def tmpdir_for_demo() -> Iterator[Path]:
    # Not under pytest's tmp_path (mode 0700 reset by concurrent runs): the embedded
    # PostgreSQL runs as its own user and must reach the state directory.
    path = Path(tempfile.mkdtemp(prefix="gw-demo-test-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.embedded
def test_the_demo_shows_the_product_calmly_and_stops_cleanly(
    tmpdir_for_demo: Path,
) -> None:
    http_port, mqtt_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo",
         "--http-port", str(http_port), "--mqtt-port", str(mqtt_port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmpdir_for_demo)},
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        for line in process.stdout or ():
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until_sync(
            lambda: bool(lines) or process.poll() is not None,
            timeout=START_TIMEOUT_S,
            message="the demo's line",
        )
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        match = LINE.match(lines[0])
        assert match, lines
        url, token = match["url"], match["token"]
        assert url == f"http://127.0.0.1:{http_port}/"
        (state_dir,) = tmpdir_for_demo.iterdir()  # the demo's own temporary state
        auth = {"Authorization": f"Bearer {token}"}
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200
        assert "Gateway console" in page.text

        def alarms() -> bool:
            reply = httpx.get(f"{url}alarms?open=true", headers=auth, timeout=10)
            return reply.status_code == 200 and len(reply.json()["items"]) > 0

        wait_until_sync(alarms, timeout=60, interval=0.5, message="an alarm from the demo")
        # A command to a simulated device is answered by its responder.
        reply = httpx.post(
            f"{url}devices/demo-00000/commands?wait=30",
            json={"name": "reboot"},
            headers=auth,
            timeout=40,
        )
        assert reply.status_code == 201
        assert reply.json()["command"]["status"] == "ACKED"

        # The second line: the state directory, and the file the other commands read.
        state = STATE_LINE.match(lines[1])
        assert state, lines
        assert Path(state["dir"]) == state_dir
        config = Path(state["config"])
        assert config == state_dir / "gateway.toml"
        assert "token" not in config.read_text()  # the API token is printed, not written
        listed = _run("gateway", "dead-letters", "list", "--config", str(config))
        assert listed.returncode == 0, listed.stderr
        published = _run("sim", "publish", "--config", str(config), "--devices", "2",
                         "--messages", "4")  # fmt: skip
        assert published.returncode == 0, published.stderr
        assert "(gateway demo online)" in published.stdout, published.stdout

        def devices(selector: str) -> dict[str, dict[str, object]]:
            reply = httpx.get(
                f"{url}devices", params={"selector": selector}, headers=auth, timeout=10
            )
            assert reply.status_code == 200, reply.text
            return {d["device_id"]: d for d in reply.json()["devices"]}

        wait_until_sync(
            lambda: set(devices("pub-*")) == {"pub-00000", "pub-00001"},
            timeout=30, interval=0.5, message="gateway-sim publish's devices, stored",
        )  # fmt: skip
        samples = httpx.get(f"{url}devices/pub-00000/telemetry", headers=auth, timeout=10)
        newest = datetime.fromisoformat(samples.json()["samples"][0]["ts"])
        assert abs((datetime.now(UTC) - newest).total_seconds()) < 120, newest  # dated now

        # Beside the native devices: the Sparkplug edge node's devices and the Tasmota ones,
        # known with their metrics and online (its birth; their retained LWT).
        beside = ("Demo/Line1", "Demo/Line1/Oven", "Demo/Line1/Pump", *TASMOTA)

        def beside_known() -> bool:
            listed = _all_devices(url, auth)
            return all(listed.get(d, {}).get("presence") == "online" for d in beside) and all(
                _latest_metrics(url, auth, d) for d in TASMOTA
            )

        wait_until_sync(
            beside_known, timeout=30, interval=0.5, message=f"{beside} online, with readings"
        )
        dsn = _run("gateway", "embedded-db", "--config", str(config)).stdout.strip()
        assert dsn, "the demo's embedded PostgreSQL"
        sparkplug = asyncio.run(_sparkplug_state(dsn))
        assert {"Temperature", "Setpoint", "Door Open"} <= sparkplug["Demo/Line1/Oven"]
        assert {"Pressure", "Flow", "Running"} <= sparkplug["Demo/Line1/Pump"]
        assert sparkplug["aliases"] == 7  # the births' aliases, the data sent by alias
        climate = _latest_metrics(url, auth, "tasmota-climate-1")
        assert {"AM2301.Temperature", "AM2301.Humidity", "AM2301.DewPoint"} <= set(climate)
        assert _latest_metrics(url, auth, "tasmota-plug-1")["ENERGY.Power"]["value"] > 0
        # A Tasmota POWER goes out on cmnd/tasmota-plug-1/POWER and stays SENT by design (no
        # receipt a gateway understands); its effect shows in the plug's next readings.
        reply = httpx.post(
            f"{url}devices/tasmota-plug-1/commands?wait=5",
            json={"name": "POWER", "params": {"value": "OFF"}},
            headers=auth,
            timeout=20,
        )
        assert reply.status_code == 201, reply.text
        assert reply.json()["command"]["status"] == "SENT"
        # A Sparkplug write (DCMD), created through the service layer (the HTTP path takes no
        # `/` in a device id): the edge node reports the written value back, so it is ACKED.
        assert asyncio.run(_write_setpoint(dsn, 190.0)) == "ACKED"

        # Presence: births retained, and the flaky hub's Will (a cut without DISCONNECT).
        wait_until_sync(
            lambda: devices("demo-hub-*")["demo-hub-3"]["presence"] == "offline",
            timeout=60, interval=0.5, message="demo-hub-3 offline by its Will",
        )  # fmt: skip
        hubs = devices("demo-hub-*")
        assert hubs["demo-hub-1"]["presence"] == hubs["demo-hub-2"]["presence"] == "online"

        def alarm_list(**params: str) -> list[dict[str, object]]:
            reply = httpx.get(
                f"{url}alarms", params={"limit": "500", **params}, headers=auth, timeout=10
            )
            assert reply.status_code == 200, reply.text
            items: list[dict[str, object]] = reply.json()["items"]
            return items

        wait_until_sync(
            lambda: bool(alarm_list(device="demo-hub-3", rule="silent")),
            timeout=30, interval=0.5, message="the silent alarm of the hub that went offline",
        )  # fmt: skip

        # The demo's own webhook receiver took notifications (sent: it answered 2xx).
        def sent() -> list[dict[str, object]]:
            reply = httpx.get(
                f"{url}deliveries", params={"receiver": "demo-webhook"}, headers=auth, timeout=10
            )
            assert reply.status_code == 200, reply.text
            return [d for d in reply.json()["items"] if d["status"] == "SENT"]

        wait_until_sync(
            lambda: bool(sent()), timeout=30, interval=0.5, message="a delivery to the webhook"
        )

        # The chattering device: raised again and again (each raise supersedes the last).
        wait_until_sync(
            lambda: len(alarm_list(device="demo-fan-1", rule="fan-vibration")) >= 3,
            timeout=60, interval=0.5, message="three raises of the chattering rule",
        )  # fmt: skip
        assert len(alarm_list(device="demo-fan-1", open="true")) == 1
        # ... and muted: its rule is routed nowhere until it is fixed.
        assert not [d for d in sent() if d["rule_key"] == "fan-vibration"]
        # The alarm system's own figures name it as chattering.
        stats = httpx.get(f"{url}alarm-stats", params={"window": "10m"}, headers=auth, timeout=10)
        assert stats.status_code == 200, stats.text
        chattering = {(p["rule_key"], p["device_id"]) for p in stats.json()["chattering"]["items"]}
        assert ("fan-vibration", "demo-fan-1") in chattering, stats.json()["chattering"]

        # The device under maintenance: out of service, said on the device.
        def out_of_service() -> object:
            reply = httpx.get(f"{url}devices/demo-00020", headers=auth, timeout=10)
            if reply.status_code != 200:
                return None
            return reply.json()["device"].get("out_of_service")

        wait_until_sync(
            lambda: out_of_service() is not None,
            timeout=30, interval=0.5, message="demo-00020 out of service",
        )  # fmt: skip
        period = out_of_service()
        assert isinstance(period, dict)
        assert period["reason"].startswith("demo:"), period

        # The plug switched off by the POWER above: its readings say so.
        wait_until_sync(
            lambda: _latest_metrics(url, auth, "tasmota-plug-1")["ENERGY.Power"]["value"] == 0,
            timeout=30, interval=0.5, message="the plug's power off in its readings",
        )  # fmt: skip

        # Calm: few alarms, CRITICAL only where a person may be in danger.
        calm = [a for a in alarm_list() if a["device_id"] != "demo-fan-1"]
        assert len(calm) <= CALM_MAX_ALARMS, calm
        assert {a["rule_key"] for a in calm if a["severity"] == "CRITICAL"} <= {"sos", "smoke"}
        session = process.pid
        assert any(str(state_dir) in cmd for _, (_, cmd) in _processes().items()), (
            "the embedded PostgreSQL runs from the demo's state directory"
        )

        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, process.stderr.read() if process.stderr else ""
        errors = process.stderr.read() if process.stderr else ""
        # The hubs' retained births that amqtt hands to the wrong subscriber are not taken for
        # commands (the simulated devices' responder used to warn of each).
        assert "responder_command_undecodable" not in errors, errors
        left = {
            pid: cmd
            for pid, (sid, cmd) in _processes().items()
            if sid == session or str(state_dir) in cmd
        }
        assert not left, left
        assert not state_dir.exists(), "the temporary state is removed"
        assert len([line for line in lines if line.strip()]) == 2, lines
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def test_the_demo_fails_in_one_line_naming_its_flag_and_leaves_nothing(
    tmpdir_for_demo: Path,
) -> None:
    """A taken port, a port out of range, a state directory that cannot be one: one line on
    stderr naming the demo's own flag (not a setting of a file it does not have), exit 2,
    nothing on stdout, no temporary directory, no process left."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        not_a_dir = tmpdir_for_demo / "file"
        not_a_dir.write_text("")
        cases = {
            ("--http-port", port, "--mqtt-port", "0"): "choose another with --http-port PORT, "
            "or --http-port 0 for any free port",
            ("--http-port", "0", "--mqtt-port", port): "choose another with --mqtt-port PORT, "
            "or --mqtt-port 0 for any free port",
            ("--http-port", "70000"): "--http-port 70000 is not a port: 1 to 65535, or 0 for "
            "any free port",
            ("--http-port", "eighty"): "argument --http-port: invalid int value: 'eighty'",
            ("--mqtt-port", "0", "--bogus"): "unrecognized arguments: --bogus",
            ("--http-port", "0", "--mqtt-port", "0", "--state-dir", str(not_a_dir / "sub")): (
                f"cannot write to --state-dir {not_a_dir / 'sub'}"
            ),
        }
        temp = tmpdir_for_demo / "tmp"
        temp.mkdir()
        for args, said in cases.items():
            process = subprocess.Popen(
                [sys.executable, "-m", "gateway", "demo", *args],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "TMPDIR": str(temp)}, start_new_session=True,
            )  # fmt: skip
            out, err = process.communicate(timeout=60)
            assert process.returncode == 2, (args, err)
            assert out == "", args
            (line,) = err.splitlines()
            assert line.startswith("gateway demo: "), line
            assert said in line, (args, line)
            assert not list(temp.iterdir()), args
            left = [cmd for _, (sid, cmd) in _processes().items() if sid == process.pid]
            assert not left, left


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@pytest.mark.embedded
def test_the_demo_photographs_the_console_at_both_sizes(tmpdir_for_demo: Path) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    outdir = tmpdir_for_demo / "shots"
    state = tmpdir_for_demo / "state"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "demo", "--screenshots", str(outdir),
         "--http-port", "0", "--mqtt-port", str(free_port()), "--state-dir", str(state)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    expected = {
        f"console-{view}-{size}.png": dims
        for view in ("alarms", "alarm-detail", "campaign")
        for size, dims in (("desktop", (1280, 800)), ("phone", (390, 844)))
    }
    assert sorted(done.stdout.split()) == sorted(str(outdir / name) for name in expected)
    for name, dims in expected.items():
        assert _png_size(outdir / name) == dims, name


@pytest.mark.embedded
def test_the_demo_times_alarms_from_telemetry_to_an_open_page(tmpdir_for_demo: Path) -> None:
    """`--measure-live N` reports a figure for N alarms, each having reached a page that was
    never reloaded (the figure itself is the docs' business, not this test's)."""
    if not CHROMIUM.exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "demo", "--measure-live", "3",
         "--http-port", "0", "--mqtt-port", str(free_port()),
         "--state-dir", str(tmpdir_for_demo / "state")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(
        r"3 alarms, telemetry to the open page: p50 \d+ ms, max \d+ ms\n", done.stdout
    ), done.stdout
