"""The per-node summary a cluster worker writes to the `fleet` bucket (keyed `p<k>.<node>`, k the
node's partition), like a node lease: what the fleet's readers (nodes, top, the Query API,
Prometheus, the scheduler) need and nothing else. `NodeLatest` is the worker's side, built from
batches; `MirrorNode` and `MirrorSeries` the readers', decoded from a summary, with the attributes
they read on the fleet state's NodeState and Series. Readers count a summary's "last seen" as at
most their own now (`seen_at`): a worker's clock ahead never keeps a node fresh."""

from __future__ import annotations

import collections
import math
import time
import zlib
from typing import Any

import msgpack

from xpusense.common import metric_names as m
from xpusense.v1 import telemetry_pb2 as pb

from ..batch_rows import BatchRows
from ..clock import ClockOffset, received_at, shift_of
from ..diagnoses import diagnosis_id
from ..node_series import IGNORED, MAX_REFS, NodeSeries
from ..series import series_key
from ..wire import WireBatch
from .seq_marks import SeqWindow

FORMAT = 2
# A summary is one msgpack map (NodeLatest.encode); its keys:
#   format          FORMAT                   node            node id
#   boot            current boot id          last_seen_ns    last seen (stream time)
#   streams         open agent streams       peer            peer of the last one
#   sessions        {session: ns} of the open streams
#   inventory       pb.Inventory bytes       stored_up_to    {boot: highest seq taken}
#   batches_stored, batches_duplicate        counts
#   series          [[name, unit, kind, labels, value, time ns, rate/s or None], ...]: the kept series
#   received_ns     [ns, ...]: each series' latest point on the gateway's clock (clock.received_at)
#   series_layout   checksum of which series `series` holds, in order: a reader that has the same
#                   layout updates its series in place by position
#   events          [[id, type, severity, device, message, attributes, time ns, received ns], ...],
#                   newest first
#   diagnoses       the open diagnoses as rows like `events`, oldest first; diagnoses_boot: their boot
#   counters        {counter key: n} of this node; diagnoses_opened {rule: n} (these four: only when set)
#   worker          worker id                written_ns      when written
# Format 1 used two-letter keys (below); decode reads both.
_FORMAT_1_KEYS = {"v": "format", "n": "node", "b": "boot", "t": "last_seen_ns", "c": "streams", "p": "peer",
                  "ss": "sessions", "i": "inventory", "m": "stored_up_to", "bs": "batches_stored",
                  "bd": "batches_duplicate", "s": "series", "r": "received_ns", "sk": "series_layout", "e": "events",
                  "dg": "diagnoses", "db": "diagnoses_boot", "dc": "counters", "do": "diagnoses_opened",
                  "w": "worker", "at": "written_ns"}
# Kept series: the host's CPU, memory and network; per accelerator utilisation, HBM, power,
# temperature, health, XID and error-code counts; per pod its use of each accelerator and the
# kubelet's assignments (no per-process or per-MIG-instance series): a few KB a node.
KEPT = frozenset({m.CPU_UTILIZATION, m.MEMORY_UTILIZATION, m.NETWORK_IO, m.GPU_UTILIZATION, m.GPU_MEMORY_USAGE,
                  m.GPU_MEMORY_LIMIT, m.GPU_MEMORY_UTILIZATION, m.HBM_BANDWIDTH_UTILIZATION, m.POWER, m.TEMPERATURE,
                  m.HEALTH, m.MEMORY_FREE, m.XID_ERRORS, m.LAST_XID, m.NPU_ERROR_CODES, m.NPU_ERROR_CODE,
                  m.POD_UTILIZATION, m.POD_MEMORY_USAGE, m.DEVICE_ASSIGNED})
SKIPPED_LABELS = ("pid", "mig_instance")
MAX_SERIES = 512          # kept series per node in a summary
EVENTS_KEPT = 16
BOOTS_KEPT = 4


