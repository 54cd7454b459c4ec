"""The wire layer: topics, message schemas and their encodings. No I/O, nothing of ours.

Owns what devices, the gateway and the simulator must agree on: device ids (``ids``), topics,
the messages (``messages``), their JSON and CBOR encodings (``codec``) and the telemetry event
id (``eventid``). Entry points: the names re-exported here. Imports nothing of ours (neither
``gateway``, ``storage`` nor ``sim``: import-linter).
"""

from protocol.codec import (
    DecodeError,
    Encoding,
    decode_command,
    decode_presence,
    decode_receipt,
    decode_telemetry,
    encode_command,
    encode_presence,
    encode_receipt,
    encode_telemetry,
)
from protocol.eventid import canonical_bytes, checked_device_event_id, telemetry_event_id
from protocol.ids import (
    DEVICE_ID_RE,
    InvalidDeviceIdError,
    is_valid_device_id,
    validate_device_id,
)
from protocol.messages import (
    MAX_EVENTS,
    MAX_METRICS,
    MAX_STRING_BYTES,
    CommandReceipt,
    DownlinkCommand,
    MetricValue,
    Presence,
    ReceiptResult,
    ResultCode,
    Telemetry,
    micros,
)
from protocol.topics import DeviceTopic, TopicError, TopicKind, Topics

__all__ = [
    "DEVICE_ID_RE",
    "MAX_EVENTS",
    "MAX_METRICS",
    "MAX_STRING_BYTES",
    "CommandReceipt",
    "DecodeError",
    "DeviceTopic",
    "DownlinkCommand",
    "Encoding",
    "InvalidDeviceIdError",
    "MetricValue",
    "Presence",
    "ReceiptResult",
    "ResultCode",
    "Telemetry",
    "TopicError",
    "TopicKind",
    "Topics",
    "canonical_bytes",
    "checked_device_event_id",
    "decode_command",
    "decode_presence",
    "decode_receipt",
    "decode_telemetry",
    "encode_command",
    "encode_presence",
    "encode_receipt",
    "encode_telemetry",
    "is_valid_device_id",
    "micros",
    "telemetry_event_id",
    "validate_device_id",
]
