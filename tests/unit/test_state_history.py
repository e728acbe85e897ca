"""The fleet state's history kept compactly (collector/series_history.py), answered by
GetHistory; latest values, counter rates and histograms alongside; and the [state] max_memory
budget: history shortened first, then samples of new series dropped, counted, never past it."""

from __future__ import annotations

import tracemalloc

from xpusense.collector.state import FleetState
from xpusense.v1 import telemetry_pb2 as pb

S = 10**9


def batch(node: str, seq: int, samples: list[pb.Sample], boot: str = "b1") -> pb.Batch:
    return pb.Batch(node_id=node, boot_id=boot, seq=seq, samples=samples)


def gauge(name: str, t: int, v: float, kind=pb.GAUGE, **labels) -> pb.Sample:
    return pb.Sample(name=name, unit="1", kind=kind, labels=labels, value=v, time_unix_nano=t)


def feed(st: FleetState, node: str, times: list[int], names=("x",), start_seq: int = 1) -> int:
    seq = start_seq
    for t in times:
        assert st.ingest(batch(node, seq, [gauge(n, t, t / S + i, device="0") for i, n in enumerate(names)]))
        seq += 1
    return seq


def test_history_answers_the_window_exactly_as_before():
    st = FleetState(history_s=900)
    times = [1_000 * S + k * S for k in range(2_500)]
    feed(st, "n", times)
    reply = st.history("n", "x", {"device": "0"})
    newest = times[-1]
    want = [t for t in times if t >= newest - 900 * S]
    assert [p.time_unix_nano for p in reply.points] == want and len(want) == 901
    assert [p.value for p in reply.points] == [t / S for t in want]
    assert reply.unit == "1"
    # What it holds is the window and a little slack, never the whole run.
    ser = next(iter(st.nodes["n"].series.values()))
    assert 901 <= len(ser.history) <= 901 + 900 // 32 + 1
    assert st.history_slots == len(ser.history)


