"""The per-node index a decision walks: what the scheduler keeps per node (NodeSummary, its Devices
and Groups, with what a decision needs for any device count precomputed) and where it is filed
(per kind of request a Pool, of Buckets by placement key, of Entries by compute level and tie key).
How and why: docs/scheduler.md "The index"."""

from __future__ import annotations

import operator
from array import array
from typing import Any

from xpusense.v1 import scheduler_pb2 as spb

from ..fleet_interface import FleetNode
from .ranked import Ranked
from .scoring import NO_READINGS_FREE, UNKNOWN_VALUE_NORM, value_norm, value_per_price

ACCEL_TYPES = ("GPU", "NPU")
TYPE_INDEX = {spb.ACCELERATOR_GPU: 0, spb.ACCELERATOR_NPU: 1, spb.ACCELERATOR_ANY: 2}
TYPE_NAMES = (("GPU",), ("NPU",), ACCEL_TYPES)   # the device types a type index stands for
POOLS = 6          # type index (0..2) + 3 when the devices must share a domain
INF = 1 << 62
CMAX = 8           # device counts the index serves; a larger count is answered by a scan
LEVELS = 32        # levels of the compute part, for the top-K search
SETTLE_NS = 3 * 10**9   # a node filed by id not refreshed for this long: by tie key (fleet.py settle_quiet)
FEWER_OFFERED = -1.0   # in a fit row: fewer than c devices offered (some are out)
FEWER_AT_ALL = -2.0    # in a fit row: fewer than c devices on the node at all
NO_FIT = array("d", [FEWER_AT_ALL] * CMAX)


class Device:
    """One accelerator of a node, with its latest readings (FleetState's Series, read in place)."""
    __slots__ = ("id", "type", "model", "capacity", "tflops", "domain", "util", "used", "limit", "bandwidth",
                 "health", "free", "free_score", "readings", "penalty", "penalty_reason", "excluded", "choice_order")

    def __init__(self, rid: str, rtype: str, model: str, capacity: float, tflops: float | None, domain: str):
        self.id, self.type, self.model = rid, rtype, model
        self.capacity, self.tflops, self.domain = capacity, tflops, domain
        self.util: Any = None               # Series of FleetState, read in place
        self.used: Any = None
        self.limit: Any = None
        self.bandwidth: Any = None
        self.health: list = []              # health Series (one per status label)
        self.free = capacity                # free HBM, bytes
        self.free_score = NO_READINGS_FREE
        self.readings: tuple = ()           # (utilisation, free HBM, HBM, bandwidth utilisation); NaN: none
        self.penalty: str | None = None     # why, when the HBM watch fired recently or a diagnosis is open
        self.penalty_reason = ""            # hbm_watch | diagnosis | hbm_watch+diagnosis
        self.excluded: tuple | None = None  # (reason, detail) when not offered
        self.choice_order: tuple = ()       # (penalised, -free score, -free HBM): the order devices are chosen in


_CHOICE_ORDER = operator.attrgetter("choice_order")
_DEVICES = operator.attrgetter("devices")
# The ends of a fit row, a levels list and a ties list past the n counts offered (n < CMAX), made once:
# _ROW_TAILS[n][n_all] for a group of n_all devices (at most CMAX), n of them offered.
_ROW_TAILS = [[array("d", [FEWER_OFFERED if c <= n_all else FEWER_AT_ALL for c in range(n + 1, CMAX + 1)])
               for n_all in range(CMAX + 1)] for n in range(CMAX)]
_LEVEL_TAILS = [[-1] * (CMAX - n) for n in range(CMAX)]
_INF_FLOAT = float(INF)
_TIE_TAILS: list[list[tuple | None]] = [[None] * (CMAX - n) for n in range(CMAX)]
# Group.of_one's, shared by every one-device group (read only): its penalty list when the device is
# not penalised, its fit row with the free HBM still to set, its levels list per level.
_ONE_PENALTY = [1.0, 1.0]
_ONE_ROW = array("d", [0.0, *_ROW_TAILS[1][1]])
_ONE_LEVELS = [[-1, level, *_LEVEL_TAILS[1]] for level in range(LEVELS)]


