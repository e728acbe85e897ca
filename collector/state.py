"""The collector's fleet state: per node its inventory, the latest value of every series, a short
history (default 15 min), recent events, open diagnoses and, per agent boot, the highest batch seq
stored (exactly once: FleetState.accept). It keeps to the bounds collector/limits.py sets and, with
`[state] max_memory`, to a memory budget. It runs on the collector's event loop thread; no locks."""

from __future__ import annotations

import collections
import logging
import time

from xpusense.v1 import telemetry_pb2 as pb

from . import clock as agent_clock
from . import columns, idle
from .batch_rows import BatchRows
from .diagnoses import Diagnoses
from .limits import DEFAULTS as LIMITS
from .limits import seq_ceiling
from .node_pages import list_nodes
from .node_series import MAX_REFS, NodeSeries
from .series import Series, read_labels, series_key
from .series_dictionary import SeriesDictionary
from .series_history import POINT_BYTES, points_of

log = logging.getLogger("xpusense.collector")
HISTOGRAM = pb.HISTOGRAM
MAX_BOOTS_REMEMBERED = 8
# Memory ([state] max_memory): a point costs POINT_BYTES in a series' own History, about
# columns.FRAME_POINT_BYTES in a frame (and a row's time as much); a series (the Series, its key,
# labels, map entries) and a node hold SERIES_BYTES and NODE_BYTES besides, measured with tracemalloc
# (bench/collector_ingest.py --memory). Over the budget the history is shortened first (every
# series, aiming at 90% of the budget; `state.max_memory.history_shortened`), down to
# min_history_points; only then are samples of new series dropped (`state.max_memory.samples_dropped`)
# and new nodes refused (full()). Points go in bulk: the estimate may pass the budget by up to 1/8
# of the shortened history. Never an OOM kill.
SERIES_BYTES = 1100
NODE_BYTES = 8000


class NodeState(NodeSeries):
    """A node's state; its series and their references are a NodeSeries table (node_series.py)."""

    def __init__(self, node_id: str, events_kept: int):
        super().__init__()
        self.node_id = node_id
        self.boot_id = ""
        self.streams = 0
        self.last_seen_ns = 0
        self.recv_ns = 0                               # when (state clock) the batch being stored was received
        self.recv_shift = 0                            # and what puts its stamps on our clock (clock.shift_of)
        self.offset = agent_clock.ClockOffset()        # its agent's clock against ours (collector/clock.py)
        self.peer = ""
        self.inventory = pb.Inventory()
        self.stored_up_to: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.mark_at: dict[str, int] = {}              # boot -> when (state clock, ns) its mark last rose
        self.live: collections.Counter[str] = collections.Counter()   # boot -> streams open for it
        self.expired_tried_ns = 0                      # last look for series to let go (evict_expired)
        self.events: collections.deque = collections.deque(maxlen=events_kept)
        self.batches_stored = 0
        self.batches_duplicate = 0
        # Open diagnoses (collector/diagnoses.py): id -> the open Event, oldest first; of this boot.
        self.diagnoses: collections.OrderedDict[str, pb.Event] = collections.OrderedDict()
        self.diagnoses_boot = ""
        # Series held in columns (collector/columns.py): (boot, refs...) -> Frame; none formed before
        # frames_hold_until (state clock, ns), after one was dissolved (frames_dissolves in a row).
        self.frames: dict[tuple, columns.Frame] = {}
        self.frames_hold_until = 0
        self.frames_dissolves = 0

    def frames_allowed(self, now_ns: int) -> bool:
        return now_ns >= self.frames_hold_until


