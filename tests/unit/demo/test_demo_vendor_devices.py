"""The demo's Sparkplug edge node and Tasmota devices speak what the gateway reads: their
payloads decoded by the gateway's own Sparkplug reader and by the demo configuration's
``tasmota`` mapping, their commands answered as the devices would (the run over MQTT is
tests/integration/acceptance/test_demo.py)."""

from __future__ import annotations

import itertools
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from gateway.config import parse_config
from gateway.demo.run import DemoSettings, demo_config_text
from gateway.demo.sparkplug_edge import (
    OVEN,
    PUMP,
    EdgeState,
    births,
    data,
    death_payload,
)
from gateway.demo.tasmota import CLIMATE, PLUG, TasmotaDevice
from gateway.domain.mappings import MappedPresence, MappedTelemetry, Mappings
from protocol import sparkplug
from protocol import sparkplug_b_pb2 as pb
from protocol.sparkplug import DataType

NOW: Final = datetime(2026, 12, 2, 17, 0, 5, 250_000, tzinfo=UTC)
NOW_MS: Final = int(NOW.timestamp() * 1000)


def _demo_mappings() -> Mappings:
    text = demo_config_text(DemoSettings(), Path("/tmp/demo-state"), "http://127.0.0.1:9/")
    return parse_config(text).mappings()


def test_the_births_define_every_metric_with_an_alias_and_the_data_use_aliases_only() -> None:
    state = EdgeState()
    seq = itertools.count()
    (nbirth, oven_birth, pump_birth) = births(state, 7, seq, NOW_MS)
    assert nbirth[0] == "spBv1.0/Demo/NBIRTH/Line1"
    node = sparkplug.decode_payload(nbirth[1])
    assert node.seq == 0
    assert node.bdseq() == 7  # the Will's (death_payload) bdSeq
    assert sparkplug.decode_payload(death_payload(7)).bdseq() == 7
    rebirth = next(m for m in node.metrics if m.name == sparkplug.REBIRTH)
    assert rebirth.datatype == DataType.BOOLEAN
    assert oven_birth[0] == "spBv1.0/Demo/DBIRTH/Line1/Oven"
    assert pump_birth[0] == "spBv1.0/Demo/DBIRTH/Line1/Pump"
    oven = sparkplug.decode_payload(oven_birth[1])
    pump = sparkplug.decode_payload(pump_birth[1])
    assert (oven.seq, pump.seq) == (1, 2)
    defined = {m.alias: (m.name, m.datatype) for m in (*oven.metrics, *pump.metrics)}
    assert len(defined) == len(oven.metrics) + len(pump.metrics)  # aliases unique in the node
    assert {name for name, _ in defined.values()} == {
        "Temperature", "Setpoint", "Door Open", "Pressure", "Flow", "Running",
    }  # fmt: skip
    assert rebirth.alias not in defined

    changed = state.step()
    topic, payload = data(OVEN, changed[OVEN], 3, NOW_MS)
    assert topic == "spBv1.0/Demo/DDATA/Line1/Oven"
    sample = sparkplug.decode_payload(payload)
    assert sample.seq == 3
    (temperature,) = sample.metrics
    assert temperature.name is None
    assert temperature.datatype is None
    assert temperature.alias is not None
    name, datatype = defined[temperature.alias]
    assert name == "Temperature"
    value = sparkplug.metric_value(temperature, datatype)
    assert isinstance(value, float)
    assert 170 < value < 190


def _write(name: str, datatype: DataType, value: float | bool) -> pb.Payload.Metric:
    """One metric of a DCMD, as the gateway writes it (protocol.sparkplug.encode_write)."""
    payload = pb.Payload()
    payload.ParseFromString(sparkplug.encode_write(NOW_MS, [(name, None, datatype, value)]))
    (metric,) = payload.metrics
    return metric


