"""The fleet state as plain data and raw arrays, for a snapshot: what `capture` takes of a node and
`restore` rebuilds. Points are written as array bytes and read back straight from the mapped file;
in a diff a node the base holds as it was carries only the points appended since (layout:
docs/design.md, on-disk formats). A node is captured in one go, consistent with itself; nodes
may differ in time, as the replay after the snapshot tells by each node's marks (those of batches
applied) which batches it holds already.
"""

from __future__ import annotations

import collections
import math
import operator
from array import array

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

from .. import columns
from ..node_series import BootRefs
from ..series import Series, series_key
from ..series_history import History
from ..state import FleetState, NodeState
from .segment_file import MAX_DEFS_BYTES


def fleet(state: FleetState) -> list:
    """The fleet-wide part: [known_marks, counters, diagnoses opened per rule]."""
    return [[[nid, boot, seq] for (nid, boot), seq in state.known_marks.items()],
            dict(state.counters), dict(state.diagnoses.opened)]


def restore_fleet(state: FleetState, data: list) -> None:
    known, counters, opened = data
    for nid, boot, seq in known:
        state.known_marks[(nid, boot)] = max(state.known_marks.get((nid, boot), 0), seq)
    state.counters.update(counters)
    state.diagnoses.opened.update(opened)


class Base:
    """What a diff is written against: per node its Series and Frames (in order; held, so that `is`
    tells the same ones) and how many points (rows) each had ever held at capture; and per node
    how many series definitions each of its boots had."""

    __slots__ = ("nodes", "defs")

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[tuple[Series, ...], array, tuple[columns.Frame, ...], array]] = {}
        self.defs: dict[str, tuple[tuple[str, int], ...]] = {}


Definitions = list[tuple[str, list[tuple[str, list[pb.Sample]]]]]   # [(node, [(boot, definitions)])]


def dictionary(state: FleetState, base: Base | None, into: Base | None) -> Definitions:
    """The series dictionary's definitions per node, taken on the loop (encoded by `encode_dictionary`
    elsewhere: a definition is never changed once held). Against a base: only the nodes whose
    definitions changed since it, with none for a node that has none now."""
    by_node: dict[str, list[tuple[str, list[pb.Sample]]]] = {}
    for (node, boot), defs in state.dictionary.boots.items():
        if defs:
            by_node.setdefault(node, []).append((boot, list(defs.values())))
    counts = {node: tuple((boot, len(d)) for boot, d in boots) for node, boots in by_node.items()}
    if into is not None:
        into.defs = counts
    if base is None:
        return list(by_node.items())
    return ([(node, boots) for node, boots in by_node.items() if base.defs.get(node) != counts[node]]
            + [(node, []) for node in base.defs if node not in by_node])


Encoded = dict[tuple[str, str], tuple[list[pb.Sample], bytes]]   # (node, boot) -> (definitions, SeriesTable.defs)


def encode_dictionary(rows: Definitions, held: Encoded, into: Encoded) -> list:
    """A snapshot's "d" record's data: [[node, [[boot, SeriesTable.defs], ...]], ...]. A boot's
    definitions as `held` has them encoded where they are the very same ones (a definition given
    again replaces the one held: a new object), else encoded now; each boot's put `into` (`held`
    itself, or a new map for a full snapshot)."""
    out = []
    for node, boots in rows:
        row = []
        for boot, defs in boots:
            was = held.get((node, boot))
            if was is None or len(was[0]) != len(defs) or not all(map(operator.is_, was[0], defs)):
                was = (defs, compact.encode_defs(defs))
            into[(node, boot)] = was
            row.append([boot, was[1]])
        out.append([node, row])
    return out


def restore_dictionary(state: FleetState, data: list) -> None:
    """A "d" record's nodes into the state's series dictionary, each replacing what it held."""
    for node, boots in data:
        state.dictionary.forget(node)
        for boot, defs in boots:
            state.dictionary.add(node, boot, compact.decode_defs(defs, MAX_DEFS_BYTES))


