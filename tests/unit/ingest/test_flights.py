"""Which messages start beside the transactions in flight (gateway.ingest.flights.plan), and
what the decoder says each message must stay in order with."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.ingest.decoder import Inbound, MessageDecoder
from gateway.ingest.flights import Flight, plan
from gateway.ingest.live_path import message_decoder
from protocol import Encoding, Topics

TOPICS = Topics("iot")


def key(item: str) -> str | None:
    """Test items are "device:n"; "*" a barrier, "-" ordered with nothing."""
    device = item.split(":", maxsplit=1)[0]
    return None if device == "*" else "" if device == "-" else device


def flying(*keys: str | None) -> list[Flight[str]]:
    return [Flight([], None if k is None else frozenset(k.split(","))) for k in keys]


def test_with_nothing_in_flight_every_message_starts_as_one_flight() -> None:
    flight, waiting = plan(["a:1", "b:1", "a:2", "-:1"], key, [])
    assert flight is not None
    assert waiting == []
    assert flight.items == ["a:1", "b:1", "a:2", "-:1"]
    assert flight.keys == {"a", "b"}


def test_a_barrier_with_nothing_in_flight_makes_the_whole_flight_a_barrier() -> None:
    flight, waiting = plan(["a:1", "*:1", "b:1"], key, [])
    assert flight is not None
    assert waiting == []
    assert flight.items == ["a:1", "*:1", "b:1"]
    assert flight.keys is None


def test_a_device_in_flight_waits_with_every_later_message_of_it() -> None:
    flight, waiting = plan(["b:1", "a:1", "c:1", "a:2", "b:2", "-:1"], key, flying("a"))
    assert flight is not None
    assert flight.items == ["b:1", "c:1", "b:2", "-:1"]
    assert flight.keys == {"b", "c"}
    assert waiting == ["a:1", "a:2"]


def test_the_devices_of_every_flight_count() -> None:
    flight, waiting = plan(["a:1", "b:1", "c:1"], key, flying("a", "b,x"))
    assert flight is not None
    assert flight.items == ["c:1"]
    assert flight.keys == {"c"}
    assert waiting == ["a:1", "b:1"]


def test_a_barrier_and_everything_after_it_waits_beside_other_flights() -> None:
    flight, waiting = plan(["b:1", "*:1", "c:1", "b:2"], key, flying("a"))
    assert flight is not None
    assert flight.items == ["b:1"]
    assert flight.keys == {"b"}
    # b:2 comes after the barrier: it waits though b started, and stays behind b:1's
    # flight when planned again (b is in flight then).
    assert waiting == ["*:1", "c:1", "b:2"]


def test_nothing_starts_beside_a_barrier_in_flight() -> None:
    flight, waiting = plan(["b:1", "-:1"], key, flying(None))
    assert flight is None
    assert waiting == ["b:1", "-:1"]


def test_when_every_message_waits_no_flight_starts() -> None:
    flight, waiting = plan(["a:1", "a:2"], key, flying("a"))
    assert flight is None
    assert waiting == ["a:1", "a:2"]


def test_replanning_what_waited_keeps_each_devices_order() -> None:
    """Planned again and again as flights land, each device's messages start in order."""
    started: list[str] = []
    in_flight = flying("a", "b")
    flight, waiting = plan(["a:1", "c:1", "b:1", "a:2", "c:2"], key, in_flight)
    assert flight is not None
    started += flight.items
    in_flight = [in_flight[1], flight]  # "a" landed
    flight, waiting = plan([*waiting, "a:3"], key, in_flight)
    assert flight is not None
    started += flight.items
    in_flight = [flight]  # "b" and "c" landed
    flight, waiting = plan(waiting, key, in_flight)
    assert flight is not None
    assert waiting == []
    started += flight.items
    assert started == ["c:1", "c:2", "a:1", "a:2", "a:3", "b:1"]


def test_the_decoder_orders_a_message_with_its_device_from_the_topic() -> None:
    decoder = MessageDecoder(TOPICS, Encoding.JSON, 65536, sparkplug=True)
    assert decoder.order_key(Inbound(TOPICS.telemetry("dev-1"), b"")) == "dev-1"
    assert decoder.order_key(Inbound(TOPICS.device_status("dev-1"), b"")) == "dev-1"
    assert decoder.order_key(Inbound(TOPICS.acks("dev-2"), b"")) == "dev-2"
    # A topic that can only become a dead letter is ordered with nothing.
    assert decoder.order_key(Inbound("iot/devices/dev-1/telemetry/extra", b"")) == ""
    assert decoder.order_key(Inbound("elsewhere/x", b"")) == ""
    # Sparkplug B: by edge node, whose state is judged with its own and its devices' messages.
    assert decoder.order_key(Inbound("spBv1.0/plant/DDATA/edge-1/pump-1", b"")) == "plant/edge-1"
    assert decoder.order_key(Inbound("spBv1.0/plant/NDATA/edge-1", b"")) == "plant/edge-1"
    assert decoder.order_key(Inbound("spBv1.0/plant/NBIRTH/edge-2", b"")) == "plant/edge-2"
    assert decoder.order_key(Inbound("spBv1.0/STATE/host-1", b"")) == ""


def test_a_mapping_naming_the_device_by_its_topic_orders_by_that_device() -> None:
    """The id the mapping stores the message under: telemetry and presence alike."""
    config = parse_config(
        '[[ingest.mappings]]\nname = "tasmota"\nprofile = "tasmota"\n'
        '[[ingest.mappings]]\nname = "lights"\nprofile = "zigbee2mqtt"\n'
        'device_ids = "normalise"\n'
    )
    decoder = message_decoder(config)
    assert decoder.order_key(Inbound("tele/kitchen/SENSOR", b"{}")) == "kitchen"
    assert decoder.order_key(Inbound("tele/kitchen/LWT", b"Online")) == "kitchen"
    # Normalised as stored ("hall lamp" is stored as hall_lamp).
    assert decoder.order_key(Inbound("zigbee2mqtt/hall lamp", b"{}")) == "hall_lamp"
    assert decoder.order_key(Inbound("zigbee2mqtt/hall lamp/availability", b"")) == "hall_lamp"
    assert decoder.order_key(Inbound("iot/devices/dev-1/telemetry", b"")) == "dev-1"


def test_a_mapping_naming_the_device_from_the_payload_is_a_barrier() -> None:
    """Its device is not known before decoding."""
    config = parse_config(
        '[[ingest.mappings]]\nname = "boiler"\ntopic = "plant/{site}/boiler/{unit}/state"\n'
        'device_path = "$.meta.serial"\ntimestamp_path = "$.meta.at"\n'
        'timestamp_format = "iso8601"\nflatten = "$.readings"\n'
    )
    decoder = message_decoder(config)
    assert decoder.order_key(Inbound("plant/a/boiler/1/state", b"{}")) is None
    assert decoder.order_key(Inbound("iot/devices/dev-1/telemetry", b"")) == "dev-1"