def group_static(node: NodeSummary, devs: list[Device]) -> tuple[int, str, float | None, float]:
    """What a Group of `devs` holds that changes only with the inventory or the node's price:
    (devices, model, TFLOPS of the slowest when all are known, value per price)."""
    known = [d.tflops for d in devs if d.tflops is not None]
    tflops = min(known) if len(known) == len(devs) else None
    return len(devs), devs[0].model, tflops, value_per_price(tflops, node.price)


class Group:
    """The offered (healthy) devices of one type on a node, or of one interconnect domain, with what
    a decision needs for any `count` precomputed. Devices are in the order they would be chosen:
    not penalised first, then by free score. For `count` devices of `memory` bytes each:
    free_desc[count-1] >= memory says whether enough devices fit at all; when min_free[count] >=
    memory the first `count` devices all fit and compute[count] (the compute dimension) and
    penalty[count] (the penalty factor) are the answer in O(1); otherwise `choose` walks the devices."""
    __slots__ = ("node", "type", "domain", "devices", "free_desc", "min_free", "mean_free", "penalty", "compute",
                 "value_norm", "tflops", "value", "model", "free_all_desc", "n_all", "fit_row", "levels",
                 "value_text", "explained", "ties")

    def __init__(self, node: NodeSummary, rtype: str, domain: str, devs: list[Device], factor: float,
                 static: tuple | None = None):
        self.node, self.type, self.domain = node, rtype, domain
        # What does not change between refreshes (the devices and the node's price): group_static(),
        # worked out once per inventory by the caller, or here.
        self.n_all, self.model, self.tflops, self.value = static or group_static(node, devs)
        self.value_norm = UNKNOWN_VALUE_NORM
        self.value_text = ""
        # explain.py's, for this group's lifetime: chosen devices per (count, memory), and made
        # candidates (1-tuples) per answer shape
        self.explained: dict[tuple, tuple] = {}
        self.levels: list[int] = []
        self.ties: list[tuple | None] = []
        self.compute: list[float]   # mean_free until rescale()
        if len(devs) == 1:   # one device (a domain of its own): the same figures, without the loops
            d = devs[0]
            free = d.free
            self.free_all_desc = [free]
            if d.excluded is None:
                self.devices, self.free_desc = [d], self.free_all_desc
                self.min_free = [INF, free if free < _INF_FLOAT else _INF_FLOAT]
                self.compute = self.mean_free = [0.0, 0.0 + d.free_score]
                self.penalty = [1.0, 1.0 if d.penalty is None else factor]
                self.fit_row = row = array("d", self.free_desc)
                row.extend(_ROW_TAILS[1][1])
            else:
                self.devices, self.free_desc = [], []
                self.min_free, self.compute, self.penalty = [INF], [0.0], [1.0]
                self.mean_free = self.compute
                self.fit_row = array("d", _ROW_TAILS[0][1])
            return
        offered = [d for d in devs if d.excluded is None]
        n = len(offered)
        if n > 1:
            offered.sort(key=_CHOICE_ORDER)
        self.devices = offered
        self.free_desc = free_desc = sorted([d.free for d in offered], reverse=True)
        # Per count c (index 0 unused): the least free HBM among the first c devices, their mean free
        # score, and the penalty factor when they are the ones chosen.
        min_free: list[float] = [INF]
        mean_free, penalty = [0.0], [1.0]
        total_score, factor_now, least = 0.0, 1.0, float(INF)
        i = 0
        for d in offered:
            i += 1
            total_score += d.free_score
            if d.penalty is not None:
                factor_now = factor
            if d.free < least:
                least = d.free
            min_free.append(least)
            mean_free.append(total_score / i)
            penalty.append(factor_now)
        self.min_free, self.mean_free, self.penalty = min_free, mean_free, penalty
        # Every device offered (the usual case): the same values (read only, shared).
        self.free_all_desc = free_desc if n == len(devs) else sorted([d.free for d in devs], reverse=True)
        self.compute = mean_free   # set by rescale()
        # The row the index files (Bucket.fit, Pool.fit): per count c = 1..CMAX the free HBM of the
        # c-th most free offered device, or FEWER_OFFERED / FEWER_AT_ALL.
        if n >= CMAX:
            self.fit_row = array("d", free_desc[:CMAX])
        else:
            self.fit_row = row = array("d", free_desc)
            row.extend(_ROW_TAILS[n][min(self.n_all, CMAX)])

    @classmethod
    def of_one(cls, node: NodeSummary, rtype: str, domain: str, d: Device, factor: float, static: tuple,
               inv_best_value: float) -> Group:
        """Group(node, rtype, domain, [d], factor, static) rescaled to `inv_best_value`, made in one
        step: the same figures (test_one_device_group_is_the_general_one). A node whose devices each
        have an interconnect domain of their own has one such group per device, made at every refresh."""
        g = cls.__new__(cls)
        g.node, g.type, g.domain = node, rtype, domain
        g.n_all, g.model, g.tflops, g.value = static
        g.value_text = ""
        g.explained = {}
        g.value_norm = norm = g.value * inv_best_value if g.value >= 0 else UNKNOWN_VALUE_NORM   # value_norm()
        free = d.free
        g.free_all_desc = free_desc = [free]
        if d.excluded is None:
            g.devices, g.free_desc = [d], free_desc
            g.min_free = [INF, free if free < _INF_FLOAT else _INF_FLOAT]
            g.mean_free = [0.0, score := 0.0 + d.free_score]
            g.penalty = penalty = _ONE_PENALTY if d.penalty is None else [1.0, factor]
            g.fit_row = row = _ONE_ROW[:]
            row[0] = free
            x = norm * score
            g.compute = [norm * 0.0, x]
            level = LEVELS - 1 if x >= 1.0 else int(x * LEVELS)
            g.levels = _ONE_LEVELS[level] if level >= 0 else [-1, level, *_LEVEL_TAILS[1]]
            g.ties = [None, (x, penalty[1], g.min_free[1], free) if level >= 0 else None, *_TIE_TAILS[1]]
        else:
            g.devices, g.free_desc = [], []
            g.min_free, g.penalty = [INF], [1.0]
            g.mean_free = [0.0]
            g.fit_row = array("d", _ROW_TAILS[0][1])
            g.compute = [norm * 0.0]
            g.levels = [-1, *_LEVEL_TAILS[0]]
            g.ties = [None, *_TIE_TAILS[0]]
        return g

    def rescale(self, inv_best_value: float) -> None:
        """The fleet's best value per price is 1 / inv_best_value: the compute dimension per count,
        and its level (0..LEVELS-1; -1 where the count is not offered)."""
        self.value_text = ""   # the compute dimension's value text (explain.py), made when first asked for
        self.value_norm = norm = value_norm(self.value, inv_best_value)
        mean_free = self.mean_free
        if len(mean_free) == 2:   # one device offered (the one-device groups): the loop below, unrolled
            self.compute = [norm * mean_free[0], x := norm * mean_free[1]]
            level = LEVELS - 1 if x >= 1.0 else int(x * LEVELS)
            self.levels = [-1, level, *_LEVEL_TAILS[1]]
            self.ties = [None, (x, self.penalty[1], self.min_free[1], self.free_desc[0]) if level >= 0 else None,
                         *_TIE_TAILS[1]]
            return
        self.compute = compute = [norm * f for f in mean_free]   # scoring.compute_efficiency, inlined
        # Per count c offered: (compute, penalty factor, least free HBM of the first c devices, free HBM
        # of the c-th most free): nodes of one Bucket with the same tie key score the same for every
        # request for c devices that their first c devices fit (search._rank_by_levels).
        # None where the count is not filed (level -1).
        # free_desc[c - 1] is fit_row's value where c is offered, and no new float.
        free_desc, min_free, penalty = self.free_desc, self.min_free, self.penalty
        n = min(len(compute) - 1, CMAX)
        levels: list[int] = [-1]
        ties: list[tuple | None] = [None]
        for c in range(1, n + 1):
            x = compute[c]
            level = LEVELS - 1 if x >= 1.0 else int(x * LEVELS)
            levels.append(level)
            ties.append((x, penalty[c], min_free[c], free_desc[c - 1]) if level >= 0 else None)
        if n < CMAX:
            levels += _LEVEL_TAILS[n]
            ties += _TIE_TAILS[n]
        self.levels, self.ties = levels, ties

    def choose(self, count: int, memory: int) -> tuple[list[Device], float, float]:
        """The first `count` devices in choice order that have `memory` free: (devices, mean free
        score, penalty factor); fewer devices when not enough fit."""
        chosen = [d for d in self.devices if d.free >= memory][:count]
        if not chosen:
            return chosen, 0.0, 1.0
        factor = self.penalty[-1] if any(d.penalty is not None for d in chosen) else 1.0
        return chosen, sum(d.free_score for d in chosen) / len(chosen), factor

    def fits(self, count: int, memory: int) -> bool:
        """Whether `count` offered devices have `memory` free."""
        return len(self.free_desc) >= count and self.free_desc[count - 1] >= memory


