"""``gateway-sim``: publish simulated device telemetry to a broker."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

import aiomqtt

from protocol import Topics
from sim.publisher import publish_many
from sim.telemetry import device_ids, telemetry_stream


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway-sim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    publish = commands.add_parser("publish", help="publish N telemetry messages (QoS 1)")
    publish.add_argument("--host", default="127.0.0.1")
    publish.add_argument("--port", type=int, default=1883)
    publish.add_argument("--prefix", default="iot", help="topic prefix")
    publish.add_argument("--devices", type=int, default=10)
    publish.add_argument("--messages", type=int, default=100)
    publish.add_argument("--seed", type=int, default=1)
    publish.add_argument("--start-seq", type=int, default=0)
    publish.add_argument("--window", type=int, default=256, help="publishes in flight")
    return parser


async def _publish(args: argparse.Namespace) -> int:
    topics = Topics(args.prefix)
    devices = device_ids(args.devices)
    started = time.perf_counter()
    async with aiomqtt.Client(args.host, args.port, max_inflight_messages=args.window) as client:
        count = await publish_many(
            client,
            telemetry_stream(
                topics, devices, args.messages, seed=args.seed, start_seq=args.start_seq
            ),
            window=args.window,
        )
    elapsed = time.perf_counter() - started
    print(
        f"published {count} messages from {len(devices)} devices in {elapsed:.2f}s "
        f"({count / elapsed:.0f} msg/s)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_publish(args))
    except aiomqtt.MqttError as exc:
        print(f"broker error: {exc}", file=sys.stderr)
        return 1
