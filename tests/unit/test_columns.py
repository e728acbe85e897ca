"""Series held in columns (collector/columns.py): whatever the batches, a fleet state that holds
series in frames answers exactly as one that keeps every series in its own History (latest and
previous values, rates, every history point, counts), and so does its snapshot, full or as a diff
on an earlier one (collector/store/fleet_image.py); frames are formed where groups come together again
and again, dissolved where they change."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store_snapshot import picture

from xpusense.collector import columns
from xpusense.collector.batch_rows import BatchRows
from xpusense.collector.columns import held
from xpusense.collector.state import FleetState
from xpusense.collector.store import fleet_image
from xpusense.v1 import telemetry_pb2 as pb

S = 10**9
T0 = 1_700_000_000 * S
# The pool of series: (name, kind, device label). One is a histogram (never in a frame).
POOL = [("u", pb.GAUGE, "0"), ("u", pb.GAUGE, "1"), ("e", pb.COUNTER, "0"), ("e", pb.COUNTER, "1"),
        ("m", pb.GAUGE, "0"), ("h", pb.HISTOGRAM, "0")]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def make_batch(node: str, boot: str, seq: int, groups: list[tuple[int, list[int], list[float]]]) -> pb.Batch:
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq)
    for t, members, values in groups:
        for i, v in zip(members, values):
            name, kind, dev = POOL[i]
            s = b.samples.add(name=name, unit="1", kind=kind, labels={"device": dev}, value=v, time_unix_nano=t,
                              series_ref=i + 1)
            if kind == pb.HISTOGRAM:
                s.histogram.count, s.histogram.sum = 2, v
                s.histogram.bounds.append(1.0)
                s.histogram.counts.extend([1, 1])
    return b


def ingest(state: FleetState, batch: pb.Batch, now_ns: int) -> bool:
    """state.ingest, as the server does it: with columns, the samples read from the batch's bytes
    (batch_rows.BatchRows: as columns where the C reader can, so a batch of one group with its refs
    rising takes columns.store_row); without, from its protobuf objects."""
    return state.ingest(batch, now_ns, batch.SerializeToString() if state.columns else None)


values = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def scripts(draw):
    """A run of batches: per batch a node, a boot, and groups of series (each series at most once a
    batch; mostly the node's groups of the batch before, sometimes others) at times that mostly
    rise, sometimes repeat or step back; and how far the clock moves."""
    out, t = [], 0
    layouts: dict[str, list[list[int]]] = {}
    for _ in range(draw(st.integers(1, 80))):
        node = draw(st.sampled_from(["A", "B"]))
        boot = draw(st.sampled_from(["b1"] * 8 + ["b2"]))
        parts = layouts.get(node)
        if parts is None or draw(st.integers(0, 9)) == 0:
            order = draw(st.permutations(range(len(POOL))))
            take = draw(st.integers(1, len(POOL)))
            cut = sorted(draw(st.lists(st.integers(1, take), max_size=2, unique=True)))
            parts = layouts[node] = [list(order[a:b]) for a, b in zip([0, *cut], [*cut, take]) if a < b]
        groups = []
        for members in parts:
            t += draw(st.sampled_from([1] * 12 + [2, 0, -3])) * S
            groups.append((T0 + t, draw(st.permutations(members)), [draw(values) for _ in members]))
        out.append((node, boot, groups, draw(st.sampled_from([0, 1, 1, 30, 90])) * S))
    return out


def run(script, with_columns: bool, history_s: float, snap_at: int):
    clock = Clock()
    state = FleetState(history_s=history_s, clock=clock)
    state.columns = with_columns
    seqs: dict[tuple[str, str], int] = {}
    base, base_parts, base_entries = fleet_image.Base(), [], []
    for k, (node, boot, groups, step) in enumerate(script):
        clock.now += step
        seqs[(node, boot)] = seqs.get((node, boot), 0) + 1
        state.hello(pb.Hello(node_id=node, boot_id=boot))
        assert ingest(state, make_batch(node, boot, seqs[(node, boot)], groups), clock.now)
        state.disconnected(node, boot)
        if k == snap_at:
            base_entries = [fleet_image.capture(n, None, base_parts, None, base) for n in state.nodes.values()]
    counted(state)
    return state, (base_parts, base_entries, base)


def counted(state: FleetState) -> None:
    """The state's counts (its memory estimate's inputs) are what it holds."""
    frames = [f for n in state.nodes.values() for f in n.frames.values()]
    assert state.history_slots == sum(len(held(s)[0]) for n in state.nodes.values() for s in n.series.values())
    assert state.frame_rows == sum(len(f.t) for f in frames)
    assert state.frame_points == sum(len(f.t) * f.k for f in frames)
    for n in state.nodes.values():   # a frame's members: the series its key's refs name (while known)
        for key, f in n.frames.items():
            assert f.key == key and f.k == len(f.series) == len(key) - 1 and len(f.v) == len(f.t) * f.k
            known = n.refs.get(key[0], {})
            assert all(known.get(ref, s) is s and s.frame is f and s.col == col
                       for col, (ref, s) in enumerate(zip(key[1:], f.series)))


def restored(state: FleetState, base_snap) -> tuple[FleetState, FleetState]:
    """The state written whole and restored; and the earlier full snapshot with a diff on it."""
    def load(entries_parts_list):
        clock = Clock()
        clock.now = state.clock.now
        st_ = FleetState(history_s=state.history_ns / S, clock=clock)
        for entries, parts in entries_parts_list:
            blob, at = memoryview(b"".join(parts)), 0
            for e in entries:
                at = fleet_image.restore(st_, e, blob, at)
        st_.history_cap = state.history_cap
        return st_
    parts: list[bytes] = []
    whole = [fleet_image.capture(n, None, parts, None, None) for n in state.nodes.values()]
    base_parts, base_entries, base = base_snap
    diff_parts: list[bytes] = []
    diff = [fleet_image.capture(n, None, diff_parts, base, None) for n in state.nodes.values()]
    return load([(whole, parts)]), load([(base_entries, base_parts), (diff, diff_parts)])


def go_on(state: FleetState, script, shift: int) -> None:
    """The script's batches again, `shift` later, each sequence number on from its boot's mark."""
    for node, boot, groups, step in script:
        state.clock.now += step
        n = state.nodes.get(node)
        seq = (n.stored_up_to.get(boot, 0) if n is not None else 0) + 1
        state.hello(pb.Hello(node_id=node, boot_id=boot))
        assert ingest(state, make_batch(node, boot, seq, [(t + shift, m, v) for t, m, v in groups]), state.clock.now)
        state.disconnected(node, boot)


def same(a: FleetState, b: FleetState) -> None:
    pa, pb_ = picture(a), picture(b)
    for p in (pa, pb_):
        for node in p.values():
            if isinstance(node, dict) and "refs" in node:
                node.pop("refs")   # kept as a cache, reset at different moments
    assert pa == pb_


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(script=scripts(), history_s=st.sampled_from([3.0, 8.0, 900.0]), snap_frac=st.floats(0, 1))
def test_columns_answer_as_every_series_on_its_own(script, history_s, snap_frac):
    snap_at = int(snap_frac * (len(script) - 1))
    framed, base_snap = run(script, True, history_s, snap_at)
    plain, _ = run(script, False, history_s, snap_at)
    same(framed, plain)
    whole, diffed = restored(framed, base_snap)
    for st_ in (whole, diffed):   # the frames come back as they were, and the counts with them
        counted(st_)
        assert {nid: list(n.frames) for nid, n in st_.nodes.items()} == \
            {nid: list(n.frames) for nid, n in framed.nodes.items()}
        same(st_, plain)
    # ...and take the batches after a restart as the state before it does
    shift = max(t for _, _, groups, _ in script for t, _, _ in groups) - T0 + S
    for st_ in (framed, plain, whole, diffed):
        go_on(st_, script, shift)
    counted(whole)
    counted(diffed)
    for st_ in (plain, whole, diffed):
        same(framed, st_)


def steady(n_batches: int, history_s: float = 900.0) -> FleetState:
    clock = Clock()
    state = FleetState(history_s=history_s, clock=clock)
    for seq in range(1, n_batches + 1):
        clock.now += S
        state.ingest(make_batch("A", "b1", seq, [(T0 + seq * S, [0, 1, 2, 3, 4], [seq, seq, seq, seq, seq]),
                                                  (T0 + seq * S + 1, [5], [1.0])]))
    return state


def test_a_steady_group_is_held_in_one_frame_and_its_prefix_goes_with_the_window():
    state = steady(20, history_s=5.0)
    n = state.nodes["A"]
    [f] = n.frames.values()
    assert f.k == 5 and state.counters["state.columns.formed"] == 1 and not state.counters["state.columns.dissolved"]
    assert not f.prefixed and all(len(s.history.t) == 0 for s in f.series)   # the points from before it: let go
    u = n.series[("u", (("device", "0"),))]
    assert u.frame is f and u.value == 20 and u.prev_value == 19 and u.time_ns == T0 + 20 * S
    assert u.latest() == (20, T0 + 20 * S, 19, T0 + 19 * S)   # the four properties with one look
    e = n.series[("e", (("device", "0"),))]
    assert math.isclose(e.rate(), 1.0)
    assert list(held(u)[0]) == [T0 + s * S for s in range(15, 21)]
    assert state.history_slots == sum(len(held(s)[0]) for s in n.series.values())
    assert n.series[("h", (("device", "0"),))].frame is None   # a histogram: on its own


def test_a_round_read_as_columns_goes_onto_its_frame_in_one_step(monkeypatch):
    """A batch of one time with its refs rising, read from its bytes as columns, is a row on its
    frame without rows of (ref, time, value) ever made; one whose refs do not rise, or that its
    frame does not take, goes the general way with the same result."""
    clock = Clock()
    state = FleetState(history_s=900.0, clock=clock)
    state.hello(pb.Hello(node_id="A", boot_id="b1"))

    def send(seq, members, t):
        clock.now += S
        b = make_batch("A", "b1", seq, [(t, members, [float(seq + m) for m in members])])
        read = BatchRows(b, b.SerializeToString())   # as the server reads it, handed to apply as it does
        assert state.accept(b, clock.now) is not None
        state.apply(b, read)
        return read

    for seq in range(1, 4):
        send(seq, [0, 1, 2, 4], T0 + seq * S)
    [f] = state.nodes["A"].frames.values()
    general = columns.store

    def not_here(*a, **kw):
        raise AssertionError("the general path was taken")
    monkeypatch.setattr(columns, "store", not_here)
    read = send(4, [0, 1, 2, 4], T0 + 4 * S)
    assert read.rising and read.time == T0 + 4 * S and read._rows is None   # apply made no rows of it
    assert list(f.t)[-1] == T0 + 4 * S and list(f.v)[-4:] == [4.0, 5.0, 6.0, 8.0]
    monkeypatch.setattr(columns, "store", general)
    read = send(5, [4, 2, 1, 0], T0 + 5 * S)   # the same series, in another order: the general path
    assert not read.rising and list(f.v)[-4:] == [5.0, 6.0, 7.0, 9.0]
    send(6, [0, 1, 2, 4], T0 + 5 * S)          # a time its frame has: not a row of the frame
    u = state.nodes["A"].series[("u", (("device", "0"),))]
    assert u.frame is None and list(held(u)[0])[-2:] == [T0 + 5 * S, T0 + 5 * S]
    counted(state)


def test_a_changed_group_dissolves_its_frame_and_forms_none_for_a_while():
    """A group that changes dissolves its frame; the node forms none for a second, then twice as
    long after each dissolve that follows, until a frame of it holds steady."""
    state = steady(5)
    n = state.nodes["A"]
    clock = state.clock
    [f] = n.frames.values()
    seq = [5]

    def send(members, dt=S):
        clock.now += dt
        seq[0] += 1
        state.ingest(make_batch("A", "b1", seq[0], [(T0 + seq[0] * S, members, [float(seq[0])] * len(members))]))

    send([0, 1, 2, 3])   # m missing
    assert not n.frames and state.counters["state.columns.dissolved"] == 1
    assert all(s.frame is None for s in f.series)
    assert list(held(n.series[("m", (("device", "0"),))])[0]) == [T0 + s * S for s in range(1, 6)]
    send([0, 1, 2, 3], dt=S // 2)
    assert not n.frames   # held off: columns.HOLD_FIRST_NS
    send([0, 1, 2, 3], dt=S // 2)
    [g] = n.frames.values()
    assert g.k == 4 and g.prefixed
    send([0, 1, 2])      # changed again at once: held off twice as long
    assert not n.frames and state.counters["state.columns.dissolved"] == 2
    send([0, 1, 2], dt=S)
    assert not n.frames
    send([0, 1, 2], dt=S)
    [g] = n.frames.values()
    for _ in range(columns.STEADY_ROWS):
        send([0, 1, 2])
    assert n.frames_dissolves == 0   # steady again: the next hold is short
    send([0, 1])
    assert n.frames_hold_until == clock.now + columns.HOLD_FIRST_NS


def test_a_memory_budget_shortens_the_columns_in_place():
    """[state] max_memory with series in columns: every series cut to the same shorter history
    (frames kept, not dissolved: that would cost memory), the estimate back under the budget."""
    state = steady(60)
    n = state.nodes["A"]
    [f] = n.frames.values()
    budget = state.memory_bytes() - 20 * 6 * 17
    state.configure(max_memory=budget, min_history_points=2)
    assert state.counters["state.max_memory.history_shortened"] >= 1 and state.history_cap < 60
    assert list(n.frames.values()) == [f] and len(f.t) <= state.history_cap
    assert state.memory_bytes() <= budget
    counted(state)
    u = n.series[("u", (("device", "0"),))]
    assert u.value == 60 and u.prev_value == 59
    for seq in range(61, 70):
        state.clock.now += S
        state.ingest(make_batch("A", "b1", seq, [(T0 + seq * S, [0, 1, 2, 3, 4], [seq] * 5), (T0 + seq * S + 1, [5], [1.0])]))
    assert len(f.t) <= state.history_cap + max(4, state.history_cap >> 3) and u.value == 69
    assert state.memory_bytes() <= budget * 1.13
    counted(state)


def test_a_frame_outlives_a_reset_of_its_nodes_refs_and_a_snapshot_brings_it_back():
    """A series let go (evict_expired) resets the node's refs; its frames stay and go on taking their
    groups by key. A snapshot then holds frames whose refs the node no longer lists: restored as
    they were, and the next batch goes to them."""
    state = steady(5, history_s=5.0)
    n, clock = state.nodes["A"], state.clock
    for seq in range(6, 14):   # h stops coming
        clock.now += S
        state.ingest(make_batch("A", "b1", seq, [(T0 + seq * S, [0, 1, 2, 3, 4], [float(seq)] * 5)]))
    assert state.evict_expired("A") == 1 and not n.refs and len(n.frames) == 1
    parts: list[bytes] = []
    entries = [fleet_image.capture(m, None, parts, None, None) for m in state.nodes.values()]
    back = FleetState(history_s=5.0, clock=clock)
    blob, at = memoryview(b"".join(parts)), 0
    for e in entries:
        at = fleet_image.restore(back, e, blob, at)
    assert list(back.nodes["A"].frames) == list(n.frames)
    for st_ in (state, back):
        st_.ingest(make_batch("A", "b1", 14, [(T0 + 14 * S, [0, 1, 2, 3, 4], [14.0] * 5)]))
        counted(st_)
    assert not state.counters["state.columns.dissolved"] and not back.counters["state.columns.dissolved"]
    same(back, state)