class NodeSummary:
    """What the scheduler keeps per node. `pool_groups[i]` is the list of groups a request of Pool
    i looks at: i = type index (GPU 0, NPU 1, any 2) + 3 when the devices must share one domain."""
    __slots__ = ("state", "node_id", "labels", "region", "zone", "province", "encryption", "attestation",
                 "price", "placement_key", "devices", "by_type", "pool_groups", "expires_ns", "series_seen",
                 "xid_events", "health_events", "checkpoint_requests", "not_offered", "best_value",
                 "base_candidate", "layout", "rtt_series", "rtt", "stale")

    def __init__(self, state: FleetNode):
        self.state = state                  # the fleet's node, read in place (last_seen_ns...)
        self.node_id: str = state.node_id
        self.devices: list[Device] = []
        self.by_type: dict[str, Group] = {}
        self.pool_groups: tuple[list[Group], ...] = ([],) * POOLS
        self.expires_ns = INF               # when its next XID / HBM-watch window ends
        self.series_seen = -1               # len(state.series) when the devices' series were mapped
        self.xid_events: dict[str, tuple] = {}     # device -> (time ns, detail): last XID / double-bit ECC
        self.health_events: dict[str, tuple] = {}  # device -> (time ns, ok, detail): last health event
        self.checkpoint_requests: dict[str, tuple] = {}   # device -> (time ns, detail): last HBM-watch request
        self.labels: dict[str, str] = {}
        self.region = self.zone = self.province = ""
        self.encryption = self.attestation = False
        self.price: float | None = None
        self.placement_key: tuple = ()      # (region, zone, province, encryption, attestation)
        self.not_offered: list[Device] = []   # devices not offered now (d.excluded says why)
        self.best_value = -1.0              # best value (TFLOPS per price) among its groups
        self.base_candidate = spb.Candidate(node_id=self.node_id)   # what every answer naming it starts from
        # (type index, type, devices, group_static, [(domain, devices, group_static)] or None: one domain)
        self.layout: list[tuple] = []
        self.rtt_series: dict[str, Any] = {}   # remote region -> its xpusense.network.tcp.rtt Series
        self.rtt: dict[str, Any] = {}          # remote region -> its latency.RttWindow
        self.stale = False                     # found stale by the last decision (FleetView.stale, mark_stale)


