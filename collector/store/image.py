"""The fleet state as plain data, for a snapshot (snapshot.py): what the store's replay rebuilds.

Per node: inventory, boot, the per-boot marks (stored_up_to, in order, and when each rose),
counts, recent events, open diagnoses, and every series (latest and previous value, histogram,
history arrays as bytes: `array.tobytes`, 16 bytes a point, copied at memcpy speed). Fleet-wide:
the marks known from earlier runs (known_marks), the state's counters and diagnoses opened per
rule. Nothing is pickled: lists, ints, floats, strings and bytes, for msgpack.

A node is captured on the event loop in one go (`node()`), so each node is consistent with itself;
nodes are captured a chunk at a time (snapshotter.py) and may differ in time from one another. That
is enough, because the replay after a snapshot tells what a node already holds by its marks: the
marks captured are those of batches *applied*, so a batch accepted (mark raised) but not applied
yet (not durable, or durable and its stream not resumed) is replayed from the log after the
snapshot, and one applied is a duplicate there.
"""

from __future__ import annotations

import collections
import math
from array import array

from xpusense.v1 import telemetry_pb2 as pb

from ..history import History
from ..state import FleetState, NodeState, Series

VERSION = 1


def fleet(state: FleetState) -> list:
    """The fleet-wide part: [known_marks, counters, diagnoses opened per rule]."""
    return [[[nid, boot, seq] for (nid, boot), seq in state.known_marks.items()],
            dict(state.counters), dict(state.diagnoses.opened)]


def node(n: NodeState, unapplied: dict[str, int] | None = None) -> list:
    """One node; `unapplied`: boot -> the lowest sequence number accepted but not applied yet (its
    mark is taken below it, so the batch is replayed from the log)."""
    marks = []
    for boot, seq in n.stored_up_to.items():
        if unapplied and boot in unapplied:
            seq = min(seq, unapplied[boot] - 1)
        marks.append([boot, seq, n.mark_at.get(boot, 0)])
    series = []
    for ser in n.series.values():
        h = ser.history
        series.append([ser.name, ser.unit, ser.kind, ser.labels, ser.value, ser.time_ns, ser.prev_value,
                       ser.prev_time_ns, ser.histogram.SerializeToString() if ser.histogram is not None else None,
                       h.t.tobytes(), h.v.tobytes(), h.due_t, h.due_n])
    return [n.node_id, n.boot_id, n.last_seen_ns, n.inventory.SerializeToString(), marks, n.batches_stored,
            n.batches_duplicate, [e.SerializeToString() for e in n.events],
            [[did, e.SerializeToString()] for did, e in n.diagnoses.items()], n.diagnoses_boot, series]


def restore_fleet(state: FleetState, data: list) -> None:
    known, counters, opened = data
    for nid, boot, seq in known:
        state.known_marks[(nid, boot)] = max(state.known_marks.get((nid, boot), 0), seq)
    state.counters.update(counters)
    state.diagnoses.opened.update(opened)


def restore_node(state: FleetState, data: list) -> None:
    """One node into `state` (which does not hold it yet): not connected, no peer, as a replay leaves it."""
    (nid, boot_id, last_seen, inv, marks, stored, dup, events, diagnoses, diag_boot, series) = data
    n = state.nodes[nid] = NodeState(nid, state.events_kept)
    n.boot_id, n.last_seen_ns = boot_id, last_seen
    n.inventory.ParseFromString(inv)
    n.stored_up_to = collections.OrderedDict((boot, seq) for boot, seq, _ in marks)
    n.mark_at = {boot: at for boot, _, at in marks if at}
    n.batches_stored, n.batches_duplicate = stored, dup
    n.events.extend(pb.Event.FromString(e) for e in events[:state.events_kept])
    n.diagnoses = collections.OrderedDict((did, pb.Event.FromString(e)) for did, e in diagnoses)
    n.diagnoses_boot = diag_boot
    slots = 0
    for (name, unit, kind, labels, value, time_ns, prev_value, prev_time_ns, hist, tb, vb, due_t, due_n) in series:
        ser = Series.__new__(Series)
        ser.name, ser.unit, ser.kind, ser.labels = name, unit, kind, labels
        ser.value, ser.time_ns = _float(value), time_ns
        ser.prev_value, ser.prev_time_ns = _float(prev_value), prev_time_ns
        ser.histogram = pb.Histogram.FromString(hist) if hist is not None else None
        h = ser.history = History()
        h.t = array("q", tb)
        h.v = array("d", vb)
        if len(h.t) != len(h.v):
            raise ValueError(f"node {nid!r} series {name!r}: {len(h.t)} times but {len(h.v)} values")
        h.due_t, h.due_n = due_t, due_n
        slots += len(h.t)
        n.series[(name, tuple(sorted(labels.items())))] = ser
    state.series_total += len(n.series)
    state.history_slots += slots
    for w in state.watchers:
        w(n, None)


def _float(x) -> float:
    return math.nan if x is None else float(x)
