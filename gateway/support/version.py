"""The installed release of the gateway (its wheel's version)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def gateway_version() -> str:
    try:
        return version("mqtt-alarm-gateway")
    except PackageNotFoundError:
        return "0+unknown"
