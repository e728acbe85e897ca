"""Series let go when idle (collector/idle.py): the fleet state's sweep looks at a bounded number
of series a step, lets go only those with no point received for series_idle_s on its own clock
(whatever the agent's stamps), keeps its memory accounting exact through frames, and a cluster
worker's node does the same with its kept series and its references."""

from __future__ import annotations

from xpusense.collector import idle
from xpusense.collector.cluster.summary import NodeLatest
from xpusense.collector.state import FleetState
from xpusense.v1 import telemetry_pb2 as pb

S = 10**9


def rows(node: str, seq: int, t: int, names: list[str], first_ref: int = 1) -> pb.Batch:
    b = pb.Batch(node_id=node, boot_id="b", seq=seq)
    for i, name in enumerate(names):
        b.samples.add(name=name, unit="1", kind=pb.GAUGE, labels={"i": str(i)}, value=seq, time_unix_nano=t,
                      series_ref=first_ref + i)
    return b


def held_points(st: FleetState) -> int:
    """Every point held, as history_slots counts them: a series' own, and its column of a frame."""
    return sum(len(s.history.t) + (len(s.frame.t) if s.frame is not None else 0)
               for n in st.nodes.values() for s in n.series.values())


def test_a_step_looks_at_a_bounded_number_of_series_and_only_idle_ones_go():
    now = [1_000 * S]
    st = FleetState(clock=lambda: now[0])
    st.series_idle_ns = 10 * S
    gone_names = [f"gone.{k}" for k in range(3 * idle.STEP)]
    assert st.ingest(rows("churn", 1, 5, gone_names, first_ref=10)), "stamps far in the past: no matter"
    live = ["live.a", "live.b"]
    assert st.ingest(rows("steady", 2, 5, live))
    now[0] += idle.every_ns(st.series_idle_ns)   # the next pass is due: the next batch stored starts it
    seq = 3
    assert st.ingest(rows("steady", seq, 5, live))
    # The first step of the pass looks at no more than STEP series (the rest wait for later batches),
    # and the next step waits STEP_GAP_NS.
    def looked() -> int:
        return sum(hasattr(s, "idle_n") for n in st.nodes.values() for s in n.series.values())
    assert 0 < looked() <= idle.STEP
    seq += 1
    assert st.ingest(rows("steady", seq, 5, live)) and looked() <= idle.STEP
    while st.idle_walk is not None:
        now[0] += idle.STEP_GAP_NS
        seq += 1
        assert st.ingest(rows("steady", seq, seq, live))
    assert looked() == len(gone_names) + len(live)
    assert st.series_count("churn") == len(gone_names)   # seen once: not idle yet
    for _ in range(12):   # 12 s on the state's clock, the live series sent to every second
        now[0] += S
        seq += 1
        assert st.ingest(rows("steady", seq, seq, live))
    while st.idle_walk is not None or st.series_count("churn"):
        now[0] += idle.STEP_GAP_NS
        seq += 1
        assert st.ingest(rows("steady", seq, seq, live))
        assert seq < 1000
    assert st.series_count("churn") == 0 and st.series_count("steady") == 2
    assert st.counters["state.series.expired"] == len(gone_names)
    assert st.series_total == 2 and st.history_slots == held_points(st)
    assert not st.nodes["churn"].refs   # the references of what went are forgotten too
    # A series that was let go and comes back under a new reference is made again.
    seq += 1
    assert st.ingest(rows("churn", 2, 7, gone_names[:1], first_ref=99_999))
    assert st.series_count("churn") == 1


def test_series_held_in_frames_go_with_the_accounting_kept():
    now = [1_000 * S]
    st = FleetState(clock=lambda: now[0])
    st.series_idle_ns = 10 * S
    names = [f"m.{k}" for k in range(8)]
    seq = 0
    for t in range(1, 200):   # two groups, a batch each, refs rising: a frame each
        now[0] += S // 10
        seq += 2
        assert st.ingest(rows("n", seq - 1, t * S, names[:4]))
        assert st.ingest(rows("n", seq, t * S, names[4:], first_ref=5))
    frames = st.nodes["n"].frames
    assert len(frames) == 2 and all(f.k == 4 for f in frames.values())
    for t in range(200, 400):   # the second group stops: its frame is let go whole
        now[0] += S // 10
        seq += 1
        assert st.ingest(rows("n", seq, t * S, names[:4]))
    assert st.series_count("n") == 4 and st.counters["state.series.expired"] == 4
    assert st.history_slots == held_points(st) and st.series_total == 4
    assert sum(f.k * len(f.t) for f in frames.values()) == st.frame_points
    assert st.history("n", "m.0", {"i": "0"}).points[-1].value == seq


def test_a_worker_node_lets_idle_kept_series_and_references_go():
    node = NodeLatest("n", 0)
    b = pb.Batch(node_id="n", boot_id="b", seq=1)
    for i in range(3):
        b.samples.add(name="hw.gpu.utilization", labels={"device": f"gpu{i}"}, value=1, time_unix_nano=10, series_ref=i + 1)
    b.samples.add(name="process.memory.usage", labels={"pid": "7"}, value=1, time_unix_nano=10, series_ref=4)
    assert node.apply(b, 10)
    assert idle.expire_latest(node, 0, 5) == (0, 0)   # first look: marks noted, the generation's turn set
    b2 = pb.Batch(node_id="n", boot_id="b", seq=2)
    b2.samples.add(name="hw.gpu.utilization", labels={"device": "gpu0"}, value=2, time_unix_nano=20, series_ref=1)
    assert node.apply(b2, 20)
    node.dirty = False
    series, refs = idle.expire_latest(node, 6, 5)   # gpu1, gpu2 idle 6 > 5; a turn: refs move to the old one
    assert series == 2 and refs == 0 and node.dirty
    assert [k[1] for k in node.series] == [(("device", "gpu0"),)]
    assert node.diagnosis_counts["state.series.expired"] == 2
    gens = node.refs["b"]
    assert set(gens.cur) | set(gens.old) == {1, 4}   # the let-go series' references gone; the ignored kept
    b3 = pb.Batch(node_id="n", boot_id="b", seq=3)
    b3.samples.add(name="hw.gpu.utilization", labels={"device": "gpu0"}, value=3, time_unix_nano=30, series_ref=1)
    assert node.apply(b3, 30)   # reference 1 in use again: back in the current generation
    assert idle.expire_latest(node, 12, 5) == (0, 1)   # the next turn: 4, not used for a generation, goes
    assert set(gens.cur) == set() and set(gens.old) == {1}
    assert node.series[("hw.gpu.utilization", (("device", "gpu0"),))].value == 3
