"""The answer's words: per candidate the score of each dimension with its weight and how it was
reached, the penalties and the devices left out; per excluded node the reason and its detail."""

from __future__ import annotations

import math

from xpusense.v1 import scheduler_pb2 as spb

from .fleet import FleetView
from .index import TYPE_NAMES, Device, Group, NodeSummary
from .latency import Measured
from .scoring import RegionMatrix, compliance, compute_efficiency, data_affinity, disaster_tolerance, replicas_in_zone
from .search import Query

EXPLAINED_MAX = 16  # entries kept per group: chosen devices per (count, memory), made candidates per answer shape


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}GiB"


def fill_reply(view: FleetView, q: Query, reply: spb.PlaceReply, weights: dict[str, float]) -> None:
    """The ranked candidates (best first, then by node id) and the exclusions, from a decided Query.

    A candidate is made once per group and answer shape and kept on the group (Group.explained,
    for the group's lifetime: a refresh makes new groups), so that the same node ranked again for
    the same request costs a copy: the shape holds every input of its words (the request's terms,
    the weights, its score, the group's value and the fleet's best one). A node whose region has a
    measured RTT to the data region is made anew each time (its detail tells the measurement's age)."""
    dims_by_key: dict[tuple, list[spb.DimensionScore]] = {}
    shape = (q.count, q.mem, q.same_domain, q.data_region, tuple(q.replicas), tuple(weights.values()),
             q.latency.max_age_ns if q.latency is not None else 0, view.best_value)
    out = reply.candidates
    for score, _, g in sorted(q.result, key=lambda x: (-x[0], x[1].s)):
        if q.measured(g.node.region) is not None:
            candidate(view, q, out.add(), score, g, weights, dims_by_key)
            continue
        explained = g.explained
        key = (shape, score, g.value_norm)
        done = explained.get(key)
        if done is not None:
            out.append(done[0])
            continue
        c = out.add()
        candidate(view, q, c, score, g, weights, dims_by_key)
        if len(explained) >= EXPLAINED_MAX:
            explained.clear()
        kept = spb.Candidate()   # its own copy: not a part of this reply, which the caller owns
        kept.CopyFrom(c)
        explained[key] = (kept,)
    exclusions(view, q, reply)


# -- candidates --------------------------------------------------------------------------------------

def candidate(view: FleetView, q: Query, c: spb.Candidate, score: float, g: Group, weights: dict[str, float],
              dims_by_key: dict[tuple, list[spb.DimensionScore]]) -> None:
    """One candidate: its devices, each dimension's score and detail, penalties, devices out.
    `dims_by_key`: the three dimensions a placement key decides, made once per key and answer."""
    s = g.node
    chosen, ids, mean_free, free_text = chosen_devices(g, q.count, q.mem)
    c.CopyFrom(s.base_candidate)
    c.score = score
    c.devices.extend(ids)
    c.accelerator_type = g.type
    c.model = g.model
    if q.same_domain:
        c.domain = g.domain
    compute = compute_efficiency(g.value_norm, mean_free)
    c.dimensions.add(dimension="compute", score=compute, weight=weights["compute"],
                     weighted=compute * weights["compute"], detail=value_text(view, g) + free_text)
    rest = dims_by_key.get(s.placement_key)
    if rest is None:   # the same for every node of this placement key
        rest = dims_by_key[s.placement_key] = key_dimensions(s, q, weights, view.settings.regions)
    c.dimensions.extend(rest)
    for d in chosen:
        if d.penalty is not None:
            c.penalties.add(reason=d.penalty_reason or "hbm_watch", device=d.id, factor=view.settings.hbm_watch_factor,
                            detail=d.penalty)
    for d in s.not_offered:
        if d.type == g.type and d.excluded:
            c.excluded_devices.add(device=d.id, reason=d.excluded[0], detail=d.excluded[1])


