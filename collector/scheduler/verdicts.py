"""A verdict per named node (what kube-scheduler's extender asks about): whether the node can take
a request and its score, as the scan decides them (search.py), else the reason and its detail in
Place's own words (explain.py), plus `unknown` (no agent reports as it) and `type` (none of the
accelerator type asked for)."""

from __future__ import annotations

from typing import NamedTuple

from .explain import exclusion_detail
from .fleet import FleetView
from .index import TYPE_NAMES
from .search import Query, best_of_groups, classify, group_score, hard_filter


class Verdict(NamedTuple):
    node_id: str
    fits: bool
    score: float    # Place's score when it fits, else 0
    reason: str     # "" when it fits; else unknown | type | one of Place's exclusion reasons
    detail: str


def judge(view: FleetView, q: Query, node_ids: list[str]) -> list[Verdict]:
    """The verdict on each of `node_ids`, in their order (a Query made by Scheduler._query)."""
    pool = view.pools[q.pool_index]
    types = TYPE_NAMES[q.type_index]
    summaries, entries, cut = view.summaries, pool.entries, q.cut
    out: list[Verdict] = []
    for nid in node_ids:
        s = summaries.get(nid)
        if s is None:
            out.append(Verdict(nid, False, 0.0, "unknown", "no agent reports as this node"))
            continue
        if s.state.last_seen_ns < cut:
            out.append(Verdict(nid, False, 0.0, "stale", exclusion_detail(view, s, "stale", q.now, types, q)))
            continue
        e = entries.get(nid)
        if e is None:
            out.append(Verdict(nid, False, 0.0, "type", f"no {' or '.join(types)} on the node"))
            continue
        why = hard_filter(e.key, q.req, q.allowed)
        if why is not None:
            out.append(Verdict(nid, False, 0.0, why, exclusion_detail(view, s, why, q.now, types, q)))
            continue
        key_part = q.key_part(e.key)
        if e.group is not None:
            fits = q.fits(e.group)
            score = group_score(q, e.group, key_part) if fits else 0.0
        else:
            score, group = best_of_groups(q, e, key_part)
            fits = group is not None
        if fits:
            out.append(Verdict(nid, True, score, "", ""))
        else:
            reason = classify(s, q)
            out.append(Verdict(nid, False, 0.0, reason, exclusion_detail(view, s, reason, q.now, types, q)))
    return out