class _Runs:
    """A node's distinct time runs, in the order first seen (most series share one with others)."""

    __slots__ = ("runs", "index", "last")

    def __init__(self) -> None:
        self.runs: list[bytes] = []
        self.index: dict[tuple, list[int]] = {}
        self.last = -1   # the run found last: the next series' is most often the same

    def ref(self, data: bytes) -> int:
        if self.last >= 0 and self.runs[self.last] == data:
            return self.last
        key = (len(data), data[:8], data[-8:])
        same = self.index.setdefault(key, [])
        for i in same:
            if self.runs[i] == data:
                self.last = i
                return i
        same.append(len(self.runs))
        self.runs.append(data)
        self.last = len(self.runs) - 1
        return self.last


def _common(n: NodeState, unapplied: dict[str, int] | None) -> list:
    """`unapplied`: boot -> the lowest sequence number accepted but not applied yet (its mark is
    taken below it, so the batch is replayed from the log)."""
    marks = []
    for boot, seq in n.stored_up_to.items():
        if unapplied and boot in unapplied:
            seq = min(seq, unapplied[boot] - 1)
        marks.append([boot, seq, n.mark_at.get(boot, 0)])
    return [n.node_id, n.boot_id, n.last_seen_ns, n.inventory.SerializeToString(), marks, n.batches_stored,
            n.batches_duplicate, [e.SerializeToString() for e in n.events],
            [[did, e.SerializeToString()] for did, e in n.diagnoses.items()], n.diagnoses_boot]


def _hist(ser: Series) -> bytes | None:
    return ser.histogram.SerializeToString() if ser.histogram is not None else None


def capture(n: NodeState, unapplied: dict[str, int] | None, parts: list[bytes], base: Base | None,
            into: Base | None) -> list:
    """One node's entry; its points are appended to `parts` (the frame's blob). `base`: write it
    incrementally against that base when it can ("I"), else whole ("F"). `into`: the base being
    written, which records the node's series and frames for later diffs."""
    prev = base.nodes.get(n.node_id) if base is not None else None
    if prev is not None:
        incr = _incremental(n, prev)
        if incr is not None:
            runs, values, series, frames, grown = incr
            parts.extend(runs.runs)
            parts.extend(values)
            return [*_common(n, unapplied), "I", [len(r) >> 3 for r in runs.runs], series, _refs(n), frames, grown]
    runs, values, series = _Runs(), [], []
    totals = array("q")
    for ser in n.series.values():
        series.append(_whole(ser, runs, values))
        totals.append(ser.history.dropped + len(ser.history.t))
    framed = tuple(n.frames.values())
    frames = []
    if framed:
        at = {id(ser): i for i, ser in enumerate(n.series.values())}
        for f in framed:
            values.append(f.v.tobytes())
            frames.append([list(f.key), [at[id(s)] for s in f.series], runs.ref(f.t.tobytes()), len(f.t),
                           f.due_t, f.due_n, f.last_t])
    if into is not None:
        into.nodes[n.node_id] = (tuple(n.series.values()), totals, framed,
                                 array("q", [f.dropped + len(f.t) for f in framed]))
    parts.extend(runs.runs)
    parts.extend(values)
    return [*_common(n, unapplied), "F", [len(r) >> 3 for r in runs.runs], series, _refs(n), frames]


def _whole(ser: Series, runs: _Runs, values: list) -> list:
    """A series' row as a full snapshot writes it; its values appended to `values`."""
    h = ser.history
    values.append(h.v.tobytes())
    return [ser.name, ser.unit, ser.kind, ser.labels, *ser.latest(),
            _hist(ser), h.due_t, h.due_n, runs.ref(h.t.tobytes()), len(h.t)]


