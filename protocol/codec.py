"""Bytes to messages and back, with every failure reported as one `DecodeError`.

Decoders and encoders are built once: decoding runs for every inbound message.

MessagePack and datetimes (msgspec 0.23): a `datetime` field decodes from the timestamp
extension (type -1, always UTC) and also from an RFC 3339 string; naive values (a string
without offset) are rejected by the `tz=True` constraint like in JSON. Aware datetimes are
encoded as the timestamp extension, which drops the offset; `Telemetry` therefore keeps its
`ts` in UTC so a message reads back identically whichever encoding carried it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Final, Literal, TypeAlias, TypeVar

import msgspec

from protocol.messages import (
    CommandReceipt,
    DownlinkCommand,
    Presence,
    Telemetry,
    WireTelemetry,
    wire_telemetry,
)

DecodeErrorCode: TypeAlias = Literal["OVERSIZED", "MALFORMED", "INVALID"]

_T = TypeVar("_T")


class Encoding(enum.StrEnum):
    JSON = "json"
    MSGPACK = "msgpack"


class DecodeError(ValueError):
    """A payload that cannot become a message.

    `code` is OVERSIZED (longer than allowed), MALFORMED (not JSON/MessagePack, bad UTF-8, or
    nested beyond what the decoder can follow) or INVALID (well formed, but breaks the schema);
    `detail` says what and where, e.g. "Expected `int`, got `str` - at `$.seq`".
    """

    def __init__(self, code: DecodeErrorCode, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code: DecodeErrorCode = code
        self.detail = detail

    def __reduce__(self) -> tuple[type[DecodeError], tuple[DecodeErrorCode, str]]:
        return (type(self), (self.code, self.detail))


def _decoders(kind: type[_T]) -> dict[Encoding, Callable[[bytes], _T]]:
    return {
        Encoding.JSON: msgspec.json.Decoder(kind).decode,
        Encoding.MSGPACK: msgspec.msgpack.Decoder(kind).decode,
    }


_TELEMETRY_DECODERS: Final = _decoders(WireTelemetry)  # then wire_telemetry: see WireTelemetry
_RECEIPT_DECODERS: Final = _decoders(CommandReceipt)
_COMMAND_DECODERS: Final = _decoders(DownlinkCommand)
_ENCODERS: Final[dict[Encoding, Callable[[object], bytes]]] = {
    Encoding.JSON: msgspec.json.Encoder().encode,
    Encoding.MSGPACK: msgspec.msgpack.Encoder().encode,
}


def _decode(decode: Callable[[bytes], _T], payload: bytes, max_bytes: int | None) -> _T:
    if max_bytes is not None and len(payload) > max_bytes:
        raise DecodeError("OVERSIZED", f"payload is {len(payload)} bytes, the limit is {max_bytes}")
    try:
        return decode(payload)
    except msgspec.ValidationError as exc:  # a subclass of msgspec.DecodeError: test it first
        raise DecodeError("INVALID", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise DecodeError("MALFORMED", str(exc)) from exc
    except RecursionError as exc:
        # msgspec raises this, not a DecodeError, for deeply nested input (~1000 levels fit in
        # a few kilobytes), so it must not escape to the reader loop.
        raise DecodeError("MALFORMED", f"nesting too deep to decode: {exc}") from exc


def decode_telemetry(
    payload: bytes, encoding: Encoding = Encoding.JSON, *, max_bytes: int | None = None
) -> Telemetry:
    wire = _decode(_TELEMETRY_DECODERS[encoding], payload, max_bytes)
    try:
        return wire_telemetry(wire)
    except ValueError as exc:  # as Telemetry's own decoding says it (a ValidationError)
        raise DecodeError("INVALID", str(exc)) from exc


def encode_telemetry(message: Telemetry, encoding: Encoding = Encoding.JSON) -> bytes:
    return _ENCODERS[encoding](message)


def decode_receipt(
    payload: bytes, encoding: Encoding = Encoding.JSON, *, max_bytes: int | None = None
) -> CommandReceipt:
    return _decode(_RECEIPT_DECODERS[encoding], payload, max_bytes)


def encode_receipt(receipt: CommandReceipt, encoding: Encoding = Encoding.JSON) -> bytes:
    return _ENCODERS[encoding](receipt)


def decode_command(payload: bytes, encoding: Encoding = Encoding.JSON) -> DownlinkCommand:
    return _decode(_COMMAND_DECODERS[encoding], payload, None)


def encode_command(command: DownlinkCommand, encoding: Encoding = Encoding.JSON) -> bytes:
    return _ENCODERS[encoding](command)


_PRESENCE_FORMS: Final[dict[bytes, Presence]] = {
    form: presence
    for presence in Presence
    for form in (presence.value.encode(), f'"{presence.value}"'.encode())
}
_MAX_PRESENCE_BYTES: Final = 64


def decode_presence(payload: bytes) -> Presence:
    """`online`/`offline`, bare or as a JSON string, surrounding ASCII whitespace ignored."""
    presence = _PRESENCE_FORMS.get(payload.strip()) if len(payload) <= _MAX_PRESENCE_BYTES else None
    if presence is None:
        shown = payload[:_MAX_PRESENCE_BYTES]
        raise DecodeError(
            "INVALID",
            f"expected `online` or `offline`, got {shown!r}"
            + ("..." if len(payload) > _MAX_PRESENCE_BYTES else ""),
        )
    return presence


def encode_presence(presence: Presence) -> bytes:
    return Presence(presence).value.encode()
