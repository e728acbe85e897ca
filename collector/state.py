"""Fleet state kept by the collector: per node its inventory, the latest value of every series,
a short history (default 15 min), recent events, and what it has stored per agent boot.

Exactly once: a batch is stored only if its sequence number is above the highest one already
stored for that node and agent boot; agents send in order on one stream, so anything at or below
that mark is a resend of something stored (acknowledged again, never stored twice).
All methods run on the collector's event loop thread; no locks.
"""

from __future__ import annotations

import collections
import math
import time

from xpusense.v1 import telemetry_pb2 as pb

MAX_BOOTS_REMEMBERED = 8


class Series:
    __slots__ = ("name", "unit", "kind", "labels", "value", "time_ns", "prev_value", "prev_time_ns",
                 "histogram", "history")

    def __init__(self, s: pb.Sample, history_points: int):
        self.name = s.name
        self.unit = s.unit
        self.kind = s.kind
        self.labels = dict(s.labels)
        self.value = math.nan
        self.time_ns = 0
        self.prev_value = math.nan
        self.prev_time_ns = 0
        self.histogram = None
        self.history: collections.deque = collections.deque(maxlen=history_points)

    def rate(self) -> float:
        if self.kind != pb.COUNTER or not self.prev_time_ns or self.time_ns <= self.prev_time_ns:
            return math.nan
        if self.value < self.prev_value:  # counter reset (agent or device restart)
            return math.nan
        return (self.value - self.prev_value) / ((self.time_ns - self.prev_time_ns) / 1e9)


class NodeState:
    def __init__(self, node_id: str, events_kept: int):
        self.node_id = node_id
        self.boot_id = ""
        self.streams = 0
        self.last_seen_ns = 0
        self.peer = ""
        self.inventory = pb.Inventory()
        self.stored_up_to: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.series: dict[tuple, Series] = {}
        self.refs: dict[str, dict[int, Series]] = {}   # boot -> the agent's series_ref -> series
        self.events: collections.deque = collections.deque(maxlen=events_kept)
        self.batches_stored = 0
        self.batches_duplicate = 0


