"""``gateway-sim devices``: its arguments, and the run from them to an exit code."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
from collections.abc import Callable

import structlog

from protocol import Encoding
from sim.devices import BrokerUnavailableError, DeviceFleet, FleetConfig
from sim.gateway_config import add_broker_arguments
from sim.patterns import DEFAULT_MIX, MAX_DEVICES, Pattern, PatternParams, parse_mix
from sim.responder import Behaviour, Script

HELP = "run N simulated devices: telemetry patterns at a target rate, commands answered"
DESCRIPTION = f"""\
Simulated devices publishing QoS 1 telemetry over one connection at a target total rate, each
following a pattern (patterns: {", ".join(p.value for p in Pattern)}), and answering downlink
commands on a second connection. Runs until --duration or --messages is reached, or Ctrl-C;
prints a summary on stdout (and a progress line on stderr when it is a terminal)."""


def _number(
    low: float, high: float = math.inf, *, integer: bool = False, low_open: bool = False
) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            kind = "an integer" if integer else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if too_low or value > high or math.isnan(value):
            bounds = f"> {low:g}" if low_open else f">= {low:g}"
            if high != math.inf:
                bounds += f" and <= {high:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return parse


def _mix(text: str) -> dict[Pattern, float]:
    try:
        return parse_mix(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    broker = parser.add_argument_group("broker")
    add_broker_arguments(broker)
    broker.add_argument(
        "--protocol",
        choices=["5", "3.1.1"],
        default="5",
        help="MQTT version (default %(default)s); the gateway's embedded broker (amqtt) "
        "speaks 3.1.1 only",
    )
    broker.add_argument(
        "--encoding",
        choices=[e.value for e in Encoding],
        default="json",
        help="(default %(default)s)",
    )
    broker.add_argument(
        "--client-id",
        default="gateway-sim-devices",
        metavar="ID",
        help="the publisher's client id (default %(default)s); the command responder's is "
        "ID-commands, with a persistent session",
    )
    broker.add_argument(
        "--window",
        type=_number(1, integer=True),
        default=256,
        help="publishes awaiting their PUBACK at once (default %(default)s)",
    )

    fleet = parser.add_argument_group("devices")
    fleet.add_argument(
        "--devices",
        type=_number(1, MAX_DEVICES, integer=True),
        default=100,
        help=f"1 to {MAX_DEVICES:,}, ids sim-00000, sim-00001, ... (default %(default)s)",
    )
    fleet.add_argument(
        "--rate",
        type=_number(0, low_open=True),
        default=100.0,
        help="messages per second, all devices together (default %(default)s)",
    )
    fleet.add_argument(
        "--duration",
        type=_number(0, low_open=True),
        metavar="S",
        help="stop after S seconds (without it and --messages: at Ctrl-C)",
    )
    fleet.add_argument(
        "--messages", type=_number(1, integer=True), metavar="N", help="stop after N messages"
    )
    fleet.add_argument(
        "--seed", type=int, default=1, help="patterns, telemetry, failures (default %(default)s)"
    )
    fleet.add_argument(
        "--mix", type=_mix, default=DEFAULT_MIX, help="pattern weights (default %(default)s)"
    )
    fleet.add_argument(
        "--crossing-probability",
        type=_number(0, 1),
        default=0.01,
        help="per walk message: the chance temp spikes above 80, then back below 75 "
        "(default %(default)s)",
    )
    fleet.add_argument(
        "--event-probability",
        type=_number(0, 1),
        default=0.05,
        help="per event-device message: the chance of its event, cleared a few messages "
        "later (default %(default)s)",
    )
    fleet.add_argument(
        "--silence-s",
        type=_number(0, low_open=True),
        default=120.0,
        help="how long a silent device stays quiet, after 20 messages (default %(default)s)",
    )

    commands = parser.add_argument_group("commands")
    commands.add_argument(
        "--behaviour",
        choices=[b.value for b in Behaviour],
        default=Behaviour.SUCCESS.value,
        metavar="NAME",
        help="how every device answers downlink commands (default %(default)s): "
        + ", ".join(b.value for b in Behaviour),
    )
    commands.add_argument(
        "--failure-rate",
        type=_number(0, 1),
        default=0.0,
        help="share of success answers turned into failure codes, seeded (default %(default)s)",
    )
    commands.add_argument(
        "--late-s",
        type=_number(0),
        default=1.0,
        help="delay of --behaviour late (default %(default)s)",
    )
    commands.add_argument(
        "--no-commands", action="store_true", help="do not answer commands (no second connection)"
    )


def config_from(args: argparse.Namespace) -> FleetConfig:
    script = None
    if not args.no_commands:
        script = Script(
            default=Behaviour(args.behaviour),
            failure_rate=args.failure_rate,
            late_s=args.late_s,
            seed=args.seed,
        )
    return FleetConfig(
        host=args.host,
        port=args.port,
        prefix=args.prefix,
        devices=int(args.devices),
        rate=args.rate,
        duration_s=args.duration,
        messages=None if args.messages is None else int(args.messages),
        seed=args.seed,
        mix=args.mix,  # parsed by argparse, the default string too
        params=PatternParams(
            crossing_probability=args.crossing_probability,
            event_probability=args.event_probability,
            silence_s=args.silence_s,
        ),
        protocol="5" if args.protocol == "5" else "3.1.1",
        encoding=Encoding(args.encoding),
        client_id=args.client_id,
        script=script,
        window=int(args.window),
    )


async def _run(config: FleetConfig) -> int:
    fleet = DeviceFleet(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        progress = sys.stderr if sys.stderr.isatty() else None
        summary = await fleet.run(stop, progress=progress)
    except BrokerUnavailableError as exc:
        print(f"gateway-sim devices: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    print(summary.render(), flush=True)
    return 0


def run(
    args: argparse.Namespace, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
) -> int:
    # The responder's log lines go to stderr, with the progress line: stdout holds the summary.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_run(config_from(args)))
