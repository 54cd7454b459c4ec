"""Embedded MQTT broker for the zero-setup default: amqtt on loopback, anonymous, in memory.

Good enough for one machine and a newcomer's first run; production points ``[mqtt] host`` at a
real broker. amqtt 0.12.1 speaks MQTT 3.1.1 only, keeps sessions in memory only, and (with
anonymous access) treats every session as clean: nothing is queued for a disconnected client.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self

from gateway.domain.errors import StartupError

if TYPE_CHECKING:
    from amqtt.broker import Broker

__all__ = ["EmbeddedBroker", "EmbeddedBrokerError"]

# amqtt logs every connection and subscription at INFO; "transitions" logs its state machines.
_NOISY_LOGGERS: Final = ("amqtt", "transitions")


class EmbeddedBrokerError(StartupError, RuntimeError):
    """The embedded broker could not start (typically: its port is taken)."""


class EmbeddedBroker:
    """An amqtt broker listening on ``host:port``, for the lifetime of ``async with``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1883) -> None:
        if not _is_loopback_v4(host):
            raise EmbeddedBrokerError(
                f"the embedded broker allows anonymous access, so it binds IPv4 loopback only, "
                f"not {host!r}: use 127.0.0.1 or localhost, or run a real broker"
            )
        self.host = host
        self.port = port
        self._broker: Broker | None = None

    async def start(self) -> None:
        if self._broker is not None:
            return
        for name in _NOISY_LOGGERS:
            logger = logging.getLogger(name)
            if logger.level == logging.NOTSET:  # leave a level someone chose alone
                logger.setLevel(logging.WARNING)
        # Checked before amqtt tries: it logs a traceback at ERROR before raising.
        self._raise_if_port_taken()

        from amqtt.broker import Broker
        from amqtt.errors import BrokerError

        broker = Broker(_broker_config(self.host, self.port))
        try:
            await broker.start()
        except BrokerError as error:
            if isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.EADDRINUSE:
                raise self._port_taken() from error  # lost a race for the port
            raise EmbeddedBrokerError(
                f"embedded MQTT broker on {self.host}:{self.port} failed to start: {error}"
            ) from error
        self._broker = broker

    async def stop(self) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            await broker.shutdown()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _raise_if_port_taken(self) -> None:
        for family, kind, proto, _, address in socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            with socket.socket(family, kind, proto) as probe:
                # Same option asyncio.start_server sets, so the probe fails exactly when it would.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(address)
                except OSError as error:
                    if error.errno == errno.EADDRINUSE:
                        raise self._port_taken() from error
                    raise EmbeddedBrokerError(
                        f"cannot bind the embedded MQTT broker to {self.host}:{self.port}: {error}"
                    ) from error

    def _port_taken(self) -> EmbeddedBrokerError:
        return EmbeddedBrokerError(
            f"port {self.port} on {self.host} is already in use: set [mqtt] host to use that "
            "broker, or [mqtt] port to move the embedded one"
        )


def _broker_config(host: str, port: int) -> dict[str, Any]:
    return {
        # amqtt 0.12.1 cannot bind IPv6 literals: it passes "[::1]" on, brackets and all.
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        # An explicit plugin map replaces amqtt's defaults: no $SYS publisher (and its psutil
        # deprecation warning), no event/packet logger plugins, no persistence plugin (so no
        # database file in the working directory).
        "plugins": {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
        },
    }


def _is_loopback_v4(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == 4 and address.is_loopback
