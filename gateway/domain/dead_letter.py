"""Which dead letters a replay can never ingest, decided from what the letter itself holds.

A replay decodes the letter again with today's decoder and configuration, so most reasons can
pass later: a schema or a size limit that changed (``INVALID``, ``OVERSIZED``), a topic prefix
or a consumed topic added (``BAD_TOPIC``, ``UNSUPPORTED_TOPIC``), a database refusal or a bug
fixed (``STORAGE_REJECTED``, ``PROCESSING_FAILED``, ``QUARANTINED``). Three cannot, whatever
changes, because what failed is fixed in the letter:

- a **truncated** letter (only the first ``[ingest] dead_letter_max_bytes`` were kept): there
  is nothing whole to ingest, whatever its reason;
- ``MALFORMED``: the bytes are neither JSON nor MessagePack (or not UTF-8) and stay so;
- ``BAD_DEVICE_ID``: the device id in the topic breaks the protocol's grammar, and a letter's
  topic never changes.

The console shows no Replay button on those (``POST /dead-letters/{id}/replay`` still answers,
as ``gateway dead-letters replay`` does: ``truncated`` or ``still_invalid: <reason>``).
"""

from __future__ import annotations

from typing import Final

NEVER_REPLAYABLE: Final[dict[str, str]] = {
    "MALFORMED": "the bytes are neither JSON nor MessagePack, and a letter's bytes never change",
    "BAD_DEVICE_ID": "the topic's device id breaks the protocol's grammar, and a letter's "
    "topic never changes",
}
TRUNCATED: Final = "only the first bytes were kept: there is nothing whole to ingest"


def why_never_replayable(reason: str, *, size: int, kept: int) -> str | None:
    """Why replaying this letter can never ingest it; None when a replay may."""
    if size == 0:
        # A zero-length message an earlier release dead-lettered (`MALFORMED` on a native
        # topic among others): a replay resolves it, `empty` (docs/topics-and-payloads.md).
        return None
    if size > kept:
        return TRUNCATED
    return NEVER_REPLAYABLE.get(reason)