CLOCK_AHEAD_NS = 2 * 10**9   # a summary's "last seen" this far ahead of the reader's clock is counted


def seen_at(t_ns: int, now_ns: int) -> int:
    """A summary's "last seen" as a reader counts it: never after the reader's now."""
    return t_ns if t_ns <= now_ns else now_ns


def fleet_key(part: int, node_token: str) -> str:
    return f"p{part}.{node_token}"


def event_row(e: pb.Event) -> list:
    return [e.id, e.type, e.severity, e.device, e.message, dict(e.attributes), e.time_unix_nano]


def event_of(row) -> pb.Event:
    return pb.Event(id=row[0], type=row[1], severity=row[2], device=row[3], message=row[4], attributes=row[5],
                    time_unix_nano=row[6])


def received_of(row) -> int:
    """When an `events` row's event happened on the collector's clock (its stamp in a row without)."""
    return row[7] if len(row) > 7 else row[6]


def diagnoses_of(rows) -> collections.OrderedDict[str, pb.Event]:
    """A summary's `diagnoses` rows as the open diagnoses (diagnosis id -> open Event, oldest first)."""
    out: collections.OrderedDict[str, pb.Event] = collections.OrderedDict()
    for row in rows or ():
        e = event_of(row)
        out[diagnosis_id(e)] = e
    return out


class _Entry:
    """One kept series: the latest point and the one before (for counter rates)."""
    __slots__ = ("name", "unit", "kind", "labels", "value", "time_ns", "prev_value", "prev_time_ns", "recv_ns",
                 "idle_t", "idle_at")

    def __init__(self, name: str, unit: str, kind: int, labels: dict):
        self.name, self.unit, self.kind, self.labels = name, unit, kind, labels
        self.value, self.time_ns, self.prev_value, self.prev_time_ns = math.nan, 0, math.nan, 0
        self.recv_ns = 0
        self.idle_t, self.idle_at = -1, 0   # its stamp when the idle sweep saw it move, and when (idle.py)

    def rate(self) -> float | None:
        if self.kind != pb.COUNTER or not self.prev_time_ns or self.time_ns <= self.prev_time_ns:
            return None
        if self.value < self.prev_value:
            return None
        return (self.value - self.prev_value) / ((self.time_ns - self.prev_time_ns) / 1e9)


