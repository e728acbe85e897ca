"""Following the fleet (fleet_interface.Fleet): one NodeSummary per node, kept up to date by a watcher
called after every Hello, inventory and stored batch, and filed in the index (index.py). A stored
batch only marks its node dirty; dirty nodes are refreshed in bulk off the ingest path, and before
every decision (catch_up), so that a Place answer never misses a batch stored more than `refresh_ns`
before it. Policy and per-node health, penalties and staleness: docs/scheduler.md."""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from typing import Any, cast

from xpusense.common.metric_names import NETWORK_TCP_RTT
from xpusense.v1 import scheduler_pb2 as spb

from .. import diagnoses as dg
from ..clock import events_received
from ..fleet_interface import Fleet, FleetNode
from .config import Settings
from .index import (
    ACCEL_TYPES,
    INF,
    POOLS,
    SETTLE_NS,
    Device,
    Group,
    NodeSummary,
    Pool,
    file_node,
    group_static,
    mark_stale,
    settle_node,
)
from .inventory import PeakTflops, device_memory, interconnect_domain, price
from .latency import MeasuredLatency, RttWindow
from .scoring import capable, free_score

log = logging.getLogger("xpusense.collector.scheduler")

UTIL, USED, LIMIT, BANDWIDTH, HEALTH = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit",
                                        "xpusense.accelerator.hbm.bandwidth.utilization",
                                        "xpusense.accelerator.health")
SLICE_S = 0.0005  # a bulk refresh gives the loop back after this long (acks and Place calls waiting)
PLACE_EXTRA_S = 0.0001   # a decision refreshes dirty nodes not yet due for this long at most (catch_up)
EXTRA_NODES = 4          # ... when no more than this many are dirty
TIMER_SHARE = 0.5        # the bulk refresh runs this share of refresh_ns after the first node was marked
BEHIND_SHARE = 0.75      # ... and its slices follow at once when the oldest was marked this share of it ago
SETTLE_EVERY_S = 0.5     # the settling timer (settle_quiet) runs at most this often
HOLD_MAX_S = 0.002       # a bulk refresh waits at most this long for the Place calls in flight (serving)
_DEVICE_SERIES = {UTIL: "util", USED: "used", LIMIT: "limit", BANDWIDTH: "bandwidth"}   # name -> Device attribute


