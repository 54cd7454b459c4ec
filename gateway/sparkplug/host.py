"""The host application's judgement of a batch of Sparkplug messages, in the batch's own
transaction (so the PUBACK still follows the commit that stored what they said).

Per edge node, in message order, against the state PostgreSQL holds for it (locked for the
batch, so any node of a ``$share`` group decides as one would):

- ``NBIRTH`` defines the node's metrics and aliases (forgetting its devices'), its ``bdSeq``
  and ``seq``; the node is online and trusted again, and a pending rebirth request is done.
  Its devices keep their presence until the births are over (``unborn``).
- ``DBIRTH`` adds a device's metrics and aliases; the device is online.
- The node's first message after its births that is no birth, no seq before it missing, ends
  them: a device of the session before that no ``DBIRTH`` bore is offline (so is it the
  rebirth loop's grace after the ``NBIRTH``, :mod:`gateway.sparkplug.rebirth`).
- ``NDATA``/``DDATA`` become telemetry rows (metrics by name or by the birth's alias);
  ``DDEATH`` sets its device offline (a late ``DBIRTH`` or ``DDEATH``, older in seq order
  than the device's latest birth or death, changes nothing of it); ``NDEATH`` with the
  birth's ``bdSeq``, or a later session's, sets the node and every device of it offline (an
  earlier ``bdSeq``: an older session's Will, ignored).
- A ``seq`` that skips (beyond ``[sparkplug] reorder_window_s``) or goes back, an alias or a
  device no birth defined: the node is not trusted — its data is stored but not judged by the
  rules — until its next ``NBIRTH``, and a rebirth request is wanted (the loop in
  :mod:`gateway.sparkplug.rebirth` sends it).
- Data of a node (or device) that is not born (never, or since its death) cannot be read for
  sure: a dead letter, ``SPARKPLUG_NOT_BORN``, and a rebirth request. Except a device's late
  data (its seq missing) published while it was born, under the birth whose aliases are still
  its own (``_lived``): stored. A born device's late data published before its DBIRTH in
  force, read by alias: a dead letter, ``SPARKPLUG_OLD_SESSION`` (``_before_birth``).
- A ``DBIRTH``, ``DDEATH`` or data published before the ``NBIRTH`` in force (its payload
  timestamp older) and taken within the reorder window after it is the session before's: a
  dead letter, ``SPARKPLUG_OLD_SESSION``, moving nothing of the stream.
- An untrusted node's data reading a metric by alias, after seq 0 in seq order while seq 0 is
  missing (its seq skipped over it, or went back: the stream started again), within the
  reorder window: maybe a new session's (the rebirth asked for, a restart), whose NBIRTH
  another node commits: a dead letter, ``SPARKPLUG_SESSION_UNKNOWN``.
- A message seen already (a redelivery: same topic and bytes among the node's last ones) is
  skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec
import structlog

from protocol import Telemetry, canonical_bytes
from protocol.messages import MAX_EPOCH_MS
from protocol.sparkplug import (
    BDSEQ,
    MessageType,
    RawMetric,
    SparkplugPayload,
    SparkplugTopic,
    SparkplugValue,
    metric_value,
)
from storage import sparkplug as repo
from storage.ingest import DeadLetterRow, TelemetryRow

log = structlog.get_logger(__name__)

NOT_BORN = "SPARKPLUG_NOT_BORN"
# A DBIRTH, DDEATH or data of the session before the NBIRTH in force, committed after it.
OLD_SESSION = "SPARKPLUG_OLD_SESSION"
# Data using aliases while seq 0 of its stream is missing: a new session's NBIRTH (and the
# births after it) may be there, not taken yet, and its aliases another metric's.
SESSION_UNKNOWN = "SPARKPLUG_SESSION_UNKNOWN"
INVALID = "INVALID"
# Message ids kept per edge node to recognise a redelivery.
RECENT = 64
# Aliases and metric names of the edge nodes' births a host holds between batches, in all
# (about 0.16 KB each decoded, tracemalloc: ~8 MB); past that the least recently used
# node's are dropped, and read again by its next batch. A node counts NODE_HELD_COST of
# them itself, and each of its devices one: a node with nothing born (met by data only, or
# born with no metric) still costs its key, its token and two dicts, ~0.4 KB, and churning
# node names (renamed, replaced, a random suffix) were held without bound (~30 MB for 60,000).
HELD_BIRTHS = 50_000
NODE_HELD_COST = 3
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# JSON of an edge node's state (jsonb columns) and of each sample's metrics, through msgspec:
# the standard library's json.dumps and json.loads were a tenth of a Sparkplug drain's CPU
# (the node's aliases, read every batch and then written by every batch too, and a dumps
# per sample). The values are
# what metric_value gives (finite floats, integers within 64 bits, booleans, valid strings),
# which both encode alike for jsonb.
_encode = msgspec.json.Encoder().encode


def _json(value: object) -> str:
    return _encode(value).decode()


_decode = msgspec.json.decode


@dataclass(slots=True)
class SparkplugMessage:
    """One decoded Sparkplug message of a batch; ``letter`` makes its dead letter."""

    topic: SparkplugTopic
    payload: SparkplugPayload
    message_id: str
    letter: Callable[[str, str], DeadLetterRow]
    # Delivered at QoS 0: the broker never delivers it again, so it is nobody's redelivery,
    # even with the bytes of a message applied before (Eclipse Tahu's JavaScript client makes
    # its Will once: every session's NDEATH is the same bytes, at QoS 0).
    at_most_once: bool = False


@dataclass(slots=True)
class HostOutcome:
    """What a batch's Sparkplug messages add to it."""

    telemetry: list[TelemetryRow] = field(default_factory=list)
    decoded: list[Telemetry] = field(default_factory=list)
    # Event ids stored but not judged by the rules (an untrusted edge node's).
    untrusted: set[str] = field(default_factory=set)
    presence: dict[str, str] = field(default_factory=dict)
    seen_devices: set[str] = field(default_factory=set)
    dead_letters: list[DeadLetterRow] = field(default_factory=list)
    births: int = 0
    deaths: int = 0
    duplicates: int = 0
    # Edge nodes that became untrusted in this batch, with why.
    distrusted: list[tuple[str, str]] = field(default_factory=list)
    # The births the batch wrote (its NBIRTHs and DBIRTHs), as the commit leaves them: the
    # host holds them once the caller says the batch committed (SparkplugHost.committed).
    births_written: dict[tuple[str, str], _Births] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Births:
    """An edge node's aliases and metric datatypes as the row holds them under ``token``
    (never changed in place: a birth replaces the dicts of the node it is judged against)."""

    token: str
    aliases: dict[str, list[object]]
    metrics: dict[str, dict[str, int | None]]

    @property
    def size(self) -> int:
        """Its share of HELD_BIRTHS: the node itself, its devices, aliases and metric names."""
        metrics = self.metrics
        return (
            NODE_HELD_COST
            + len(self.aliases)
            + len(metrics)
            + sum(len(names) for names in metrics.values())
        )


