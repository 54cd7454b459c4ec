"""/health and /metrics of a running daemon."""

from __future__ import annotations

import aiohttp
import aiomqtt

from protocol import Topics
from tests.support.daemon import make_config, running_daemon, scrape
from tests.support.mosquitto import Mosquitto
from tests.support.waiting import wait_until


async def test_health_and_metrics(db_dsn: str, mosquitto: Mosquitto) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="http-node")
    async with running_daemon(config) as daemon, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{daemon.http_port}"
        async with http.get(f"{base}/health") as response:
            assert response.status == 200
            body = await response.json()
        assert body["status"] == "ok"
        assert body["node_id"] == "http-node"
        assert body["database"]["ok"] is True
        # The server the pool's connections reach (host:port, or the embedded one's socket).
        assert body["database"]["server"]
        assert body["broker"]["ok"] is True

        async with aiomqtt.Client("127.0.0.1", mosquitto.port) as pub:
            await pub.publish(Topics("iot").telemetry("d1"), b"{nope", qos=1)

        async def dead_lettered() -> bool:
            async with http.get(f"{base}/metrics") as response:
                text = await response.text()
            return 'gateway_dead_letters_total{reason="MALFORMED"} 1.0' in text

        await wait_until(dead_lettered, timeout=30)
        async with http.get(f"{base}/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
        for name in (
            "gateway_telemetry_received_total",
            "gateway_telemetry_stored_total",
            "gateway_telemetry_duplicates_total",
            "gateway_ingest_batch_size_bucket",
            "gateway_ingest_commit_seconds_bucket",
            "gateway_ingest_inflight",
        ):
            assert name in text

        mosquitto.stop()  # the broker goes away: the node is not healthy any more

        async def unhealthy() -> bool:
            async with http.get(f"{base}/health") as response:
                return response.status == 503 and (await response.json())["broker"]["ok"] is False

        await wait_until(unhealthy, timeout=30)
        mosquitto.start()
        await wait_until(
            lambda: daemon.session is not None and daemon.session.connected, timeout=30
        )


async def test_metrics_carry_the_process_the_build_and_the_pool_and_no_created_series(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    config = make_config(dsn=db_dsn, mqtt_port=mosquitto.port, node_id="metrics-node")
    # /health is never asked: the pool gauges are read at the scrape itself.
    async with running_daemon(config) as daemon:
        assert daemon.http_port is not None
        values = await scrape(daemon.http_port)
    assert values["process_cpu_seconds_total"] > 0
    assert values["process_resident_memory_bytes"] > 0
    (build,) = [name for name in values if name.startswith("gateway_build_info{")]
    assert 'version="' in build
    assert values["gateway_db_pool_size"] >= 1
    assert "gateway_db_pool_idle" in values
    assert [name for name in values if "_created" in name.split("{")[0]] == []
