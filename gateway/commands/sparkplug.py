"""Commands to Sparkplug devices (docs/commands.md, "Sparkplug devices").

A command whose device id is a Sparkplug id (``{group}/{node}[/{device}]``) writes one metric:
its ``name`` is the metric, ``params`` ``{"value": v}`` (and optionally ``"confirm"``: the
metric whose reported value confirms the write, by default the written one). It goes out as
``DCMD`` (``NCMD`` for the edge node itself) with the metric's datatype from the birth in
force. Sparkplug has no receipt: the command is ACKED when the device reports the written
value back (a sample of the confirmation metric equal to it, received after the claim), and
otherwise follows the native rules for a command no receipt answers (``[commands]
ack_window_s``: a realtime one FAILED, a deferrable one retried).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from protocol import CommandReceipt, Telemetry, sparkplug
from protocol.messages import ReceiptResult
from storage import sparkplug as repo
from storage.ingest import TelemetryRow


class SparkplugWriteError(ValueError):
    """A write that cannot go out as it is (the command FAILS at once, with ``code``)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Write:
    value: sparkplug.SparkplugValue
    confirm: str


def write_of(name: str, params: object) -> Write:
    if not isinstance(params, dict) or "value" not in params:
        raise SparkplugWriteError("INVALID_PARAMS", 'a Sparkplug write takes params {"value": v}')
    value = params["value"]
    if isinstance(value, bool | int | float | str):
        confirm = params.get("confirm", name)
        if not isinstance(confirm, str) or not confirm:
            raise SparkplugWriteError("INVALID_PARAMS", "confirm names a metric")
        return Write(value, confirm)
    raise SparkplugWriteError(
        "INVALID_PARAMS", "a Sparkplug write's value is a number, a bool or a string"
    )


async def downlink(
    pool: asyncpg.Pool, device_id: str, name: str, params: object
) -> tuple[str, bytes]:
    """The topic and payload of a Sparkplug command; raises :class:`SparkplugWriteError`."""
    key = sparkplug.split_device_key(device_id)
    assert key is not None
    group, node, device = key
    write = write_of(name, params)
    born, datatype = await repo.metric_definition(pool, group, node, device or "", name)
    if not born:
        raise SparkplugWriteError("SPARKPLUG_NOT_BORN", f"{device_id} has no birth in force")
    if datatype is None:
        raise SparkplugWriteError(
            "SPARKPLUG_UNKNOWN_METRIC", f"no birth of {device_id} names {name!r}"
        )
    try:
        payload = sparkplug.encode_write(
            int(time.time() * 1000), [(name, None, datatype, write.value)]
        )
    except ValueError as exc:
        raise SparkplugWriteError("INVALID_PARAMS", str(exc)) from exc
    kind = sparkplug.MessageType.NCMD if device is None else sparkplug.MessageType.DCMD
    return sparkplug.topic(group, kind, node, device), payload


def _same(reported: object, written: sparkplug.SparkplugValue) -> bool:
    if isinstance(written, bool) or isinstance(reported, bool):
        return reported is written
    if isinstance(written, int | float) and isinstance(reported, int | float):
        # A Float metric comes back rounded to 32 bits.
        return math.isclose(float(reported), float(written), rel_tol=1e-6, abs_tol=1e-9)
    return reported == written


async def confirmations(
    conn: asyncpg.Connection,
    samples: Sequence[tuple[TelemetryRow, Telemetry]],
    received_at: datetime | None = None,
) -> list[tuple[str, CommandReceipt]]:
    """ACKED receipts for the open commands of these samples' devices whose written value a
    sample reports back (the claim's generation and node, as the command's own receipt would).
    ``received_at``: when the samples were received, if not now (a replayed dead letter): only
    a command claimed by then can be answered by them. Compared by value alone, an old DDATA
    replayed while a write was open confirmed it if it held the value written."""
    devices = {row.device_id for row, _ in samples}
    writes = await repo.open_writes(conn, sorted(devices), received_at)
    receipts = []
    for command in writes:
        try:
            write = write_of(command.name, json.loads(command.params))
        except SparkplugWriteError:
            continue
        confirmed = any(
            row.device_id == command.device_id
            and message.metrics is not None
            and write.confirm in message.metrics
            and _same(message.metrics[write.confirm], write.value)
            for row, message in samples
        )
        if confirmed:
            receipts.append(
                (
                    command.device_id,
                    CommandReceipt(
                        command_id=command.id,
                        claim_generation=command.claim_generation,
                        node_id=command.claimed_node_id,
                        result=ReceiptResult.ACKED,
                        result_code=0,
                    ),
                )
            )
    return receipts