def _written(
    read: str, aliases: dict[str, list[object]], metrics: dict[str, dict[str, int | None]]
) -> _Births:
    """The births a write of ``aliases`` and ``metrics`` leaves on a row read under the
    token ``read``: the version one on (migration 0039's trigger), on the same server."""
    version, _, server = read.partition("@")
    return _Births(f"{int(version) + 1}@{server}", aliases, metrics)


@dataclass(slots=True)
class _Node:
    """One edge node's state while a batch is judged (decoded from ``NodeRow``)."""

    group: str
    node: str
    born: bool
    bdseq: int | None
    seq: int | None
    missing: dict[str, float]
    trusted: bool
    aliases: dict[str, list[object]]
    metrics: dict[str, dict[str, int | None]]
    devices: list[str]
    recent: list[str]
    rebirth_reason: str | None
    births_token: str  # the births' token as read (lock_nodes)
    # The bdSeq of an NDEATH taken before its session's NBIRTH (another node of a $share group
    # committed the Will first): that NBIRTH finds its session dead.
    dead_bdseq: int | None = None
    # The devices of the session before the latest NBIRTH that no DBIRTH has born since: their
    # presence is left as it was until the births are over (`_births_over`, or the rebirth
    # loop's grace), not set offline by the NBIRTH (migration 0050).
    unborn: list[str] = field(default_factory=list)
    # Each device's latest DBIRTH or DDEATH seq taken while a seq before it was missing
    # (migration 0059): a late DBIRTH or DDEATH older than it changes nothing of the device.
    marks: dict[str, int] = field(default_factory=dict)
    # Each device's latest life taken while a seq before it was missing (migration 0062):
    # [the seq of its DBIRTH in force (None: born before the first seq missing), the seq of
    # the DDEATH that ended it (None: alive)]. Late data of a dead device published within it
    # is read with that birth's aliases (`_lived`).
    lives: dict[str, list[int | None]] = field(default_factory=dict)
    # The payload timestamp of the NBIRTH in force (epoch ms), and when it was taken (the
    # database's epoch seconds): a message published before it, committed within the reorder
    # window after it, is of the session before (migration 0061).
    birth_ts: int | None = None
    born_epoch: float | None = None
    born_now: bool = False
    # A birth in this batch replaced aliases and metrics: only then are they written back.
    births_changed: bool = False

    @classmethod
    def of(cls, row: repo.NodeRow, births: _Births) -> _Node:
        return cls(
            group=row.group_id,
            node=row.edge_node_id,
            born=row.born,
            bdseq=row.bdseq,
            seq=row.seq,
            missing=_decode(row.missing),
            trusted=row.trusted,
            aliases=births.aliases,
            metrics=births.metrics,
            devices=list(row.devices),
            recent=list(row.recent),
            rebirth_reason=row.rebirth_reason,
            births_token=births.token,
            dead_bdseq=row.dead_bdseq,
            # Less those born since: a node of the previous release took their DBIRTH (a
            # rolling upgrade) and left `unborn` as it was.
            unborn=[device for device in row.unborn if device not in row.devices],
            marks=_decode(row.device_marks),
            birth_ts=row.birth_ts,
            born_epoch=row.born_epoch,
            lives=_decode(row.device_lives),
        )

    def write(self) -> repo.NodeWrite:
        return repo.NodeWrite(
            group_id=self.group,
            edge_node_id=self.node,
            born=self.born,
            bdseq=self.bdseq,
            seq=self.seq,
            missing=_json(self.missing),
            trusted=self.trusted,
            # Unchanged (no birth in the batch): left as stored, neither encoded here nor
            # parsed and written again by PostgreSQL (an edge node's aliases grow with every
            # metric it has: kilobytes, written back by every batch before).
            aliases=_json(self.aliases) if self.births_changed else None,
            metrics=_json(self.metrics) if self.births_changed else None,
            devices=self.devices,
            recent=self.recent[-RECENT:],
            rebirth_reason=self.rebirth_reason,
            born_now=self.born_now,
            dead_bdseq=self.dead_bdseq,
            unborn=self.unborn,
            # Only while a seq is missing: no message can be late otherwise.
            device_marks=_json(self.marks) if self.missing else "{}",
            device_lives=_json(self.lives) if self.missing else "{}",
            birth_ts=self.birth_ts,
        )

    @property
    def key(self) -> str:
        return f"{self.group}/{self.node}"