class Entry:
    """A node in one pool. `group`: its one group to look at there (the common case), or None with
    `groups` the several (types for `any`, domains for same_domain), evaluated one by one."""
    __slots__ = ("summary", "state", "key", "group", "groups", "bucket_slot", "pool_slot", "levels", "ties", "row",
                 "stale", "settled", "most_offered", "misfit")

    def __init__(self, s: NodeSummary, key: tuple):
        self.summary, self.state, self.key = s, s.state, key
        self.group: Group | None = None
        self.groups: list[Group] = []
        self.bucket_slot = -1          # place in its Bucket's one_group (one-group nodes)
        self.pool_slot = -1            # row in its Pool's fit
        self.row = NO_FIT              # the fit row filed (its group's once set)
        self.stale = False             # in its Bucket's `stale`, its row out of Bucket.counts
        self.levels = [-1] * (CMAX + 1)   # per count: its level in Bucket.by_level, -1 when not there
        self.ties: list[tuple | None] = [None] * (CMAX + 1)   # per count: its group's tie key (Group.ties)
        self.settled: bool | None = None   # filed by tie key (True) or by id (False); None: not filed yet
        # Several groups: the most devices any of them offers, and per request shape (type index,
        # count, memory, same_domain) where it is a misfit: its reason, whether it fits as a type (as
        # `classify` found them) and what its type rows take out of the counts (search.py): both
        # hold until its groups change (file_node resets them, and sets its type rows with them).
        self.most_offered = 0
        self.misfit: dict[tuple, tuple[str, bool, int, int, int]] = {}


