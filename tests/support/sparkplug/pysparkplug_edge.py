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
import time

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
    edge.connect(host, port=int(port), blocking=False)
    deadline = time.monotonic() + 30
    while not edge._connected:  # set by its connect callback, after the NBIRTH went out
        if time.monotonic() > deadline:
            sys.exit("not connected")
        time.sleep(0.01)
    edge.register(
        sp.Device(
            device_id=device,
            metrics=[
                sp.Metric(timestamp=now(), name="temp", datatype=sp.DataType.DOUBLE, value=20.0),
                sp.Metric(
                    timestamp=now(), name="running", datatype=sp.DataType.BOOLEAN, value=True
                ),
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