def test_a_faster_tier_keeps_at_most_history_points():
    st = FleetState(history_s=10)   # 10 * 4 + 16 = 56 points at most
    times = [k * S // 10 for k in range(1, 1_000)]   # 10 points a second
    feed(st, "n", times)
    pts = st.history("n", "x", {"device": "0"}).points
    assert [p.time_unix_nano for p in pts] == times[-56:]
    assert len(next(iter(st.nodes["n"].series.values())).history) <= 56 + 56 // 8


def test_an_agent_clock_stepping_back_joins_the_history_in_arrival_order():
    st = FleetState(history_s=900)
    feed(st, "n", [100 * S, 101 * S, 99 * S, 102 * S])
    assert [p.time_unix_nano for p in st.history("n", "x", {"device": "0"}).points] == \
        [100 * S, 101 * S, 99 * S, 102 * S]
    assert st.nodes["n"].series[("x", (("device", "0"),))].value == 102.0


def test_latest_values_counter_rates_and_histograms_still_work():
    st = FleetState()
    c1 = gauge("c", 10 * S, 100.0, kind=pb.COUNTER)
    h = pb.Sample(name="h", unit="s", kind=pb.HISTOGRAM, time_unix_nano=10 * S,
                  histogram=pb.Histogram(bounds=[0.1, 1.0], counts=[1, 3, 4], sum=2.5, count=4))
    b = batch("n", 1, [c1, h])
    assert st.ingest(b)
    b.samples[1].histogram.count = 99   # the stored histogram is a copy, not the batch's
    assert st.ingest(batch("n", 2, [gauge("c", 12 * S, 150.0, kind=pb.COUNTER)]))
    view = {s.name: s for s in st.view().nodes[0].series}
    assert view["c"].value == 150.0 and view["c"].rate == 25.0
    assert view["h"].histogram.count == 4 and list(view["h"].histogram.counts) == [1, 3, 4]


def test_a_point_costs_about_16_bytes():
    st = FleetState(history_s=900)
    feed(st, "warm", [S])   # the first series and node are not what is measured
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    feed(st, "n", [k * S for k in range(1, 901)], names=[f"m{i}" for i in range(20)])
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    points = 20 * 900
    assert held / points < 20, f"{held / points:.1f} bytes a point"   # a deque of tuples: ~150


def test_max_memory_shortens_history_first_then_drops_new_series_counted():
    st = FleetState(history_s=900)
    names = [f"m{i}" for i in range(20)]
    seq = feed(st, "n1", [k * S for k in range(1, 301)], names=names)
    held = st.memory_bytes()
    st.configure(max_memory=held // 2, min_history_points=30)
    assert st.counters["state.max_memory.history_shortened"] >= 1
    cap = st.counters["state.history_points"]
    assert 30 <= cap < 300 and st.memory_bytes() <= held // 2
    pts = st.history("n1", "m0", {"device": "0"}).points
    assert len(pts) == cap and pts[-1].time_unix_nano == 300 * S   # the newest points kept
    # More points and more series: the history shortens further, down to its floor, and no further.
    for k in range(301, 400):
        seq = feed(st, "n1", [k * S], names=names + [f"new{k}"], start_seq=seq)
        # Within the budget, but for the points let go in bulk (at most 1/8 of the cut history).
        assert st.memory_bytes() <= held // 2 * 1.125
    assert st.history_cap == 30
    assert st.counters["state.max_memory.samples_dropped"] > 0   # new series refused at the floor
    assert st.full()   # and the server refuses new nodes (RESOURCE_EXHAUSTED, collector/server.py)
    # The series it holds still take their points (only new ones are refused).
    assert st.history("n1", "m0", {"device": "0"}).points[-1].time_unix_nano == 399 * S


def test_series_references_a_client_makes_up_stay_bounded_and_cost_nothing_but_a_lookup():
    st = FleetState(history_s=900)
    st.max_series_per_node = 4
    seq = 1
    for k in range(50):     # a new reference in every sample, for the same two series
        samples = [gauge("x", (100 + k) * S, k, device="0"), gauge("y", (100 + k) * S, -k, device="0")]
        samples[0].series_ref, samples[1].series_ref = 2 * k + 1, 2 * k + 2
        assert st.ingest(batch("n", seq, samples))
        seq += 1
    node = st.nodes["n"]
    assert len(node.series) == 2 and all(len(r) <= 8 for r in node.refs.values())
    assert st.counters["state.series_refs_reset"] >= 50 * 2 // 8 - 1
    assert [p.value for p in st.history("n", "x", {"device": "0"}).points] == list(range(50))
    assert [p.value for p in st.history("n", "y", {"device": "0"}).points] == [-k for k in range(50)]


def test_series_of_one_batch_with_the_same_labels_share_one_label_set():
    """A device's series come with the same labels: read once a batch, the new series share the
    dict and the tuple of pairs (their keys still tell them apart by name); another label set, or
    a later batch's new series, reads its own, equal to what the sample said."""
    st = FleetState(history_s=60)
    t = 1_000 * S
    assert st.ingest(batch("n", 1, [gauge("a", t, 1.0, device="0", vendor="v"), gauge("b", t, 2.0, vendor="v", device="0"),
                                    gauge("a", t, 3.0, device="1", vendor="v")]))
    assert st.ingest(batch("n", 2, [gauge("c", t + S, 4.0, device="0", vendor="v")]))
    series = st.nodes["n"].series
    a0, b0, a1 = (series[(n, tuple(sorted(lb.items())))] for n, lb in
                  (("a", {"device": "0", "vendor": "v"}), ("b", {"device": "0", "vendor": "v"}),
                   ("a", {"device": "1", "vendor": "v"})))
    c0 = series[("c", (("device", "0"), ("vendor", "v")))]
    assert a0.labels is b0.labels and a0.labels == {"device": "0", "vendor": "v"}
    keys = {ser: key for key, ser in series.items()}
    assert keys[a0][1] is keys[b0][1] and keys[a0] != keys[b0]
    assert a1.labels == {"device": "1", "vendor": "v"} and a1.labels is not a0.labels
    assert c0.labels == a0.labels and c0.labels is not a0.labels   # another batch: its own
    assert [st.history("n", n, lb).points[-1].value for n, lb in
            (("a", {"device": "0", "vendor": "v"}), ("b", {"vendor": "v", "device": "0"}),
             ("a", {"device": "1", "vendor": "v"}), ("c", {"device": "0", "vendor": "v"}))] == [1.0, 2.0, 3.0, 4.0]