def test_a_write_is_applied_and_reported_back_unless_out_of_range_or_read_only() -> None:
    state = EdgeState()
    written = state.write(OVEN, _write("Setpoint", DataType.DOUBLE, 220.0))
    assert written is not None
    assert (written.name, written.value) == ("Setpoint", 220.0)
    # The report back (its DDATA) carries the written value under the birth's alias.
    _, payload = data(OVEN, [written], 9, NOW_MS)
    (echo,) = sparkplug.decode_payload(payload).metrics
    assert echo.alias == written.alias
    assert sparkplug.metric_value(echo, DataType.DOUBLE) == 220.0
    # The oven heads for its new setpoint.
    for _ in range(40):
        state.step()
    temperature = state.devices[OVEN].metrics["Temperature"].value
    assert isinstance(temperature, float)
    assert 215 < temperature < 225

    assert state.write(OVEN, _write("Setpoint", DataType.DOUBLE, 400.0)) is None  # > 300 °C
    assert state.write(OVEN, _write("Temperature", DataType.DOUBLE, 20.0)) is None  # read-only
    assert state.write(OVEN, _write("Setpoint", DataType.BOOLEAN, True)) is None
    assert state.write("Mixer", _write("Setpoint", DataType.DOUBLE, 200.0)) is None
    assert state.devices[OVEN].metrics["Setpoint"].value == 220.0

    stopped = state.write(PUMP, _write("Running", DataType.BOOLEAN, False))
    assert stopped is not None
    assert stopped.value is False
    changed = state.step()
    assert [(m.name, m.value) for m in changed[PUMP]] == [("Pressure", 0.0), ("Flow", 0.0)]


def test_the_tasmota_devices_are_read_by_the_demo_mapping() -> None:
    mappings = _demo_mappings()
    for name, expected in (
        (PLUG, {"ENERGY.Power", "ENERGY.Voltage", "ENERGY.Current", "ENERGY.Today"}),
        (CLIMATE, {"AM2301.Temperature", "AM2301.Humidity", "AM2301.DewPoint"}),
    ):
        reading = json.dumps(TasmotaDevice(name).sensor(NOW)).encode()
        read = mappings.read(f"tele/{name}/SENSOR", reading, NOW_MS)
        assert isinstance(read, MappedTelemetry), read
        assert read.device_id == name
        assert read.message.metrics is not None
        assert expected <= set(read.message.metrics)
        assert "TempUnit" not in read.message.metrics
        # Tasmota's Time (to the second, no offset) read in UTC.
        assert read.message.ts == NOW_MS // 1000 * 1000
        assert mappings.read(f"tele/{name}/LWT", b"Online", NOW_MS) == MappedPresence(
            "tasmota", name, "online", {"device": name}
        )


def test_a_power_command_reaches_the_plug_as_tasmota_takes_it_and_shows_in_its_readings() -> None:
    mappings = _demo_mappings()
    downlink = mappings.downlink(
        "tasmota",
        {"device": PLUG},
        device_id=PLUG,
        command="POWER",
        command_id=1,
        params={"value": "OFF"},
    )
    assert downlink is not None
    assert (downlink.topic, downlink.payload) == (f"cmnd/{PLUG}/POWER", b"OFF")
    plug = TasmotaDevice(PLUG)
    assert plug.sensor(NOW)["ENERGY"]["Power"] > 0
    assert plug.command("POWER", downlink.payload.decode()) == [
        (f"stat/{PLUG}/RESULT", '{"POWER":"OFF"}'),
        (f"stat/{PLUG}/POWER", "OFF"),
    ]
    assert plug.sensor(NOW)["ENERGY"]["Power"] == 0
    assert plug.command("POWER", "TOGGLE")[-1] == (f"stat/{PLUG}/POWER", "ON")
    assert plug.command("POWER", "")[-1] == (f"stat/{PLUG}/POWER", "ON")  # the state, unchanged
    assert plug.command("POWER", "dim") == [(f"stat/{PLUG}/RESULT", '{"Command":"Error"}')]
    assert TasmotaDevice(CLIMATE).command("POWER", "ON") == [
        (f"stat/{CLIMATE}/RESULT", '{"Command":"Unknown"}')
    ]
