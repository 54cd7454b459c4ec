"""The gateway's exception hierarchy: one root, data carried as attributes."""

from __future__ import annotations


class GatewayError(Exception):
    """Root of every error the gateway raises on purpose."""


class ConfigError(GatewayError):
    """The configuration is invalid; ``key_path`` names the offending key (``mqtt.port``)."""

    def __init__(self, key_path: str, message: str) -> None:
        super().__init__(f"{key_path}: {message}")
        self.key_path = key_path
        self.message = message


class StartupError(GatewayError):
    """The daemon cannot start (a port in use, a schema too new, ...)."""