def chosen_devices(g: Group, count: int, memory: int) -> tuple[list[Device], list[str], float, str]:
    """The devices chosen on the group (Group.choose), their ids, mean free score and the compute
    detail's part on them; kept on the group, whose devices' readings are fixed for its lifetime
    (a refresh makes new groups), so that a request shape asked again costs a lookup."""
    done = g.explained.get((count, memory))
    if done is not None:
        return done
    chosen, mean_free, _ = g.choose(count, memory)
    utils = [d.readings[0] for d in chosen if d.readings and d.readings[0] == d.readings[0]]   # not NaN
    bandwidths = [d.readings[3] for d in chosen if d.readings and d.readings[3] == d.readings[3]]
    reads = (f"util {sum(utils) / len(utils):.0%}" if utils else "util -",
             f"HBM free >= {gib(min(d.free for d in chosen))}",
             f"HBM bandwidth {sum(bandwidths) / len(bandwidths):.0%}" if bandwidths else "HBM bandwidth -")
    done = (chosen, [d.id for d in chosen], mean_free, f"; x free {mean_free:.2f} (the chosen: {', '.join(reads)})")
    if len(g.explained) >= EXPLAINED_MAX:
        g.explained.clear()
    g.explained[(count, memory)] = done
    return done


def key_dimensions(s: NodeSummary, q: Query, weights: dict[str, float],
                   regions: RegionMatrix) -> list[spb.DimensionScore]:
    """Data affinity, disaster tolerance and compliance of a node, with their details."""
    dim = spb.DimensionScore
    measured = q.measured(s.region)
    affinity = data_affinity(s.region, q.data_region, regions, None if measured is None else measured.ms)
    tolerance = disaster_tolerance(s.zone, q.replicas)
    comply = compliance(s.encryption, s.attestation)
    w_data, w_dr, w_comply = weights["data_affinity"], weights["disaster_tolerance"], weights["compliance"]
    return [
        dim(dimension="data_affinity", score=affinity, weight=w_data, weighted=affinity * w_data,
            detail=affinity_detail(s.region, q.data_region, regions, measured, q.now,
                                   q.latency.max_age_ns if q.latency is not None else 0)),
        dim(dimension="disaster_tolerance", score=tolerance, weight=w_dr, weighted=tolerance * w_dr,
            detail=tolerance_detail(s.zone, q.replicas)),
        dim(dimension="compliance", score=comply, weight=w_comply, weighted=comply * w_comply,
            detail=compliance_detail(s))]


def value_text(view: FleetView, g: Group) -> str:
    """How the group's value_norm was reached (kept on the group until its next refresh)."""
    if not g.value_text:
        g.value_text = _make_value_text(view, g)
    return g.value_text


def _make_value_text(view: FleetView, g: Group) -> str:
    if g.value >= 0:
        return (f"{g.tflops:g} TFLOPS / price {g.node.price:g} per accelerator-hour = {g.value:.1f} "
                f"(fleet best {view.best_value:.1f}) -> {g.value_norm:.2f}")
    why = [] if g.tflops else [f"no peak TFLOPS for {g.model} (catalog or [scheduler.peak_tflops])"]
    if not g.node.price:
        why.append("no price label")
    return f"value per price unknown ({'; '.join(why)}) -> {g.value_norm:g}"


def affinity_detail(node_region: str, data_region: str, regions: RegionMatrix, measured: Measured | None = None,
                    now: int = 0, max_age_ns: int = 0) -> str:
    """How scoring.data_affinity was reached, in words: which latency it used, measured or configured."""
    if not data_region:
        return "no data region in the request"
    if not node_region:
        return "node has no region label"
    if node_region == data_region:
        return f"data in the node's region {node_region}"
    lat = regions.latency_ms.get((node_region, data_region))
    cost = regions.transfer_cost.get((node_region, data_region))
    ref = f" (0 at {regions.latency_ref_ms:g})"
    if measured is not None:
        age = max(0, now - measured.newest_ns) / 1e9
        lat_text = (f"{measured.ms:.3g} ms measured (median RTT over {measured.nodes} node(s) of {node_region}, "
                    f"last {age:.0f} s ago; each node's median over its recent tcp_rtt samples, interpolated within "
                    f"the log2 bucket; configured {'none' if lat is None else f'{lat:g} ms'})" + ref)
    elif lat is not None:
        since = f"in the last {max_age_ns / 1e9:g} s" if max_age_ns > 0 else "used"
        lat_text = f"{lat:g} ms configured (no RTT measurement {since})" + ref
    elif cost is None:
        return f"{node_region} -> {data_region}: not in the region matrix, no RTT measurement"
    else:
        lat_text = "latency unknown (neither measured nor configured)"
    return (f"{node_region} -> {data_region}: " + lat_text
            + ", " + ("transfer cost unknown" if cost is None
                      else f"{cost:g}/GB (0 at {regions.transfer_cost_ref:g})"))