def _incremental(n: NodeState, prev: tuple) -> tuple[_Runs, list, list, list, list] | None:
    """The node's series and frames with what each appended since the base (runs, values, series,
    frames), and the series new since it written whole (grown); None when the base's series are
    not the first of the node's or its frames are not the base's (then the node is written whole)."""
    kept, totals, framed, frame_totals = prev
    now = tuple(n.frames.values())
    if not (_grown_from(n, kept) and len(now) == len(framed) and all(f is g for f, g in zip(now, framed))):
        return None
    runs, values, series, frames = _Runs(), [], [], []
    none = -1   # the empty run's index, once referred to (most series of a frame gain no points of their own)
    for ser, was in zip(n.series.values(), totals):
        h = ser.history
        t = h.t
        have = len(t)
        k = min(h.dropped + have - was, have)   # points appended since the base (the newest `have` at most)
        if k > 0:
            values.append(h.v[have - k:].tobytes())
            r = runs.ref(t[have - k:].tobytes())
        elif k == 0:
            if none < 0:
                none = runs.ref(b"")
            r = none
        else:   # fewer than the base had: not the same series after all
            return None
        series.append([*ser.latest(), _hist(ser) if ser.histogram is not None else None, h.due_t, h.due_n,
                       r, k, have, t[0] if have else 0, t[-1] if have else 0])
    grown = [_whole(ser, runs, values) for ser in list(n.series.values())[len(kept):]]
    for f, was in zip(now, frame_totals):
        rows = len(f.t)
        k = min(f.dropped + rows - was, rows)
        if k < 0:
            return None
        values.append(f.v[(rows - k) * f.k:].tobytes())
        frames.append([runs.ref(f.t[rows - k:].tobytes()), k, rows, f.due_t, f.due_n, f.last_t,
                       f.t[0] if rows else 0, f.t[-1] if rows else 0])
    return runs, values, series, frames, grown


def _refs(n: NodeState) -> list:
    """The agent's series_ref of each series, per boot (stable for a boot): [[boot, [ref, position, ...]], ...],
    so the first batches after a restart find their series without reading labels."""
    if not n.refs:
        return []
    at = {id(ser): i for i, ser in enumerate(n.series.values())}
    out = []
    for boot, refs in n.refs.items():
        flat: list[int] = []
        for ref, ser in refs.items():
            i = at.get(id(ser))
            if i is not None:   # (a series let go since is not in n.series: its ref goes with it)
                flat += (ref, i)
        out.append([boot, flat])
    return out


def _grown_from(n: NodeState, kept: tuple[Series, ...]) -> bool:
    """The base's series are the node's first ones, as they were (series new since come after them)."""
    return len(n.series) >= len(kept) and all(s is k for s, k in zip(n.series.values(), kept))


def _take(blob: memoryview, at: int, size: int, nid: str) -> memoryview:
    if at + size > len(blob):
        raise ValueError(f"node {nid!r}: its history runs past its frame")
    return blob[at:at + size]


def restore(state: FleetState, entry: list, blob: memoryview, at: int) -> int:
    """One node's entry into `state`, its history from blob[at:]; where the next node's bytes begin.
    ValueError (or another error of shape) when it does not fit."""
    (nid, boot_id, last_seen, inv, marks, stored, dup, events, diagnoses, diag_boot, mode, runs, series,
     refs) = entry[:14]
    frames = entry[14] if len(entry) > 14 else []   # version 2: none
    grown = entry[15] if len(entry) > 15 else []    # before version 4: none
    starts = []
    for r in runs:
        starts.append(at)
        at += r << 3
    _take(blob, at, 0, nid)
    if mode == "F":
        old = state.nodes.get(nid)
        if old is not None:   # a diff's node written whole replaces the base's
            _forget(state, old)
        n = state.nodes[nid] = NodeState(nid, state.events_kept)
        at = _restore_full(state, n, series, runs, starts, blob, at)
        _restore_refs(n, refs)
        at = _restore_frames(state, n, frames, runs, starts, blob, at)
    elif mode == "I":
        have = state.nodes.get(nid)
        if have is None or len(have.series) != len(series) or len(have.frames) != len(frames):
            raise ValueError(f"node {nid!r}: a diff on a base that does not hold it as it was")
        n = have
        at = _restore_incr(state, n, series, runs, starts, blob, at)
        at = _restore_full(state, n, grown, runs, starts, blob, at)
        _restore_refs(n, refs)
        at = _restore_rows(state, n, frames, runs, starts, blob, at)
    else:
        raise ValueError(f"node {nid!r}: mode {mode!r}")
    n.boot_id, n.last_seen_ns = boot_id, last_seen
    n.inventory.ParseFromString(inv)
    n.stored_up_to = collections.OrderedDict((boot, seq) for boot, seq, _ in marks)
    n.mark_at = {boot: at_ for boot, _, at_ in marks if at_}
    n.batches_stored, n.batches_duplicate = stored, dup
    n.events.clear()
    n.events.extend(pb.Event.FromString(e) for e in events[:state.events_kept])
    n.diagnoses = collections.OrderedDict((did, pb.Event.FromString(e)) for did, e in diagnoses)
    n.diagnoses_boot = diag_boot
    return at


