"""Lean batches (collector/state.py LeanAgentMessage): the Ingest stream parses a batch's samples
without their names and labels; what is stored from them is what the full batch stores, a series
that is new is read in full, the limits still read names and labels of series not checked yet,
and a watcher not known to read only ids and events is handed full batches."""

from __future__ import annotations

from xpusense.collector.limits import Limits
from xpusense.collector.state import FleetState, LeanAgentMessage, LeanBatch, full_batch, rows
from xpusense.v1 import telemetry_pb2 as pb

S = 10**9


def agent_batch(seq: int, t: int, names=("a", "b"), **kw) -> pb.AgentMessage:
    samples = [pb.Sample(name=n, unit="1", kind=pb.GAUGE, labels={"device": "0", "vendor": "v"}, value=seq + i / 10,
                         time_unix_nano=t, series_ref=i + 1) for i, n in enumerate(names)]
    return pb.AgentMessage(batch=pb.Batch(node_id="n", boot_id="b1", seq=seq, samples=samples, **kw))


def lean(msg: pb.AgentMessage):
    return LeanAgentMessage.FromString(msg.SerializeToString())


def fed(batches, as_lean: bool, watchers=(), header_only: bool = True) -> FleetState:
    st = FleetState(history_s=900)
    for w in watchers:
        st.watchers.append(w)
        if header_only:
            st.header_watchers.add(w)
    for m in batches:
        b = lean(m).batch if as_lean else m.batch
        assert st.accept(b) is not None
        st.apply(b, rows(b))
    return st


def snapshot(st: FleetState) -> list:
    n = st.nodes["n"]
    return sorted((k, s.name, s.unit, s.kind, s.labels, s.value, s.time_ns, s.prev_value, s.prev_time_ns,
                   list(s.history.t), list(s.history.v)) for k, s in n.series.items())


def test_a_lean_batch_encodes_the_same_batch_and_reads_the_same_rows():
    m = agent_batch(1, 100 * S, events=[pb.Event(id="e", type="xid", message="m")])
    lb = lean(m).batch
    assert lb.node_id == "n" and lb.seq == 1 and len(lb.events) == 1
    assert rows(lb) == rows(m.batch)
    assert not hasattr(lb.samples[0], "labels")   # not parsed...
    assert full_batch(lb) == m.batch               # ...but kept, and written out again
    assert pb.Batch.FromString(lb.SerializeToString()) == m.batch


def test_lean_batches_store_what_full_ones_do_new_series_mid_stream_included():
    t0 = 1_000 * S
    msgs = [agent_batch(1, t0), agent_batch(2, t0 + S), agent_batch(3, t0 + 2 * S, names=("a", "b", "c")),
            agent_batch(4, t0 + 3 * S, names=("a", "b", "c"))]
    want, got = fed(msgs, as_lean=False), fed(msgs, as_lean=True)
    assert snapshot(got) == snapshot(want)
    assert {s.name for s in got.nodes["n"].series.values()} == {"a", "b", "c"}
    assert got.nodes["n"].series[("c", (("device", "0"), ("vendor", "v")))].labels == {"device": "0", "vendor": "v"}


def test_a_histogram_sample_of_a_lean_batch_keeps_its_buckets():
    h = pb.Histogram(bounds=[1.0, 2.0], counts=[1, 2, 3], sum=4.0, count=6)
    s = pb.Sample(name="h", unit="s", kind=pb.HISTOGRAM, labels={"k": "v"}, histogram=h, time_unix_nano=S,
                  series_ref=1)
    m1 = pb.AgentMessage(batch=pb.Batch(node_id="n", boot_id="b1", seq=1, samples=[s]))
    s.time_unix_nano, s.histogram.sum = 2 * S, 9.0
    m2 = pb.AgentMessage(batch=pb.Batch(node_id="n", boot_id="b1", seq=2, samples=[s]))
    st = fed([m1, m2], as_lean=True)
    ser = next(iter(st.nodes["n"].series.values()))
    assert ser.histogram.sum == 9.0 and list(ser.histogram.counts) == [1, 2, 3]


def test_a_watcher_not_known_to_read_only_ids_and_events_gets_full_batches():
    seen_header, seen_other = [], []
    st = fed([agent_batch(1, S), agent_batch(2, 2 * S)], as_lean=True,
             watchers=[lambda n, b: seen_header.append(type(b))])
    # The first batch's series were new: it was read in full for them, and handed on so.
    assert st.lean_ok() and seen_header == [pb.Batch, LeanBatch]
    fed([agent_batch(1, S), agent_batch(2, 2 * S)], as_lean=True, header_only=False,
        watchers=[lambda n, b: seen_other.append((type(b), b.samples[0].name))])
    assert seen_other == [(pb.Batch, "a"), (pb.Batch, "a")]


def test_the_limits_read_names_and_labels_of_a_lean_batch_for_series_not_checked_yet():
    lim = Limits(clock=lambda: 0.0, max_label_value_len=3)
    st = FleetState()
    ok = lean(agent_batch(1, S)).batch   # label values "0" and "v": within 3 characters
    assert lim.check("n", ok, st, [r[0] for r in rows(ok)]) is None
    bad = agent_batch(2, 2 * S, names=("a", "b", "c"))
    bad.batch.samples[2].labels["vendor"] = "long"
    lb = lean(bad).batch
    v = lim.check("n", lb, st, [r[0] for r in rows(lb)])
    assert v is not None and v.key == "max_label_value_len"