class NodeLatest(NodeSeries):
    """What a worker keeps of one node: latest values of the kept series (a NodeSeries table of
    _Entry), inventory, recent events."""
    __slots__ = ("node_id", "part", "boot_id", "last_seen_ns", "sessions", "peer", "inventory", "windows",
                 "batches_stored", "batches_duplicate", "events", "event_ids", "dirty", "_layout",
                 "diagnoses", "diagnoses_boot", "diagnosis_counts", "diagnoses_opened", "offset")

    def __init__(self, node_id: str, part: int):
        super().__init__()
        self.node_id, self.part = node_id, part
        self.boot_id, self.last_seen_ns, self.peer = "", 0, ""
        self.sessions: dict[str, int] = {}
        self.inventory = b""
        self.windows: collections.OrderedDict[str, SeqWindow] = collections.OrderedDict()
        self.batches_stored = self.batches_duplicate = 0
        self.events: collections.deque = collections.deque(maxlen=EVENTS_KEPT)
        self.event_ids: set[str] = set()
        self.dirty = True
        self._layout: int | None = None
        # Open diagnoses, kept by collector/diagnoses.py's Diagnoses (the worker's) as FleetState's NodeState.
        self.diagnoses: collections.OrderedDict[str, pb.Event] = collections.OrderedDict()
        self.diagnoses_boot = ""
        self.diagnosis_counts: dict[str, int] = {}
        self.diagnoses_opened: dict[str, int] = {}
        self.offset = ClockOffset()   # its agent's clock against the gateways' (collector/clock.py)

    # -- from the stream --------------------------------------------------------------------------
    def hello(self, hello: pb.Hello, session: str, peer: str, t_ns: int) -> None:
        self.boot_id = hello.boot_id
        self.inventory = hello.inventory.SerializeToString()
        self.sessions = {session: t_ns}   # the agent opened a new stream: its earlier ones are gone
        self.peer = peer
        self.last_seen_ns = max(self.last_seen_ns, t_ns)
        self._window(hello.boot_id)
        self.dirty = True

    def set_inventory(self, data: bytes) -> None:
        self.inventory = data
        self.dirty = True

    def bye(self, session: str) -> None:
        if self.sessions.pop(session, None) is not None:
            self.dirty = True

    def _window(self, boot: str) -> SeqWindow:
        w = self.windows.get(boot)
        if w is None:
            w = self.windows[boot] = SeqWindow()
            while len(self.windows) > BOOTS_KEPT:
                old = next(b for b in self.windows if b != boot)
                del self.windows[old]
                self.refs.pop(old, None)
        return w

    def apply(self, b: pb.Batch | WireBatch, t_ns: int, recv_ns: int = 0) -> bool:
        """A batch from the stream, received by a gateway at `recv_ns` (0: at `t_ns`): False when its
        (boot, seq) was taken before (dropped)."""
        recv_ns = recv_ns or t_ns
        shift = shift_of(b.sent_unix_nano, recv_ns)
        if t_ns > self.last_seen_ns:
            self.last_seen_ns = t_ns
        if not self._window(b.boot_id).take(b.seq, t_ns):
            self.batches_duplicate += 1
            return False
        self.batches_stored += 1
        if not self.boot_id:
            self.boot_id = b.boot_id
        gens = self.boot_refs(b.boot_id)   # turned by the worker's idle sweep too
        known = gens.cur.get
        samples = None   # protobuf's, read only for a series not known by its ref
        for i, (ref, t, v) in enumerate(BatchRows(b).rows()):
            e = known(ref) if ref else None
            if e is None:
                if samples is None:
                    samples = b.samples
                e = self.entry_for(gens, ref, samples[i], NodeLatest._new_entry, MAX_REFS)
                known = gens.cur.get
            if e is IGNORED:
                continue
            # The newest received is the latest, whatever its stamp (an agent clock stepped back).
            e.prev_value, e.prev_time_ns = e.value, e.time_ns
            e.value, e.time_ns, e.recv_ns = v, t, min(recv_ns, t + shift)
        sent = b.sent_unix_nano
        for ev in b.events:
            self.note_event(ev, received_at(ev.time_unix_nano, sent, recv_ns))
        self.dirty = True
        return True

    def note_event(self, ev: pb.Event, received_ns: int) -> None:
        """An event into the recent ones (once by id), with when it happened on our clock."""
        if ev.id and ev.id in self.event_ids:
            return
        if len(self.events) == self.events.maxlen:
            self.event_ids.discard(self.events[-1][0])
        self.events.appendleft((ev.id, ev.type, ev.severity, ev.device, ev.message, dict(ev.attributes),
                                ev.time_unix_nano, received_ns))
        self.event_ids.add(ev.id)
        self.dirty = True

    def _new_entry(self, s: pb.Sample, labels: dict) -> Any:
        """A new series of this node (NodeSeries.entry_for's `make`): an _Entry, or IGNORED when
        not one a summary keeps."""
        if s.name not in KEPT or any(k in labels for k in SKIPPED_LABELS) or len(self.series) >= MAX_SERIES:
            return IGNORED
        self._layout = None
        return _Entry(s.name, s.unit, s.kind, labels)

    def layout(self) -> int:
        if self._layout is None:
            self._layout = layout_of(self.series)
        return self._layout

    # -- to and from the bucket -----------------------------------------------------------------------
    def encode(self, worker: str, now_ns: int) -> bytes:
        d = {
            "format": FORMAT, "node": self.node_id, "boot": self.boot_id, "last_seen_ns": self.last_seen_ns,
            "streams": len(self.sessions), "peer": self.peer, "sessions": self.sessions, "inventory": self.inventory,
            "stored_up_to": {boot: w.high for boot, w in self.windows.items()},
            "batches_stored": self.batches_stored, "batches_duplicate": self.batches_duplicate,
            "series": [[e.name, e.unit, e.kind, e.labels, e.value, e.time_ns, e.rate()] for e in self.series.values()],
            "series_layout": self.layout(), "received_ns": [e.recv_ns or e.time_ns for e in self.series.values()],
            "events": list(self.events), "worker": worker, "written_ns": now_ns,
        }
        if self.diagnoses or self.diagnoses_boot:
            d.update(diagnoses=[event_row(e) for e in self.diagnoses.values()], diagnoses_boot=self.diagnoses_boot)
        if self.diagnosis_counts or self.diagnoses_opened:
            d.update(counters=self.diagnosis_counts, diagnoses_opened=self.diagnoses_opened)
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def restore(cls, d: dict, part: int) -> NodeLatest:
        """A node as the previous owner of its partition last wrote it (a takeover)."""
        n = cls(d["node"], part)
        n.boot_id, n.last_seen_ns, n.peer = d.get("boot", ""), d.get("last_seen_ns", 0), d.get("peer", "")
        n.sessions = dict(d.get("sessions") or {})
        n.inventory = d.get("inventory") or b""
        for boot, high in (d.get("stored_up_to") or {}).items():
            n.windows[boot] = SeqWindow(high, at=n.last_seen_ns)   # rose at the latest when last seen
        n.batches_stored, n.batches_duplicate = d.get("batches_stored", 0), d.get("batches_duplicate", 0)
        received = d.get("received_ns") or ()
        for i, (name, unit, kind, labels, value, t, _rate) in enumerate(d.get("series") or ()):
            e = n.series[series_key(name, labels)] = _Entry(name, unit, kind, labels)
            e.value, e.time_ns = value, t
            e.recv_ns = received[i] if i < len(received) else t
        for ev in reversed(d.get("events") or ()):
            n.events.appendleft(tuple(ev))
            n.event_ids.add(ev[0])
        n.diagnoses, n.diagnoses_boot = diagnoses_of(d.get("diagnoses")), d.get("diagnoses_boot", "")
        n.diagnosis_counts = dict(d.get("counters") or {})
        n.diagnoses_opened = dict(d.get("diagnoses_opened") or {})
        n.dirty = False
        return n