def _forget(state: FleetState, n: NodeState) -> None:
    """A node's series and points out of the state's counts (a diff writes it whole again)."""
    rows = sum(len(f.t) for f in n.frames.values())
    points = sum(len(f.t) * f.k for f in n.frames.values())
    state.series_total -= len(n.series)
    state.history_slots -= sum(len(s.history.t) for s in n.series.values()) + points
    state.frame_rows -= rows
    state.frame_points -= points


def _restore_refs(n: NodeState, refs: list) -> None:
    n.refs = {}
    if refs:
        order = list(n.series.values())
        for boot, flat in refs:
            n.boot_refs(boot).cur.update({flat[j]: order[flat[j + 1]] for j in range(0, len(flat), 2)})


def _restore_full(state: FleetState, n: NodeState, series: list, runs: list, starts: list, blob: memoryview,
                  at: int) -> int:
    slots = 0
    for (name, unit, kind, labels, value, time_ns, prev_value, prev_time_ns, hist, due_t, due_n, r, k) in series:
        if runs[r] != k:
            raise ValueError(f"node {n.node_id!r} series {name!r}: {k} values on a run of {runs[r]} times")
        ser = Series.__new__(Series)
        ser.name, ser.unit, ser.kind, ser.labels = name, unit, kind, labels
        ser.frame, ser.col = None, 0
        _set_latest(ser, value, time_ns, prev_value, prev_time_ns, hist)
        h = ser.history = History()
        h.t.frombytes(blob[starts[r]:starts[r] + (k << 3)])
        h.v.frombytes(_take(blob, at, k << 3, n.node_id))
        at += k << 3
        h.due_t, h.due_n = due_t, due_n
        h.newest = max(max(h.t, default=0), time_ns, prev_time_ns)
        slots += k
        key = series_key(name, labels)
        if key in n.series:
            raise ValueError(f"node {n.node_id!r}: series {name!r} {labels!r} twice")
        n.series[key] = ser
    state.series_total += len(series)
    state.history_slots += slots
    return at


def _restore_frames(state: FleetState, n: NodeState, frames: list, runs: list, starts: list, blob: memoryview,
                    at: int) -> int:
    """A node's frames (after its series and refs): each member on its own so far, not a histogram,
    and the series its key's ref names where the refs still name one (a frame outlives a reset of
    the node's refs: node_series.NodeSeries, evict_expired)."""
    order = list(n.series.values())
    for key, positions, r, rows, due_t, due_n, last_t in frames:
        key, width = tuple(key), len(positions)
        known = n.refs.get(key[0] if key else "") or BootRefs()
        members = [order[p] for p in positions]
        if (not width or len(key) != width + 1 or runs[r] != rows
                or any(known.get(ref, s) is not s or s.frame is not None or s.kind == pb.HISTOGRAM
                       for ref, s in zip(key[1:], members))):
            raise ValueError(f"node {n.node_id!r}: frame {key[:4]!r}... does not fit its series")
        t, v = array("q"), array("d")
        t.frombytes(blob[starts[r]:starts[r] + (rows << 3)])
        v.frombytes(_take(blob, at, (rows * width) << 3, n.node_id))
        at += (rows * width) << 3
        columns.adopt(state, n, key, members, t, v, last_t, due_t, due_n)
        state.history_slots += rows * width
        if rows:
            _before_rows(members)
    return at


def _before_rows(members: list[Series]) -> None:
    """A framed series with rows holds its point before them in its latest fields (columns.py): the
    previous value the snapshot has for it (exact while the frame has one row, not read after)."""
    for s in members:
        s._value, s._time_ns = s._prev_value, s._prev_time_ns