class Alike:
    """The nodes of one level and tie key in a Bucket when more than one node has had it (O(1) in
    and out; it stays when fewer are left), and their ids sorted, made when a decision first needs
    them after a change (the order search takes the top K in)."""
    __slots__ = ("members", "order")

    def __init__(self, members: dict[str, Entry]) -> None:
        self.members = members
        self.order: list[str] | None = None

    def ids_sorted(self) -> list[str]:
        if self.order is None:
            self.order = sorted(self.members)
        return self.order


class Bucket:
    """The nodes of one placement key in a pool: `one_group` (by slot) and `many_groups` (the nodes
    with several groups). by_level[c][level] = the one-group nodes whose compute part for c
    devices is in that level, walked best level first: a node whose tie key (Group.ties[c]) did not
    change at its last refresh, or that has not been refreshed for SETTLE_NS (`settled`: idle, or
    quiet; FleetView settles those on its timer, off the decision path), under its tie key, with the
    node or the nodes (Alike, when more than one has had it) that have it; a node whose tie key
    changed (busy: its readings move) under its id, so that its refreshes cost what a level move
    does. In a type pool (`counts` not None):
    counts[c - 1] = the values of its nodes' fit rows for count c (free HBM of the c-th most free
    offered device, or FEWER_OFFERED / FEWER_AT_ALL), sorted, of the nodes not marked stale
    (`stale`: those found stale by the last decision, mark_stale). `version` rises whenever a node
    with several groups comes, goes, goes stale or back, or is refreshed; `misfit_sums` (search.py,
    per request shape) hold while it stays the same."""
    __slots__ = ("key", "one_group", "many_groups", "counts", "by_level", "nonempty", "key_part", "stale",
                 "version", "misfit_sums")

    def __init__(self, key: tuple, counted: bool = False):
        self.key = key
        self.one_group: list[Entry] = []
        self.many_groups: dict[str, Entry] = {}
        self.counts: list[Ranked] | None = [Ranked() for _ in range(CMAX)] if counted else None
        self.stale: dict[str, Entry] = {}
        self.by_level: list[list[dict[tuple | str, Entry | Alike]]] = \
            [[]] + [[{} for _ in range(LEVELS)] for _ in range(CMAX)]
        self.nonempty = [0] * (CMAX + 1)   # per count: bit `level` set when by_level[c][level] has nodes
        self.key_part = 0.0     # during a decision: its placement key's part of the score
        self.version = 0
        self.misfit_sums: dict[tuple, Any] = {}

    def size(self) -> int:
        return len(self.one_group) + len(self.many_groups)

    def refile(self, e: Entry, g: Group) -> None:
        """File a one-group node under its new group's levels: by tie key when the tie keys are
        those of its last refresh (or on its first filing), else by id. O(1) per count moved; a
        node that stays settled or stays busy in its levels is not moved."""
        same = e.ties == g.ties
        if e.settled is None:
            self._file(e, g.levels, g.ties, True)
        elif e.settled:
            if not same:
                self._unfile(e)
                self._file(e, g.levels, g.ties, False)
        elif same:
            self._unfile(e)
            self._file(e, g.levels, g.ties, True)
        elif e.levels != g.levels:
            self._move_by_id(e, g.levels)
        e.levels, e.ties = g.levels, g.ties

    def settle(self, e: Entry) -> None:
        """A node filed by id whose group has not changed for a while (FleetView.settle_quiet): by tie key."""
        if e.settled is False:
            self._unfile(e)
            self._file(e, e.levels, e.ties, True)

    def _move_by_id(self, e: Entry, new_levels: list[int]) -> None:
        """A busy node filed by id: under its new levels instead of its old ones."""
        nid, by_level, nonempty, old_levels = e.summary.node_id, self.by_level, self.nonempty, e.levels
        for c in range(1, CMAX + 1):
            old, new = old_levels[c], new_levels[c]
            if new != old:
                if old >= 0:
                    nodes = by_level[c][old]
                    del nodes[nid]
                    if not nodes:
                        nonempty[c] &= ~(1 << old)
                if new >= 0:
                    by_level[c][new][nid] = e
                    nonempty[c] |= 1 << new

    def _file(self, e: Entry, levels: list[int], ties: list[tuple | None], settled: bool) -> None:
        nid, by_level, nonempty = e.summary.node_id, self.by_level, self.nonempty
        for c in range(1, CMAX + 1):
            level = levels[c]
            if level < 0:
                continue
            nodes = by_level[c][level]
            key = ties[c] if settled else nid
            alike = nodes.get(key)   # type: ignore[arg-type]
            if alike is None:
                nodes[key] = e   # type: ignore[index]
                nonempty[c] |= 1 << level
            elif alike.__class__ is Entry:
                nodes[key] = Alike({alike.summary.node_id: alike, nid: e})   # type: ignore[index]
            else:
                alike.members[nid] = e   # type: ignore[union-attr]
                alike.order = None       # type: ignore[union-attr]
        e.settled = settled

    def _unfile(self, e: Entry) -> None:
        nid, by_level, nonempty, levels, ties = e.summary.node_id, self.by_level, self.nonempty, e.levels, e.ties
        for c in range(1, CMAX + 1):
            level = levels[c]
            if level < 0:
                continue
            nodes = by_level[c][level]
            key = ties[c] if e.settled else nid
            alike = nodes[key]   # type: ignore[index]
            if alike is not e:
                members = alike.members   # type: ignore[union-attr]
                del members[nid]
                alike.order = None        # type: ignore[union-attr]
                if members:
                    continue
            del nodes[key]   # type: ignore[arg-type]
            if not nodes:
                nonempty[c] &= ~(1 << level)
        e.settled = None

    def file_row(self, old: array, new: array) -> None:
        """A node's fit row changed from `old` to `new`: the sorted values with it."""
        if self.counts is not None:
            Ranked.replace_each(self.counts, old, new)

    def remove_one_group(self, e: Entry) -> None:
        """Take a one-group node out: its slot (the last one moves into its place), its fit row's
        values and its levels."""
        last = self.one_group.pop()
        if last is not e:
            self.one_group[e.bucket_slot] = last
            last.bucket_slot = e.bucket_slot
        if self.counts is not None and not e.stale:
            for c in range(CMAX):
                self.counts[c].remove(e.row[c])
        if e.settled is not None:
            self._unfile(e)
        e.bucket_slot = -1


