"""Verdicts kept per request shape (pods of one job ask alike) for every fleet node, brought up to
date at each ask from the index's journal (FleetView.journal: the nodes refiled or gone stale or
back since): only those, and the stale ones (their detail says for how long), are judged again. A
change of a placement key's part of the score (measured latency) judges every node again. With
them, per shape, the extender's replies over the lists of names last asked (extender_replies.py),
patched with the verdicts judged again. The answer is judge()'s over the index as it is now."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .extender_replies import Replies, fleet_ids
from .fleet import FleetView
from .search import Query
from .verdicts import Verdict, failed, judge

FULL_SHARE = 0.5   # more nodes than this share of the fleet changed: all judged again (no journal walk)
SEP = "\x00"       # joins a list of names into its key (a list with a name holding it is not kept)


@dataclass(slots=True)
class Shape:
    by_id: dict[str, Verdict]   # every fleet node's verdict
    seen: int                   # FleetView.changes when it was last brought up to date
    key_parts: dict[tuple, float]
    replies: dict[str, Replies] = field(default_factory=dict)   # the names joined by SEP -> their replies


def unknown(nid: str) -> Verdict:
    return failed(nid, "unknown", "no agent reports as this node")


class VerdictCache:
    """Verdicts of the last `keep` request shapes (least recently asked dropped first, counted
    `kubernetes.extender.verdict_shapes` in `counters`), and per shape the replies over the last
    `lists` lists of names (counted `kubernetes.extender.name_lists`)."""

    def __init__(self, keep: int = 16, counters: Counter | None = None, lists: int = 2):
        self.keep, self.lists = keep, lists
        self.counters: Counter = counters if counters is not None else Counter()
        self.shapes: dict[bytes, Shape] = {}
        self.full = 0      # shapes judged over the whole fleet
        self.judged = 0    # nodes judged again from the journal

    def _shape(self, view: FleetView, q: Query) -> Shape:
        """The request's shape, its verdicts (and kept replies) brought up to date."""
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
                fresh = judge(view, q, again)
                shape.by_id.update((v.node_id, v) for v in fresh)
                for replies in shape.replies.values():
                    replies.patch(fresh)
            shape.seen = view.changes
        self.shapes[key] = shape
        return shape

    def replies(self, view: FleetView, q: Query, names: list[str]) -> Replies:
        """The replies over the Kubernetes node `names` (their verdicts judge()'s), kept for the
        shape while it asks with the same list (kube-scheduler sends one per pod); made anew when the
        `k8s_node` labels moved. `q` made by Scheduler._query (the index caught up to now)."""
        shape = self._shape(view, q)
        key = SEP.join(names)
        kept = shape.replies.pop(key, None)
        if kept is None or kept.k8s_changes != view.k8s_changes:
            ids = fleet_ids(view.k8s_nodes, names)
            verdicts = list(map(shape.by_id.get, ids))
            if None in verdicts:   # not a fleet node
                verdicts = [v or unknown(i) for i, v in zip(ids, verdicts)]
            kept = Replies(names, ids, verdicts, view.k8s_changes)   # type: ignore[arg-type]
            if not names or key.count(SEP) != len(names) - 1:
                return kept   # a name holds SEP: its key would not be its own
            if len(shape.replies) >= self.lists:
                del shape.replies[next(iter(shape.replies))]
                self.counters["kubernetes.extender.name_lists"] += 1
        shape.replies[key] = kept
        return kept