def _restore_incr(state: FleetState, n: NodeState, series: list, runs: list, starts: list, blob: memoryview,
                  at: int) -> int:
    slots = 0
    for ser, (value, time_ns, prev_value, prev_time_ns, hist, due_t, due_n, r, k, held, first, last) in zip(
            n.series.values(), series):
        if runs[r] != k:
            raise ValueError(f"node {n.node_id!r} series {ser.name!r}: {k} values on a run of {runs[r]} times")
        h = ser.history
        before = len(h.t)
        if k:
            h.t.frombytes(blob[starts[r]:starts[r] + (k << 3)])
            h.v.frombytes(_take(blob, at, k << 3, n.node_id))
            at += k << 3
        extra = len(h.t) - held
        if extra < 0:
            raise ValueError(f"node {n.node_id!r} series {ser.name!r}: {len(h.t)} points, the diff says {held}")
        if extra:
            del h.t[:extra]
            del h.v[:extra]
        if held and (h.t[0] != first or h.t[-1] != last):
            raise ValueError(f"node {n.node_id!r} series {ser.name!r}: the points do not follow on from the base's")
        _set_latest(ser, value, time_ns, prev_value, prev_time_ns, hist)
        h.due_t, h.due_n = due_t, due_n
        slots += held - before
    state.history_slots += slots
    return at


def _restore_rows(state: FleetState, n: NodeState, frames: list, runs: list, starts: list, blob: memoryview,
                  at: int) -> int:
    """A diff's rows of the node's frames (after its series), appended and the oldest let go."""
    for f, (r, k, rows, due_t, due_n, last_t, first, last) in zip(list(n.frames.values()), frames):
        if runs[r] != k:
            raise ValueError(f"node {n.node_id!r} frame {f.key[:4]!r}...: {k} rows on a run of {runs[r]} times")
        before = len(f.t)
        if k:
            f.t.frombytes(blob[starts[r]:starts[r] + (k << 3)])
            f.v.frombytes(_take(blob, at, (k * f.k) << 3, n.node_id))
            at += (k * f.k) << 3
        extra = len(f.t) - rows
        if extra < 0:
            raise ValueError(f"node {n.node_id!r} frame {f.key[:4]!r}...: {len(f.t)} rows, the diff says {rows}")
        if extra:
            del f.t[:extra]
            del f.v[:extra * f.k]
            f.dropped += extra
        if rows and (f.t[0] != first or f.t[-1] != last):
            raise ValueError(f"node {n.node_id!r} frame {f.key[:4]!r}...: the rows do not follow on from the base's")
        f.due_t, f.due_n, f.last_t = due_t, due_n, last_t
        f.prefixed = any(len(s.history.t) for s in f.series)
        grown = (rows - before) * f.k
        state.frame_rows += rows - before
        state.frame_points += grown
        state.history_slots += grown
        if rows:
            _before_rows(f.series)
    return at


def restore_node_v1(state: FleetState, data: list) -> None:
    """A node of a version 1 snapshot (written before this version): read, never written."""
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
        ser.frame, ser.col = None, 0
        _set_latest(ser, value, time_ns, prev_value, prev_time_ns, hist)
        h = ser.history = History()
        h.t = array("q", tb)
        h.v = array("d", vb)
        if len(h.t) != len(h.v):
            raise ValueError(f"node {nid!r} series {name!r}: {len(h.t)} times but {len(h.v)} values")
        h.due_t, h.due_n = due_t, due_n
        h.newest = max(max(h.t, default=0), time_ns, prev_time_ns)
        slots += len(h.t)
        n.series[series_key(name, labels)] = ser
    state.series_total += len(n.series)
    state.history_slots += slots


def _set_latest(ser: Series, value, time_ns: int, prev_value, prev_time_ns: int, hist: bytes | None) -> None:
    """A series' latest and previous values as a snapshot holds them (None: NaN)."""
    ser._value, ser._time_ns = _float(value), time_ns
    ser._prev_value, ser._prev_time_ns = _float(prev_value), prev_time_ns
    ser.histogram = pb.Histogram.FromString(hist) if hist is not None else None


def _float(x) -> float:
    return math.nan if x is None else float(x)
