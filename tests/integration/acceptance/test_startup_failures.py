"""Every expected startup failure: one JSON line naming the setting to change, no traceback,
exit 2 when only a change of configuration can fix it (the units do not restart those), 1 for
the others; an unreachable database or broker is waited for, /health saying why meanwhile.

Each case runs ``gateway run`` as a process, as an operator would, with ``[log] format = "json"``
and reads its whole output: every line must parse.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import aiohttp
import asyncpg
import pytest

from gateway.embedded.postgres import EmbeddedPostgres
from tests.support.credentials import password_file
from tests.support.daemon import DaemonProcess, config_toml
from tests.support.dsn import proxy_for, through, with_database
from tests.support.gateway_cli import Finished, gateway_run
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

EXIT_FAILURE: Final = 1
EXIT_CONFIG: Final = 2
DSN_SETTING: Final = "[database] dsn (or GATEWAY_DATABASE_DSN)"
DB_PASSWORD: Final = "right-Passw0rd-4711"
WRONG_PASSWORD: Final = "wrong-Passw0rd-0815"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def _failed(done: Finished, code: int, setting: str) -> dict[str, Any]:
    """The run ended with ``code`` and one ``startup_failed`` line naming ``setting``."""
    assert done.returncode == code, done.output
    done.assert_no_traceback()
    line = done.the("startup_failed")
    assert line["level"] == "error"
    assert line["setting"] == setting
    return line


async def test_an_invalid_file_is_one_line_naming_the_key_and_exit_2(tmp_path: Path) -> None:
    config = _write(tmp_path, '[http]\nport = "eighty"\n[log]\nformat = "json"\n')
    done = await gateway_run(config)
    assert done.returncode == EXIT_CONFIG
    done.assert_no_traceback()
    line = done.the("config_invalid")
    assert line["setting"] == "http.port"
    assert "Expected `int`" in line["error"]
    assert len(done.records()) == 1


async def test_an_unknown_database_is_a_configuration_error(
    pg_server_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    dsn = with_database(pg_server_dsn, "no_such_database_here")
    config = _write(tmp_path, config_toml(dsn=dsn, mqtt_port=mosquitto.port))
    line = _failed(await gateway_run(config), EXIT_CONFIG, DSN_SETTING)
    assert "has no such database" in line["error"]
    assert '"no_such_database_here" does not exist' in line["error"]


async def test_an_unknown_role_is_a_configuration_error(
    pg_server_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    dsn = pg_server_dsn.replace("postgres@", "no_such_role@", 1)
    assert "no_such_role@" in dsn
    config = _write(tmp_path, config_toml(dsn=dsn, mqtt_port=mosquitto.port))
    line = _failed(await gateway_run(config), EXIT_CONFIG, DSN_SETTING)
    assert "refused role 'no_such_role'" in line["error"]


@pytest.mark.parametrize("command", [("migrate",), ("dead-letters", "list")])
async def test_the_commands_beside_the_daemon_fail_the_same_way(
    pg_server_dsn: str, tmp_path: Path, command: tuple[str, ...]
) -> None:
    unknown = with_database(pg_server_dsn, "no_such_database_here")
    config = _write(tmp_path, f'[database]\ndsn = "{unknown}"\n[log]\nformat = "json"\n')
    line = _failed(await gateway_run(config, command=command), EXIT_CONFIG, DSN_SETTING)
    assert "has no such database" in line["error"]
    closed = f"postgresql://postgres@127.0.0.1:{free_port()}/gateway"
    config = _write(tmp_path, f'[database]\ndsn = "{closed}"\n[log]\nformat = "json"\n')
    line = _failed(await gateway_run(config, command=command), EXIT_FAILURE, DSN_SETTING)
    assert line["error"].startswith(f"cannot reach the database at {closed.split('@')[1]}")


def _loopback_address() -> str:
    """A 127/8 address nothing else here listens on (the shared server has 127.0.0.1)."""
    for _ in range(50):
        a, b, c = (secrets.randbelow(200) + 20 for _ in range(3))
        host = f"127.{a}.{b}.{c}"
        with socket.socket() as probe:
            try:
                probe.bind((host, 5432))
            except OSError:
                continue
            return host
    raise AssertionError("no free loopback address for a private PostgreSQL")


@pytest.fixture(scope="module")
def password_server() -> Iterator[str]:
    """A private PostgreSQL that checks passwords (scram) over TCP: the shared test server
    trusts every connection. The DSN's role is ``gw_pw`` with :data:`DB_PASSWORD`."""
    state = Path(tempfile.mkdtemp(prefix="gw-pw-pg-"))
    server = EmbeddedPostgres(state)
    host = _loopback_address()
    try:
        socket_dsn = server.start()

        async def configure() -> None:
            conn = await asyncpg.connect(socket_dsn)
            try:
                await conn.execute(f"ALTER SYSTEM SET listen_addresses = '{host}'")
                await conn.execute(f"CREATE ROLE gw_pw LOGIN PASSWORD '{DB_PASSWORD}'")
                await conn.execute("GRANT ALL ON DATABASE gateway TO gw_pw")
            finally:
                await conn.close()

        asyncio.run(configure())
        hba = server.data_dir / "pg_hba.conf"
        hba.write_text("local all all trust\nhost all all 127.0.0.0/8 scram-sha-256\n")
        server.stop()
        server.start()
        yield f"postgresql://gw_pw:{{password}}@{host}:5432/gateway"
    finally:
        server.stop()
        shutil.rmtree(state, ignore_errors=True)


