"""Sparkplug B edge nodes' traffic, as a host application sees it (docs/sparkplug.md):
``gateway-sim publish --format sparkplug`` sends these, so that ingest can be measured on
Sparkplug traffic beside the native format.

The simulated devices are grouped into edge nodes of :data:`DEVICES_PER_NODE`. Each node is
born (``NBIRTH``: ``bdSeq``, one node metric, seq 0), then each of its devices (``DBIRTH``: its
metrics with their names, datatypes and aliases); then ``DDATA``, round-robin over the devices,
each naming its metrics by alias only (the datatype left out, as the birth gave it), every
message of a node one ``seq`` on from the last (0..255, wrapping). Payloads are protobuf,
Eclipse Tahu's schema (``protocol/sparkplug_b_pb2``).

Every message is one sample at a time of its own, so each must be stored exactly once: a
stream of ``messages`` stores ``messages`` telemetry rows.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from protocol import sparkplug
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType, MessageType
from sim.telemetry import EPOCH_MS

GROUP: Final = "gateway-sim"
DEVICES_PER_NODE: Final = 10
NODE_METRIC: Final = "Uptime"
# (name, datatype) of each device's metrics; DDATA names them by alias. An alias is unique
# within an edge node and its devices (Sparkplug 3.0): the k-th metric of the node's i-th
# device has the alias 10 + 3 i + k (:func:`alias`), the node's own metric 1.
TEMP: Final = ("temp", DataType.DOUBLE)
HUMIDITY: Final = ("humidity", DataType.FLOAT)
COUNT: Final = ("count", DataType.INT64)
DEVICE_METRICS: Final = (TEMP, HUMIDITY, COUNT)
_NODE_ALIAS: Final = 1


def alias(device_index: int, metric: int) -> int:
    """The alias of a device's metric (``metric`` its index in :data:`DEVICE_METRICS`);
    ``device_index`` the device's place among its edge node's devices."""
    return 10 + len(DEVICE_METRICS) * device_index + metric


@dataclass(frozen=True, slots=True)
class EdgeNode:
    node: str
    devices: tuple[str, ...]


def edge_nodes(devices: list[str]) -> list[EdgeNode]:
    """The simulated devices as edge nodes of :data:`DEVICES_PER_NODE`: node ``edge-00000``
    holds the first ten, ``edge-00001`` the next, …"""
    return [
        EdgeNode(f"edge-{k:05d}", tuple(devices[start : start + DEVICES_PER_NODE]))
        for k, start in enumerate(range(0, len(devices), DEVICES_PER_NODE))
    ]


def device_key(group: str, device: str, devices: list[str]) -> str:
    """The gateway's id of a simulated device: ``{group}/{node}/{device}``."""
    node = edge_nodes(devices)[devices.index(device) // DEVICES_PER_NODE].node
    return f"{group}/{node}/{device}"


def _payload(timestamp_ms: int, seq: int) -> pb.Payload:
    return pb.Payload(timestamp=timestamp_ms, seq=seq)


def _add(
    payload: pb.Payload,
    value: float | int,
    datatype: DataType,
    *,
    name: str | None = None,
    alias: int | None = None,
) -> None:
    metric = payload.metrics.add()
    if name is not None:
        metric.name = name
        metric.datatype = datatype  # a birth gives the datatype; data messages leave it out
    if alias is not None:
        metric.alias = alias
    if datatype is DataType.DOUBLE:
        metric.double_value = float(value)
    elif datatype is DataType.FLOAT:
        metric.float_value = float(value)
    else:
        metric.long_value = int(value) % 2**64


def sparkplug_stream(
    devices: list[str],
    messages: int,
    *,
    group: str = GROUP,
    seed: int = 1,
    start_seq: int = 0,
    epoch_ms: int = EPOCH_MS,
    bdseq: int = 0,
) -> Iterator[tuple[str, bytes]]:
    """``messages`` Sparkplug messages (births first, then DDATA round-robin over ``devices``),
    dated from ``epoch_ms`` one millisecond apart; with ``start_seq``, the data goes on from
    that reading (the births come again first: a new session, ``bdseq`` its number)."""
    nodes = edge_nodes(devices)
    rng = random.Random(seed)
    temps = {device: 20.0 + rng.random() * 5 for device in devices}
    seqs = {node.node: 0 for node in nodes}
    node_of = {device: node.node for node in nodes for device in node.devices}
    sent = 0

    def next_seq(node: str) -> int:
        seq = seqs[node]
        seqs[node] = (seq + 1) % 256
        return seq

    births: list[tuple[str, bytes]] = []
    for node in nodes:
        at = epoch_ms + len(births)
        birth = _payload(at, next_seq(node.node))
        _add(birth, bdseq % 256, DataType.UINT64, name=sparkplug.BDSEQ)
        _add(birth, start_seq, DataType.INT64, name=NODE_METRIC, alias=_NODE_ALIAS)
        births.append(
            (
                sparkplug.topic(group, MessageType.NBIRTH, node.node),
                birth.SerializeToString(),
            )
        )
        for index, device in enumerate(node.devices):
            at = epoch_ms + len(births)
            dbirth = _payload(at, next_seq(node.node))
            values = (round(temps[device], 2), 40.0, start_seq)
            for k, ((name, datatype), value) in enumerate(zip(DEVICE_METRICS, values, strict=True)):
                _add(dbirth, value, datatype, name=name, alias=alias(index, k))
            births.append(
                (
                    sparkplug.topic(group, MessageType.DBIRTH, node.node, device),
                    dbirth.SerializeToString(),
                )
            )
    for message in births[:messages]:
        yield message
        sent += 1
    for n in range(start_seq, start_seq + messages - sent):
        position = n % len(devices)
        device = devices[position]
        owner = node_of[device]
        index = position % DEVICES_PER_NODE
        temps[device] += rng.uniform(-0.5, 0.5)
        data = _payload(epoch_ms + len(births) + n - start_seq, next_seq(owner))
        values = (round(temps[device], 2), round(40 + (n % 200) / 10, 1), n)
        for k, ((_, datatype), value) in enumerate(zip(DEVICE_METRICS, values, strict=True)):
            _add(data, value, datatype, alias=alias(index, k))
        yield sparkplug.topic(group, MessageType.DDATA, owner, device), data.SerializeToString()