def tolerance_detail(zone: str, replica_zones: list[str]) -> str:
    """How scoring.disaster_tolerance was reached, in words."""
    if not replica_zones:
        return "no other replicas given"
    if not zone:
        return "node has no zone label"
    return f"{replicas_in_zone(zone, replica_zones)} of {len(replica_zones)} other replicas in zone {zone}"


def compliance_detail(s: NodeSummary) -> str:
    """The node's encryption and attestation capabilities, as its labels name them."""
    enc, att = s.labels.get("encryption", ""), s.labels.get("attestation", "")
    return f"encryption {enc if s.encryption else 'none'}, attestation {att if s.attestation else 'none'}"


# -- exclusions --------------------------------------------------------------------------------------

def exclusions(view: FleetView, q: Query, reply: spb.PlaceReply) -> None:
    """Every excluded node counted by reason; the first `max_excluded` listed: health (stale,
    XID, unhealthy), then compliance, then fit (count, domain, memory)."""
    nodes_with_type = len(view.pools[q.type_index].entries)
    if nodes_with_type < len(view.summaries):
        q.count_reason("type", len(view.summaries) - nodes_with_type)   # counted, not listed
    health = sorted(q.listed_health, key=lambda x: x[0] != "stale")
    types = TYPE_NAMES[q.type_index]
    for reason, s in (health + q.listed_filter + q.listed_fit)[:q.max_listed]:
        e = reply.excluded.add(node_id=s.node_id, reason=reason,
                               detail=exclusion_detail(view, s, reason, reply.time_unix_nano, types, q))
        for d in s.not_offered:
            if d.type in types and d.excluded:
                e.devices.add(device=d.id, reason=d.excluded[0], detail=d.excluded[1])
    for key, v in q.counts.items():
        if v:
            reply.excluded_counts[key] = v


_FILTER_DETAILS = {
    "encryption": "no encryption capability (label `encryption`)",
    "attestation": "no attestation capability (label `attestation`)",
}


def exclusion_detail(view: FleetView, s: NodeSummary, reason: str, now: int, types: tuple[str, ...],
                     q: Query) -> str:
    """Why a node was left out, in words."""
    count, mem = q.count, q.mem
    if reason == "stale":
        age = (now - s.state.last_seen_ns) / 1e9 if s.state.last_seen_ns else math.inf
        return f"no telemetry for {age:.1f} s (stale after {view.stale_ns / 1e9:g} s)"
    if reason in ("xid", "unhealthy"):
        out = [d for d in s.not_offered if d.type in types]
        return (f"{len(out)} accelerator(s) not offered ({', '.join(d.id for d in out)}); "
                f"the others cannot take the job")
    if reason in ("count", "domain", "memory"):
        return _fit_detail(s, reason, types, count, mem)
    if reason == "region":
        return f"region {s.region or '(no label)'} is not among the allowed regions"
    if reason == "residency":
        return (f"data may not leave its region/province; node is in region "
                f"{s.region or '(no label)'}, province {s.province or '(no label)'}")
    return _FILTER_DETAILS.get(reason, reason)


def _fit_detail(s: NodeSummary, reason: str, types: tuple[str, ...], count: int, mem: int) -> str:
    groups = [s.by_type[t] for t in types if t in s.by_type]
    if reason == "count":
        g = max(groups, key=lambda g: g.n_all)
        return f"{g.n_all} {g.type} on the node, {count} asked"
    if reason == "domain":
        return f"no {count} fitting accelerators share one NVLink/HCCS domain"
    best = max(g.free_all_desc[min(count, len(g.free_all_desc)) - 1] for g in groups)
    nth = "the most free has" if count == 1 else f"the {count} most free have at least"
    return f"{count} device(s) with {gib(mem)} free needed; {nth} {gib(best)}"
