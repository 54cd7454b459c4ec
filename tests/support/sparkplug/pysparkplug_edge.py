"""A Sparkplug B edge node for the host tests, by an independent Python implementation
(PyPI ``pysparkplug`` 0.6.1), run with the interpreter of its own venv (.pyvenv, see
pysparkplug-requirements.txt: it pins paho-mqtt<2, the gateway needs paho-mqtt>=2.1).

argv: host port group node device temp...
Connects (its NBIRTH, with bdSeq, on connect), registers the device (its DBIRTH), publishes one
DDATA per temperature given, prints "published", and when its stdin closes leaves without a
DISCONNECT (os._exit): the broker publishes its Will, the NDEATH.
"""

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import pysparkplug as sp


def main() -> None:
    host, port, group, node, device, *temps = sys.argv[1:]
    now = sp.get_current_timestamp
    edge = sp.EdgeNode(
        group_id=group,
        edge_node_id=node,
        metrics=[
            sp.Metric(timestamp=now(), name="Firmware", datatype=sp.DataType.STRING, value="1.2")
        ],
        client=sp.Client(client_id=f"pysparkplug-{group}-{node}"),
    )
    # Wait for its connect callback to *finish*. EdgeNode sets `_connected` first thing in that
    # callback (on paho's thread), then publishes the NBIRTH and a DBIRTH for each registered
    # device with their metrics as they are then. Waiting on `_connected` alone raced it: once
    # in CI the callback resumed after this thread had registered the device and published
    # both DDATA, and its late DBIRTH carried temp 85.5: a fourth sample the test did not expect
    # (a DBIRTH before the NBIRTH would have been refused as not born).
    births_out = threading.Event()
    connect = edge._client.connect

    def connect_and_tell(*args: Any, callback: Callable[[Any], None], **kwargs: Any) -> None:
        def then_tell(client: Any) -> None:
            callback(client)
            births_out.set()

        connect(*args, callback=then_tell, **kwargs)

    edge._client.connect = connect_and_tell
    edge.connect(host, port=int(port), blocking=False)
    if not births_out.wait(timeout=30):
        sys.exit("not connected")
    # The DBIRTH's metrics share one time: metrics of one message with different timestamps
    # are one sample each (docs/sparkplug.md), and two calls of now() may straddle a
    # millisecond (seen once in CI: the birth stored as two samples, a fourth one in all).
    born = now()
    edge.register(
        sp.Device(
            device_id=device,
            metrics=[
                sp.Metric(timestamp=born, name="temp", datatype=sp.DataType.DOUBLE, value=20.0),
                sp.Metric(timestamp=born, name="running", datatype=sp.DataType.BOOLEAN, value=True),
            ],
        )
    )
    for temp in temps:
        edge.update_device(
            device,
            [
                sp.Metric(
                    timestamp=now(), name="temp", datatype=sp.DataType.DOUBLE, value=float(temp)
                )
            ],
        )
    print("published", flush=True)
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    main()
