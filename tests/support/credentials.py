"""Broker credentials made for a test: a mosquitto password file, a CA and a server certificate.

The certificates are generated with ``openssl`` (EC P-256, valid two days); the server one names
127.0.0.1 and localhost, so a client checking the host name against 127.0.0.1 accepts it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def password_file(path: Path, username: str, password: str) -> Path:
    """A mosquitto ``password_file`` holding one user (hashed by ``mosquitto_passwd``)."""
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(path), username, password],
        check=True,
        capture_output=True,
    )
    return path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA certificate and its key, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def make_server_cert(directory: Path, ca_cert: Path, ca_key: Path) -> tuple[Path, Path]:
    """A server certificate for 127.0.0.1 and localhost signed by the CA, and its key."""
    cert, key, csr = directory / "server.crt", directory / "server.key", directory / "server.csr"
    extensions = directory / "server.ext"
    extensions.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(extensions),
    )  # fmt: skip
    return cert, key
