"""The benchmark as a user runs it: ``gateway-sim bench --quick`` completes and reports every
figure (no timing assertions: speed lives in the README, not in tests), its lean publisher
delivers every message, and its embedded database starts and stops."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiomqtt
import asyncpg
import pytest

from protocol import TopicKind, Topics
from sim.bench import TARGETS, embedded_database
from sim.cpu import PARTIES
from sim.telemetry import device_ids, telemetry_stream
from sim.wire import WireError, WirePublisher
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port

TOPICS = Topics("wire")


async def test_the_wire_publisher_delivers_every_message_once_acknowledged(
    mosquitto: Mosquitto,
) -> None:
    messages = list(telemetry_stream(TOPICS, device_ids(50), 5_000, seed=3))
    received: list[tuple[str, bytes]] = []
    async with aiomqtt.Client("127.0.0.1", mosquitto.port) as subscriber:
        await subscriber.subscribe(TOPICS.subscription(TopicKind.TELEMETRY), qos=1)
        # A window smaller than the batch: the publisher must wait for PUBACKs to go on.
        async with WirePublisher("127.0.0.1", mosquitto.port, "wire-test", window=64) as wire:
            assert await wire.publish_all(messages) == len(messages)
        async with asyncio.timeout(60):
            async for message in subscriber.messages:
                assert isinstance(message.payload, bytes)
                received.append((message.topic.value, message.payload))
                if len(received) == len(messages):
                    break
    assert sorted(received) == sorted(messages)


async def test_the_wire_publisher_reports_a_refused_connection() -> None:
    with pytest.raises(ConnectionRefusedError):  # nothing listens there
        async with WirePublisher("127.0.0.1", free_port(), "nobody"):
            pass


async def test_the_wire_publisher_reports_a_broker_that_goes_away(
    mosquitto: Mosquitto,
) -> None:
    def endless() -> object:
        n = 0
        while True:
            if n == 2_000:
                mosquitto.kill()
            yield TOPICS.telemetry("dev"), b'{"ts": %d, "metrics": {"t": 1}}' % n
            n += 1

    async with asyncio.timeout(60):
        with pytest.raises((WireError, OSError)):
            async with WirePublisher("127.0.0.1", mosquitto.port, "doomed", window=100) as wire:
                await wire.publish_all(endless())  # type: ignore[arg-type]  # an endless generator on purpose


async def test_the_benchmark_can_run_on_the_gateways_embedded_postgres(tmp_path: Path) -> None:
    async with embedded_database(tmp_path) as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT current_user") == "postgres"
            assert await conn.fetchval(
                "SELECT rolcreatedb FROM pg_roles WHERE rolname = current_user"
            )
        finally:
            await conn.close()
    with pytest.raises(OSError, match=r"No such file|Connection refused"):
        await asyncpg.connect(dsn, timeout=5)  # stopped with the context


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_bench_quick_completes_and_reports_every_figure(
    pg_server_dsn: str, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sim", "bench", "--quick", "--dsn", pg_server_dsn,
        "--json", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(540):
        stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()[-3000:]
    result = json.loads(out.read_text())

    rates = ["bare_msgs_per_s", "native_msgs_per_s", "gateway_msgs_per_s",
             "gateway_live_msgs_per_s", "gateway2_msgs_per_s", "gateway3_msgs_per_s",
             "naive_msgs_per_s",
             "commands_per_s", "reference_msgs_per_s", "gateway_msgs_per_s_mqtt311",
             "gateway_tasmota_msgs_per_s", "gateway_sparkplug_msgs_per_s",
             "gateway_zigbee2mqtt_msgs_per_s", "gateway_shelly_gen2_msgs_per_s",
             "gateway_chirpstack_v4_msgs_per_s", "gateway_norules_msgs_per_s"]  # fmt: skip
    for key in rates:
        assert isinstance(result[key], int), key
        assert result[key] > 0, key
    for key, numerator, denominator in [
        ("ratio_gateway_vs_bare", "gateway_msgs_per_s", "bare_msgs_per_s"),
        ("ratio_gateway_vs_naive", "gateway_msgs_per_s", "naive_msgs_per_s"),
        ("ratio_gateway_vs_native", "gateway_msgs_per_s", "native_msgs_per_s"),
        ("ratio_two_vs_one", "gateway2_msgs_per_s", "gateway_live_msgs_per_s"),
        ("ratio_three_vs_one", "gateway3_msgs_per_s", "gateway_live_msgs_per_s"),
        ("ratio_gateway_vs_reference_mqtt5", "gateway_msgs_per_s", "reference_msgs_per_s"),
        (
            "ratio_gateway_vs_reference_mqtt311",
            "gateway_msgs_per_s_mqtt311",
            "reference_msgs_per_s",
        ),
        ("ratio_gateway_vs_bare_mqtt311", "gateway_msgs_per_s_mqtt311", "bare_msgs_per_s"),
        ("ratio_tasmota_vs_gateway", "gateway_tasmota_msgs_per_s", "gateway_msgs_per_s"),
        ("ratio_sparkplug_vs_gateway", "gateway_sparkplug_msgs_per_s", "gateway_msgs_per_s"),
    ]:
        expected = result[numerator] / result[denominator]
        assert result[key] == pytest.approx(expected, rel=0.01, abs=0.001)
    assert 0 < result["latency_p50_ms"] <= result["latency_p95_ms"] <= result["latency_p99_ms"]
    assert result["latency_p99_ms"] <= result["latency_max_ms"]
    assert result["latency_messages"] > 0
    assert result["storm_seconds"] > 0
    for key in (
        "gateway_cpu_us_per_msg_mqtt5",
        "gateway_cpu_us_per_msg_mqtt311",
        "reference_cpu_us_per_msg",
        "gateway_live_cpu_us_per_msg",
        "gateway_norules_cpu_us_per_msg",
    ):
        assert result[key] > 0, key
    # The rules' share is the difference of the two drains' CPU per message, and the CPU ratios
    # their quotients by the reference's. The report computes each from the unrounded figures
    # and rounds every figure (CPU to 0.1 µs, ratios to 0.01): checked within what that
    # rounding allows, which for a quotient grows as the reference's CPU shrinks (a quick
    # run's 5.2 µs is 5.15-5.25, 1 %).
    cpu, norules = result["gateway_cpu_us_per_msg_mqtt5"], result["gateway_norules_cpu_us_per_msg"]
    assert abs(result["gateway_rules_cpu_us_per_msg"] - (cpu - norules)) <= 0.15 + 1e-9
    for ratio, numerator in (
        ("ratio_gateway_cpu_vs_reference_mqtt5", cpu),
        ("ratio_gateway_norules_cpu_vs_reference", norules),
    ):
        low, high = _quotient_bounds(numerator, result["reference_cpu_us_per_msg"], step=0.1)
        assert low - 0.005 - 1e-9 <= result[ratio] <= high + 0.005 + 1e-9, ratio
    # One alarm per device: a storm raises each device's alarm once, never twice.
    assert result["storm_alarms"] == result["storm_alarmed_devices"] == result["storm_devices"]
    assert result["commands_acked"] == result["commands"]
    assert 0 < result["commands_p50_ms"] <= result["commands_p99_ms"]
    assert 0 < result["rss_mb"] <= result["rss_all_phases_mb"]
    # The live phases judged shared devices (two nodes each) exactly as one node would.
    assert result["gateway2_alarms_found"] == result["gateway2_alarms_expected"] > 0
    assert result["gateway2_cleared_found"] == result["gateway2_cleared_expected"] > 0
    assert result["gateway_live_alarms_found"] == result["gateway_live_alarms_expected"]
    assert result["gateway2_devices_on_both_nodes"] == result["shared_devices"]
    # Three nodes: never an alarm one node would not raise; a normal run committed after the
    # next violation (its samples on two nodes, the violation on the third) may merge two
    # episodes into one, the ordering rule's documented limit (docs/rules-and-alarms.md).
    assert 0 < result["gateway3_alarms_found"] <= result["gateway3_alarms_expected"]
    assert 0 < result["gateway3_cleared_found"] <= result["gateway3_cleared_expected"]
    assert result["gateway3_no_extra_alarms"] is True
    assert result["gateway3_runs_merged"] == (
        result["gateway3_alarms_expected"] - result["gateway3_alarms_found"]
    )
    assert result["gateway3_devices_on_several_nodes"] > 0
    assert result["alarms_match"] is True
    # The live phases' CPU per message: the gateways', and PostgreSQL's (its server runs here
    # in the tests, the machine's or the embedded one), and what one follows from the other.
    for phase in ("gateway_live", "gateway2", "gateway3"):
        assert result[f"{phase}_gateway_cpu_us_per_msg"] > 0, phase
        assert result[f"{phase}_pg_cpu_us_per_msg"] > 0, phase
        assert result[f"{phase}_pg_server_cpu_us_per_msg"] >= 0, phase
    pg_per_msg = result["gateway3_pg_cpu_us_per_msg"] + result["gateway3_pg_server_cpu_us_per_msg"]
    assert result["gateway_cores_per_pg_core"] == pytest.approx(
        result["gateway3_gateway_cpu_us_per_msg"] / pg_per_msg, rel=0.02, abs=0.01
    )
    assert set(TARGETS) <= set(result)
    # Who paid for the commands: every party runs on this machine and did some of the work.
    for phase in ("commands", "campaign"):
        split = [result[f"{phase}_cpu_us_{party}"] for party in PARTIES]
        assert all(isinstance(us, int) and us > 0 for us in split), (phase, split)
        assert result[f"{phase}_cpu_us_total"] == pytest.approx(sum(split), abs=len(split))
        assert 0 < result[f"{phase}_machine_busy_pct"] <= 100
        assert result[f"{phase}_cpu_ceiling_per_s"] > 0

    table = stdout.decode()
    assert f"{result['gateway_msgs_per_s']:,} msg/s" in table
    assert table.count("target") == len(TARGETS)


def _quotient_bounds(numerator: float, denominator: float, *, step: float) -> tuple[float, float]:
    """The range of a / b for the values a and b that round to these (to ``step``)."""
    half = step / 2
    return (numerator - half) / (denominator + half), (numerator + half) / (denominator - half)