class Pool:
    """What one kind of request walks: the nodes that have such devices, in Buckets by placement
    key. `fit` and `one_group` hold every one-group node's fit row once more, pool-wide (by pool
    slot), so that a decision finds a few misfits to list at C speed. `counted`: a type pool,
    whose Buckets keep the sorted fit values (Bucket.counts)."""
    __slots__ = ("buckets", "entries", "with_devices_out", "fit", "one_group", "counted")

    def __init__(self, counted: bool = False) -> None:
        self.counted = counted
        self.buckets: dict[tuple, Bucket] = {}
        self.entries: dict[str, Entry] = {}
        self.with_devices_out: dict[str, Entry] = {}   # nodes with a device not offered now
        self.fit = array("d")
        self.one_group: list[Entry] = []

    def add(self, s: NodeSummary, one_group: bool) -> Entry:
        """A new entry for the node in the bucket of its placement key, its rows not yet set."""
        nid, key = s.node_id, s.placement_key
        e = self.entries[nid] = Entry(s, key)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = Bucket(key, self.counted)
        if one_group:
            e.bucket_slot = len(b.one_group)
            b.one_group.append(e)
            if b.counts is not None:
                for c in range(CMAX):
                    b.counts[c].add(NO_FIT[c])
            e.pool_slot = len(self.one_group)
            self.one_group.append(e)
            self.fit.extend(NO_FIT)
        else:
            b.many_groups[nid] = e
            b.version += 1
        if s.stale:
            self.mark_stale(e, True)
        return e

    def mark_stale(self, e: Entry, stale: bool) -> None:
        """A node found stale (True) or back (False): in or out of its Bucket's `stale`, its fit row
        out of or back into the Bucket's sorted values."""
        if e.stale == stale:
            return
        e.stale = stale
        b = self.buckets[e.key]
        if e.bucket_slot < 0:
            b.version += 1
        if stale:
            b.stale[e.summary.node_id] = e
        else:
            del b.stale[e.summary.node_id]
        if b.counts is not None and e.bucket_slot >= 0:
            for values, v in zip(b.counts, e.row):
                if stale:
                    values.remove(v)
                else:
                    values.add(v)

    def set_group(self, e: Entry, g: Group) -> None:
        """A one-group node's group after a refresh: its fit rows and its levels."""
        e.group = g
        b = self.buckets[e.key]
        if b.counts is not None and e.row is not g.fit_row and not e.stale:
            b.file_row(e.row, g.fit_row)
        e.row = g.fit_row
        row = e.pool_slot * CMAX
        self.fit[row:row + CMAX] = g.fit_row
        b.refile(e, g)

    def remove(self, e: Entry) -> None:
        nid = e.summary.node_id
        b = self.buckets[e.key]
        if e.bucket_slot >= 0:
            b.remove_one_group(e)
            last = self.one_group.pop()
            if last is not e:
                self.one_group[e.pool_slot] = last
                row = e.pool_slot * CMAX
                self.fit[row:row + CMAX] = self.fit[-CMAX:]
                last.pool_slot = e.pool_slot
            del self.fit[-CMAX:]
            e.pool_slot = -1
        else:
            del b.many_groups[nid]
            b.version += 1
        if e.stale:
            del b.stale[nid]
            e.stale = False
        del self.entries[nid]
        self.with_devices_out.pop(nid, None)
        if not b.size():
            del self.buckets[e.key]


