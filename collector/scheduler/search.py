"""The decision: a request (Query) against the index, answered by the indexed search (counts over
the fit columns, compute levels walked best first) or by the scan of every node, the reference the
search is tested against (docs/scheduler.md "The decision")."""

from __future__ import annotations

import heapq
import operator
from itertools import chain, compress, islice, repeat
from typing import Any

from xpusense.v1 import scheduler_pb2 as spb

from .fleet import FleetView
from .index import CMAX, FEWER_AT_ALL, FEWER_OFFERED, LEVELS, Alike, Bucket, Entry, Group, NodeSummary
from .latency import Measured, MeasuredLatency
from .scoring import RegionMatrix, compliance, data_affinity, disaster_tolerance

HEALTH_REASONS = ("xid", "unhealthy")
ALIKE_WALKED = 8   # alike nodes (one tie key in a level) up to this many are offered without sorting
FIT_REASONS = ("count", "domain", "memory")
MISFIT_SHAPES = 16   # request shapes whose misfit reason a node with several groups keeps (Entry.misfit)


class _Later:
    """A node id that sorts the other way: in the min-heap of the best, the larger id goes first."""
    __slots__ = ("s",)

    def __init__(self, s: str):
        self.s = s

    def __lt__(self, other: _Later) -> bool:
        return other.s < self.s


