"""Letting go of what a node no longer sends (`[state] series_idle_s`). Process series carry pids,
so a node whose processes come and go makes new series all the time; without this the collector,
the gateways' reference tables and the workers would only grow. The fleet state's series go by a
sweep run a bounded step at a time from ingest (`sweep`), a worker's by `expire_latest`, and
series references by generations (RefGenerations)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from . import columns

# A pass over every series starts every every_ns() and looks at STEP series a step (about a
# millisecond), a step at most every STEP_GAP_NS as batches are stored: no batch pays for more, and
# a pass takes at most a tenth of the loop.
STEP = 2048
STEP_GAP_NS = 10**7
_SECOND = 10**9

C = TypeVar("C", set, dict)


def every_ns(idle_ns: int) -> int:
    """How often a pass over every series starts: an eighth of the idle bound, within 0.1-60 s."""
    return max(_SECOND // 10, min(idle_ns // 8, 60 * _SECOND))


class RefGenerations(Generic[C]):
    """A boot's series references in two generations of a set (or dict) each: `cur` (used since the
    last turn) and `old` (used in the generation before, not since). A user looks a reference up in
    `cur`, else in `old` (and moves it to `cur`); `turn` lets the older generation go. Turned every
    series_idle_s, an idle reference goes between that and twice that after its last use; it only
    stands for the name and labels its samples carry anyway, so one let go is found again by them."""

    __slots__ = ("cur", "old", "turn_at")

    def __init__(self, cur: C, turn_at: float):
        self.cur: C = cur
        self.old: C = type(cur)()
        self.turn_at = turn_at

    def turn(self, next_at: float) -> int:
        """The older generation let go (how many references: returned), the current one made the
        older, a new one begun; the next turn at `next_at`."""
        gone = len(self.old)
        self.old, self.cur = self.cur, type(self.cur)()
        self.turn_at = next_at
        return gone

    def __len__(self) -> int:
        return len(self.cur) + len(self.old)


# -- the fleet state's series -------------------------------------------------------------------------
def points_received(ser: Any) -> int:
    """How many points the series was given so far: held in its History or its Frame, or let go
    from either (a frame formed or dissolved moves points, never changes the sum)."""
    h, f = ser.history, ser.frame
    got = h.dropped + len(h.t)
    return got if f is None else got + f.dropped + len(f.t)


def due(state: Any, now_ns: int) -> bool:
    """Whether ingest should run a step of the sweep now (of the pass under way, or a new pass)."""
    return now_ns >= state.idle_due_ns


def sweep(state: Any, now_ns: int) -> int:
    """One step: up to STEP series of the pass under way looked at (a new pass begun if none is);
    those idle for series_idle_s let go. Sets when the next step is due. Returns how many went.
    Idle is told on the collector's own clock, whatever the agent's stamps: a series' points
    received so far only grow, one a point (points_received), so a pass notes that count and when
    it last moved, and a series whose count has not moved for series_idle_s goes."""
    if state.idle_walk is None:
        state.idle_walk = (_walk(state), now_ns + every_ns(state.series_idle_ns))   # and when the next begins
    walk, next_pass = state.idle_walk
    budget, gone = STEP, 0
    while budget > 0:
        step = next(walk, None)
        if step is None:
            state.idle_walk = None
            state.idle_due_ns = next_pass
            return gone
        n, keys = step
        budget -= len(keys) + 1
        gone += _look(state, n, keys, now_ns)
    state.idle_due_ns = now_ns + STEP_GAP_NS
    return gone


def _walk(state: Any) -> Iterator[tuple[Any, list]]:
    """The pass: every node's series keys, STEP at a time (lists taken at the start of a node, so
    ingest may add and remove series between steps)."""
    for nid in list(state.nodes):
        n = state.nodes.get(nid)
        if n is None or not n.series:
            continue
        keys = list(n.series)
        for i in range(0, len(keys), STEP):
            yield n, keys[i:i + STEP]


def _look(state: Any, n: Any, keys: list, now_ns: int) -> int:
    series, idle_ns = n.series, state.series_idle_ns
    old = []
    for k in keys:
        ser = series.get(k)
        if ser is None:
            continue
        got = points_received(ser)
        if getattr(ser, "idle_n", -1) != got:   # unset on a series a snapshot restored
            ser.idle_n, ser.idle_at = got, now_ns
        elif now_ns - ser.idle_at >= idle_ns:
            old.append(k)
    if old:
        let_go(state, n, old)
        state.counters["state.series.expired"] += len(old)
    return len(old)


def let_go(state: Any, n: Any, keys: list) -> None:
    """The node's series `keys` let go, with their history; a frame holding one is dissolved first,
    and the node's references are forgotten (found again by name and labels)."""
    for k in keys:
        if (f := n.series[k].frame) is not None:
            columns.dissolve(state, n, f)
    for k in keys:
        state.history_slots -= len(n.series.pop(k).history)
    state.series_total -= len(keys)
    n.refs.clear()


# -- a cluster worker's nodes (cluster/summary.py NodeLatest) -------------------------------------------
def expire_latest(node: Any, now_ns: int, idle_ns: int) -> tuple[int, int]:
    """A worker's node: its kept series whose latest point has not moved for idle_ns let go (with
    the references to them), its boots' reference generations turned when due. Returns (series,
    references) let go."""
    gone = []
    for key, e in node.series.items():
        if e.idle_t != e.time_ns:
            e.idle_t, e.idle_at = e.time_ns, now_ns
        elif now_ns - e.idle_at >= idle_ns:
            gone.append(key)
    refs_gone = node.turn_refs(now_ns, idle_ns)
    if gone:
        node.forget_refs_to({node.series.pop(k) for k in gone})
        node._layout = None
        node.dirty = True
        counts = node.diagnosis_counts
        counts["state.series.expired"] = counts.get("state.series.expired", 0) + len(gone)
    return len(gone), refs_gone
