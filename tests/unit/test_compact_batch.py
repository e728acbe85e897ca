"""A batch in the compact encoding as the collector reads it (collector/wire.py compact_batch): the
fleet state holds exactly the points, times and histograms the same samples give as Sample messages;
a ref with no definition or columns that do not decode are refused, never read as something else."""

from __future__ import annotations

import pytest
from compact_support import S, as_compact, rounds

from xpusense.collector.batch_rows import BatchRows
from xpusense.collector.series_dictionary import MissingDefinition, SeriesDictionary
from xpusense.collector.state import MAX_BOOTS_REMEMBERED, FleetState
from xpusense.collector.wire import CompactBatch, compact_batch
from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb


def held(st: FleetState) -> dict:
    """Every series' unit, latest value, time, histogram and whole history."""
    out = {}
    for n in st.view().nodes:
        for s in n.series:
            key = (n.node_id, s.name, tuple(sorted(s.labels.items())))
            h = st.history(n.node_id, s.name, dict(s.labels))
            out[key] = (s.unit, s.kind, s.value, s.time_unix_nano, s.histogram.SerializeToString(),
                        [(p.time_unix_nano, p.value) for p in h.points])
    return out


def test_compact_batches_hold_exactly_the_points_of_sample_messages():
    full, small = FleetState(), FleetState()
    for b in rounds():
        assert full.ingest(b, wire=b.SerializeToString())
        cb, defs = as_compact(b)
        small.dictionary.add("n1", "boot-1", defs)
        got = compact_batch(cb, small.dictionary)
        assert got.__class__ is CompactBatch and got.seq == b.seq and got.node_id == "n1"
        assert small.accept(got) is not None
        small.apply(got, BatchRows(got, cb.SerializeToString()))
    want = held(full)
    assert len(want) == 9 and held(small) == want
    assert [e.id for e in small.nodes["n1"].events if e.type == "health"] == ["e2"]
    hist = next(v for k, v in want.items() if k[1] == "tcp_rtt")
    assert hist[4] and pb.Histogram.FromString(hist[4]).counts == [1, 3, 5]


def test_expanded_samples_are_those_the_sample_encoding_carried():
    d = SeriesDictionary()
    for b in rounds():
        cb, defs = as_compact(b)
        d.add("n1", "boot-1", defs)
        got = compact_batch(cb, d)
        want = sorted(b.samples, key=lambda s: (s.series_ref == 0, s.series_ref))
        assert list(got.samples) == want
        assert [got.samples[i] for i in range(len(want))] == want and got.samples[-1] == want[-1]
        assert list(BatchRows(got).rows()) == [(s.series_ref, s.time_unix_nano, s.value) for s in want]
        assert list(compact.expand(cb, compact.decode_columns(cb.columns, 100), d.definitions("n1", "boot-1")).samples) \
            == want


def test_the_usual_round_is_read_as_columns_for_the_fast_path():
    cb, defs = as_compact(rounds()[0])
    d = SeriesDictionary()
    d.add("n1", "boot-1", defs)
    read = BatchRows(compact_batch(cb, d), cb.SerializeToString())
    assert read.refs == (1, 2, 3, 4) and read.time == 1_000 * S + 123 and read.rising
    assert read.rows() == [(r, 1_000 * S + 123, 0.25 * (r - 1)) for r in (1, 2, 3)] + [(4, 1_000 * S + 123, 300.5)]


def test_a_ref_without_definition_is_refused_naming_it():
    b = rounds()[0]
    cb, defs = as_compact(b)
    d = SeriesDictionary()
    d.add("n1", "boot-1", defs[:2])
    with pytest.raises(MissingDefinition, match="series_ref 3 of node 'n1' boot 'boot-1'"):
        compact_batch(cb, d)
    d.add("n1", "other-boot", defs)   # another boot's definitions do not count
    with pytest.raises(MissingDefinition, match="series_ref 3"):
        compact_batch(cb, d)


def test_columns_that_do_not_decode_are_refused():
    cb, defs = as_compact(rounds()[0])
    d = SeriesDictionary()
    d.add("n1", "boot-1", defs)
    cb.columns = cb.columns[:-3]
    with pytest.raises(compact.CompactError, match="cut short"):
        compact_batch(cb, d)
    cb.columns = b"not zlib"
    with pytest.raises(compact.CompactError, match="do not inflate"):
        compact_batch(cb, d)
    many = pb.Batch(node_id="n1", boot_id="boot-1", seq=1,
                    columns=compact.encode_columns([(1, 1, 0.0)] * 11))
    with pytest.raises(compact.CompactError):
        compact_batch(many, d, max_samples=10)


def test_a_round_like_the_last_reuses_its_refs_but_never_past_their_definitions():
    d = SeriesDictionary()
    first, defs = as_compact(rounds()[0])
    later, _ = as_compact(rounds(t0=2_000 * S)[4])   # refs 1-4 and 7: encoded otherwise
    again, _ = as_compact(rounds(t0=3_000 * S)[0])   # refs 1-4 again, other times and values
    d.add("n1", "boot-1", defs)
    a = compact_batch(first, d)
    b = compact_batch(again, d)
    assert b.columns[0] is a.columns[0] and b.columns[1] == 3_000 * S   # the same refs, taken as they are
    assert list(b.samples) == sorted(rounds(t0=3_000 * S)[0].samples, key=lambda s: s.series_ref)
    with pytest.raises(MissingDefinition, match="series_ref 7"):
        compact_batch(later, d)
    d.forget("n1", "boot-1")   # the boot forgotten: its refs are checked again, and refused
    with pytest.raises(MissingDefinition, match="series_ref 1"):
        compact_batch(again, d)
    d.add("n1", "boot-1", defs)
    compact_batch(first, d)
    d.boots.clear()   # definitions replaced wholesale (a snapshot loaded): the refs are checked again
    d.add("n1", "boot-1", defs[:2])
    with pytest.raises(MissingDefinition, match="series_ref 3"):
        compact_batch(again, d)


def test_decoding_after_another_block_reads_each_block_alone():
    blocks = [compact.encode_columns(rows) for rows in (
        [(1, 5, 1.0), (2, 5, 2.0)], [(1, 7, 3.0), (2, 7, 4.0)], [(2, 9, 5.0), (1, 8, 6.0)],
        [(2**32 - 1, -(2**63), 7.0), (3, 2**63 - 1, 8.0)], [])]
    for last in blocks:
        for data in blocks:
            alone = compact.decode_columns(data, 10)
            got = compact.decode_columns(data, 10, compact.decode_columns(last, 10))
            assert (got.refs, got.times, got.values, got.rising, got.time) == \
                (alone.refs, alone.times, alone.values, alone.rising, alone.time)
    assert compact.decode_columns(blocks[2], 10).refs == (2, 1)
    assert compact.decode_columns(blocks[3], 10).times == [-(2**63), 2**63 - 1]


def test_tables_of_made_up_boots_are_let_go_as_their_marks_are():
    st = FleetState()
    st.hello(pb.Hello(node_id="n1", boot_id="live"))
    _, defs = as_compact(rounds()[0])
    for k in range(50):
        st.define("n1", f"made-up-{k}", defs)
    st.define("n1", "live", defs)
    boots = {b for (n, b) in st.dictionary.boots if n == "n1"}
    assert "live" in boots and "made-up-49" in boots and len(boots) <= MAX_BOOTS_REMEMBERED
    assert boots <= set(st.nodes["n1"].stored_up_to)