class Query:
    """One request while it is being decided: its terms, the running top K, counts and lists."""
    __slots__ = ("req", "type_index", "pool_index", "same_domain", "count", "mem", "limit", "max_listed",
                 "allowed", "replicas", "data_region", "cut", "regions", "w_compute", "w_data", "w_dr",
                 "w_compliance", "result", "threshold", "feasible", "counts", "listed_health", "listed_filter",
                 "listed_fit", "affinity_by_region", "tolerance_by_zone", "filtering", "now", "latency")

    def __init__(self, req: spb.PlaceRequest, weights: dict[str, float], type_index: int, now: int,
                 stale_ns: int, regions: RegionMatrix, latency: MeasuredLatency | None = None):
        self.req, self.type_index = req, type_index
        self.same_domain = req.same_domain
        self.pool_index = type_index + 3 if self.same_domain else type_index
        self.count = req.count or 1
        self.mem = req.memory_bytes
        self.limit = req.limit or 5
        self.max_listed = req.max_excluded or 10
        self.allowed = frozenset(req.allowed_regions)
        self.replicas = list(req.replica_zones)
        self.data_region = req.data_region
        self.cut = now - stale_ns          # a node last heard from before this is stale
        self.regions = regions
        self.now = now
        self.latency = latency             # measured RTT per region pair (expired up to `now`), or None
        self.w_compute, self.w_data = weights["compute"], weights["data_affinity"]
        self.w_dr, self.w_compliance = weights["disaster_tolerance"], weights["compliance"]
        self.result: list[tuple] = []      # min-heap of (score, _Later(node id), group), at most `limit`
        self.threshold = -1.0              # the K-th best score once the heap is full
        self.feasible = 0
        self.counts: dict[str, int] = {}   # excluded nodes by reason
        self.listed_health: list[tuple[str, NodeSummary]] = []   # (reason, node) to list: stale, xid, unhealthy
        self.listed_filter: list[tuple[str, NodeSummary]] = []   # ... region, residency, encryption, attestation
        self.listed_fit: list[tuple[str, NodeSummary]] = []      # ... count, domain, memory
        self.affinity_by_region: dict[str, float] = {}
        self.tolerance_by_zone: dict[str, float] = {}
        self.filtering = bool(self.allowed or req.residency or req.require_encryption or req.require_attestation)

    def offer(self, score: float, nid: str, g: Group) -> bool:
        """Keep the best `limit`: higher score first, then the lower node id (so that the answer
        does not depend on the order nodes are looked at). False when not kept: then no node of
        the same score and a higher id would be."""
        r = self.result
        if len(r) < self.limit:
            heapq.heappush(r, (score, _Later(nid), g))
            if len(r) == self.limit:
                self.threshold = r[0][0]
        elif score > self.threshold or (score == self.threshold and nid < r[0][1].s):
            heapq.heapreplace(r, (score, _Later(nid), g))
            self.threshold = r[0][0]
        else:
            return False
        return True

    def count_reason(self, reason: str, n: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def note_misfit(self, reason: str, s: NodeSummary) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        listed = self.listed_health if reason in HEALTH_REASONS else self.listed_fit
        if len(listed) < self.max_listed:
            listed.append((reason, s))

    def key_part(self, key: tuple) -> float:
        """The part of the score a node's placement key decides: data affinity, disaster
        tolerance, compliance, weighted (each worked out once per region / zone in a decision)."""
        region, zone, _, encryption, attestation = key
        affinity = self.affinity_by_region.get(region)
        if affinity is None:
            measured = self.measured(region)
            affinity = self.affinity_by_region[region] = data_affinity(
                region, self.data_region, self.regions, None if measured is None else measured.ms)
        tolerance = self.tolerance_by_zone.get(zone)
        if tolerance is None:
            tolerance = self.tolerance_by_zone[zone] = disaster_tolerance(zone, self.replicas)
        return self.w_data * affinity + self.w_dr * tolerance + self.w_compliance * compliance(encryption, attestation)

    def measured(self, region: str) -> Measured | None:
        """The measured RTT from `region` to the request's data region, when the fleet has one."""
        if self.latency is None or not region or not self.data_region or region == self.data_region:
            return None
        return self.latency.figure(region, self.data_region)

    def fits(self, g: Group) -> bool:
        return g.fits(self.count, self.mem)


def hard_filter(key: tuple, req: spb.PlaceRequest, allowed: frozenset[str]) -> str | None:
    """Hard filters on a placement key (region, zone, province, encryption, attestation): the
    reason its nodes are left out, or None."""
    region, _, province, encryption, attestation = key
    if allowed and region not in allowed:
        return "region"
    residency = req.residency
    if residency == spb.RESIDENCY_REGION and region != req.data_region:
        return "residency"
    if residency == spb.RESIDENCY_PROVINCE and (not province or province != req.data_province):
        return "residency"
    if req.require_encryption and not encryption:
        return "encryption"
    if req.require_attestation and not attestation:
        return "attestation"
    return None


def classify(s: NodeSummary, q: Query) -> str:
    """Why a node that passed the filters cannot take the job: health first."""
    groups = s.pool_groups[q.type_index]
    count, mem = q.count, q.mem
    if s.not_offered:
        for g in groups:
            every = g.free_all_desc
            if len(every) >= count and every[count - 1] >= mem and any(d.type == g.type for d in s.not_offered):
                return "xid" if any(d.excluded and d.excluded[0] == "xid" for d in s.not_offered) else "unhealthy"
    if max(g.n_all for g in groups) < count:
        return "count"
    if q.same_domain and any(q.fits(g) for g in groups):
        return "domain"
    return "memory"


def group_score(q: Query, g: Group, key_part: float) -> float:
    """The score of a node whose group to use is `g`: its best `count` devices when they all fit
    (precomputed), else the first `count` that fit."""
    count, mem = q.count, q.mem
    if g.min_free[count] >= mem:
        return (key_part + q.w_compute * g.compute[count]) * g.penalty[count]
    _, mean_free, factor = g.choose(count, mem)
    return (key_part + q.w_compute * g.value_norm * mean_free) * factor


def best_of_groups(q: Query, e: Entry, key_part: float) -> tuple[float, Group | None]:
    """The best score over a node's several groups and the group: (-1, None) when none fits."""
    best, best_group = -1.0, None
    for g in e.groups:
        if q.fits(g):
            _, mean_free, factor = g.choose(q.count, q.mem)
            score = (key_part + q.w_compute * g.value_norm * mean_free) * factor
            if score > best:
                best, best_group = score, g
    return best, best_group


# -- the scan: every node, one by one ----------------------------------------------------------------

def scan(view: FleetView, q: Query) -> None:
    """Every node of the pool, one by one: O(1) each for the one-group nodes."""
    cut = q.cut
    stale: list[NodeSummary] = []
    misfits: list[NodeSummary] = []
    filtered: list[tuple[str, Bucket]] = []
    for key, b in view.pools[q.pool_index].buckets.items():
        why = hard_filter(key, q.req, q.allowed)
        if why is not None:
            filtered.append((why, b))
            continue
        key_part = q.key_part(key)
        for e in chain(b.one_group, b.many_groups.values()):
            if e.state.last_seen_ns < cut:
                stale.append(e.summary)
                continue
            if e.group is not None:   # O(1) when its best `count` devices all fit
                group = e.group if q.fits(e.group) else None
                score = group_score(q, group, key_part) if group is not None else -1.0
            else:
                score, group = best_of_groups(q, e, key_part)
            if group is None:
                misfits.append(e.summary)
            else:
                q.feasible += 1
                q.offer(score, e.summary.node_id, group)
    for why, b in filtered:   # a stale node is counted as stale, whatever its region
        nodes = [e.summary for e in chain(b.one_group, b.many_groups.values())]
        fresh = [s for s in nodes if s.state.last_seen_ns >= cut]
        stale += [s for s in nodes if s.state.last_seen_ns < cut]
        if fresh:
            q.count_reason(why, len(fresh))
            q.listed_filter += [(why, s) for s in fresh[:q.max_listed]]
    if stale:
        q.count_reason("stale", len(stale))
        q.listed_health += [("stale", s) for s in stale[:q.max_listed]]
    for s in misfits:
        q.note_misfit(classify(s, q), s)


# -- the indexed search --------------------------------------------------------------------------------

TYPE_POOLS = ((0,), (1,), (0, 1), (0,), (1,), (0, 1))   # per pool: the type pools whose counts cover its nodes


class _Walk:
    """The working state of one indexed search over a pool. `type_pools`: the type pools (GPU,
    NPU) whose sorted fit values (Bucket.counts) hold a value for each of this pool's fresh nodes
    per type it has: the pool's one-group nodes once, its many-group nodes once per type (taken
    out again as they are met). The counts are of fresh one-group nodes in buckets no filter
    removes: `fitting` (count devices fit), `too_few` (fewer than count devices at all),
    `one_group` (all). Stale nodes are in their Buckets' `stale`, marked by FleetView.find_stale."""
    __slots__ = ("pool", "type_pools", "col", "mem", "fitting", "too_few", "one_group",
                 "filtered_keys", "typefit_classified", "levels_heap", "pushed")

    def __init__(self, view: FleetView, q: Query):
        self.pool, self.col, self.mem = view.pools[q.pool_index], q.count - 1, q.mem
        self.type_pools = [view.pools[t] for t in TYPE_POOLS[q.pool_index]]
        self.fitting = self.too_few = self.one_group = 0
        self.filtered_keys: set[tuple] = set()
        self.typefit_classified = 0   # same_domain: misfits classified one by one that fit as a type
        self.levels_heap: list[tuple] = []   # (-bound, push order, level, bucket): best level first
        self.pushed = 0

    def add_key(self, key: tuple) -> None:
        """Every node of the placement key in the type pools, counted from their sorted fit values."""
        col, mem = self.col, self.mem
        for tp in self.type_pools:
            tb = tp.buckets.get(key)
            if tb is not None and tb.counts is not None:
                values = tb.counts[col]
                self.fitting += values.at_least(mem)
                self.too_few += values.size - values.at_least(FEWER_OFFERED)   # the rest are FEWER_AT_ALL
                self.one_group += values.size

    def drop_row(self, row: Any) -> None:
        """Take one fit row (a node's, counted by add_key) out of the counts."""
        self.one_group -= 1
        fit = row[self.col]
        if fit >= self.mem:
            self.fitting -= 1
        elif fit == FEWER_AT_ALL:
            self.too_few -= 1

    def drop_many_groups(self, e: Entry) -> None:
        """A fresh node with several groups here: its rows in the type pools out of the one-group counts."""
        nid = e.summary.node_id
        for tp in self.type_pools:
            te = tp.entries.get(nid)
            if te is not None:
                self.drop_row(te.row)

    def push_level(self, q: Query, b: Bucket, level: int) -> None:
        """Queue a bucket's level: no node in it can score above key_part + w_compute x its top."""
        if level >= 0:
            self.pushed += 1
            heapq.heappush(self.levels_heap, (-(b.key_part + q.w_compute * (level + 1) / LEVELS), self.pushed,
                                              level, b))


def search(view: FleetView, q: Query) -> None:
    """The indexed decision: counts per placement key from the type pools' sorted fit values,
    corrected for the nodes with several groups (stale nodes are out of them); the ranking from the
    best compute levels down. No pass over every node: the work grows with the placement keys, the
    nodes going stale or coming back, those with several groups or a device out, and the nodes the
    ranking looks at."""
    view.find_stale(q.cut)   # marks them in the index
    walk = _Walk(view, q)
    n_stale = 0
    for key, b in walk.pool.buckets.items():
        if b.stale:
            n_stale += len(b.stale)
            room = q.max_listed - len(q.listed_health)
            if room > 0:
                q.listed_health += [("stale", e.summary) for e in islice(b.stale.values(), room)]
        why = hard_filter(key, q.req, q.allowed) if q.filtering else None
        if why is not None:
            _filter_bucket(q, walk, b, why)
            continue
        walk.add_key(key)
        b.key_part = q.key_part(key)
        walk.push_level(q, b, b.nonempty[q.count].bit_length() - 1)   # its best non-empty level
        if b.many_groups:
            _score_many_group_nodes(q, walk, b)
    q.feasible += walk.fitting
    if walk.too_few:
        q.count_reason("count", walk.too_few)
    if n_stale:
        q.count_reason("stale", n_stale)
    _rank_by_levels(q, walk)
    _count_fit_misfits(view, q, walk)
    _list_fit_misfits(q, walk)


def _filter_bucket(q: Query, walk: _Walk, b: Bucket, why: str) -> None:
    """A bucket a hard filter removes: its fresh nodes counted (and a few listed) under `why`."""
    walk.filtered_keys.add(b.key)
    n_fresh = b.size() - len(b.stale)
    if not n_fresh:
        return
    q.count_reason(why, n_fresh)
    room = q.max_listed - len(q.listed_filter)
    if room > 0:
        q.listed_filter += islice(((why, e.summary) for e in chain(b.one_group, b.many_groups.values())
                                   if not e.stale), room)


class _MisfitSums:
    """A bucket's fresh nodes with several groups that are misfits for one request shape, summed:
    what they take out of the counts, their reasons counted, their (reason, node) in the order the
    nodes are walked, and the other fresh ones (`rest`, scored each time). Valid while the bucket's
    version is `version` (index.Bucket)."""
    __slots__ = ("version", "one_group", "fitting", "too_few", "typefit", "reasons", "listed", "rest")

    def __init__(self, version: int) -> None:
        self.version = version
        self.one_group = self.fitting = self.too_few = self.typefit = 0
        self.reasons: dict[str, int] = {}
        self.listed: list[tuple[str, NodeSummary]] = []
        self.rest: list[Entry] = []


def _score_many_group_nodes(q: Query, walk: _Walk, b: Bucket) -> None:
    """The bucket's fresh nodes with several groups, one by one: out of the one-group counts, then
    ranked, or classified as misfits. A node none of whose groups offers `count` devices (devices
    each a domain of their own, asked for several in one domain) is a misfit without a look at its
    groups; a misfit's reason, whether it fits as a type and what its rows take out of the counts
    are kept per request shape until its groups change (Entry.misfit), and their sums per bucket
    while none of its several-group nodes changes (_MisfitSums): then only the others are walked."""
    shape = (q.type_index, q.count, q.mem, q.same_domain)
    sums = b.misfit_sums.get(shape)
    if sums is not None and sums.version == b.version:
        walk.one_group -= sums.one_group
        walk.fitting -= sums.fitting
        walk.too_few -= sums.too_few
        walk.typefit_classified += sums.typefit
        for reason, n in sums.reasons.items():
            q.count_reason(reason, n)
        for reason, s in sums.listed:
            listed = q.listed_health if reason in HEALTH_REASONS else q.listed_fit
            if len(listed) < q.max_listed:
                listed.append((reason, s))
            elif len(q.listed_health) >= q.max_listed and len(q.listed_fit) >= q.max_listed:
                break
        for e in sums.rest:
            known = _misfit_or_offer(q, walk, b, e, shape)
            if known is not None:   # (not while the version holds; as the walk below, if it did)
                q.note_misfit(known[0], e.summary)
                walk.typefit_classified += known[1]
        return
    if len(b.misfit_sums) >= MISFIT_SHAPES:
        b.misfit_sums.clear()
    sums = b.misfit_sums[shape] = _MisfitSums(b.version)
    for e in b.many_groups.values():
        if e.stale:
            continue
        known = _misfit_or_offer(q, walk, b, e, shape)
        if known is None:
            sums.rest.append(e)
            continue
        q.note_misfit(known[0], e.summary)
        walk.typefit_classified += known[1]
        sums.typefit += known[1]
        sums.one_group += known[2]
        sums.fitting += known[3]
        sums.too_few += known[4]
        sums.reasons[known[0]] = sums.reasons.get(known[0], 0) + 1
        sums.listed.append((known[0], e.summary))


def _misfit_or_offer(q: Query, walk: _Walk, b: Bucket, e: Entry, shape: tuple) -> tuple | None:
    """A fresh node with several groups: out of the one-group counts, and offered (None) or its
    misfit record for `shape` (Entry.misfit, worked out and kept when not known yet)."""
    known = e.misfit.get(shape)
    if known is not None:   # a misfit for this shape, its groups unchanged since
        walk.one_group -= known[2]
        walk.fitting -= known[3]
        walk.too_few -= known[4]
        return known
    one_group, fitting, too_few = walk.one_group, walk.fitting, walk.too_few
    walk.drop_many_groups(e)
    score, group = best_of_groups(q, e, b.key_part) if q.count <= e.most_offered else (-1.0, None)
    if group is None:
        if len(e.misfit) >= MISFIT_SHAPES:
            e.misfit.clear()
        known = e.misfit[shape] = (classify(e.summary, q), bool(q.same_domain and _fits_as_type(e.summary, q)),
                                   one_group - walk.one_group, fitting - walk.fitting, too_few - walk.too_few)
        return known
    q.feasible += 1
    q.offer(score, e.summary.node_id, group)
    return None


def _rank_by_levels(q: Query, walk: _Walk) -> None:
    """Best compute level first, across buckets, until the K-th best beats every level left."""
    heap, col, result, count, limit = walk.levels_heap, walk.col, q.result, q.count, q.limit
    heapq.heapify(heap)
    while heap:
        neg_bound, _, level, b = heapq.heappop(heap)
        if len(result) >= limit and -neg_bound < q.threshold:
            break
        _rank_level(q, b, b.by_level[count][level], col)
        walk.push_level(q, b, (b.nonempty[count] & ((1 << level) - 1)).bit_length() - 1)   # next level down


def _rank_level(q: Query, b: Bucket, nodes: dict, col: int) -> None:
    """The nodes of one level of a bucket offered to the top K. Those filed by id one by one; per
    tie key (compute, penalty, least free HBM of the first `count` devices, free HBM of the
    count-th most free): none fits when the latter is short of the memory, else _offer_alike."""
    mem, cut, key_part, offer = q.mem, q.cut, b.key_part, q.offer
    for key, alike in nodes.items():
        if key.__class__ is str:   # a busy node, filed by id
            e = alike
            if e.row[col] < mem or e.state.last_seen_ns < cut:
                continue
            g = e.group
            offer(group_score(q, g, key_part), key, g)
        elif key[3] >= mem:
            if alike.__class__ is Entry:   # the one node with this tie key
                g = alike.group
                if alike.state.last_seen_ns >= cut and g is not None:
                    offer(group_score(q, g, key_part), alike.summary.node_id, g)
            else:
                _offer_alike(q, alike, key, key_part)


def _offer_alike(q: Query, alike: Alike, key: tuple, key_part: float) -> None:
    """Nodes of one tie key whose count-th most free device has the memory: when their first
    `count` devices all have it they score alike (group_score's first case), offered by id until
    one is not kept (none after it would be); else one by one."""
    compute, penalty, first_free, _ = key
    members, cut, offer = alike.members, q.cut, q.offer
    if first_free >= q.mem:
        score = (key_part + q.w_compute * compute) * penalty
        if len(members) <= ALIKE_WALKED:
            for nid, e in members.items():
                if e.state.last_seen_ns >= cut:
                    offer(score, nid, e.group)   # type: ignore[arg-type]
            return
        for nid in alike.ids_sorted():
            e = members[nid]
            if e.state.last_seen_ns >= cut and not offer(score, nid, e.group):   # type: ignore[arg-type]
                return
        return
    for nid, e in members.items():
        if e.state.last_seen_ns >= cut:
            g = e.group
            assert g is not None
            offer(group_score(q, g, key_part), nid, g)


def _count_fit_misfits(view: FleetView, q: Query, walk: _Walk) -> None:
    """The one-group nodes that passed the filters and are not feasible: those with a device out
    classified one by one (health first); the rest counted as domain (same_domain) or memory."""
    misfits = walk.one_group - walk.fitting - walk.too_few   # too few offered devices with the memory free
    col, mem, cut = walk.col, q.mem, q.cut
    for e in walk.pool.with_devices_out.values():
        if e.pool_slot < 0 or e.key in walk.filtered_keys or e.state.last_seen_ns < cut:
            continue
        fit = e.row[col]
        if fit >= mem or fit == FEWER_AT_ALL:
            continue
        q.note_misfit(classify(e.summary, q), e.summary)
        misfits -= 1
        walk.typefit_classified += q.same_domain and _fits_as_type(e.summary, q)
    if q.same_domain and misfits:
        domain = _domain_misfits(view, q, walk) - walk.typefit_classified
        if domain:
            q.count_reason("domain", domain)
            misfits -= domain
    if misfits:
        q.count_reason("memory", misfits)


def _list_fit_misfits(q: Query, walk: _Walk) -> None:
    """A few of the fit misfits to show: the misfit rows of the pool, found at C speed."""
    unlisted = sum(q.counts.get(r, 0) for r in FIT_REASONS) - len(q.listed_fit)
    room = q.max_listed - len(q.listed_health) - len(q.listed_filter)   # listed before these
    if unlisted <= 0 or len(q.listed_fit) >= room:
        return
    shown = {s.node_id for _, s in q.listed_fit}
    fit_col, one_group = walk.pool.fit[walk.col::CMAX], walk.pool.one_group
    for slot in compress(range(len(fit_col)), map(operator.lt, fit_col, repeat(q.mem))):
        e = one_group[slot]
        if e.key in walk.filtered_keys or e.state.last_seen_ns < q.cut or e.summary.node_id in shown:
            continue
        if e.summary.not_offered or q.same_domain:
            reason = classify(e.summary, q)
        else:
            reason = "count" if fit_col[slot] == FEWER_AT_ALL else "memory"
        if reason not in HEALTH_REASONS:
            q.listed_fit.append((reason, e.summary))
            if len(q.listed_fit) >= room:
                break


def _fits_as_type(s: NodeSummary, q: Query) -> bool:
    return any(q.fits(g) for g in s.pool_groups[q.type_index])


def _domain_misfits(view: FleetView, q: Query, walk: _Walk) -> int:
    """same_domain: nodes whose devices fit as a type but not within one domain = the fresh nodes
    of the buckets no filter removes that fit at the type level (pool type_index, counted from the
    type pools' sorted fit values) less those feasible in one domain."""
    type_pool = view.pools[q.type_index]
    col, mem = walk.col, q.mem
    type_pools = [view.pools[t] for t in TYPE_POOLS[q.type_index]]
    fit_as_type = 0
    for key, b in type_pool.buckets.items():
        if key in walk.filtered_keys:
            continue
        for tp in type_pools:
            tb = tp.buckets.get(key)
            if tb is not None and tb.counts is not None:
                fit_as_type += tb.counts[col].at_least(mem)
        for e in b.many_groups.values():   # counted once per type above; once here when a group fits
            if e.stale:
                continue
            nid = e.summary.node_id
            for tp in type_pools:
                te = tp.entries.get(nid)
                if te is not None and te.row[col] >= mem:
                    fit_as_type -= 1
            if any(q.fits(g) for g in e.groups):
                fit_as_type += 1
    return fit_as_type - q.feasible