def mark_stale(pools: tuple[Pool, ...], s: NodeSummary, stale: bool) -> None:
    """The node found stale (True) or back (False), in every pool."""
    s.stale = stale
    for pool in pools:
        e = pool.entries.get(s.node_id)
        if e is not None:
            pool.mark_stale(e, stale)


def file_node(pools: tuple[Pool, ...], s: NodeSummary) -> bool:
    """Index the node's current groups in every pool (after every refresh). True when it is filed
    by id in some pool (busy: its tie key changed; to be settled once it has been quiet)."""
    nid, by_id = s.node_id, False
    for pool, groups in zip(pools, s.pool_groups):
        e = pool.entries.get(nid)
        if not groups:
            if e is not None:
                pool.remove(e)
            continue
        one = len(groups) == 1
        if e is None or e.key != s.placement_key or (e.bucket_slot >= 0) != one:
            if e is not None:
                pool.remove(e)
            e = pool.add(s, one)
        if one:
            pool.set_group(e, groups[0])
            by_id = by_id or e.settled is False
        else:
            e.groups = groups
            e.most_offered = max(map(len, map(_DEVICES, groups)))
            e.misfit = {}
            pool.buckets[e.key].version += 1
        if s.not_offered:
            pool.with_devices_out[nid] = e
        else:
            pool.with_devices_out.pop(nid, None)
    return by_id


def settle_node(pools: tuple[Pool, ...], nid: str) -> None:
    """The node's entries filed by id, under their tie keys (it has been quiet for SETTLE_NS)."""
    for pool in pools:
        e = pool.entries.get(nid)
        if e is not None and e.settled is False:
            pool.buckets[e.key].settle(e)