def layout_of(series: dict) -> int:
    """Checksum of which series (keys) a node has, in order."""
    return zlib.crc32(repr(list(series)).encode())


def decode(data: bytes) -> dict | None:
    """A summary as a map with format 2's keys (format 1's renamed), or None where it is not one."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        return None
    if not isinstance(d, dict):
        return None
    if d.get("v") == 1:
        d = {_FORMAT_1_KEYS.get(k, k): v for k, v in d.items()}
    elif d.get("format") != FORMAT:
        return None
    return d if isinstance(d.get("node"), str) else None


# -- the readers' side ------------------------------------------------------------------------------
class MirrorSeries:
    """A kept series as FleetState's Series shows it to readers (no history: that is the stream)."""
    __slots__ = ("name", "unit", "kind", "labels", "value", "time_ns", "_rate", "histogram", "recv_ns")

    def __init__(self, name: str, unit: str, kind: int, labels: dict, value: float, time_ns: int, rate,
                 recv_ns: int = 0):
        self.name, self.unit, self.kind, self.labels = name, unit, kind, labels
        self.value, self.time_ns, self.recv_ns = value, time_ns, recv_ns or time_ns
        self._rate = math.nan if rate is None else rate
        self.histogram = None

    def rate(self) -> float:
        return self._rate


