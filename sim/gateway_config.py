"""The broker a gateway config file names, so the simulator talks to the same one.

``gateway-sim publish --config my.toml`` reads ``[mqtt] host``, ``port`` and ``topic_prefix``
from the gateway's own file, with the gateway's defaults: the same file (or none) starts the
gateway and points the simulator at it, and no port is written twice. An empty host is the
embedded broker, which listens on 127.0.0.1. sim/ sits below gateway/ in the layers, so the
file is read here with tomllib rather than through gateway.config (a test checks that the
defaults agree).
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

DEFAULT_HOST: Final = "127.0.0.1"  # where the embedded broker listens
DEFAULT_PORT: Final = 1883
DEFAULT_PREFIX: Final = "iot"


@dataclass(frozen=True, slots=True)
class Broker:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    prefix: str = DEFAULT_PREFIX


def broker_of(path: Path | None) -> Broker:
    """The broker and topic prefix of a gateway config file (``None``: the defaults)."""
    if path is None:
        return Broker()
    try:
        with path.open("rb") as file:
            mqtt = tomllib.load(file).get("mqtt", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read the gateway config {path}: {exc}") from exc
    port = mqtt.get("port", DEFAULT_PORT)
    if not isinstance(port, int):
        # A ValueError like the others: the caller reports every bad file the same way.
        raise ValueError(f"{path}: [mqtt] port is not a number")  # noqa: TRY004 - see above
    return Broker(
        host=str(mqtt.get("host") or DEFAULT_HOST),
        port=port,
        prefix=str(mqtt.get("topic_prefix", DEFAULT_PREFIX)),
    )


def add_broker_arguments(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    group.add_argument(
        "--config",
        type=Path,
        help="the gateway's config file: broker host, port and topic prefix are taken from "
        "its [mqtt] section (default: the gateway's defaults, 127.0.0.1:1883, prefix iot)",
    )
    group.add_argument("--host", help="broker host (overrides --config)")
    group.add_argument("--port", type=int, help="broker port (overrides --config)")
    group.add_argument("--prefix", help="topic prefix (overrides --config)")


def resolve_broker(args: argparse.Namespace) -> None:
    """Fill ``args.host/port/prefix`` from ``--config`` where not given on the command line."""
    broker = broker_of(args.config)
    if args.host is None:
        args.host = broker.host
    if args.port is None:
        args.port = broker.port
    if args.prefix is None:
        args.prefix = broker.prefix