async def test_a_refused_password_is_a_configuration_error_and_never_logged(
    password_server: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    # The right password gets past authentication (the check below means something) ...
    conn = await asyncpg.connect(password_server.format(password=DB_PASSWORD))
    await conn.close()
    dsn = password_server.format(password=WRONG_PASSWORD)
    config = _write(tmp_path, config_toml(dsn=dsn, mqtt_port=mosquitto.port))
    line = _failed(await gateway_run(config), EXIT_CONFIG, DSN_SETTING)
    assert "refused the password of role 'gw_pw'" in line["error"]
    assert WRONG_PASSWORD not in (await gateway_run(config)).output
    # ... and the same password from the environment is refused the same way.
    env_config = _write(tmp_path, config_toml(dsn="", mqtt_port=mosquitto.port))
    from_env = await gateway_run(env_config, env={"GATEWAY_DATABASE_DSN": dsn})
    _failed(from_env, EXIT_CONFIG, DSN_SETTING)
    assert WRONG_PASSWORD not in from_env.output


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_broker_refusing_the_credentials_is_a_configuration_error(
    db_dsn: str, tmp_path: Path, protocol: str
) -> None:
    passwords = password_file(tmp_path / "passwd", "gw", "broker-Passw0rd-1")
    broker = Mosquitto(
        tmp_path / "mosquitto",
        extra_config=f"allow_anonymous false\npassword_file {passwords}\n",
    )
    broker.start()
    try:
        config = _write(
            tmp_path,
            config_toml(
                dsn=db_dsn,
                mqtt_port=broker.port,
                protocol=protocol,
                mqtt_extra='username = "gw"\npassword = "not-the-Passw0rd"',
            ),
        )
        done = await gateway_run(config)
    finally:
        broker.stop()
    line = _failed(done, EXIT_CONFIG, "[mqtt] username, [mqtt] password (or GATEWAY_MQTT_PASSWORD)")
    assert f"the broker at 127.0.0.1:{broker.port} refused the connection" in line["error"]
    assert "not-the-Passw0rd" not in done.output


# mosquitto's ACL file grants every SUBSCRIBE (it checks reads at delivery, on the topic without
# its $share prefix); its dynamic-security plugin checks the subscription itself, $share
# included, and refuses it with NOT_AUTHORIZED (0x87; 0x80 to MQTT 3.1.1).
_DYNSEC_PLUGINS: Final = (
    "/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so",
    "/usr/lib/mosquitto_dynamic_security.so",
)


def _no_shared_subscriptions(workdir: Path) -> Mosquitto:
    """A mosquitto that accepts anonymous clients and every subscription but a $share one."""
    plugin = next((p for p in _DYNSEC_PLUGINS if Path(p).exists()), None)
    assert plugin is not None, f"mosquitto's dynamic-security plugin is not in {_DYNSEC_PLUGINS}"
    workdir.mkdir(parents=True, exist_ok=True)
    dynsec = workdir / "dynamic-security.json"
    dynsec.write_text(
        json.dumps(
            {
                "defaultACLAccess": {
                    "publishClientSend": True,
                    "publishClientReceive": True,
                    "subscribe": True,
                    "unsubscribe": True,
                },
                "clients": [],
                "groups": [
                    {"groupname": "anonymous", "roles": [{"rolename": "no-share"}], "clients": []}
                ],
                "roles": [
                    {
                        "rolename": "no-share",
                        "acls": [
                            {
                                "acltype": "subscribePattern",
                                "topic": "$share/#",
                                "priority": 0,
                                "allow": False,
                            }
                        ],
                    }
                ],
                "anonymousGroup": "anonymous",
            }
        )
    )
    return Mosquitto(workdir, extra_config=f"plugin {plugin}\nplugin_opt_config_file {dynsec}\n")


@pytest.mark.parametrize(("protocol", "code"), [("5", 0x87), ("3.1.1", 0x80)])
async def test_a_shared_subscription_the_broker_refuses_is_a_configuration_error(
    db_dsn: str, tmp_path: Path, protocol: str, code: int
) -> None:
    broker = _no_shared_subscriptions(tmp_path / "mosquitto")
    broker.start()
    try:
        config = _write(
            tmp_path,
            config_toml(
                dsn=db_dsn,
                mqtt_port=broker.port,
                protocol=protocol,
                mqtt_extra='shared_group = "gateways"',
            ),
        )
        done = await gateway_run(config)
    finally:
        broker.stop()
    setting = "[mqtt] shared_group (empty: no shared subscription), or the broker's ACL"
    line = _failed(done, EXIT_CONFIG, setting)
    assert line["error"].startswith(
        f"the broker at 127.0.0.1:{broker.port} refused the subscription "
        "'$share/gateways/iot/devices/+/telemetry': "
    ), line["error"]
    assert line["error"].endswith(f"(reason code {code})"), line["error"]
    # Not taken for an unreachable broker and retried forever.
    assert "broker_unavailable" not in done.output


async def test_an_http_port_taken_is_one_line_and_exit_1(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _write(tmp_path, config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=port))
        done = await gateway_run(config)
    line = _failed(done, EXIT_FAILURE, "[http] port (0: any free port), or [http] enabled = false")
    assert line["error"].startswith(f"port {port} on 127.0.0.1 is already in use")


async def test_a_state_directory_that_is_not_writable_is_one_line_and_exit_1(
    tmp_path: Path,
) -> None:
    # Root may write anywhere permissions say no: a path through a regular file fails for
    # anyone, as a read-only mount would.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    state = blocker / "state"
    config = _write(
        tmp_path,
        f'[node]\nstate_dir = "{state}"\n[mqtt]\nport = {free_port()}\n'
        f'[http]\nport = 0\n[log]\nformat = "json"\n',
    )
    line = _failed(
        await gateway_run(config),
        EXIT_FAILURE,
        "[node] state_dir (or give this user write access to it)",
    )
    assert line["error"] == f"the state directory {state} is not writable: Not a directory"


@pytest.fixture
def daemon_process(tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(tmp_path / "gateway.toml", tmp_path / "gateway.log")
    try:
        yield process
    finally:
        process.cleanup()


async def _health(port: int) -> tuple[int, dict[str, Any]] | None:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            return response.status, await response.json()
    except aiohttp.ClientError:
        return None


async def test_an_unreachable_database_is_waited_for_with_503_naming_it(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path, daemon_process: DaemonProcess
) -> None:
    proxy = proxy_for(db_dsn)
    await proxy.start()
    await proxy.cut()
    http_port = free_port()
    config = _write(
        tmp_path,
        config_toml(dsn=through(db_dsn, proxy), mqtt_port=mosquitto.port, http_port=http_port),
    )
    process = daemon_process
    assert process.config_path == config
    process.start()
    try:
        seen: dict[str, Any] = {}

        async def unhealthy_with_reason() -> bool:
            answer = await _health(http_port)
            if answer is None or "waiting for the database" not in answer[1].get("reason", ""):
                return False
            seen.update(answer[1], http_status=answer[0])
            return True

        await wait_until(unhealthy_with_reason, timeout=30, message="503 naming the database")
        assert seen["http_status"] == 503
        assert f"127.0.0.1:{proxy.port}/" in seen["reason"]
        await proxy.resume()

        async def healthy() -> bool:
            answer = await _health(http_port)
            return answer is not None and answer[0] == 200

        await wait_until(healthy, timeout=30, message="healthy once the database is back")
        assert await asyncio.to_thread(process.terminate) == 0
    finally:
        await proxy.stop()
    done = Finished(0, process.log_text())
    done.assert_no_traceback()
    waits = [r for r in done.records() if r["event"] == "database_unavailable"]
    assert waits
    assert all(r["database"].startswith(f"127.0.0.1:{proxy.port}/") for r in waits)
    assert all(r["setting"] == DSN_SETTING for r in waits)


async def test_an_unreachable_broker_is_waited_for_with_503_naming_it(
    db_dsn: str, tmp_path: Path, daemon_process: DaemonProcess
) -> None:
    http_port, broker_port = free_port(), free_port()
    config = _write(tmp_path, config_toml(dsn=db_dsn, mqtt_port=broker_port, http_port=http_port))
    process = daemon_process
    assert process.config_path == config
    process.start()
    seen: dict[str, Any] = {}

    async def waiting_for_the_broker() -> bool:
        answer = await _health(http_port)
        if answer is None or "connecting to the broker" not in answer[1].get("reason", ""):
            return False
        seen.update(answer[1], http_status=answer[0])
        return "broker_unavailable" in process.log_text()

    await wait_until(waiting_for_the_broker, timeout=30, message="503 naming the broker")
    assert seen["http_status"] == 503
    assert seen["reason"] == f"connecting to the broker at 127.0.0.1:{broker_port}"
    broker = Mosquitto(tmp_path / "mosquitto", port=broker_port)
    broker.start()
    try:

        async def healthy() -> bool:
            answer = await _health(http_port)
            return answer is not None and answer[0] == 200

        await wait_until(healthy, timeout=30, message="healthy once the broker is up")
        assert await asyncio.to_thread(process.terminate) == 0
    finally:
        broker.stop()
    done = Finished(0, process.log_text())
    done.assert_no_traceback()
    waits = [r for r in done.records() if r["event"] == "broker_unavailable"]
    assert waits
    assert all(r["port"] == broker_port and r["host"] == "127.0.0.1" for r in waits)
    assert all(r["setting"] == "[mqtt] host, [mqtt] port" for r in waits)


def _zero_setup(tmp_path: Path, state: Path, mqtt_port: int) -> Path:
    return _write(
        tmp_path,
        f'[node]\nstate_dir = "{state}"\n[mqtt]\nport = {mqtt_port}\n'
        '[http]\nport = 0\n[log]\nformat = "json"\n',
    )


@pytest.mark.embedded
async def test_the_embedded_brokers_port_taken_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = await gateway_run(_zero_setup(tmp_path, tmp_path / "state", port))
    line = _failed(done, EXIT_FAILURE, "[mqtt] port, or [mqtt] host")
    assert line["error"].startswith(f"port {port} on 127.0.0.1 is already in use")
    # Found before the embedded PostgreSQL was even started.
    assert not (tmp_path / "state" / "pgdata").exists()


@pytest.mark.embedded
async def test_an_embedded_postgresql_that_cannot_start_is_one_line_and_exit_1(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    (state / "pgdata").mkdir(parents=True)
    (state / "pgdata" / "somebody-elses-file").write_text("keep me")
    done = await gateway_run(_zero_setup(tmp_path, state, free_port()))
    line = _failed(
        done, EXIT_FAILURE, "[node] state_dir, or [database] dsn for a PostgreSQL of your own"
    )
    assert "holds no PostgreSQL cluster" in line["error"]
    assert (state / "pgdata" / "somebody-elses-file").read_text() == "keep me"


@pytest.mark.embedded
async def test_an_embedded_postgresql_owned_by_another_process_is_one_line_and_exit_1(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with (state / "pg.lock").open("ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = await gateway_run(_zero_setup(tmp_path, state, free_port()))
    line = _failed(
        done, EXIT_FAILURE, "[node] state_dir, or [database] dsn for a PostgreSQL of your own"
    )
    assert "pg.lock is locked" in line["error"]
