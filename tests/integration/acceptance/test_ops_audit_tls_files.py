"""The files of ``[mqtt.tls]`` (the CA bundle, the client certificate and its key) are read
once, at start: one that cannot be read or does not hold what its key says is one
``startup_failed`` line naming the key, exit 2 (the units do not restart it), before the
database is touched; and a node running over TLS keeps connecting after its files changed
on disk (a key credential gone, a certificate renewed half-written), as it started.

They used to be read at every connect, first after the migration: a wrong ``ca_file`` path
passed ``check-config`` and ended ``gateway run`` with a traceback and exit 1, which
``Restart=on-failure`` restarted every 2 s, forever; and a node whose CA file was gone at a
broker restart died at the reconnect.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.credentials import make_ca, make_server_cert
from tests.support.daemon import DaemonProcess, config_toml, http_healthy
from tests.support.gateway_cli import Finished, gateway_run
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until

EXIT_CONFIG = 2


def _tls_config(tmp_path: Path, dsn: str, port: int, tls: str, *, http_port: int = 0) -> Path:
    path = tmp_path / "gateway.toml"
    text = config_toml(dsn=dsn, mqtt_port=port, http_port=http_port)
    path.write_text(text.replace("[database]", f"[mqtt.tls]\nenabled = true\n{tls}\n[database]"))
    return path


@pytest.mark.parametrize(
    ("tls", "setting", "said"),
    [
        ('ca_file = "{pki}/missing-ca.pem"', "[mqtt.tls] ca_file", "missing-ca.pem"),
        ('ca_file = "{pki}/not-a-cert.pem"', "[mqtt.tls] ca_file", "not-a-cert.pem"),
        (
            'cert_file = "{pki}/missing.crt"\nkey_file = "{pki}/server.key"',
            "[mqtt.tls] cert_file",
            "missing.crt",
        ),
        (
            'cert_file = "{pki}/server.crt"\nkey_file = "{pki}/other-ca.key"',
            "[mqtt.tls] cert_file, [mqtt.tls] key_file",
            "other-ca.key",
        ),
    ],
    ids=["ca-missing", "ca-not-pem", "cert-missing", "key-not-the-certs"],
)
async def test_a_tls_file_that_cannot_be_used_is_one_line_and_exit_2(
    db_dsn: str, tmp_path: Path, tls: str, setting: str, said: str
) -> None:
    pki = tmp_path / "pki"
    ca_cert, ca_key = make_ca(pki, "gateway-test-ca")
    make_ca(pki, "other-ca")
    make_server_cert(pki, ca_cert, ca_key)
    (pki / "not-a-cert.pem").write_text("this is no certificate\n")
    # A broker that is not there: the files are refused before any connection is tried.
    config = _tls_config(tmp_path, db_dsn, free_port(), tls.format(pki=pki))
    done = await gateway_run(config)
    assert done.returncode == EXIT_CONFIG, done.output
    done.assert_no_traceback()
    line = done.the("startup_failed")
    assert line["setting"] == setting, line
    assert said in line["error"], line
    # Before the database: no migration, no wait for a broker.
    events = [r["event"] for r in done.records()]
    assert "broker_unavailable" not in events, done.output
    key_text = (pki / "other-ca.key").read_text()
    secret_line = next(x for x in key_text.splitlines() if x and not x.startswith("-----"))
    assert secret_line not in done.output


async def test_a_running_node_reconnects_over_tls_after_its_ca_file_is_gone(
    db_dsn: str, tmp_path: Path
) -> None:
    pki = tmp_path / "pki"
    ca_cert, ca_key = make_ca(pki, "gateway-test-ca")
    server_cert, server_key = make_server_cert(pki, ca_cert, ca_key)
    tls_port = free_port()
    broker = Mosquitto(
        tmp_path / "broker",
        extra_config=(
            f"listener {tls_port} 127.0.0.1\ncafile {ca_cert}\ncertfile {server_cert}\n"
            f"keyfile {server_key}\n"
        ),
    )
    # The CA file the node is given: a copy, removed while it runs.
    given = pki / "given-ca.pem"
    given.write_bytes(ca_cert.read_bytes())
    http_port = free_port()
    config = _tls_config(tmp_path, db_dsn, tls_port, f'ca_file = "{given}"', http_port=http_port)
    process = DaemonProcess(config, tmp_path / "gateway.log")
    broker.start()
    try:
        process.start()
        await wait_until(lambda: http_healthy(http_port), timeout=60, message="healthy over TLS")
        given.unlink()
        await asyncio.to_thread(broker.restart)

        async def healthy_again() -> bool:
            assert process.alive(), process.log_tail()
            return await http_healthy(http_port)

        await wait_until(healthy_again, timeout=60, message="reconnected over TLS")
        assert await asyncio.to_thread(process.terminate) == 0
    finally:
        process.cleanup()
        broker.stop()
    Finished(0, process.log_text()).assert_no_traceback()
