"""`gateway run` takes what its start made out of the garbage collector's full passes: each pass
walked ~100,000 start-up objects (50-70 ms with the event loop stopped, several times a minute
under load, freeing nothing). Read from its own /metrics, as an operator would."""

from __future__ import annotations

from pathlib import Path

from tests.support.daemon import DaemonProcess, config_toml, http_healthy, scrape
from tests.support.mosquitto import Mosquitto
from tests.support.ports import free_port
from tests.support.waiting import wait_until


async def test_a_running_gateway_has_its_start_up_objects_frozen(
    db_dsn: str, mosquitto: Mosquitto, tmp_path: Path
) -> None:
    http_port = free_port()
    path = tmp_path / "gateway.toml"
    path.write_text(config_toml(dsn=db_dsn, mqtt_port=mosquitto.port, http_port=http_port))
    process = DaemonProcess(path, tmp_path / "daemon.log")
    process.start()
    try:

        async def healthy() -> bool:
            assert process.alive(), f"daemon exited:\n{process.log_tail()}"
            return await http_healthy(http_port)

        await wait_until(healthy, timeout=90, message="daemon healthy")
        frozen: dict[str, float] = {}

        async def frozen_once_ready() -> bool:
            frozen.update(await scrape(http_port))
            return frozen["gateway_gc_frozen_objects"] > 10_000

        await wait_until(frozen_once_ready, timeout=30, message="start-up objects frozen")
        # The collector's own counts are exposed beside it.
        assert 'python_gc_collections_total{generation="2"}' in frozen
        assert process.terminate() == 0
    finally:
        process.cleanup()