class SparkplugHost:
    """Judges the Sparkplug messages of a batch (``apply``), in the caller's transaction."""

    def __init__(self, *, reorder_window_s: float = 0.0, replay: bool = False) -> None:
        self.reorder_window_s = reorder_window_s
        # Replaying dead letters: a message from the past, judged against today's births. Its
        # data is read with the aliases in force and stored, never judged by the rules, and it
        # moves nothing of the stream (seq, births, presence); births and deaths are not
        # replayed (their moment has passed).
        self.replay = replay
        # Edge nodes' births held between batches (the least recently used first), at most
        # HELD_BIRTHS aliases and metric names in all: a batch is sent again only the births
        # another writer changed since (storage.sparkplug.lock_nodes).
        self._births: dict[tuple[str, str], _Births] = {}
        self._births_size = 0

    async def apply(
        self, conn: asyncpg.Connection, messages: Sequence[SparkplugMessage]
    ) -> HostOutcome:
        out = HostOutcome()
        if not messages:
            return out
        keys = {(m.topic.group, m.topic.node) for m in messages}
        # What this batch holds, taken now: another flight's batch may change the host's
        # copies while this one waits for its rows.
        held = {key: births for key in keys if (births := self._births.get(key)) is not None}
        rows = await repo.lock_nodes(
            conn, list(keys), {key: births.token for key, births in held.items()}
        )
        nodes = {}
        for key, row in rows.items():
            if row.aliases is None or row.metrics is None:
                births = held[key]  # the row's own still
                if self._births.get(key) is births:
                    self._births[key] = self._births.pop(key)  # the most recently used
            else:
                births = _Births(row.births, _decode(row.aliases), _decode(row.metrics))
                self._hold(key, births)  # as committed: whatever this batch does
            nodes[key] = _Node.of(row, births)
        now = await repo.db_epoch(conn) if self.reorder_window_s > 0 else 0.0
        for message in messages:
            node = nodes[(message.topic.group, message.topic.node)]
            short = message.message_id[:16]
            if not message.at_most_once and short in node.recent:
                out.duplicates += 1
                continue
            letters = len(out.dead_letters)
            self._one(node, message, out, now)
            if len(out.dead_letters) == letters and not message.at_most_once:
                # Applied: a redelivery is skipped. (A dead letter is not: replayed, it is
                # judged again. Nor a message at QoS 0: none comes again.)
                node.recent.append(short)
        await repo.write_nodes(conn, [node.write() for node in nodes.values()])
        for key, node in nodes.items():
            if node.births_changed:
                out.births_written[key] = _written(node.births_token, node.aliases, node.metrics)
        return out

    def committed(self, out: HostOutcome) -> None:
        """After the commit of the batch ``out`` came from (never after a rollback): the
        births it wrote are held as the row now has them."""
        for key, births in out.births_written.items():
            self._hold(key, births)

    def _hold(self, key: tuple[str, str], births: _Births) -> None:
        known = self._births.pop(key, None)
        if known is not None:
            self._births_size -= known.size
        size = births.size
        if size > HELD_BIRTHS:
            return  # larger than all that is held: read each batch
        self._births[key] = births
        self._births_size += size
        while self._births_size > HELD_BIRTHS:
            oldest = next(iter(self._births))
            self._births_size -= self._births.pop(oldest).size

    # --- one message ---------------------------------------------------------------------

    def _one(self, node: _Node, message: SparkplugMessage, out: HostOutcome, now: float) -> None:
        kind = message.topic.type
        if self.replay:
            self._replayed(node, message, out)
        elif kind is MessageType.NBIRTH:
            self._nbirth(node, message, out)
            node.born_epoch = now
        elif kind is MessageType.NDEATH:
            self._ndeath(node, message, out)
        elif not node.born:
            self._distrust(node, out, "data before the node's birth")
            out.dead_letters.append(
                message.letter(
                    NOT_BORN, f"edge node {node.key} has no birth in force: a rebirth is requested"
                )
            )
        elif self._old_session(node, message, now):
            out.dead_letters.append(
                message.letter(
                    OLD_SESSION,
                    f"published at {message.payload.timestamp} before the NBIRTH in force "
                    f"({node.birth_ts}) of edge node {node.key}: of the session before, whose "
                    "aliases and seq are not this one's; not applied",
                )
            )
        else:
            self._stream(node, message, out, now)

    def _old_session(self, node: _Node, message: SparkplugMessage, now: float) -> bool:
        """A born node's DBIRTH, DDEATH or data published before the NBIRTH in force (its
        payload timestamp older, on the edge node's clock), taken within the reorder window
        after that birth: the session before's, held by another node of a ``$share`` group
        while the birth was committed (its seq started again at 0 with the birth, so it may
        look in order). Past the window nothing is held that long, and an edge node's clock
        stepped back after its birth refuses nothing."""
        published = message.payload.timestamp
        return (
            self.reorder_window_s > 0
            and published is not None
            and node.birth_ts is not None
            and node.born_epoch is not None
            and published < node.birth_ts
            and now - node.born_epoch <= self.reorder_window_s
        )

    def _stream(self, node: _Node, message: SparkplugMessage, out: HostOutcome, now: float) -> None:
        """A born node's DBIRTH, DDEATH or data."""
        late = self._check_seq(node, message.payload.seq, out, now)
        if self._session_unknown(node, message):
            out.dead_letters.append(
                message.letter(
                    SESSION_UNKNOWN,
                    f"seq {message.payload.seq} of edge node {node.key} follows a seq 0 not "
                    "taken yet: maybe a new session's NBIRTH, whose aliases are not the ones in "
                    "force; not applied (replay it once the births are stored)",
                )
            )
        else:
            self._in_stream(node, message, out, late=late)
        if not node.missing:
            node.marks = {}  # no message can be late now
            node.lives = {}

    def _session_unknown(self, node: _Node, message: SparkplugMessage) -> bool:
        """An untrusted node's data reading a metric by alias, after seq 0 of its stream in
        seq order while that seq is missing (within the reorder window): that may be a new
        session's NBIRTH (the answer to the rebirth asked for, or a restart: the seq went
        back), committed by another node of a ``$share`` group, the data that session's, read
        with the old session's aliases. Seq 0 taken as data (the stream's own wrap), the
        NBIRTH, or the window past, ends the doubt. A trusted node's seq skipping over 0 is
        its own wrap, reordered (frequent in a ``$share`` group: each would be a letter)."""
        seq = message.payload.seq
        if (
            message.topic.type not in (MessageType.NDATA, MessageType.DDATA)
            or node.trusted
            or "0" not in node.missing
            or seq is None
            or node.seq is None
        ):
            return False
        if (node.seq - seq) % 256 >= node.seq % 256:
            return False  # before seq 0: the stream's own, in force
        return _by_alias(message)

    def _in_stream(
        self, node: _Node, message: SparkplugMessage, out: HostOutcome, *, late: bool
    ) -> None:
        kind = message.topic.type
        device = message.topic.device
        seq = message.payload.seq
        if (
            kind in (MessageType.DBIRTH, MessageType.DDEATH)
            and device is not None
            and seq is not None
            and late
            and _overtaken(node, device, seq)
        ):
            # Committed after a birth or death of its device that follows it in seq order
            # (another node of a $share group took it first): that one is what the device is.
            # A DBIRTH's values are stored (they were read), under the names it gives.
            log.info(
                "sparkplug_device_overtaken",
                device=message.topic.device_key,
                seq=seq,
                later_seq=node.marks[device],
                note=f"a {kind.value} older than the device's latest birth or death: "
                "its presence and births are left as they are",
            )
            if kind is MessageType.DBIRTH:
                self._data(node, message, out, birth=True)
            return
        if kind is MessageType.DBIRTH:
            self._dbirth(node, message, out)
            if device is not None and seq is not None:
                node.marks[device] = seq
                node.lives[device] = [seq, None]
            return
        if not node.missing:
            # In order: the births are over. With a seq before it still missing (another node
            # of a $share group commits it, within the reorder window), that may be a DBIRTH:
            # its device, set offline here, raised "presence offline" for nothing. The next
            # message in order ends them, or the rebirth loop's grace.
            self._births_over(node, out)
        assert device is None or kind in (MessageType.DDATA, MessageType.DDEATH)
        if kind is MessageType.DDEATH:
            assert device is not None
            if seq is not None:
                node.marks[device] = seq
                if device in node.devices:
                    # The end of the birth in force: of one taken with a seq missing, or of
                    # one before the first seq missing (None).
                    life = node.lives.get(device)
                    born = life[0] if life is not None and life[1] is None else None
                    node.lives[device] = [born, seq]
            if device in node.unborn:
                node.unborn.remove(device)
            out.presence[message.topic.device_key] = "offline"
            if device in node.devices:
                node.devices.remove(device)
                out.deaths += 1
            elif not node.missing:
                # No birth of it anywhere before (with a seq before it missing, that may be
                # its DBIRTH, committed by another node of a $share group: judged then).
                self._distrust(node, out, f"device {device} has no birth in force")
            return
        self._stream_data(node, message, out, late=late)

    def _stream_data(
        self, node: _Node, message: SparkplugMessage, out: HostOutcome, *, late: bool
    ) -> None:
        """A born node's data (``late``: its seq was missing)."""
        device = message.topic.device
        seq = message.payload.seq
        if (
            device is not None
            and device not in node.devices
            and not (late and seq is not None and _lived(node, device, seq))
        ):
            self._distrust(node, out, f"device {device} has no birth in force")
            out.dead_letters.append(
                message.letter(
                    NOT_BORN,
                    f"device {message.topic.device_key} has no birth in force: "
                    "a rebirth is requested",
                )
            )
            return
        if (
            late
            and device is not None
            and seq is not None
            and _by_alias(message)
            and _before_birth(node, device, seq)
        ):
            # Published under the device's birth before the one in force (another node of a
            # $share group committed its DDEATH and DBIRTH first): their aliases are not its.
            out.dead_letters.append(
                message.letter(
                    OLD_SESSION,
                    f"seq {seq} of {message.topic.device_key} was published before its DBIRTH "
                    f"in force (seq {node.lives[device][0]}), whose aliases are not the ones it "
                    "was sent with; not applied",
                )
            )
            return
        self._data(node, message, out, birth=False)

    def _replayed(self, node: _Node, message: SparkplugMessage, out: HostOutcome) -> None:
        topic = message.topic
        if topic.type not in (MessageType.NDATA, MessageType.DDATA):
            out.dead_letters.append(
                message.letter(
                    INVALID, f"a replayed {topic.type.value} changes nothing: not applied"
                )
            )
            return
        if not node.born or (topic.device is not None and topic.device not in node.devices):
            out.dead_letters.append(
                message.letter(NOT_BORN, f"{topic.device_key} has no birth in force")
            )
            return
        trusted = node.trusted
        node.trusted = False  # stored, not judged: it is from the past
        before = (node.rebirth_reason, len(out.distrusted))
        self._data(node, message, out, birth=False)
        node.trusted = trusted
        if len(out.distrusted) > before[1]:  # an alias today's births do not have
            node.rebirth_reason = before[0]
            del out.distrusted[before[1] :]
            out.dead_letters.append(
                message.letter(
                    NOT_BORN,
                    f"the births in force do not define all of {topic.device_key}'s metrics",
                )
            )
            out.telemetry.clear()
            out.decoded.clear()

    def _nbirth(self, node: _Node, message: SparkplugMessage, out: HostOutcome) -> None:
        payload = message.payload
        if payload.seq is None or not 0 <= payload.seq <= 255:
            out.dead_letters.append(
                message.letter(INVALID, "an NBIRTH carries a seq from 0 to 255")
            )
            self._distrust(node, out, "an NBIRTH without a valid seq")
            return
        node.born = True
        node.born_now = True
        node.trusted = True
        node.rebirth_reason = None
        node.bdseq = payload.bdseq()
        node.seq = payload.seq
        node.birth_ts = payload.timestamp
        node.missing = {}
        node.marks = {}
        node.lives = {}
        node.aliases = {}
        node.metrics = {}
        node.births_changed = True
        # The devices' births are void too: they come again after the node's, right after it.
        # Their presence stays as it was until then (`_births_over`): a rebirth is no death,
        # and set offline here, a device committed apart from its DBIRTH (another batch,
        # another node of a $share group) raised "presence offline" for a moment.
        node.unborn = sorted({*node.unborn, *node.devices})
        node.devices = []
        out.presence[node.key] = "online"
        out.births += 1
        self._define(node, "", payload.metrics)
        self._data(node, message, out, birth=True)
        dead = node.dead_bdseq
        # This session's (below), or another's: done with either way. The next one's did stay
        # (for a rebirth of the session before, committed late), and an edge node that starts
        # its bdSeq at 0 in each process had its new session's first reconnect taken for dead:
        # pysparkplug's clean disconnect sends the next bdSeq (1 after a first birth of 0), its
        # restart births 0, and its first reconnect 1
        # (test_sparkplug_clean_disconnect_restart.py).
        node.dead_bdseq = None
        if dead is not None and dead == node.bdseq:
            # Its Will came first ($share: committed by another node before this birth): the
            # session is over. Its birth's values are stored (they were read); the node and
            # its devices are offline, as the death left them.
            log.info(
                "sparkplug_death_before_birth",
                edge_node=node.key,
                bdseq=dead,
                note="the NDEATH of this NBIRTH's session was taken first: the node is dead",
            )
            self._die(node, out)

    def _dbirth(self, node: _Node, message: SparkplugMessage, out: HostOutcome) -> None:
        device = message.topic.device
        assert device is not None
        # New dicts, not the read ones changed in place: those are held (_Births).
        node.aliases = {a: d for a, d in node.aliases.items() if d[0] != device}
        node.metrics = {d: names for d, names in node.metrics.items() if d != device}
        node.births_changed = True
        self._define(node, device, message.payload.metrics)
        if device not in node.devices:
            node.devices.append(device)
        if device in node.unborn:
            node.unborn.remove(device)
        out.presence[message.topic.device_key] = "online"
        out.births += 1
        self._data(node, message, out, birth=True)

    def _ndeath(self, node: _Node, message: SparkplugMessage, out: HostOutcome) -> None:
        bdseq = message.payload.bdseq()
        if bdseq is not None and _next_session(bdseq, node.bdseq):
            # The next session's death (bdSeq counts sessions, 0-255 wrapping): its NBIRTH may
            # still be on its way ($share: another node commits it). Kept, so that this birth,
            # when it comes, finds its session dead. It ends the session in force too (an edge
            # node holds one connection, one client id, at a time): the node dies now. Left
            # online until that birth, it stayed online for good where none comes:
            # pysparkplug's clean disconnect sends the next session's bdSeq (its Will is made
            # for the next connection once its births are out).
            node.dead_bdseq = bdseq
            log.info(
                "sparkplug_death_before_birth",
                edge_node=node.key,
                bdseq=bdseq,
                birth_bdseq=node.bdseq,
                note="an NDEATH of the next session: the node is dead, and that session's"
                " NBIRTH, if it comes, finds it dead",
            )
            if node.born:
                self._die(node, out)
            return
        if not node.born or bdseq != node.bdseq:
            # An earlier session's Will; or one further on than the next session, which no
            # edge node reaches before its births: a late Will from before the edge node
            # started its bdSeq at 0 again (pysparkplug, srad, the demo's edge node do at each
            # start). Kept as a death to come, it killed the session of that bdSeq, born and
            # serving, reconnects later.
            log.info(
                "sparkplug_stale_death",
                edge_node=node.key,
                bdseq=bdseq,
                birth_bdseq=node.bdseq,
                note="an NDEATH of another session than the birth in force: ignored",
            )
            return
        self._die(node, out)

    @staticmethod
    def _die(node: _Node, out: HostOutcome) -> None:
        node.born = False
        node.trusted = False
        node.rebirth_reason = None  # a dead node is not asked for anything; its birth will come
        node.missing = {}
        node.marks = {}
        node.lives = {}
        out.presence[node.key] = "offline"
        for device in (*node.devices, *node.unborn):
            out.presence[f"{node.key}/{device}"] = "offline"
        node.devices = []
        node.unborn = []
        out.deaths += 1

    @staticmethod
    def _births_over(node: _Node, out: HostOutcome) -> None:
        """A message of the node's session that is no birth: its DBIRTHs are over (Sparkplug
        sends them all right after the NBIRTH, before any data). The devices of the session
        before that none of them bore are gone: offline."""
        for device in node.unborn:
            out.presence[f"{node.key}/{device}"] = "offline"
        node.unborn = []

    # --- births, metrics -----------------------------------------------------------------

    @staticmethod
    def _define(node: _Node, device: str, metrics: Sequence[RawMetric]) -> None:
        names = node.metrics.setdefault(device, {})
        for metric in metrics:
            if metric.name is None:
                continue
            names[metric.name] = metric.datatype
            if metric.alias is not None:
                node.aliases[str(metric.alias)] = [device, metric.name, metric.datatype]

    def _data(
        self, node: _Node, message: SparkplugMessage, out: HostOutcome, *, birth: bool
    ) -> None:
        topic = message.topic
        device = topic.device or ""
        payload = message.payload
        known = node.metrics.get(device, {})
        by_time: dict[int, dict[str, SparkplugValue]] = {}
        out.seen_devices.add(topic.device_key)
        for metric in payload.metrics:
            name = metric.name
            datatype: int | None = None
            if name is None and metric.alias is not None:
                entry = node.aliases.get(str(metric.alias))
                if entry is None or entry[0] != device:
                    self._distrust(
                        node, out, f"alias {metric.alias} is in no birth of {topic.device_key}"
                    )
                    continue
                name = str(entry[1])
                datatype = entry[2] if isinstance(entry[2], int) else None
            elif name is not None:
                if name not in known and not birth:
                    self._distrust(
                        node, out, f"metric {name!r} is in no birth of {topic.device_key}"
                    )
                    continue
                datatype = known.get(name)
            if name is None or (name == BDSEQ and device == ""):
                continue
            value = metric_value(metric, datatype)
            if value is None:
                continue  # null, or a kind rules do not compare (docs/sparkplug.md)
            at = metric.timestamp if metric.timestamp is not None else payload.timestamp
            if at is None:
                out.dead_letters.append(
                    message.letter(INVALID, f"metric {name!r} has no timestamp, nor its payload")
                )
                return
            by_time.setdefault(at, {})[name] = value
        for at, values in sorted(by_time.items()):
            # Judged as an integer first: a time in microseconds or nanoseconds (an edge node
            # that does not send milliseconds), or an unset uint64, holds no date at all, and
            # making one raised (OverflowError: the whole batch refused, a bug to the writer).
            if not 0 <= at <= MAX_EPOCH_MS:
                out.dead_letters.append(message.letter(INVALID, f"timestamp {at} is out of range"))
                return
            ts = _EPOCH + timedelta(milliseconds=at)
            telemetry = Telemetry(ts=ts, seq=payload.seq, metrics=values)
            event_id = event_id_of(topic.device_key, telemetry)
            out.telemetry.append(
                TelemetryRow(
                    event_id=event_id,
                    device_id=topic.device_key,
                    ts_us=at * 1000,
                    seq=payload.seq,
                    metrics_json=_json(values),
                    events_json=None,
                )
            )
            # The rules order the device's samples by time alone: a Sparkplug seq is the edge
            # node's transport counter (0-255, wrapping, shared by its devices), not a device's
            # sample counter. Given to them, each wrap was a reboot (`seq_reset`) and a late
            # sample from before a wrap a clock stepped back, judged newer than the newest
            # (docs/sparkplug.md). The row and the event id keep the seq as sent.
            out.decoded.append(msgspec.structs.replace(telemetry, seq=None))
            if not node.trusted:
                out.untrusted.add(event_id)

    # --- seq -----------------------------------------------------------------------------

    def _check_seq(self, node: _Node, seq: int | None, out: HostOutcome, now: float) -> bool:
        """Follow the node's seq; whether the message is late (its seq was missing)."""
        if seq is None or not 0 <= seq <= 255:
            self._distrust(node, out, "a message without a valid seq")
            return False
        last = node.seq
        if last is None:
            node.seq = seq
            return False
        ahead = (seq - last) % 256
        late = False
        if ahead == 1:
            node.seq = seq
        elif str(seq) in node.missing:
            del node.missing[str(seq)]  # late, within the reorder window
            late = True
        elif 1 < ahead < 128 and self.reorder_window_s > 0:
            for skipped in range(1, ahead):
                node.missing.setdefault(str((last + skipped) % 256), now)
            node.seq = seq
        else:
            node.seq = seq
            node.missing = {}
            self._distrust(node, out, f"seq {seq} after {last}")
            if 0 < seq < 128 and self.reorder_window_s > 0:
                # The stream started again: a new session's, maybe, whose NBIRTH (seq 0) and
                # births after it another node of a $share group commits (its data waits
                # for them: `_session_unknown`).
                node.missing = {str(skipped): now for skipped in range(seq)}
            # Seqs of the stream before (missing now, the marks are its), none of this one's.
            node.marks = {}
            node.lives = {}
        window = self.reorder_window_s
        if window > 0 and node.missing and min(node.missing.values()) < now - window:
            node.missing = {}
            self._distrust(node, out, "a seq missing longer than the reorder window")
        return late

    @staticmethod
    def _distrust(node: _Node, out: HostOutcome, why: str) -> None:
        if node.trusted or node.rebirth_reason is None:
            out.distrusted.append((node.key, why))
            log.warning("sparkplug_rebirth_wanted", edge_node=node.key, reason=why)
        node.trusted = False
        if node.rebirth_reason is None:
            node.rebirth_reason = why[:200]


