"""Verdicts kept per request shape (pods of one job ask alike) for every fleet node, brought up to
date at each ask from the index's journal (FleetView.journal: the nodes refiled or gone stale or
back since): only those, and the stale ones (their detail says for how long), are judged again. A
change of a placement key's part of the score (measured latency) judges every node again. The
answer is judge()'s over the index as it is now."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .fleet import FleetView
from .search import Query
from .verdicts import Verdict, failed, judge

FULL_SHARE = 0.5   # more nodes than this share of the fleet changed: all judged again (no journal walk)


@dataclass(slots=True)
class Shape:
    by_id: dict[str, Verdict]   # every fleet node's verdict
    seen: int                   # FleetView.changes when it was last brought up to date
    key_parts: dict[tuple, float]


def unknown(nid: str) -> Verdict:
    return failed(nid, "unknown", "no agent reports as this node")


class VerdictCache:
    """Verdicts of the last `keep` request shapes (least recently asked dropped first, counted
    `kubernetes.extender.verdict_shapes` in `counters`)."""

    def __init__(self, keep: int = 16, counters: Counter | None = None):
        self.keep = keep
        self.counters: Counter = counters if counters is not None else Counter()
        self.shapes: dict[bytes, Shape] = {}
        self.full = 0      # shapes judged over the whole fleet
        self.judged = 0    # nodes judged again from the journal

    def verdicts(self, view: FleetView, q: Query, node_ids: list[str]) -> list[Verdict]:
        """judge(view, q, node_ids), from the shape's kept verdicts. `q` made by Scheduler._query
        (the index caught up to now)."""
        view.find_stale(q.cut)   # staleness changes into the journal
        key = q.req.SerializeToString(deterministic=True)
        pool = view.pools[q.pool_index]
        parts = {k: q.key_part(k) for k in pool.buckets}
        shape = self.shapes.pop(key, None)
        if shape is not None and (view.changes - shape.seen > FULL_SHARE * len(view.summaries)
                                  or any(shape.key_parts.get(k, v) != v for k, v in parts.items())):
            shape = None
        if shape is None:
            if len(self.shapes) >= self.keep:
                del self.shapes[next(iter(self.shapes))]
                self.counters["kubernetes.extender.verdict_shapes"] += 1
            shape = Shape({v.node_id: v for v in judge(view, q, list(view.summaries))}, view.changes, parts)
            self.full += 1
        else:
            shape.key_parts.update(parts)
            again = list(view.stale_known)
            seen = shape.seen
            for nid, n in reversed(view.journal.items()):
                if n <= seen:
                    break
                again.append(nid)
            if again:
                self.judged += len(again)
                shape.by_id.update((v.node_id, v) for v in judge(view, q, again))
            shape.seen = view.changes
        self.shapes[key] = shape
        out = list(map(shape.by_id.get, node_ids))
        if None in out:   # not a fleet node
            out = [v or unknown(i) for i, v in zip(node_ids, out)]
        return out   # type: ignore[return-value]
