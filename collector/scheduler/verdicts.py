"""A verdict per named node (what kube-scheduler's extender asks about): whether the node can take
a request and its score, as the scan decides them (search.py), else the reason and its detail in
Place's own words (explain.py), plus `unknown` (no agent reports as it) and `type` (none of the
accelerator type asked for)."""

from __future__ import annotations

from json.encoder import encode_basestring_ascii as _json
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
    entry: str = ""   # failing: ':"xpusense reason: detail"', the JSON of its reply entry's value, made once


def failed(nid: str, reason: str, detail: str) -> Verdict:
    """A failing verdict, its reply entry encoded as it is made (not at every ask that reads it)."""
    return Verdict(nid, False, 0.0, reason, detail, ":" + _json(f"xpusense {reason}: {detail}"))


def judge(view: FleetView, q: Query, node_ids: list[str]) -> list[Verdict]:
    """The verdict on each of `node_ids`, in their order (a Query made by Scheduler._query). The
    filters and the key's part of the score are worked out once per placement key; a one-group node
    whose best `count` devices fit is scored in place (search.group_score's first case)."""
    pool = view.pools[q.pool_index]
    types = TYPE_NAMES[q.type_index]
    summaries, entries, cut, now = view.summaries, pool.entries, q.cut, q.now
    count, mem, w_compute = q.count, q.mem, q.w_compute
    by_key: dict[tuple, tuple[Verdict | None, float]] = {}   # placement key -> (its filter's verdict, key part)
    no_type = failed("", "type", f"no {' or '.join(types)} on the node")
    unknown = failed("", "unknown", "no agent reports as this node")
    out: list[Verdict] = []
    add = out.append
    for nid in node_ids:
        e = entries.get(nid)
        s = summaries.get(nid) if e is None else e.summary
        if s is None:
            add(Verdict(nid, False, 0.0, *unknown[3:]))
            continue
        if s.state.last_seen_ns < cut:
            add(failed(nid, "stale", exclusion_detail(view, s, "stale", now, types, q)))
            continue
        if e is None:
            add(Verdict(nid, False, 0.0, *no_type[3:]))
            continue
        known = by_key.get(e.key)
        if known is None:   # a filter's detail reads only what the key holds (region, province, capabilities)
            why = hard_filter(e.key, q.req, q.allowed)
            known = by_key[e.key] = (failed("", why, exclusion_detail(view, s, why, now, types, q)), 0.0) if why \
                else (None, q.key_part(e.key))
        filtered, key_part = known
        if filtered is not None:
            add(Verdict(nid, False, 0.0, *filtered[3:]))
            continue
        g = e.group
        if g is not None:
            if count < len(g.min_free) and g.min_free[count] >= mem:
                add(Verdict(nid, True, (key_part + w_compute * g.compute[count]) * g.penalty[count], "", ""))
                continue
            fits = g.fits(count, mem)
            score = group_score(q, g, key_part) if fits else 0.0
        else:
            score, group = best_of_groups(q, e, key_part)
            fits = group is not None
        if fits:
            add(Verdict(nid, True, score, "", ""))
        else:
            reason = classify(s, q)
            add(failed(nid, reason, exclusion_detail(view, s, reason, now, types, q)))
    return out