def _overtaken(node: _Node, device: str, seq: int) -> bool:
    """A late message of ``device`` at ``seq`` is older in seq order than the device's latest
    birth or death taken (``marks``: taken while a seq before it was missing, so within the
    reorder window of the node's seq, which no seq there has passed by 256)."""
    mark = node.marks.get(device)
    if mark is None or node.seq is None:
        return False
    return 0 < (mark - seq) % 256 <= (node.seq - seq) % 256


def _lived(node: _Node, device: str, seq: int) -> bool:
    """Late data of ``device`` (dead now) at ``seq`` was published while it was born, under
    the birth whose aliases are still its own: within the device's last life taken (``lives``:
    after its DBIRTH, or with none taken, its birth before the first seq missing; before the
    DDEATH that ended it), and no seq between that birth and ``seq`` still missing (another
    death and birth, with other aliases, may be there). In seq order, as ``_overtaken``."""
    born, died = node.lives.get(device, (None, None))
    if died is None or node.seq is None:
        return False
    top = node.seq

    def age(at: int) -> int:
        return (top - at) % 256

    if not age(seq) > age(died):
        return False
    if born is not None and not age(born) > age(seq):
        return False
    return not any(
        age(int(gap)) > age(seq) and (born is None or age(int(gap)) < age(born))
        for gap in node.missing
    )