class FleetView:
    """The scheduler's view of the fleet. Construct it on the loop thread that owns `state`; it
    registers itself as a watcher."""

    def __init__(self, state: Fleet, settings: Settings, refresh_ms: float = 0.0, mono=time.monotonic_ns):
        self.state = state
        self.refresh_ns = int(refresh_ms * 1e6)
        self.mono = mono
        self.dirty: dict[str, int] = {}    # node -> when (mono ns) it was first changed since its refresh
        self.first: set[str] = set()       # nodes whose next batch is their first since a Hello or inventory
        # Nodes that come with their readings (a cluster replica's: a summary has the inventory and the
        # latest values at once): the batch after an inventory is one like any other.
        self.readings_with_inventory = state.readings_with_inventory
        self.timer: asyncio.TimerHandle | asyncio.Handle | None = None
        # Nodes filed by id in some pool (busy: their tie key changed at their last refresh) -> when
        # (state clock) they were last refreshed, oldest first: settled on `settle_timer` once quiet
        # for SETTLE_NS (settle_quiet), so that no decision walks them one by one.
        self.busy: dict[str, int] = {}
        self.settle_timer: asyncio.TimerHandle | None = None
        self.settled = 0   # nodes moved under their tie keys by settle_quiet
        self.extra_s = PLACE_EXTRA_S
        # Place calls in flight over gRPC (service.py: from the handler until the reply is sent): the
        # bulk refresh, and a cluster replica's watch, wait for them (at most HOLD_MAX_S), so that a
        # call's last loop turns do not queue behind their slices. catch_up() keeps the bound.
        self.serving = 0
        self.held = 0          # bulk refresh slices put off for a Place call
        self._held_since = 0.0
        self._idle: asyncio.Event | None = None
        self.refreshes = self.deferred = 0   # summaries refreshed; batches that only marked their node
        self.unchanged = 0   # refreshes that found nothing a decision reads moved (groups and filing kept)
        self.settings = settings
        self.stale_ns = settings.stale_ns
        self.peak_tflops = PeakTflops(settings.peak_tflops)
        self.summaries: dict[str, NodeSummary] = {}
        self.k8s_nodes: dict[str, str] = {}   # inventory label k8s_node -> node id (kube-scheduler's extender)
        self.k8s_changes = 0                  # times k8s_nodes changed
        # node -> `changes` at its last refiling or staleness change, oldest first (verdict_cache.py)
        self.journal: dict[str, int] = {}
        self.changes = 0
        self.pools: tuple[Pool, ...] = tuple(Pool(counted=i < len(ACCEL_TYPES)) for i in range(POOLS))
        self.seen_heap: list[tuple[int, str]] = []   # (last seen ns, node), see _seen
        self.seen_pushed: dict[str, int] = {}        # node -> time of its live entry in seen_heap
        self.stale_known: dict[str, NodeSummary] = {}
        self.best_value = 0.0                         # the fleet's best value (TFLOPS per price)
        self.inv_best_value = 0.0
        self.expiries: list[tuple[int, str]] = []    # heap: (when a node's XID/HBM-watch window ends, node)
        # Measured RTT per region pair (latency.py), from the nodes' tcp_rtt histograms at each refresh.
        self.latency = MeasuredLatency(settings.latency_window_ns, settings.latency_max_age_ns)
        for n in list(state.nodes.values()):
            self._rebuild(self._summary(n), initial=True)
            self._seen(n)
        state.watchers.append(self.on_change)

    def _summary(self, n: FleetNode) -> NodeSummary:
        s = self.summaries.get(n.node_id)
        if s is None or s.state is not n:
            s = self.summaries[n.node_id] = NodeSummary(n)
        return s

    def on_change(self, node: FleetNode, batch: Any) -> None:
        """The fleet's watcher: batch None after a Hello or a new inventory, else a stored batch."""
        try:
            self._seen(node)
            nid = node.node_id
            s = self.summaries.get(nid)
            if s is None or batch is None:
                s = self._summary(node)
                self.dirty.pop(nid, None)
                if not self.readings_with_inventory:
                    self.first.add(nid)
                self._rebuild(s)
                if batch is None:
                    return
            if batch.events or nid in self.first:   # events: read now (the batch is not kept)
                self._note_events(s, batch.events, events_received(node, batch))
                self.first.discard(nid)
                self.dirty.pop(nid, None)
                self._refresh(s, self.state.clock())
                return
            if self.refresh_ns <= 0:
                self._refresh(s, self.state.clock())
            elif nid not in self.dirty:
                self.dirty[nid] = self.mono()
                self.deferred += 1
                if self.timer is None:
                    self._arm()
            else:
                self.deferred += 1
        except Exception:   # never let the scheduler break ingest; the node keeps its last summary
            log.exception("scheduler: cannot follow node %s", node.node_id)

    # -- refreshes off the ingest path -------------------------------------------------------------------
    def _arm(self, delay_ns: int | None = None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:   # no loop (in-process use): catch_up() before each decision does it
            return
        delay_ns = int(self.refresh_ns * TIMER_SHARE) if delay_ns is None else delay_ns
        self.timer = loop.call_later(delay_ns / 1e9, self._on_timer)

    def serve_begin(self) -> None:
        """A Place call came in (its reply not sent yet)."""
        self.serving += 1
        if self._idle is not None:
            self._idle.clear()

    def serve_end(self) -> None:
        """A Place call's reply went out (or it failed)."""
        self.serving = max(0, self.serving - 1)
        if self.serving:
            return
        if self._idle is not None:
            self._idle.set()
        if self._held_since and self.timer is not None:   # a slice waited for this call: now
            self.timer.cancel()
            self._arm(0)

    async def idle(self, timeout_s: float = HOLD_MAX_S) -> None:
        """Wait until no Place call is in flight, at most timeout_s (a cluster replica's watch, before
        a batch of changes)."""
        if not self.serving:
            return
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass

    def _on_timer(self) -> None:
        self.timer = None
        if self.serving and self.dirty:
            now = time.perf_counter()
            if not self._held_since:
                self._held_since = now
            behind = self.mono() - next(iter(self.dirty.values())) > self.refresh_ns * BEHIND_SHARE
            left = HOLD_MAX_S - (now - self._held_since)
            if not behind and left > 0:
                self.held += 1
                self._arm(int(left * 1e9))   # or as soon as the last call in flight is answered (serve_end)
                return
        self._held_since = 0.0
        # The stale nodes as of now, so that the next decision only looks at those since: most of
        # that work is dropping the heap's superseded entries, one per node every stale_s / 2.
        self.find_stale(self.state.clock() - self.stale_ns)
        done = self.refresh_dirty(None, SLICE_S)   # all of them: the oldest is nearly due
        if not done and self.dirty:
            # The rest after a gap as long as the slice (a Place call's loop turns fit in between),
            # or at once when the oldest is close to due (a busy machine: else decisions refresh it).
            behind = self.mono() - next(iter(self.dirty.values())) > self.refresh_ns * BEHIND_SHARE
            self._arm(0 if behind else int(SLICE_S * 1e9))

    def refresh_dirty(self, upto_ns: int | None = None, budget_s: float = 0.0, every: int = 4) -> bool:
        """Refresh the dirty nodes marked at or before `upto_ns` (None: all), oldest first, for at
        most `budget_s` of this thread's CPU time (0: no bound; CPU time, so that a slice preempted
        on a busy machine still does its share). True when all of those were done."""
        dirty, summaries, now, cpu = self.dirty, self.summaries, self.state.clock(), time.thread_time
        t_end = cpu() + budget_s if budget_s else 0.0
        k = 0
        while dirty:
            nid, t = next(iter(dirty.items()))
            if upto_ns is not None and t > upto_ns:
                return True
            del dirty[nid]
            s = summaries.get(nid)
            if s is not None:
                try:
                    self._refresh(s, now)
                except Exception:
                    log.exception("scheduler: cannot follow node %s", nid)
            k += 1
            if t_end and not k % every and cpu() > t_end:
                return False
        return True

    def catch_up(self) -> None:
        """Before a decision: every node changed more than refresh_ns ago (all of them when no timer
        runs) is refreshed now; then, when at most EXTRA_NODES are left, those too, for at most
        `extra_s` (work the timer would do anyway: a small fleet's answer follows every stored batch;
        a large one's, whose dirty nodes never run out, is not slowed down by it). Without a loop
        to time it, the quiet nodes are settled here too."""
        if self.dirty:
            self.refresh_dirty(None if self.timer is None else self.mono() - self.refresh_ns)
        if self.dirty and self.extra_s > 0 and len(self.dirty) <= EXTRA_NODES:
            self.refresh_dirty(None, self.extra_s, every=1)
        if self.busy and self.settle_timer is None and not self._arm_settle():
            self.settle_quiet(self.state.clock())

    # -- settling quiet nodes off the decision path ----------------------------------------------------
    def _filed(self, s: NodeSummary, now: int) -> None:
        """File the node's groups in the index; a node filed by id is noted busy as of `now`."""
        nid = s.node_id
        self._journal(nid)
        self.busy.pop(nid, None)
        if file_node(self.pools, s):
            self.busy[nid] = now
            if self.settle_timer is None:
                self._arm_settle()

    def _arm_settle(self) -> bool:
        """The settling timer, when the oldest busy node falls due (at least SETTLE_EVERY_S from
        now); False without a running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        oldest = next(iter(self.busy.values()))
        delay_s = max(SETTLE_EVERY_S, (oldest + SETTLE_NS - self.state.clock()) / 1e9)
        self.settle_timer = loop.call_later(delay_s, self._on_settle_timer)
        return True

    def _on_settle_timer(self) -> None:
        self.settle_timer = None
        done = self.settle_quiet(self.state.clock(), SLICE_S)
        if not done:   # the rest once the loop has served what waits behind this slice
            self.settle_timer = asyncio.get_running_loop().call_later(0, self._on_settle_timer)
        elif self.busy:
            self._arm_settle()

    def settle_quiet(self, now: int, budget_s: float = 0.0, every: int = 4) -> bool:
        """The busy nodes not refreshed for SETTLE_NS, oldest first, under their tie keys, for at
        most `budget_s` (0: no bound): what a decision reads of them is the same either way
        (index.Bucket), only how many it walks one by one. True when all those due were done."""
        busy, pools, cut = self.busy, self.pools, now - SETTLE_NS
        t_end = time.perf_counter() + budget_s if budget_s else 0.0
        k = 0
        while busy:
            nid, t = next(iter(busy.items()))
            if t > cut:
                return True
            del busy[nid]
            settle_node(pools, nid)
            self.settled += 1
            k += 1
            if t_end and not k % every and time.perf_counter() > t_end:
                return not busy or next(iter(busy.values())) > cut
        return True

    # -- a new inventory -----------------------------------------------------------------------------
    def _rebuild(self, s: NodeSummary, initial: bool = False) -> None:
        """A new inventory: labels, devices, domains; then the readings."""
        inv = s.state.inventory
        region, k8s_node = s.region, s.labels.get("k8s_node")
        self._read_labels(s, dict(inv.labels))
        if s.labels.get("k8s_node") != k8s_node:
            if k8s_node is not None and self.k8s_nodes.get(k8s_node) == s.node_id:
                del self.k8s_nodes[k8s_node]
            if "k8s_node" in s.labels:
                self.k8s_nodes[s.labels["k8s_node"]] = s.node_id
            self.k8s_changes += 1
        if s.region != region:   # its measured figures belong to another region pair now
            for remote, w in s.rtt.items():
                self.latency.set(s.node_id, s.region, remote,
                                 None if w.median_s is None else w.median_s * 1e3, w.grew_ns)
        s.devices = devs = [Device(r.id, r.type.upper(), r.model, device_memory(r.attributes),
                                   self.peak_tflops(r.vendor, r.model), interconnect_domain(r, r.type.upper()))
                            for r in inv.resources if r.type.upper() in ACCEL_TYPES]
        s.layout = []
        for i, t in enumerate(ACCEL_TYPES):
            of_type = [d for d in devs if d.type == t]
            if of_type:
                domains: dict[str, list[Device]] = {}
                for d in of_type:
                    domains.setdefault(d.domain, []).append(d)
                s.layout.append((i, t, of_type, group_static(s, of_type),
                                 [(name, of_domain, group_static(s, of_domain)) for name, of_domain in domains.items()]
                                 if len(domains) > 1 else None))
        s.series_seen = -1
        if initial:
            for e in reversed(s.state.events):   # the node's recent events, oldest first
                self._note_events(s, (e,))
        old = s.best_value
        self._refresh(s, self.state.clock(), force=True)
        s.best_value = max((g.value for g in s.by_type.values()), default=-1.0)
        if s.best_value > self.best_value or (old >= self.best_value and s.best_value < old):
            self._rescale_fleet()

    @staticmethod
    def _read_labels(s: NodeSummary, labels: dict[str, str]) -> None:
        s.labels = labels
        s.region, s.zone, s.province = labels.get("region", ""), labels.get("zone", ""), labels.get("province", "")
        s.encryption, s.attestation = capable(labels.get("encryption")), capable(labels.get("attestation"))
        s.price = price(labels.get("price", ""))
        s.placement_key = (s.region, s.zone, s.province, s.encryption, s.attestation)
        s.base_candidate = spb.Candidate(node_id=s.node_id, labels=labels)

    def _rescale_fleet(self) -> None:
        """The fleet's best value moved: every group's value_norm and compute levels with it."""
        self.best_value = max((x.best_value for x in self.summaries.values()), default=0.0)
        self.inv_best_value = 1.0 / self.best_value if self.best_value > 0 else 0.0
        now = self.state.clock()
        for x in self.summaries.values():
            for g in {id(g): g for gs in x.pool_groups for g in gs}.values():
                g.rescale(self.inv_best_value)
            self._filed(x, now)

    # -- staleness -------------------------------------------------------------------------------------
    def _seen(self, node: Any) -> None:
        """Track when a node was last heard from, to find the stale ones without a scan: every
        node is in `stale_known` or has one live entry (time, node) in `seen_heap` with a time at
        or before its last_seen_ns (renewed at most every stale_s / 2, and when it comes due)."""
        nid = node.node_id
        back = self.stale_known.pop(nid, None)
        if back is not None:
            self._mark_stale(back, False)
        t = node.last_seen_ns
        pushed = self.seen_pushed.get(nid)
        if pushed is None or t - pushed > self.stale_ns // 2:
            heapq.heappush(self.seen_heap, (t, nid))
            self.seen_pushed[nid] = t

    def stale(self, cut: int) -> list[NodeSummary]:
        """Every node last heard from before `cut`, as its NodeState says now."""
        self.find_stale(cut)
        return list(self.stale_known.values())

    def find_stale(self, cut: int) -> None:
        """`stale_known` = the nodes last heard from before `cut`, as their NodeStates say now, each
        marked stale in the index (index.mark_stale: out of the counts a decision reads) when it
        joins and unmarked when it leaves; a node joins or leaves once per time it goes silent."""
        heap, known, pushed = self.seen_heap, self.stale_known, self.seen_pushed
        while heap and heap[0][0] < cut:
            t, nid = heapq.heappop(heap)
            if pushed.get(nid) != t:
                continue          # superseded by a later entry
            s = self.summaries.get(nid)
            if s is None:
                continue
            seen = s.state.last_seen_ns
            if seen < cut:
                known[nid] = s
                del pushed[nid]
                self._mark_stale(s, True)
            else:                 # heard from since: follow it on from there
                heapq.heappush(heap, (seen, nid))
                pushed[nid] = seen
        for s in [s for s in known.values() if s.state.last_seen_ns >= cut]:
            nid = s.node_id           # back (a resend refreshes last_seen without a stored batch)
            del known[nid]
            heapq.heappush(heap, (s.state.last_seen_ns, nid))
            pushed[nid] = s.state.last_seen_ns
            self._mark_stale(s, False)

    def _mark_stale(self, s: NodeSummary, stale: bool) -> None:
        mark_stale(self.pools, s, stale)
        self._journal(s.node_id)

    def _journal(self, nid: str) -> None:
        self.changes += 1
        self.journal.pop(nid, None)
        self.journal[nid] = self.changes

    # -- readings and events ---------------------------------------------------------------------------
    def _map_series(self, s: NodeSummary) -> None:
        by_id = {d.id: d for d in s.devices}
        for d in s.devices:
            d.health = []
        s.rtt_series = {}
        for ser in s.state.series.values():
            attr = _DEVICE_SERIES.get(ser.name)
            if attr is None and ser.name != HEALTH:
                if ser.name == NETWORK_TCP_RTT and ser.labels.get("remote_region"):
                    s.rtt_series[ser.labels["remote_region"]] = ser
                continue
            dev = by_id.get(ser.labels.get("device", ""))
            if dev is None:
                continue
            if attr is None:
                dev.health.append(ser)
            else:
                setattr(dev, attr, ser)
        s.series_seen = len(s.state.series)

    def _note_events(self, s: NodeSummary, events: Any, received: list[int] | None = None) -> None:
        now = self.state.clock()   # an event counts from `received` (on our clock, clock.py), else its stamp
        for i, e in enumerate(events):
            t = received[i] if received is not None else (e.time_unix_nano or now)
            if t > now:   # an agent clock ahead of ours: count from when it arrived
                t = now
            kind = e.type
            if kind == "xid" or kind == "ecc":
                what = f"XID {e.attributes['xid']}" if "xid" in e.attributes else (
                    "double-bit ECC error" if kind == "ecc" else "XID")
                s.xid_events[e.device] = (t, f"{what}: {e.message}")
            elif kind == "health":
                status = e.attributes.get("status", "")
                ok = status.upper() in ("OK", "HEALTHY") if status else e.severity == "info"
                s.health_events[e.device] = (t, ok, f"health {status or e.severity}: {e.message}")
            elif kind == "checkpoint_request":
                s.checkpoint_requests[e.device] = (t, e.message or "HBM bandwidth watch fired")

    def _refresh(self, s: NodeSummary, now: int, force: bool = False) -> None:
        """New readings or events: each device's free HBM, free score and health; then the groups,
        filed in the index, unless nothing a decision reads moved (`force`: a new inventory, whose
        devices and layout are new whatever their readings)."""
        self.refreshes += 1
        if len(s.state.series) != s.series_seen:
            self._map_series(s)
        if s.rtt_series:
            self._measure(s, now)
        expires = INF
        diagnosed = _diagnosed(s.state, now)
        with_events = bool(s.xid_events or s.health_events or s.checkpoint_requests or diagnosed)
        nan = math.nan
        looked = False   # whether any device's health was looked at (else none is out)
        # Whether anything a decision reads moved: with events (their windows and texts age) always;
        # else only where a device's readings, or whether it is offered or penalised, did.
        changed = with_events or force
        for d in s.devices:
            if not changed:
                was = (d.readings, d.excluded, d.penalty)
            d.excluded = d.penalty = None
            if with_events or d.health:
                looked = True
                expires = self._health(s, d, now, expires, diagnosed.get(d.id) if diagnosed else None)
            # Free HBM, readings and free score from the latest series values.
            limit = d.limit.value if d.limit is not None else nan
            total = limit if limit > 0 else d.capacity    # NaN > 0 is False
            used = d.used.value if d.used is not None else nan
            free = total - used if used >= 0 else total
            free = d.free = free if free > 0 else 0.0
            util = d.util.value if d.util is not None else nan
            bandwidth = d.bandwidth.value if d.bandwidth is not None else nan
            score = d.free_score = free_score(util, used, free, total, bandwidth)
            d.readings = (util, free, total, bandwidth)
            d.choice_order = (d.penalty is not None, -score, -free)
            if not changed and was != (d.readings, d.excluded, d.penalty):
                changed = True
        if not changed:   # an idle node's round: its groups and their filing in the index stand
            self.unchanged += 1
            return
        self._group(s)
        s.not_offered = [d for d in s.devices if d.excluded is not None] if looked else []
        if expires != s.expires_ns:
            s.expires_ns = expires
            if expires < INF:
                heapq.heappush(self.expiries, (expires, s.node_id))
        self._filed(s, now)

    def _measure(self, s: NodeSummary, now: int) -> None:
        """The node's RTT histograms: a new point of one joins its window (latency.py), and the
        node's figure for that region pair is filed anew."""
        window_ns, latency = self.latency.window_ns, self.latency
        for remote, ser in s.rtt_series.items():
            w = s.rtt.get(remote)
            if w is None:
                w = s.rtt[remote] = RttWindow()
            if w.observe(ser.histogram, now, window_ns):
                latency.set(s.node_id, s.region, remote,
                            None if w.median_s is None else w.median_s * 1e3, w.grew_ns)

    def _group(self, s: NodeSummary) -> None:
        """The node's groups: per type, and per interconnect domain (the type's group when it has
        one domain); then the lists each pool looks at."""
        factor, inv_best = self.settings.hbm_watch_factor, self.inv_best_value
        by_type: dict[str, Group] = {}
        per_type: list[list[Group]] = [[], []]
        per_domain: list[list[Group]] = [[], []]
        for i, t, devs, static, domains in s.layout:
            g = by_type[t] = Group(s, t, "", devs, factor, static)
            g.rescale(inv_best)
            per_type[i].append(g)
            if domains is None:
                g.domain = devs[0].domain
                per_domain[i].append(g)
            else:
                of_one = Group.of_one
                for name, of_domain, domain_static in domains:
                    if len(of_domain) == 1:   # a device with a domain of its own (most often all of them)
                        dg = of_one(s, t, name, of_domain[0], factor, domain_static, inv_best)
                    else:
                        dg = Group(s, t, name, of_domain, factor, domain_static)
                        dg.rescale(inv_best)
                    per_domain[i].append(dg)
        s.by_type = by_type
        s.pool_groups = (per_type[0], per_type[1], per_type[0] + per_type[1],
                         per_domain[0], per_domain[1], per_domain[0] + per_domain[1])

    def _health(self, s: NodeSummary, d: Device, now: int, expires: int, diagnosis: str | None = None) -> int:
        """Whether the device is offered (d.excluded) and penalised (d.penalty: a recent HBM-watch
        checkpoint request, or `diagnosis`, what is open on it now); returns the earliest time a
        window that decided it ends."""
        xid_window, ckpt_window = self.settings.xid_window_ns, self.settings.hbm_watch_window_ns
        xid = s.xid_events.get(d.id) if s.xid_events else None
        if xid is not None and now - xid[0] < xid_window:
            d.excluded = ("xid", f"{xid[1]} ({(now - xid[0]) / 1e9:.0f} s ago)")
            expires = min(expires, xid[0] + xid_window)
        else:
            d.excluded = _health_state(d, s.health_events.get(d.id) if s.health_events else None)
        ckpt = s.checkpoint_requests.get(d.id) if s.checkpoint_requests else None
        if ckpt is not None and now - ckpt[0] < ckpt_window:
            d.penalty = f"HBM watch asked for a checkpoint {(now - ckpt[0]) / 1e9:.0f} s ago: {ckpt[1]}"
            d.penalty_reason = "hbm_watch"
            expires = min(expires, ckpt[0] + ckpt_window)
        if diagnosis is not None:   # no window: it lasts as long as the diagnosis is open
            d.penalty, d.penalty_reason = ((diagnosis, "diagnosis") if d.penalty is None
                                           else (f"{d.penalty}; {diagnosis}", "hbm_watch+diagnosis"))
        return expires

    def expire(self, now: int) -> None:
        """Windows (XID, HBM watch) that ended since the last decision: refresh those nodes."""
        heap = self.expiries
        while heap and heap[0][0] <= now:
            _, nid = heapq.heappop(heap)
            s = self.summaries.get(nid)
            if s is not None and s.expires_ns <= now:
                self._refresh(s, now)


def _diagnosed(node: FleetNode, now: int) -> dict[str, str]:
    """Device -> the penalty's detail for the diagnoses open on it (node-wide ones, device "", name
    no device and penalise none)."""
    held = node.diagnoses
    if not held:
        return {}
    out: dict[str, list[str]] = {}
    for e in list(held.values()):
        if not e.device:
            continue
        since = dg.opened_ns(e)
        age = f" (opened {max(0, now - since) / 1e9:.0f} s ago)" if since else ""
        rule = e.attributes.get(dg.RULE, "") or "unknown"
        out.setdefault(e.device, []).append(f"open diagnosis {rule}{age}: {e.attributes.get(dg.CAUSE) or e.message}")
    return {dev: "; ".join(texts) for dev, texts in out.items()}


def _health_state(d: Device, event: tuple | None) -> tuple | None:
    """("unhealthy", detail) when the newer of the health series and the last health event says
    the device is not OK, else None."""
    newest_time, newest = -1, cast(Any, None)
    for ser in d.health:   # by when it arrived, as the events
        if ser.recv_ns > newest_time:
            newest_time, newest = ser.recv_ns, ser
    if event is not None and event[0] > newest_time:
        return None if event[1] else ("unhealthy", event[2])
    if newest is not None and newest.value < 1.0:
        return ("unhealthy", f"health {newest.labels.get('status', 'not OK')} "
                             f"(xpusense.accelerator.health = {newest.value:g})")
    return None