class FleetState:
    readings_with_inventory = False   # a node's latest values come with its batches (fleet_interface.Fleet)

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
        # Marks restored from the durable store count as stored at this time (the state clock, ns);
        # the collector sets it to when the store was last written, for seq_ceiling.
        self.restored_at_ns = clock()
        self.max_series_per_node: int | None = None   # set by the server from limits.max_series_per_node
        # The compact encoding's series definitions per (node, boot) (collector/series_dictionary.py),
        # bounded per boot as a node's series are (limits.max_series_per_node).
        self.dictionary = SeriesDictionary(int(LIMITS["max_series_per_node"]))
        self.counters: collections.Counter[str] = collections.Counter()
        # Memory ([state]): the history's points per series now (history_points until a budget cuts it).
        self.history_cap = self.history_points
        self.max_memory = 0                 # bytes; 0: no budget
        self.min_history_points = 60
        self.history_slots = 0              # points held in every series' history (POINT_BYTES each)
        self.frame_points = 0               # ...of them in frames' rows (columns.FRAME_POINT_BYTES each)
        self.frame_rows = 0                 # frames' rows (a time each)
        self.series_total = 0
        self.diagnoses = Diagnoses(self.counters)   # open diagnoses per node, opened per rule
        self.columns = True   # series that come together held in columns (collector/columns.py)
        # [state] series_idle_s: a series with no point received this long is let go (collector/idle.py).
        self.series_idle_ns = 3600 * 10**9
        self.idle_due_ns = 0                # when the sweep's next step is due
        self.idle_walk = None               # the pass under way and when the next begins (idle.sweep), or None
        self.max_clock_offset_ns = 5 * 10**9   # [state] max_clock_offset_s: past it, a diagnosis (clock.py)

    def configure(self, max_memory: int = 0, min_history_points: int = 60, max_open_diagnoses_per_node: int = 64,
                  max_clock_offset_s: float = 5.0) -> None:
        """The [state] budget (collector/config.py); applied at once if already over it."""
        self.max_memory, self.min_history_points = int(max_memory), max(1, int(min_history_points))
        self.max_clock_offset_ns = int(max_clock_offset_s * 1e9)
        self.diagnoses.configure(max_open_diagnoses_per_node)
        if self.max_memory and self.memory_bytes() > self.max_memory:
            self._over_budget()

    def memory_bytes(self) -> int:
        """What the fleet state holds, estimated (the comment at SERIES_BYTES)."""
        return ((self.history_slots - self.frame_points) * POINT_BYTES
                + (self.frame_points + self.frame_rows) * columns.FRAME_POINT_BYTES
                + self.series_total * SERIES_BYTES + len(self.nodes) * NODE_BYTES)

    def _over_budget(self) -> bool:
        """Over max_memory: shorten every series' history (to 90% of the budget); False when it is
        as short as allowed already (then new series are refused)."""
        fixed = self.series_total * SERIES_BYTES + len(self.nodes) * NODE_BYTES
        # What a point costs now, on average (in columns less than POINT_BYTES).
        per_point = (self.memory_bytes() - fixed) / self.history_slots if self.history_slots else POINT_BYTES
        room = int(max(0, int(self.max_memory * 0.9) - fixed) / max(1.0, per_point))
        cap = max(self.min_history_points, min(int(self.history_cap * 0.9), room // max(1, self.series_total)))
        if cap >= self.history_cap:
            return False
        before = self.history_cap
        self.history_cap = cap
        for n in self.nodes.values():
            for ser in n.series.values():
                if ser.frame is None:
                    self.history_slots -= ser.history.shrink(cap)
            for f in n.frames.values():
                self.history_slots -= columns.shrink(self, f, cap)
        self.counters["state.max_memory.history_shortened"] += 1
        self.counters["state.history_points"] = cap
        log.warning("fleet state at its memory budget ([state] max_memory = %d bytes, ~%d held): history "
                    "shortened from %d to %d points a series", self.max_memory, self.memory_bytes(), before, cap)
        return True

    def full(self) -> bool:
        """At the memory budget with the history as short as allowed: no room for another node."""
        return bool(self.max_memory) and self.history_cap <= self.min_history_points and \
            self.memory_bytes() + NODE_BYTES > self.max_memory

    def _room_for_series(self) -> bool:
        """Whether a new series fits the budget (history shortened first, if it can be)."""
        need = SERIES_BYTES + POINT_BYTES
        if self.memory_bytes() + need <= self.max_memory:
            return True
        self._over_budget()
        if self.memory_bytes() + need <= self.max_memory:
            return True
        c = self.counters
        if not c["state.max_memory.samples_dropped"] % 10_000:
            log.warning("fleet state at its memory budget ([state] max_memory = %d bytes) with the history at its "
                        "shortest (%d points): samples of new series are dropped (%d so far)", self.max_memory,
                        self.history_cap, c["state.max_memory.samples_dropped"])
        c["state.max_memory.samples_dropped"] += 1
        return False

    def _node(self, node_id: str) -> NodeState:
        n = self.nodes.get(node_id)
        if n is None:
            n = self.nodes[node_id] = NodeState(node_id, self.events_kept)
        return n

    def hello(self, hello: pb.Hello, peer: str = "") -> pb.Welcome:
        n = self._node(hello.node_id)
        if n.boot_id not in n.live:   # a second stream (another boot) does not take over a live one's place
            n.boot_id, n.peer = hello.boot_id, peer
        n.streams += 1
        n.last_seen_ns = self.clock()
        n.inventory.CopyFrom(hello.inventory)
        n.live[hello.boot_id] += 1
        n.stored_up_to.setdefault(hello.boot_id, self.known_marks.get((hello.node_id, hello.boot_id), 0))
        n.stored_up_to.move_to_end(hello.boot_id)
        self._forget_boots(n, hello.boot_id)
        self.diagnoses.hello(n, hello.boot_id)   # a new agent boot: the last one's diagnoses end
        self._clock_observed(n, hello.time_unix_nano, n.last_seen_ns)
        for w in self.watchers:
            w(n, None)
        return pb.Welcome(boot_id=hello.boot_id, stored_up_to=n.stored_up_to[hello.boot_id])

    def set_inventory(self, node_id: str, inv: pb.Inventory) -> None:
        n = self._node(node_id)
        n.inventory.CopyFrom(inv)
        for w in self.watchers:
            w(n, None)

    def disconnected(self, node_id: str, boot_id: str = "") -> None:
        n = self.nodes.get(node_id)
        if n is not None:
            n.streams = max(0, n.streams - 1)
            if n.live.get(boot_id, 0) > 1:
                n.live[boot_id] -= 1
            else:
                n.live.pop(boot_id, None)

    def _forget_boots(self, n: NodeState, keep: str) -> None:
        """Bounded, whatever boot ids a client makes up: the oldest boots are forgotten first, never
        one with an open stream (a made-up boot must not push a live one's mark out), nor `keep`."""
        if len(n.stored_up_to) <= MAX_BOOTS_REMEMBERED:
            return
        for old in [b for b in n.stored_up_to if b not in (n.boot_id, keep) and b not in n.live]:
            if len(n.stored_up_to) <= MAX_BOOTS_REMEMBERED:
                break
            del n.stored_up_to[old]
            n.mark_at.pop(old, None)
            n.refs.pop(old, None)
            self.dictionary.forget(n.node_id, old)

    def define(self, node_id: str, boot_id: str, defs: list[pb.Sample]) -> int:
        """A SeriesTable of one of the node's boots: its definitions kept in `dictionary`, the boot
        remembered as a batch of it would be (so definitions of made-up boots go as their marks do,
        _forget_boots). How many definitions were dropped over the bound."""
        n = self._node(node_id)
        if boot_id not in n.stored_up_to:
            n.stored_up_to[boot_id] = self.known_marks.get((node_id, boot_id), 0)
            self._forget_boots(n, boot_id)
        return self.dictionary.add(node_id, boot_id, defs)

    def restore_inventory(self, node_id: str, boot_id: str, inv: pb.Inventory) -> None:
        """Replay of the durable store: the node's last inventory, without a live stream."""
        n = self._node(node_id)
        n.boot_id = boot_id or n.boot_id
        n.inventory.CopyFrom(inv)
        if boot_id and n.diagnoses_boot and boot_id != n.diagnoses_boot:
            self.diagnoses.hello(n, boot_id)
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

    def ingest(self, batch: pb.Batch, now_ns: int | None = None, wire: bytes | None = None) -> bool:
        """Store a batch (`wire`: the bytes it was parsed from, where the caller has them); False
        when it was already stored (a resend), True when stored now."""
        if self.accept(batch, now_ns) is None:
            return False
        self.apply(batch, BatchRows(batch, wire))
        return True

    def accept(self, batch: pb.Batch, now_ns: int | None = None) -> int | None:
        """Claim the batch's sequence number: the mark before it, or None when the batch is at or
        below what was stored for its node and boot. Agents send in order on one stream, so such a
        batch is a resend of one stored (acknowledged again, never stored twice)."""
        n = self._node(batch.node_id)
        n.last_seen_ns = self.clock() if now_ns is None else now_ns
        if now_ns is None:   # live: received now; the agent's clock against ours
            n.recv_ns = n.last_seen_ns
            self._clock_observed(n, batch.sent_unix_nano, n.recv_ns)
        else:   # the store's replay: received when sent, as far as is known
            n.recv_ns = min(now_ns, self.clock())
        mark = n.stored_up_to.get(batch.boot_id)
        if mark is None:  # no Hello for this boot on this stream (a replay of an earlier boot)
            mark = n.stored_up_to[batch.boot_id] = self.known_marks.get((batch.node_id, batch.boot_id), 0)
            self._forget_boots(n, batch.boot_id)
        if batch.seq <= mark:
            n.batches_duplicate += 1
            return None
        n.stored_up_to[batch.boot_id] = batch.seq
        # When the mark rose: now, or for the store's replay (now_ns given) when the batch was sent.
        n.mark_at[batch.boot_id] = self.clock() if now_ns is None else min(now_ns, self.clock())
        return mark

    def _clock_observed(self, n: NodeState, agent_ns: int, now_ns: int) -> None:
        """A message the agent stamped `agent_ns` received now: the node's clock offset estimate,
        and its clock_offset diagnosis opened, updated or closed (collector/clock.py)."""
        n.offset.observe(agent_ns, now_ns)
        e = agent_clock.check(self.diagnoses, n, self.max_clock_offset_ns, now_ns)
        if e is not None:
            n.events.appendleft(e)

    def seq_mark(self, node_id: str, boot_id: str) -> tuple[int, float] | None:
        """The boot's mark (highest seq stored) and the seconds since it rose (limits.Stored);
        None when nothing of the boot is stored."""
        n = self.nodes.get(node_id)
        mark = n.stored_up_to.get(boot_id) if n is not None else None
        at = self.restored_at_ns
        if mark is None:
            mark = self.known_marks.get((node_id, boot_id), 0)
        elif n is not None:
            at = n.mark_at.get(boot_id, at)
        return (mark, (self.clock() - at) / 1e9) if mark else None

    def seq_ceiling(self, node_id: str, boot_id: str, max_jump: int, per_s: float) -> int | None:
        """The highest sequence number a batch of this boot may carry now (limits.seq_ceiling)."""
        mark = self.seq_mark(node_id, boot_id)
        return None if mark is None else seq_ceiling(mark[0], mark[1], max_jump, per_s)

    def admit(self, node_id: str, samples) -> None:
        """limits.Stored: the state counts a node's series as it stores them, not here."""

    # -- series per node -----------------------------------------------------------------------------
    def series_count(self, node_id: str) -> int:
        n = self.nodes.get(node_id)
        return len(n.series) if n is not None else 0

    def new_series(self, node_id: str, samples) -> set[tuple]:
        """The series (name, labels) among `samples` that the node does not have."""
        n = self.nodes.get(node_id)
        have = n.series if n is not None else {}
        return {k for s in samples if (k := series_key(s.name, read_labels(s.labels))) not in have}

    def evict_expired(self, node_id: str, newest_ns: int = 0, every_s: float = 10.0) -> int:
        """Let go of the node's series with no point for history_s: older by that much than its
        newest point (or `newest_ns`, the newest of a batch coming in; the agent's clock, as for the
        history). At most once every `every_s` per node, as it reads every series. Their references
        are forgotten too (a series that comes back is found again by name and labels)."""
        n = self.nodes.get(node_id)
        now = self.clock()
        if n is None or now - n.expired_tried_ns < every_s * 1e9:
            return 0
        n.expired_tried_ns = now
        cutoff = max(newest_ns, max((s.time_ns for s in n.series.values()), default=0)) - self.history_ns
        old = [k for k, s in n.series.items() if s.time_ns < cutoff]
        if old:
            idle.let_go(self, n, old)
            self.counters["series_expired"] += len(old)
        return len(old)

    def unaccept(self, batch: pb.Batch, previous: int) -> None:
        """The batch could not be made durable: its boot's mark goes back to before it (the stream
        is ended, and this batch and any later ones accepted on it are resent)."""
        n = self.nodes[batch.node_id]
        if n.stored_up_to.get(batch.boot_id, 0) >= batch.seq:
            n.stored_up_to[batch.boot_id] = previous

    def _new_series(self, n: NodeState, s: pb.Sample, labels: dict[str, str]) -> Series | None:
        """A new series of node `n` for sample `s` (NodeSeries.entry_for's `make`), if there is
        room (None: dropped, counted)."""
        room = self.max_series_per_node
        if room is not None and len(n.series) >= room:
            # Batches admitted together (limits.py counts each against the series already there)
            # may add more than the room left: the excess is dropped, and counted.
            self.counters["limits.max_series_per_node.samples_dropped"] += 1
            return None
        if self.max_memory and not self._room_for_series():
            return None
        self.series_total += 1
        return Series(s, labels)

    def apply(self, batch: pb.Batch, read: BatchRows | None = None) -> None:
        """The batch's samples and events into the fleet state (after accept); `read` is
        BatchRows(batch) when the caller has it already."""
        n = self._node(batch.node_id)
        n.batches_stored += 1
        n.recv_shift = agent_clock.shift_of(batch.sent_unix_nano, n.recv_ns)
        if self.series_idle_ns and idle.due(self, now := self.clock()):   # a bounded step (idle.py)
            idle.sweep(self, now)
        if batch.boot_id != n.boot_id and batch.boot_id in n.live:   # a boot that streams and is stored now
            n.boot_id = batch.boot_id
        if read is None:
            read = BatchRows(batch)
        if self.columns and read.refs and read.refs[0]:   # with series refs: groups to frames
            if not (read.rising and read.time is not None
                    and columns.store_row(self, n, (batch.boot_id, *read.refs), read.time, read.values)):
                batch_rows = read.rows()
                by_time = columns.groups(batch_rows)
                slow = columns.store(self, n, batch.boot_id, by_time)
                if slow is not None:
                    self._apply_rows(n, batch, batch_rows, slow)
                    columns.form(self, n, batch.boot_id, by_time, slow)
        else:
            self._apply_rows(n, batch, read.rows(), None)
        if self.max_memory and self.memory_bytes() > self.max_memory:
            self._over_budget()
        for e in batch.events:
            n.events.appendleft(e)
        if batch.events or batch.boot_id != n.diagnoses_boot:
            self.diagnoses.batch(n, batch)
        for w in self.watchers:
            w(n, batch)

    def _apply_rows(self, n: NodeState, batch: pb.Batch, batch_rows: list[tuple[int, int, float]],
                    times: set[int] | None) -> None:
        """The general path: the batch's samples one by one (those at `times` only, unless None)."""
        gens = n.boot_refs(batch.boot_id)
        refs = gens.cur
        # References a boot holds: as many as its series may be, in each of two generations.
        max_refs = self.max_series_per_node or MAX_REFS
        hist_ns, cap = self.history_ns, self.history_cap
        slack_ns = hist_ns >> 5
        recv, shift = n.recv_ns, n.recv_shift
        samples = batch.samples
        grown = 0
        known = refs.get
        label_sets: dict[tuple, tuple] = {}
        # Per sample, the common case (a known series_ref): the latest value, its time and two
        # appends to the history. The sample itself is read again only for a new series (its
        # name and map of labels) or a histogram.
        for i, (ref, t, v) in enumerate(batch_rows):
            if times is not None and t not in times:
                continue
            ser = known(ref) if ref else None
            if ser is None:
                ser = n.entry_for(gens, ref, samples[i], self._new_series, max_refs, label_sets)
                if gens.cur is not refs:   # the generations turned at their bound
                    refs, known = gens.cur, gens.cur.get
                    self.counters["state.series_refs_reset"] += 1
                if ser is None:
                    continue
                cap = self.history_cap   # a new series may have shortened the history (max_memory)
            if ser.frame is not None:   # its frame's rows back in each member's own History
                columns.dissolve(self, n, ser.frame)
            # The newest received is the latest, whatever its stamp (an agent clock stepped back).
            ser._prev_value = ser._value
            ser._prev_time_ns = ser._time_ns
            ser._value = v
            ser._time_ns = t
            r = t + shift   # its time on our clock (collector/clock.py received_at)
            ser._recv_ns = r if r < recv else recv
            if ser.kind == HISTOGRAM:   # a copy: a sub-message would keep the whole batch alive
                ser.histogram = hg = pb.Histogram()
                hg.CopyFrom(samples[i].histogram)
            # Age is measured on the agent's clock (the series' newest point), so a skewed
            # agent clock cannot empty the history.
            h = ser.history
            ts = h.t
            ts.append(t)
            h.v.append(v)
            if t > h.newest:
                h.newest = t
            grown += 1
            if t > h.due_t or len(ts) > h.due_n:
                grown -= h.prune(h.newest - hist_ns, cap, hist_ns, slack_ns)
        self.history_slots += grown

    # -- read side ---------------------------------------------------------------------------------
    def view(self, node_id: str = "", name_prefix: str = "", page_token: str = "", page_size: int = 0,
             max_bytes: int = 0, boot_ids: bool = True) -> pb.ListNodesReply:
        """A ListNodes page of the fleet (node_pages.list_nodes)."""
        request = pb.ListNodesRequest(node_id=node_id, name_prefix=name_prefix, page_token=page_token,
                                      page_size=page_size)
        return list_nodes(self.nodes, request, max_bytes, boot_ids, self.clock(), self.counters)

    def history(self, node_id: str, name: str, labels: dict[str, str]) -> pb.HistoryReply | None:
        n = self.nodes.get(node_id)
        ser = n.series.get(series_key(name, labels)) if n else None
        if ser is None:
            return None
        reply = pb.HistoryReply(unit=ser.unit)
        ts, vs = columns.held(ser)
        reply.points.extend(pb.Point(time_unix_nano=t, value=v)
                            for t, v in points_of(ts, vs, ser.time_ns - self.history_ns, self.history_cap))
        return reply

