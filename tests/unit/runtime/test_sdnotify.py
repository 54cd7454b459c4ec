"""sd_notify over real AF_UNIX datagram sockets: a path, and the abstract namespace."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.runtime.sdnotify import Notifier

RECEIVE_TIMEOUT_S = 5.0


class Receiver:
    """The service manager's end: a bound datagram socket and the NOTIFY_SOCKET naming it."""

    def __init__(self, sock: socket.socket, notify_socket: str) -> None:
        self.sock = sock
        self.notify_socket = notify_socket
        sock.settimeout(RECEIVE_TIMEOUT_S)

    def receive(self) -> bytes:
        return self.sock.recv(65536)

    def pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(65536)
        except BlockingIOError:
            return False
        finally:
            self.sock.settimeout(RECEIVE_TIMEOUT_S)
        return True


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Not tmp_path: sun_path holds 108 bytes, and pytest's per-test directories get long.
    path = Path(tempfile.mkdtemp(prefix="sdn-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def path_receiver(short_dir: Path) -> Iterator[Receiver]:
    address = str(short_dir / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        yield Receiver(sock, address)


@pytest.fixture
def abstract_receiver() -> Iterator[Receiver]:
    name = f"gateway-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield Receiver(sock, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest) -> Receiver:
    fixture: Receiver = request.getfixturevalue(f"{request.param}_receiver")
    return fixture


@pytest.fixture
def notifier(receiver: Receiver) -> Iterator[Notifier]:
    with Notifier({"NOTIFY_SOCKET": receiver.notify_socket}) as notifier:
        yield notifier


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (lambda n: n.ready(), b"READY=1"),
        (lambda n: n.ready("serving 3 devices"), b"READY=1\nSTATUS=serving 3 devices"),
        (lambda n: n.stopping(), b"STOPPING=1"),
        (lambda n: n.watchdog(), b"WATCHDOG=1"),
        (lambda n: n.status("broker down\nretrying in 2 s"), b"STATUS=broker down retrying in 2 s"),
        (lambda n: n.status("naïve ✓"), "STATUS=naïve ✓".encode()),
        (lambda n: n.notify("EXTEND_TIMEOUT_USEC=5000000"), b"EXTEND_TIMEOUT_USEC=5000000"),
    ],
    ids=["ready", "ready-status", "stopping", "watchdog", "status-one-line", "utf8", "raw"],
)
def test_each_notification_arrives_as_one_exact_datagram(
    notifier: Notifier,
    receiver: Receiver,
    send: Callable[[Notifier], bool],
    expected: bytes,
) -> None:
    assert notifier.enabled
    assert send(notifier) is True
    assert receiver.receive() == expected
    assert not receiver.pending()


def test_reloading_carries_the_monotonic_clock_in_microseconds(
    notifier: Notifier, receiver: Receiver
) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading() is True
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = receiver.receive().split(b"\n")
    assert first == b"RELOADING=1"
    key, _, value = second.partition(b"=")
    assert key == b"MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_one_socket_is_created_lazily_and_reused(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[socket.socket] = []
    real_socket = socket.socket

    def counting(*args: int) -> socket.socket:
        sock = real_socket(*args)
        created.append(sock)
        return sock

    monkeypatch.setattr(socket, "socket", counting)
    with Notifier({"NOTIFY_SOCKET": receiver.notify_socket}) as notifier:
        assert created == []  # the constructor only reads the environment
        for _ in range(3):
            assert notifier.watchdog()
        assert len(created) == 1
        assert created[0].getblocking() is False
        notifier.close()
        assert created[0].fileno() == -1
        assert notifier.stopping()  # usable again after close(): a fresh socket
        assert len(created) == 2
    assert [receiver.receive() for _ in range(4)] == [b"WATCHDOG=1"] * 3 + [b"STOPPING=1"]


def test_without_notify_socket_nothing_is_sent_and_no_socket_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forbidden(*_args: int) -> socket.socket:
        raise AssertionError("no socket may be created outside systemd")

    monkeypatch.setattr(socket, "socket", forbidden)
    for environ in ({}, {"NOTIFY_SOCKET": ""}, {"NOTIFY_SOCKET": "vsock:2:1234"}):
        notifier = Notifier(environ)
        assert notifier.enabled is False
        assert notifier.ready("up") is False
        assert notifier.reloading() is False
        assert notifier.stopping() is False
        assert notifier.watchdog() is False
        assert notifier.status("x") is False
        notifier.close()


def test_reads_the_process_environment_by_default(
    path_receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", path_receiver.notify_socket)
    with Notifier() as notifier:
        assert notifier.ready()
    assert path_receiver.receive() == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert Notifier().enabled is False


def test_an_unreachable_socket_returns_false_and_never_raises(short_dir: Path) -> None:
    with Notifier({"NOTIFY_SOCKET": str(short_dir / "missing")}) as notifier:
        assert notifier.enabled  # configured, just not deliverable
        assert notifier.ready() is False
        assert notifier.watchdog() is False
    with Notifier({"NOTIFY_SOCKET": f"@gateway-test-nobody-{uuid.uuid4().hex}"}) as notifier:
        assert notifier.stopping() is False


def test_a_service_manager_gone_away_mid_run_is_survived(short_dir: Path) -> None:
    address = str(short_dir / "notify")
    with Notifier({"NOTIFY_SOCKET": address}) as notifier:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(address)
            assert notifier.watchdog() is True
        os.unlink(address)
        assert notifier.watchdog() is False


def test_notify_with_nothing_to_say_sends_nothing(notifier: Notifier, receiver: Receiver) -> None:
    assert notifier.notify() is False
    assert not receiver.pending()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": ""}, 0.25),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "not-a-pid"}, None),
        ({}, None),
        ({"WATCHDOG_PID": str(os.getpid())}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "thirty"}, None),
    ],
    ids=[
        "usec",
        "usec-our-pid",
        "empty-pid",
        "other-pid",
        "bad-pid",
        "unset",
        "pid-only",
        "zero",
        "negative",
        "garbage",
    ],
)
def test_watchdog_interval_is_half_the_timeout_for_this_process_only(
    environ: dict[str, str], expected: float | None
) -> None:
    assert Notifier(environ).watchdog_interval_s() == expected