class MirrorNode:
    """A node of the `fleet` bucket, with the attributes readers use on FleetState's NodeState."""
    __slots__ = ("node_id", "boot_id", "streams", "last_seen_ns", "peer", "inventory", "stored_up_to",
                 "batches_stored", "batches_duplicate", "series", "series_list", "layout", "events", "revision",
                 "written_ns", "worker", "diagnoses", "diagnosis_counts", "diagnoses_opened", "_diagnosis_rows")

    def __init__(self, d: dict, revision: int = 0, now_ns: int | None = None):
        self.node_id: str = d["node"]
        self.inventory = pb.Inventory.FromString(d.get("inventory") or b"")
        self.events = [event_of(e) for e in d.get("events") or ()]
        self.last_seen_ns = 0
        self.series: dict[tuple, MirrorSeries] = {}
        self.series_list: list[MirrorSeries] = []
        self.layout = -1
        self._diagnosis_rows: Any = None
        self.update(d, revision, time.time_ns() if now_ns is None else now_ns)

    def update(self, d: dict, revision: int, now_ns: int) -> None:
        """The node as summary `d` says (its series in place where their layout is the same); its
        inventory and events: the caller's to compare, when it is a newer summary of the node."""
        self.revision, self.written_ns, self.worker = revision, d.get("written_ns", 0), d.get("worker", "")
        self.boot_id: str = d.get("boot", "")
        self.streams: int = d.get("streams", 0)
        self.peer: str = d.get("peer", "")
        self.last_seen_ns = max(self.last_seen_ns, seen_at(d.get("last_seen_ns", 0), now_ns))
        self.stored_up_to: dict[str, int] = dict(d.get("stored_up_to") or {})
        self.batches_stored, self.batches_duplicate = d.get("batches_stored", 0), d.get("batches_duplicate", 0)
        self.set_series(d)
        self.set_diagnoses(d)

    def set_diagnoses(self, d: dict) -> None:
        """The summary's open diagnoses (what FleetState's NodeState.diagnoses holds: the Query API's
        NodeView.diagnoses, Prometheus and the scheduler read it) and the node's diagnosis counts."""
        rows = d.get("diagnoses") or []
        if rows != self._diagnosis_rows:   # decoded again only when they changed
            self._diagnosis_rows, self.diagnoses = rows, diagnoses_of(rows)
        self.diagnosis_counts: dict[str, int] = d.get("counters") or {}
        self.diagnoses_opened: dict[str, int] = d.get("diagnoses_opened") or {}

    def set_series(self, d: dict) -> list[MirrorSeries]:
        """The summary's series into this node: in place when the layout is the one it has (the
        objects keep their identity), else matched by name and labels. Returns the new ones."""
        rows = d.get("series") or ()
        received = d.get("received_ns") or [row[5] for row in rows]   # a summary without: the stamps
        if len(received) != len(rows):
            received = [row[5] for row in rows]
        if d.get("series_layout") == self.layout and len(rows) == len(self.series_list):
            for ser, row, r in zip(self.series_list, rows, received):
                if r >= ser.recv_ns:   # the newest received is the latest
                    ser.value, ser.time_ns, ser.recv_ns = row[4], row[5], r
                    ser._rate = math.nan if row[6] is None else row[6]
            return []
        new: list[MirrorSeries] = []
        old, series = self.series, {}
        for (name, unit, kind, labels, value, t, rate), r in zip(rows, received):
            key = series_key(name, labels)
            have = old.get(key)
            if have is None:
                have = MirrorSeries(name, unit, kind, labels, value, t, rate, r)
                new.append(have)
            elif r >= have.recv_ns:
                have.value, have.time_ns, have.recv_ns = value, t, r
                have._rate = math.nan if rate is None else rate
            series[key] = have
        self.series, self.series_list = series, list(series.values())
        self.layout = d.get("series_layout", -1)
        return new
