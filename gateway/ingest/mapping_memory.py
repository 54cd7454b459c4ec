"""Which mapping, with which topic wildcards, this node last recorded for each device read
through an ``[[ingest.mappings]]`` entry (the ``device_mapping`` table a command to such a
device is rendered from): a batch records only the devices whose mapping or wildcards differ
from that, or whose record is older than ``REFRESH_S``.

Every batch used to record every mapped device it held. Most never change (a device keeps
its vendor topic), yet each cost the gateway the wildcards encoded as JSON with sorted keys,
and PostgreSQL a lock on the row (an ``INSERT … ON CONFLICT DO UPDATE`` locks each existing
row it meets, a WAL record, even where its ``WHERE`` writes nothing): a tenth of a mapped
drain's CPU in the gateway (docs/performance.md, "Mapped devices recorded once").

What this node remembers is what it committed (``recorded`` after the commit; a batch rolled
back leaves it as it was). Another node may record something else for the same device
meanwhile (a rolling reload that changes a mapping), or a failover may lose a recent record:
``REFRESH_S`` bounds how long this node leaves such a row as it finds it before recording
its own again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Final, TypeAlias

# A device's mapping name and the topic wildcards it was read with (decoder.Classified's).
Recorded: TypeAlias = tuple[str, dict[str, str]]

# At most this often a device's unchanged record is written again by a node.
REFRESH_S: Final = 300.0
# Devices remembered; past that the least recently recorded is forgotten (and recorded again
# at its next message). About 0.45 KB each (its id, the wildcards' dict; 25-character ids,
# tracemalloc): ~4.5 MB.
DEVICES: Final = 10_000


class MappingMemory:
    def __init__(
        self,
        *,
        refresh_s: float = REFRESH_S,
        devices: int = DEVICES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refresh_s = refresh_s
        self.devices = max(1, devices)
        self._clock = clock
        # Device id -> (mapping, wildcards, when recorded), the least recently recorded first.
        self._recorded: dict[str, tuple[str, dict[str, str], float]] = {}

    def __len__(self) -> int:
        return len(self._recorded)

    def due(self, mapped: Mapping[str, Recorded]) -> dict[str, Recorded]:
        """Those of ``mapped`` to record: new to this node, changed, or recorded too long ago."""
        recorded = self._recorded
        oldest = self._clock() - self.refresh_s
        due: dict[str, Recorded] = {}
        for device_id, value in mapped.items():
            known = recorded.get(device_id)
            if known is None or known[2] <= oldest or known[0] != value[0] or known[1] != value[1]:
                due[device_id] = value
        return due

    def recorded(self, mapped: Mapping[str, Recorded]) -> None:
        """After the commit that recorded ``mapped``."""
        if not mapped:
            return
        recorded = self._recorded
        now = self._clock()
        for device_id, (mapping, captures) in mapped.items():
            recorded.pop(device_id, None)  # to the end: the most recently recorded
            recorded[device_id] = (mapping, captures, now)
        while len(recorded) > self.devices:
            del recorded[next(iter(recorded))]
