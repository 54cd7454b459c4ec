"""Brokers nobody here wrote, started privately by tests: NATS (its ``mqtt`` block, on
JetStream) and RabbitMQ (its MQTT plugin). Both speak MQTT 3.1.1 only.

Each runs as a child process of the test run with everything of its own under ``workdir``:
ports chosen free, its own data directory, and never the machine's instances (a system
``nats-server`` and a system RabbitMQ node may run here: they are left alone).

Facts these classes rely on (checked against nats-server 2.9.10 and RabbitMQ 3.10.8 on
Erlang/OTP 25):

* NATS's MQTT needs JetStream (sessions, retained messages and QoS 1 are streams) and a
  ``server_name``; without either it refuses to start.
* Debian's ``/usr/sbin/rabbitmq-server`` is a wrapper that, run as root, ``su``\\ s to the
  ``rabbitmq`` user with the system node's home and cookie: the private node is started with
  ``/usr/lib/rabbitmq/bin/rabbitmq-server`` itself, with ``HOME`` (hence ``.erlang.cookie``)
  under ``workdir``.
* An Erlang node registers its name with epmd, which an Erlang VM starts as a daemon when none
  listens on ``ERL_EPMD_PORT`` (4369 by default, the system node's). The private node gets an
  epmd of its own on a free port, started and stopped here by its pid: nothing outlives the
  tests and nothing is registered with the system's epmd.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from tests.support.ports import free_port
from tests.support.waiting import wait_until_sync

NATS_BINARIES = ("/usr/sbin/nats-server", "/usr/bin/nats-server")
RABBIT_HOME = "/usr/lib/rabbitmq"
RABBIT_SERVER = f"{RABBIT_HOME}/bin/rabbitmq-server"
RABBIT_CTL = f"{RABBIT_HOME}/bin/rabbitmqctl"
NATS_START_TIMEOUT_S = 20.0
# A RabbitMQ node boots in 5-10 s on an idle machine; on 2 busy cores, more.
RABBIT_START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
# Both brokers know a user who may subscribe to anything but the devices' telemetry: a
# subscription refused by the broker's permissions (an ACL), for the gateway to name.
RESTRICTED_USER = "restricted"
RESTRICTED_PASSWORD = "restricted-pw"


def _rabbit_password_hash(password: str) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password))."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def nats_binary() -> str | None:
    found = shutil.which("nats-server")
    return found or next((b for b in NATS_BINARIES if os.access(b, os.X_OK)), None)


def rabbit_missing() -> str | None:
    """Why a private RabbitMQ node cannot be started here, or None."""
    if not os.access(RABBIT_SERVER, os.X_OK):
        return f"{RABBIT_SERVER} is missing (apt-get install rabbitmq-server)"
    if not glob.glob(f"{RABBIT_HOME}/lib/rabbitmq_server-*/plugins/rabbitmq_mqtt-*"):
        return "RabbitMQ's MQTT plugin (rabbitmq_mqtt) is missing"
    if _epmd_binary() is None:
        return "epmd (Erlang's port mapper) is missing"
    return None


def _epmd_binary() -> str | None:
    found = shutil.which("epmd")
    return found or next(iter(sorted(glob.glob("/usr/lib/erlang/erts-*/bin/epmd"))), None)


def _accepting(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _tail(path: Path, n: int = 40) -> str:
    if not path.exists():
        return ""
    with path.open(errors="replace") as lines:
        return f"--- {path.name} ---\n" + "".join(deque(lines, maxlen=n))


class _Child:
    """A child process whose output goes to one file, stopped by its pid."""

    def __init__(self, name: str, output: Path) -> None:
        self.name = name
        self.output = output
        self.process: subprocess.Popen[bytes] | None = None
        self._file: IO[bytes] | None = None

    def start(
        self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self._file = self.output.open("ab")
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._file,
            stderr=self._file,
            env=env,
            cwd=cwd,
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.process.returncode}")

    def stop(
        self, signum: signal.Signals = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S
    ) -> None:
        process = self.process
        try:
            if process is not None and process.poll() is None:
                process.send_signal(signum)
                try:
                    process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        finally:
            self.process = None
            if self._file is not None:
                self._file.close()
                self._file = None


class Nats:
    """A private nats-server with JetStream and its MQTT listener on ``host:port``."""

    host: str = "127.0.0.1"
    family: str = "nats"

    def __init__(self, workdir: Path, *, mqtt_extra: str = "") -> None:
        self.workdir = workdir
        self.mqtt_extra = mqtt_extra  # lines of the mqtt block (ack_wait, max_ack_pending)
        self.port = free_port()  # MQTT
        self.client_port = free_port()  # NATS protocol
        self.monitor_port = free_port()  # HTTP monitoring (/jsz: JetStream's consumers)
        self.server_name = f"gw-test-{secrets.token_hex(4)}"
        self._child = _Child("nats-server", workdir / "nats.log")

    @property
    def config_path(self) -> Path:
        return self.workdir / "nats.conf"

    def config_text(self) -> str:
        store = self.workdir / "jetstream"
        return (
            "# Written by tests.support.brokers.\n"
            f'server_name: "{self.server_name}"\n'
            f'listen: "{self.host}:{self.client_port}"\n'
            f'http: "{self.host}:{self.monitor_port}"\n'
            "jetstream {\n"
            f'  store_dir: "{store}"\n'
            "  max_memory_store: 64MB\n"
            "  max_file_store: 1GB\n"
            "}\n"
            "mqtt {\n"
            f'  host: "{self.host}"\n'
            f"  port: {self.port}\n"
            f"{self.mqtt_extra}\n"
            "}\n"
            # Anonymous clients are "anon", who may do anything.
            'no_auth_user: "anon"\n'
            "authorization {\n"
            "  users: [\n"
            '    {user: "anon", password: "anon"}\n'
            f'    {{user: "{RESTRICTED_USER}", password: "{RESTRICTED_PASSWORD}",\n'
            '     permissions: {subscribe: {deny: ["*.devices.*.telemetry"]}}}\n'
            "  ]\n"
            "}\n"
        )

    def start(self) -> None:
        binary = nats_binary()
        if binary is None:
            raise RuntimeError("nats-server is missing")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text())
        self._child.start([binary, "-c", str(self.config_path)])
        try:
            wait_until_sync(
                self._ready, timeout=NATS_START_TIMEOUT_S, message=f"NATS MQTT on {self.port}"
            )
        except BaseException as exc:
            self._child.stop(signal.SIGKILL)
            raise RuntimeError(f"nats-server failed to start:\n{self.log_tail()}") from exc

    def _ready(self) -> bool:
        self._child.check_alive()
        return _accepting(self.host, self.port)

    def is_running(self) -> bool:
        return self._child.alive()

    def ack_pending(self) -> dict[str, int]:
        """JetStream's consumers (one per MQTT session's QoS 1 subscription) and how many
        messages each has delivered and not had acknowledged."""
        url = f"http://{self.host}:{self.monitor_port}/jsz?consumers=true&accounts=true"
        with urllib.request.urlopen(url, timeout=5) as response:
            jsz = json.load(response)
        return {
            consumer["name"]: int(consumer.get("num_ack_pending", 0))
            for account in jsz.get("account_details") or []
            for stream in account.get("stream_detail") or []
            for consumer in stream.get("consumer_detail") or []
        }

    def stop(self) -> None:
        self._child.stop(signal.SIGTERM)

    def log_tail(self, n: int = 40) -> str:
        return _tail(self._child.output, n)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RabbitMQ:
    """A private RabbitMQ node with the MQTT plugin on ``host:port``: its own node name,
    ports, epmd, data and log directories, enabled-plugins file, configuration and cookie."""

    host: str = "127.0.0.1"
    family: str = "rabbitmq"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()  # MQTT
        self.amqp_port = free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.nodename = f"gw-test-{secrets.token_hex(4)}@localhost"
        self._epmd = _Child("epmd", workdir / "epmd.log")
        self._node = _Child("rabbitmq-server", workdir / "rabbitmq.stdout")

    def env(self) -> dict[str, str]:
        home = self.workdir / "home"
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/usr/lib/rabbitmq/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(home),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": self.host,
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.workdir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.workdir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.workdir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.workdir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.workdir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.workdir / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.workdir / "rabbitmq.pid"),
            # No management plugin, no feature-flag noise in the logs: a quiet, small node.
            "RABBITMQ_LOGS": str(self.workdir / "log" / "rabbit.log"),
        }

    def config_text(self) -> str:
        return (
            "# Written by tests.support.brokers.\n"
            "listeners.tcp.default = " + f"{self.host}:{self.amqp_port}\n"
            f"mqtt.listeners.tcp.default = {self.host}:{self.port}\n"
            "mqtt.allow_anonymous = true\n"
            "mqtt.default_user = guest\n"
            "mqtt.default_pass = guest\n"
            "mqtt.vhost = /\n"
            "mqtt.exchange = amq.topic\n"
            # guest may log in from loopback only (the default): the tests connect there.
            "loopback_users.guest = true\n"
            # The machine's free disk must not stop publishers.
            "disk_free_limit.absolute = 1MB\n"
            f"load_definitions = {self.workdir / 'definitions.json'}\n"
            "log.console = false\n"
            "log.file.level = info\n"
        )

    def definitions(self) -> dict[str, object]:
        """guest (what anonymous MQTT clients log in as) and the restricted user, whose topic
        permissions refuse reading any routing key ending in ``.telemetry``."""
        users = [("guest", "guest"), (RESTRICTED_USER, RESTRICTED_PASSWORD)]
        return {
            "vhosts": [{"name": "/"}],
            "users": [
                {
                    "name": name,
                    "password_hash": _rabbit_password_hash(password),
                    "hashing_algorithm": "rabbit_password_hashing_sha256",
                    "tags": [],
                }
                for name, password in users
            ],
            "permissions": [
                {"user": name, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}
                for name, _ in users
            ],
            "topic_permissions": [
                {
                    "user": RESTRICTED_USER,
                    "vhost": "/",
                    "exchange": "amq.topic",
                    "write": ".*",
                    "read": "^(?!.*\\.telemetry$).*",
                }
            ],
        }

    def start(self) -> None:
        missing = rabbit_missing()
        if missing:
            raise RuntimeError(missing)
        epmd = _epmd_binary()
        assert epmd is not None
        home = self.workdir / "home"
        home.mkdir(parents=True, exist_ok=True)
        (self.workdir / "log").mkdir(exist_ok=True)
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16))
            cookie.chmod(0o400)
        (self.workdir / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        (self.workdir / "rabbitmq.conf").write_text(self.config_text())
        (self.workdir / "definitions.json").write_text(json.dumps(self.definitions()))
        (self.workdir / "advanced.config").write_text("[].\n")
        (self.workdir / "rabbitmq-env.conf").write_text("")
        env = self.env()
        self._epmd.start([epmd, "-port", str(self.epmd_port)], env=env)
        try:
            wait_until_sync(
                lambda: self._up(self._epmd, self.epmd_port),
                timeout=10,
                message=f"epmd on {self.epmd_port}",
            )
            self._node.start([RABBIT_SERVER], env=env, cwd=self.workdir)
            wait_until_sync(
                lambda: self._up(self._node, self.port),
                timeout=RABBIT_START_TIMEOUT_S,
                interval=0.2,
                message=f"RabbitMQ MQTT on {self.port}",
            )
        except BaseException as exc:
            self.stop()
            raise RuntimeError(f"RabbitMQ failed to start:\n{self.log_tail()}") from exc

    def _up(self, child: _Child, port: int) -> bool:
        child.check_alive()
        return _accepting(self.host, port)

    def is_running(self) -> bool:
        return self._node.alive()

    def stop(self) -> None:
        """SIGTERM to the node (the Erlang VM stops cleanly on it since OTP 19), then its epmd."""
        try:
            if self._node.alive():
                self._node.stop(signal.SIGTERM, timeout=STOP_TIMEOUT_S)
        finally:
            self._epmd.stop(signal.SIGTERM)

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``rabbitmqctl -n <node> ...`` against this node only."""
        return subprocess.run(
            [RABBIT_CTL, "-n", self.nodename, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def log_tail(self, n: int = 40) -> str:
        parts = [_tail(self._node.output, n), _tail(self.workdir / "log" / "rabbit.log", n)]
        return "\n".join(p for p in parts if p)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
