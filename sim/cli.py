"""``gateway-sim``: publish simulated device telemetry to a broker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import aiomqtt
import structlog

from protocol import Topics
from sim import devices_cli
from sim.gateway_config import add_broker_arguments, resolve_broker
from sim.publisher import publish_many
from sim.sparkplug import GROUP as SPARKPLUG_GROUP
from sim.sparkplug import sparkplug_stream
from sim.telemetry import EPOCH_MS, device_ids, telemetry_stream
from sim.vendor import FORMATS, span_ms, vendor_stream


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway-sim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    publish = commands.add_parser("publish", help="publish N telemetry messages (QoS 1)")
    add_broker_arguments(publish)
    publish.add_argument("--devices", type=int, default=10)
    publish.add_argument("--messages", type=int, default=100)
    publish.add_argument("--seed", type=int, default=1)
    publish.add_argument("--start-seq", type=int, default=0)
    publish.add_argument("--window", type=int, default=256, help="publishes in flight")
    publish.add_argument(
        "--device-prefix",
        default=PUBLISH_DEVICE_PREFIX,
        help="device ids PREFIX-00000, PREFIX-00001, ... (default %(default)s: never the "
        "demo's demo-... nor gateway-sim devices' sim-...)",
    )
    publish.add_argument(
        "--fixed-time",
        action="store_true",
        help="date the messages from 2026-01-01T00:00:00Z, the same on every run (the same "
        "event ids: a second run is stored as duplicates); default: the current time",
    )
    publish.add_argument(
        "--force",
        action="store_true",
        help="publish even when no gateway says it is online on this broker and prefix",
    )
    publish.add_argument(
        "--format",
        choices=(*FORMATS, "sparkplug"),
        default="native",
        help="the gateway's own schema (native), a vendor's JSON on its own topics, as the "
        "[[ingest.mappings]] profile of that name reads it (docs/devices.md), or Sparkplug B "
        "edge nodes (births, then DDATA by alias; the gateway's [sparkplug] section must take "
        "--sparkplug-group, docs/sparkplug.md)",
    )
    publish.add_argument(
        "--sparkplug-group",
        default=SPARKPLUG_GROUP,
        help="with --format sparkplug: the Sparkplug group id (default %(default)s); devices are "
        "{group}/edge-NNNNN/{device}, ten to an edge node",
    )

    devices_cli.add_arguments(commands.add_parser("devices", help=devices_cli.HELP))

    bench = commands.add_parser("bench", help="measure the gateway against this machine's limits")
    bench.add_argument(
        "--messages", type=int, help="backlog per drain (default 100,000; 10,000 with --quick)"
    )
    bench.add_argument(
        "--quick", action="store_true", help="every phase smaller, under 2 minutes (CI smoke)"
    )
    bench.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    bench.add_argument(
        "--phase",
        choices=("all", "streams"),
        default="all",
        help="streams: only ingest with live stream readers against ingest without (one "
        "gateway, --messages per run, default 20,000), not part of 'all'",
    )
    bench.add_argument(
        "--readers", type=int, default=200, help="GET /stream clients of the streams phase"
    )
    bench.add_argument(
        "--dsn",
        default=os.environ.get("GATEWAY_BENCH_DSN"),
        help="PostgreSQL DSN of a role that may create databases; the bench creates and drops "
        "its own (default: $GATEWAY_BENCH_DSN, else the gateway's embedded PostgreSQL)",
    )

    size = commands.add_parser(
        "size",
        help="fill the state tables for a large fleet, drive a load, report sizes, HOT updates, "
        "lock waits and the inactivity sweep (docs/performance.md)",
    )
    size.add_argument("--devices", type=int, default=1_000_000, help="fleet (default 1,000,000)")
    size.add_argument("--rules", type=int, default=3, help="threshold rules per device (1-3)")
    size.add_argument("--hot", type=int, default=10_000, help="devices the load reports from")
    size.add_argument("--workers", type=int, default=3, help="connections (nodes) of the load")
    size.add_argument("--batch", type=int, default=100, help="samples per batch")
    size.add_argument("--seconds", type=float, default=60.0, help="load per fillfactor (s)")
    size.add_argument(
        "--fillfactor",
        type=int,
        action="append",
        help="fillfactor of device and rule_state, one run each (default: 100 and 80)",
    )
    size.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    size.add_argument(
        "--dsn",
        default=os.environ.get("GATEWAY_BENCH_DSN"),
        help="PostgreSQL DSN of a role that may create databases; one database per run is "
        "created and dropped (default: $GATEWAY_BENCH_DSN, else the embedded PostgreSQL)",
    )

    field = commands.add_parser(
        "field",
        help="real daemons in field conditions, checked against a reference model "
        "(docs/field-simulation.md)",
    )
    field.add_argument("--seed", type=int, default=1, help="the first seed (default 1)")
    field.add_argument("--seeds", type=int, default=1, help="how many seeds, one after another")
    field.add_argument("--nodes", type=int, default=3, help="gateway processes (default 3)")
    field.add_argument(
        "--minutes", type=float, default=1.0, help="device traffic per seed (default 1)"
    )
    field.add_argument("--devices", type=int, default=24, help="devices per seed (default 24)")
    field.add_argument(
        "--dsn",
        default=os.environ.get("GATEWAY_BENCH_DSN"),
        help="PostgreSQL DSN of a role that may create databases; one is created and dropped "
        "per seed (default: $GATEWAY_BENCH_DSN, else the gateway's embedded PostgreSQL)",
    )
    field.add_argument("--json", type=Path, help="also write every seed's result (JSON lines)")
    field.add_argument(
        "--keep", type=Path, help="keep each seed's configs and logs under this directory"
    )
    field.add_argument(
        "--plan", action="store_true", help="only print each seed's plan (devices, faults)"
    )
    return parser


PUBLISH_DEVICE_PREFIX: Final = "pub"
# How long `publish` listens for a gateway's retained status before it refuses.
GATEWAY_WAIT_S: Final = 3.0


class NoGatewayError(Exception):
    """No gateway says it is online on the broker and prefix ``publish`` was pointed at."""


async def online_gateways(client: aiomqtt.Client, prefix: str, wait_s: float) -> list[str]:
    """The node ids whose retained status (``{prefix}/gateways/{node}/status``) is ``online``:
    every gateway publishes it retained when it connects, and its Will says ``offline``.
    Returns at the first one, or empty after ``wait_s``."""
    status_filter = f"{prefix}/gateways/+/status"
    online: list[str] = []
    await client.subscribe(status_filter, qos=1)
    try:
        async with asyncio.timeout(wait_s):
            async for message in client.messages:
                if not message.topic.matches(status_filter):
                    # The embedded broker (amqtt 0.12) sometimes hands a new connection
                    # retained messages of another client's subscription (devices' status).
                    continue
                payload = message.payload
                text = payload.decode(errors="replace") if isinstance(payload, bytes) else ""
                if text.strip().strip('"') == "online":
                    online.append(str(message.topic).split("/")[-2])
                    break
    except TimeoutError:
        pass
    await client.unsubscribe(status_filter)
    return online


async def _publish(args: argparse.Namespace) -> int:
    topics = Topics(args.prefix)
    devices = device_ids(args.devices, args.device_prefix)
    where = f"{args.host}:{args.port}, prefix {args.prefix}"
    async with aiomqtt.Client(args.host, args.port, max_inflight_messages=args.window) as client:
        gateways = [] if args.force else await online_gateways(client, args.prefix, GATEWAY_WAIT_S)
        if not args.force and not gateways:
            raise NoGatewayError(
                f"no gateway is online at {where} (no retained 'online' on "
                f"{args.prefix}/gateways/+/status within {GATEWAY_WAIT_S:g} s): start one "
                "(gateway run, gateway demo), point at its broker with --config (the demo "
                "prints its file) or --host/--port/--prefix, or publish anyway with --force"
            )
        now_ms = time.time_ns() // 1_000_000
        # The last message dated now: each stream spans its own time (a millisecond a
        # message; Tasmota's clock has whole seconds, a second a round of the devices).
        span = span_ms(args.format, len(devices), args.messages)
        epoch_ms = EPOCH_MS if args.fixed_time else now_ms - span
        kind = "" if args.format == "native" else f" ({args.format})"
        started = time.perf_counter()
        count = await publish_many(
            client,
            telemetry_stream(
                topics,
                devices,
                args.messages,
                seed=args.seed,
                start_seq=args.start_seq,
                epoch_ms=epoch_ms,
            )
            if args.format == "native"
            else sparkplug_stream(
                devices,
                args.messages,
                group=args.sparkplug_group,
                seed=args.seed,
                start_seq=args.start_seq,
                epoch_ms=epoch_ms,
                # A new session's number on every run that is not replayed (--fixed-time).
                bdseq=0 if args.fixed_time else now_ms // 1000 % 256,
            )
            if args.format == "sparkplug"
            else vendor_stream(
                args.format,
                devices,
                args.messages,
                seed=args.seed,
                start_seq=args.start_seq,
                epoch_ms=epoch_ms,
            ),
            window=args.window,
        )
    elapsed = time.perf_counter() - started
    listener = f"gateway {gateways[0]} online" if gateways else "no gateway checked (--force)"
    print(
        f"published {count} messages{kind} from {len(devices)} devices ({devices[0]} ...) to "
        f"{where} ({listener}) in {elapsed:.2f}s ({count / max(elapsed, 1e-9):.0f} msg/s)"
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from sim.bench import Sizes, render_streams_table, render_table, run_bench, run_streams_bench

    # The table goes to stdout; the responder's log lines, warnings only, to stderr.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    if args.phase == "streams":
        messages = args.messages or (5_000 if args.quick else 20_000)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            result = runner.run(run_streams_bench(messages, args.readers, dsn=args.dsn))
        print(render_streams_table(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.messages is not None:
        sizes = dataclasses.replace(
            sizes, messages=args.messages, naive_messages=min(args.messages, sizes.naive_messages)
        )
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        result = runner.run(run_bench(sizes, dsn=args.dsn))
    print(render_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _size(args: argparse.Namespace) -> int:
    from sim.bench import embedded_database
    from sim.sizing import SizingPlan, render_run, run_sizing

    try:
        plan = SizingPlan(
            devices=args.devices,
            rules=args.rules,
            hot=args.hot,
            workers=args.workers,
            batch=args.batch,
            seconds=args.seconds,
            fillfactors=tuple(args.fillfactor or (100, 80)),
        )
    except ValueError as exc:
        print(f"gateway-sim size: {exc}", file=sys.stderr)
        return 2

    async def run() -> dict[str, Any]:
        if args.dsn is not None:
            return await run_sizing(args.dsn, plan)
        with tempfile.TemporaryDirectory(prefix="gw-size-db-") as tmp:
            async with embedded_database(Path(tmp)) as dsn:
                return await run_sizing(dsn, plan)

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        result = runner.run(run())
    print("\n".join(render_run(plan, one) for one in result["runs"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _field(args: argparse.Namespace) -> int:
    from sim.field import plan_summary, render, run_field

    seeds = range(args.seed, args.seed + args.seeds)
    if args.plan:
        for seed in seeds:
            print(plan_summary(seed, minutes=args.minutes, nodes=args.nodes, devices=args.devices))
        return 0

    async def run() -> int:
        failed = 0
        async with contextlib.AsyncExitStack() as stack:
            dsn = args.dsn
            if dsn is None:
                from sim.bench import embedded_database

                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                dsn = await stack.enter_async_context(embedded_database(workdir))
            for seed in seeds:
                result = await run_field(
                    seed,
                    minutes=args.minutes,
                    nodes=args.nodes,
                    devices=args.devices,
                    server_dsn=dsn,
                    keep=args.keep,
                )
                print(render(result), flush=True)
                failed += not result.ok
                if args.json:
                    with args.json.open("a") as out:
                        out.write(json.dumps(result.as_json()) + "\n")
        print(f"{len(seeds)} seeds, {failed} with discrepancies")
        return 1 if failed else 0

    return asyncio.run(run())


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0911 - an exit per failure
    args = _parser().parse_args(argv)
    if args.command in ("publish", "devices"):
        try:
            resolve_broker(args)
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    if args.command == "devices":
        return devices_cli.run(args, _loop_factory())
    if args.command == "bench":
        return _bench(args)
    if args.command == "field":
        return _field(args)
    if args.command == "size":
        return _size(args)
    try:
        return asyncio.run(_publish(args))
    except NoGatewayError as exc:
        print(f"gateway-sim publish: {exc}", file=sys.stderr)
        return 1
    except aiomqtt.MqttError as exc:
        print(
            f"gateway-sim publish: broker error at {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
