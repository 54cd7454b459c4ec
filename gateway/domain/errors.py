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


class ConfigErrors(ConfigError):
    """Several configuration errors at once (``errors``, in file order); it reads as the
    first one for code that looks at ``key_path``, and ``str()`` lists them all."""

    def __init__(self, errors: list[ConfigError]) -> None:
        super().__init__(errors[0].key_path, errors[0].message)
        self.errors = errors
        self.args = ("; ".join(str(error) for error in errors),)

    def __str__(self) -> str:
        return str(self.args[0])


def config_errors(errors: list[ConfigError]) -> ConfigError:
    """One error as itself, several as :class:`ConfigErrors`."""
    return errors[0] if len(errors) == 1 else ConfigErrors(errors)


class StartupError(GatewayError):
    """The daemon cannot start (a port in use, a schema too new, ...).

    ``setting`` names what the operator changes to fix it (``[http] port``), when a setting can;
    ``configuration`` marks a failure only a change of configuration fixes (the database refused
    its name, role or password; the broker refused the credentials): the process exits with 2
    then, which the systemd units do not restart, and 1 otherwise. ``detail`` is what a tool
    printed (initdb's output, a server log's tail), logged as a field of the same line.
    """

    def __init__(
        self, message: str, *, setting: str = "", configuration: bool = False, detail: str = ""
    ) -> None:
        super().__init__(message)
        self.setting = setting
        self.configuration = configuration
        self.detail = detail


class ConcurrentWriteError(GatewayError):
    """Another transaction (another node) wrote what this one was deciding about first — the
    same alarm, or the row it was to change: retry the whole batch, which then sees it."""