class FleetState:
    def __init__(self, history_s: float = 900.0, events_kept: int = 200, clock=time.time_ns):
        self.history_ns = int(history_s * 1e9)
        # A point per second for history_s, with room for faster tiers; time pruning does the rest.
        self.history_points = int(history_s * 4) + 16
        self.events_kept = events_kept
        self.clock = clock
        self.nodes: dict[str, NodeState] = {}
        # What an earlier run of this collector stored, by (node, boot): filled from the durable
        # store's checkpoint records (collector/store.py) when it is replayed.
        self.known_marks: dict[tuple[str, str], int] = {}
        # Called as fn(node, batch) after a Hello or an inventory (batch None) and after each stored
        # batch, on the loop thread (the scheduler core keeps its per-node summaries this way).
        self.watchers: list = []

    def _node(self, node_id: str) -> NodeState:
        n = self.nodes.get(node_id)
        if n is None:
            n = self.nodes[node_id] = NodeState(node_id, self.events_kept)
        return n

    def hello(self, hello: pb.Hello, peer: str = "") -> pb.Welcome:
        n = self._node(hello.node_id)
        n.boot_id = hello.boot_id
        n.streams += 1
        n.peer = peer
        n.last_seen_ns = self.clock()
        n.inventory.CopyFrom(hello.inventory)
        n.stored_up_to.setdefault(hello.boot_id, self.known_marks.get((hello.node_id, hello.boot_id), 0))
        n.stored_up_to.move_to_end(hello.boot_id)
        while len(n.stored_up_to) > MAX_BOOTS_REMEMBERED:
            old, _ = n.stored_up_to.popitem(last=False)
            n.refs.pop(old, None)
        for w in self.watchers:
            w(n, None)
        return pb.Welcome(boot_id=hello.boot_id, stored_up_to=n.stored_up_to[hello.boot_id])

    def set_inventory(self, node_id: str, inv: pb.Inventory) -> None:
        n = self._node(node_id)
        n.inventory.CopyFrom(inv)
        for w in self.watchers:
            w(n, None)

    def disconnected(self, node_id: str) -> None:
        n = self.nodes.get(node_id)
        if n is not None:
            n.streams = max(0, n.streams - 1)

    def restore_inventory(self, node_id: str, boot_id: str, inv: pb.Inventory) -> None:
        """Replay of the durable store: the node's last inventory, without a live stream."""
        n = self._node(node_id)
        n.boot_id = boot_id or n.boot_id
        n.inventory.CopyFrom(inv)
        for w in self.watchers:
            w(n, None)

    def checkpoint(self) -> list[tuple]:
        """What a new store segment starts with, so older segments can be deleted: every node's
        inventory and every (node, boot) mark."""
        out: list[tuple] = []
        for nid, n in self.nodes.items():
            out.append(("i", nid, n.boot_id, n.inventory.SerializeToString()))
            for boot, seq in n.stored_up_to.items():
                out.append(("m", nid, boot, seq))
        return out

    def ingest(self, batch: pb.Batch, now_ns: int | None = None) -> bool:
        """Store a batch; False when it was already stored (a resend), True when stored now."""
        if self.accept(batch, now_ns) is None:
            return False
        self.apply(batch)
        return True

    def accept(self, batch: pb.Batch, now_ns: int | None = None) -> int | None:
        """Claim the batch's sequence number: the mark before it, or None when the batch is at or
        below what was stored (a resend)."""
        n = self._node(batch.node_id)
        n.last_seen_ns = self.clock() if now_ns is None else now_ns
        mark = n.stored_up_to.get(batch.boot_id)
        if mark is None:  # no Hello for this boot on this stream (a replay of an earlier boot)
            mark = n.stored_up_to[batch.boot_id] = self.known_marks.get((batch.node_id, batch.boot_id), 0)
            # Bounded, whatever boot ids a client makes up: the oldest boots are forgotten first.
            for old in [b for b in n.stored_up_to if b not in (n.boot_id, batch.boot_id)]:
                if len(n.stored_up_to) <= MAX_BOOTS_REMEMBERED:
                    break
                del n.stored_up_to[old]
                n.refs.pop(old, None)
        if batch.seq <= mark:
            n.batches_duplicate += 1
            return None
        n.stored_up_to[batch.boot_id] = batch.seq
        return mark

    def unaccept(self, batch: pb.Batch, previous: int) -> None:
        """The batch could not be made durable: its boot's mark goes back to before it (the stream
        is ended, and this batch and any later ones accepted on it are resent)."""
        n = self.nodes[batch.node_id]
        if n.stored_up_to.get(batch.boot_id, 0) >= batch.seq:
            n.stored_up_to[batch.boot_id] = previous

    def apply(self, batch: pb.Batch) -> None:
        """The batch's samples and events into the fleet state (after accept)."""
        n = self._node(batch.node_id)
        n.batches_stored += 1
        series = n.series
        refs = n.refs.get(batch.boot_id)
        if refs is None:
            refs = n.refs[batch.boot_id] = {}
        for s in batch.samples:
            # Reading a protobuf map from Python is the costly part of ingest: do it once per series.
            ref = s.series_ref
            ser = refs.get(ref) if ref else None
            if ser is None:
                key = (s.name, tuple(sorted(s.labels.items())))
                ser = series.get(key)
                if ser is None:
                    ser = series[key] = Series(s, self.history_points)
                if ref:
                    refs[ref] = ser
            t = s.time_unix_nano
            if t >= ser.time_ns:   # an older point (agent clock stepped back) only joins the history
                ser.prev_value, ser.prev_time_ns = ser.value, ser.time_ns
                ser.value, ser.time_ns = s.value, t
                if s.kind == pb.HISTOGRAM:
                    ser.histogram = s.histogram
            h = ser.history
            h.append((t, s.value))
            # Age is measured on the agent's clock (the series' newest point), so a skewed
            # agent clock cannot empty the history.
            cutoff = ser.time_ns - self.history_ns
            while h and h[0][0] < cutoff:
                h.popleft()
        for e in batch.events:
            n.events.appendleft(e)
        for w in self.watchers:
            w(n, batch)

    # -- read side ---------------------------------------------------------------------------------
    def view(self, node_id: str = "", name_prefix: str = "") -> pb.ListNodesReply:
        reply = pb.ListNodesReply(time_unix_nano=self.clock())
        for nid in sorted(self.nodes):
            if node_id and nid != node_id:
                continue
            n = self.nodes[nid]
            nv = reply.nodes.add(node_id=nid, boot_id=n.boot_id, connected=n.streams > 0,
                                 last_seen_unix_nano=n.last_seen_ns,
                                 stored_up_to=n.stored_up_to.get(n.boot_id, 0),
                                 batches_stored=n.batches_stored, batches_duplicate=n.batches_duplicate,
                                 peer=n.peer)
            nv.inventory.CopyFrom(n.inventory)
            for ser in n.series.values():
                if name_prefix and not ser.name.startswith(name_prefix):
                    continue
                sv = nv.series.add(name=ser.name, unit=ser.unit, kind=ser.kind, labels=ser.labels,
                                   value=ser.value, time_unix_nano=ser.time_ns, rate=ser.rate())
                if ser.histogram is not None:
                    sv.histogram.CopyFrom(ser.histogram)
            nv.events.extend(n.events)
        return reply

    def history(self, node_id: str, name: str, labels: dict[str, str]) -> pb.HistoryReply | None:
        n = self.nodes.get(node_id)
        ser = n.series.get((name, tuple(sorted(labels.items())))) if n else None
        if ser is None:
            return None
        reply = pb.HistoryReply(unit=ser.unit)
        reply.points.extend(pb.Point(time_unix_nano=t, value=v) for t, v in ser.history)
        return reply