def _before_birth(node: _Node, device: str, seq: int) -> bool:
    """Late data of ``device`` (born) at ``seq`` was published before the device's DBIRTH in
    force, taken while a seq before it was missing (``lives``): under an earlier birth."""
    born = node.lives.get(device, (None, None))[0]
    if born is None or node.seq is None:
        return False
    return (node.seq - born) % 256 < (node.seq - seq) % 256


def _by_alias(message: SparkplugMessage) -> bool:
    """A metric of the message is named by its alias alone (read with a birth's aliases)."""
    return any(m.name is None and m.alias is not None for m in message.payload.metrics)


def _next_session(bdseq: int, birth: int | None) -> bool:
    """``bdseq`` is the session after ``birth``'s (bdSeq counts an edge node's connections,
    one more each, 0-255 and wrapping). After no birth at all, nothing is known to be: a node
    never born here may have been born before this gateway ran, and its Will be that
    session's."""
    return birth is not None and bdseq == (birth + 1) % 256


def event_id_of(device_key: str, telemetry: Telemetry) -> str:
    """Hex SHA-256 of the namespace, the Sparkplug id and the sample's canonical bytes: a
    redelivery (or the same sample in another message) has the same id, a native device's
    never does (its id holds no `/`)."""
    return hashlib.sha256(
        b"spBv1.0\n" + device_key.encode() + b"\n" + canonical_bytes(telemetry)
    ).hexdigest()
