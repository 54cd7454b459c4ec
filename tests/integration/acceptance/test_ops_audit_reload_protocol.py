"""A reload that changes `[mqtt] protocol`, a key read at start only: the node keeps the
protocol it connected with, and its shared subscription with it. It used to subscribe again
without the `$share` group (the group was kept only when the file's protocol matched the
session's), so that every node of the group received every message."""

from __future__ import annotations

from gateway.config import Config
from gateway.runtime.components import subscriptions
from tests.support.daemon import make_config, running_daemon
from tests.support.mosquitto import Mosquitto
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until


async def test_a_reload_changing_the_protocol_keeps_the_shared_subscription(
    db_dsn: str, mosquitto: Mosquitto
) -> None:
    def config(protocol: str, port: int) -> Config:
        return make_config(
            dsn=db_dsn, mqtt_port=port, protocol=protocol, mqtt_extra='shared_group = "gateways"'
        )

    started = config("5", mosquitto.port)
    shared = tuple(subscriptions(started, "5"))
    assert shared[0] == "$share/gateways/iot/devices/+/telemetry"
    async with TcpProxy("127.0.0.1", mosquitto.port) as proxy, running_daemon(started) as daemon:
        session = daemon.session
        assert session is not None
        assert session.subscriptions == shared
        # The file now asks for 3.1.1, and names the same broker by another address (the proxy):
        # the connection is made again there, with what the reload computed.
        daemon.reload(config("3.1.1", proxy.port))
        await wait_until(
            lambda: session.connections >= 2 and session.subscribed,
            timeout=30,
            message="subscribed again through the proxy",
        )
        assert session.endpoint == ("127.0.0.1", proxy.port)
        assert session.settings.protocol == "5"  # read at start
        assert session.subscriptions == shared
