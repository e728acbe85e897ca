"""The compact encoding at rest (collector/store/defs.py): series tables logged in order
with the compact batches, a restart (log only, snapshot + log, a diff) holding exactly the points
the same samples sent as Sample messages give, segments before a checkpoint not needed, exporters'
readers handed samples. Real stores in tmp_path."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading

import pytest
from test_store_snapshot import T0, Live, picture, restart

from xpusense.collector.series_dictionary import SeriesDictionary
from xpusense.collector.store import StoreError, StoreReader, segments, stored_batches
from xpusense.collector.store.defs import Tables, expanded, read_table
from xpusense.collector.store.segment_file import Segment, frame, parse, scan
from xpusense.collector.store.snapshot_load import listed, records
from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

BOUNDS = [0.1, 1.0]


def defs(refs=(1, 2, 3)):
    """Series definitions (as the agent keeps them: no value, no time)."""
    out = {1: pb.Sample(name="x", unit="1", kind=pb.GAUGE, labels={"device": "0"}, series_ref=1),
           2: pb.Sample(name="c", unit="J", kind=pb.COUNTER, series_ref=2),
           3: pb.Sample(name="h", unit="s", kind=pb.HISTOGRAM, series_ref=3),
           4: pb.Sample(name="y", unit="W", kind=pb.GAUGE, labels={"device": "1"}, series_ref=4)}
    return [out[r] for r in refs]


def rows(seq, refs):
    """(ref, time, value, histogram) of one round: x and c (and y) at t, the histogram a moment later."""
    t = T0 + seq * 10**9
    out = {1: (1, t, seq * 1.5 + 0.1, None), 2: (2, t, seq * 100.0, None),
           3: (3, t + 1, seq * 0.5, (BOUNDS, [seq, 2 * seq, 3 * seq])), 4: (4, t, -seq / 3, None)}
    return [out[r] for r in refs]


def lone(seq):
    """A sample without a series ref (sent whole in either encoding)."""
    return pb.Sample(name="z", unit="1", kind=pb.GAUGE, value=seq * 7.0, time_unix_nano=T0 + seq * 10**9)


def sample_batch(node, boot, seq, refs=(1, 2, 3)):
    """The round as Sample messages."""
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq, sent_unix_nano=T0 + seq * 10**9)
    by_ref = {d.series_ref: d for d in defs((1, 2, 3, 4))}
    for ref, t, v, hist in rows(seq, refs):
        s = b.samples.add()
        s.CopyFrom(by_ref[ref])
        s.time_unix_nano, s.value = t, v
        if hist is not None:
            s.histogram.bounds.extend(hist[0])
            s.histogram.counts.extend(hist[1])
            s.histogram.sum, s.histogram.count = v, hist[1][-1]
    b.samples.append(lone(seq))
    return b


def compact_batch(node, boot, seq, refs=(1, 2, 3)):
    """The same round in the compact encoding."""
    rs = rows(seq, refs)
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq, sent_unix_nano=T0 + seq * 10**9,
                 columns=compact.encode_columns([r[:3] for r in rs], {i: r[3] for i, r in enumerate(rs) if r[3]}))
    b.samples.append(lone(seq))
    return b


def table(boot, refs):
    return pb.SeriesTable(boot_id=boot, defs=compact.encode_defs(defs(refs))).SerializeToString()


class Feed(Live):
    """Live, with series tables: added to the state's dictionary and logged, as ingest does."""

    def table(self, node, boot, refs):
        self.state.dictionary.add(node, boot, defs(refs))
        self.store.append_defs(node, table(boot, refs))

    async def send(self, b):
        """A batch of either encoding: stored as received, applied as its samples."""
        applied = expanded(b, self.state.dictionary)
        assert self.state.accept(applied, now_ns=b.sent_unix_nano) is not None
        fut = self.store.submit(["b", b.SerializeToString()])
        self.store.track(fut, b.node_id, b.boot_id, b.seq)
        await fut
        self.state.apply(applied)
        self.store.untrack(fut)


def run(path, make, snapshots=(), roll_at=()):
    """Node A boot a1: a table of refs 1-3, batches 1-6, a second table (ref 4), batches 7-10 with
    it; node B: batches 1-3. `make(node, boot, seq, refs)` builds each batch (either encoding; the
    tables only with the compact one, as an agent of today's version sends none).
    `snapshots`: after which A seqs a snapshot is taken ("full"/"diff"); `roll_at`: A seqs before
    which a new segment begins. Returns the live Feed."""
    live = Feed(path)
    tables = make is compact_batch

    async def go():
        live.hello("A", "a1", "host-a")
        live.hello("B", "b1", "host-b")
        if tables:
            live.table("A", "a1", (1, 2, 3))
            live.table("B", "b1", (1, 2))
        for s in range(1, 11):
            if s in roll_at:
                live.store.segment_bytes = 0
            if s == 7 and tables:
                live.table("A", "a1", (4,))
            await live.send(make("A", "a1", s, (1, 2, 3) if s < 7 else (1, 2, 3, 4)))
            live.store.segment_bytes = 10**12
            if s <= 3:
                await live.send(make("B", "b1", s, (1, 2)))
            for at, kind in snapshots:
                if at == s:
                    assert await live.snap.take("test", full=kind == "full") is not None
    asyncio.run(go())
    live.store.close()
    return live


def test_compact_store_replays_to_the_points_of_sample_messages(tmp_path):
    """Log only: the tables are replayed before the batches after them; every point (values, ns
    times, histograms, the sample without a ref) as from Sample messages."""
    run(tmp_path / "c", compact_batch)
    run(tmp_path / "s", sample_batch)
    fig_c, st_c = restart(tmp_path / "c")
    fig_s, st_s = restart(tmp_path / "s")
    assert fig_c["batches"] == fig_s["batches"] == 13 and fig_c["invalid_records"] == 0
    assert fig_c["series_tables"] == 3
    assert picture(st_c) == picture(st_s)
    h = st_c.history("A", "y", {"device": "1"})
    assert [(p.time_unix_nano, p.value) for p in h.points] == [(T0 + s * 10**9, -s / 3) for s in range(7, 11)]
    hist = next(s for s in st_c.view().nodes[0].series if s.name == "h")
    assert list(hist.histogram.counts) == [10, 20, 30] and hist.histogram.sum == 5.0
    assert len(st_c.history("A", "z", {}).points) == 10
    assert set(st_c.dictionary.boots) == {("A", "a1"), ("B", "b1")}
    # A table of a boot nothing else of is stored (no mark remembers it) is not kept past a restart.
    live = Feed(tmp_path / "c")

    async def table_only():
        live.table("A", "a0", (1, 2))
        await live.store.barrier()
    asyncio.run(table_only())
    live.store.close()
    fig, st = restart(tmp_path / "c")
    assert fig["series_tables"] > 3 and set(st.dictionary.boots) == {("A", "a1"), ("B", "b1")}
    # The log holds the compact bytes as received, and fewer of them.
    kept = [b for b in _logged_batches(tmp_path / "c") if b.node_id == "A"]
    assert all(b.columns and len(b.samples) == 1 for b in kept)
    assert _log_bytes(tmp_path / "c") < _log_bytes(tmp_path / "s")


def _logged_batches(path):
    out = []
    for _, p in segments(str(path)):
        with Segment(p) as seg:
            for span in seg.spans():
                rec = parse(span.payload)
                if rec[0] == "b":
                    out.append(pb.Batch.FromString(rec[1]))
    return out


def _log_bytes(path):
    return sum(os.path.getsize(p) for _, p in segments(str(path)))


def test_snapshot_and_diff_keep_the_dictionary(tmp_path):
    """A full snapshot after batch 3 and a diff after batch 8 (after the second table): the restart
    loads both and replays only the log after the diff, which needs ref 4 (defined before the
    diff, in the log before it): the diff carries it."""
    run(tmp_path / "c", compact_batch, snapshots=[(3, "full"), (8, "diff")])
    run(tmp_path / "s", sample_batch)
    fig, st = restart(tmp_path / "c")
    assert fig["snapshot_loaded"] == 1 and fig["snapshot_diff_loaded"] == 1
    assert fig["batches"] == 2 and fig["invalid_records"] == 0 and fig["series_tables"] == 0
    assert picture(st) == picture(restart(tmp_path / "s")[1])
    assert {ref for ref in st.dictionary.definitions("A", "a1")} == {1, 2, 3, 4}
    assert set(st.dictionary.definitions("B", "b1")) == {1, 2}


def test_a_diff_carries_only_the_definitions_changed_since_its_base(tmp_path):
    """Snapshots every few seconds must not write the whole dictionary again each time."""
    run(tmp_path / "c", compact_batch, snapshots=[(2, "full"), (4, "diff"), (8, "diff")])
    snaps = {os.path.basename(p): [r for r in records(p) if r[0] == "d"] for _, p in listed(str(tmp_path / "c" / "snapshots"))}
    full = next(v for k, v in snaps.items() if "-on-" not in k)
    assert sorted(node for r in full for node, _ in r[1]) == ["A", "B"]
    diffs = [v for k, v in sorted(snaps.items()) if "-on-" in k]
    assert len(diffs) == 2
    assert diffs[0] == []   # after A4: nothing defined since the base, no dictionary record at all
    assert [node for r in diffs[1] for node, _ in r[1]] == ["A"]   # after A8: A has ref 4 since; B as it was


def test_segments_before_a_checkpoint_are_not_needed(tmp_path):
    """A table is logged once; a new segment begins with every boot's definitions, so retention
    may delete the segment holding the table and the batches after it still replay."""
    run(tmp_path / "c", compact_batch, roll_at=(4, 8))
    run(tmp_path / "s", sample_batch, roll_at=(4, 8))
    segs = segments(str(tmp_path / "c"))
    assert len(segs) == 3
    os.unlink(segs[0][1])
    os.unlink(segments(str(tmp_path / "s"))[0][1])
    fig, st = restart(tmp_path / "c")
    assert fig["invalid_records"] == 0 and fig["batches"] == 7 + 0   # A 4-10; B's were all in the first
    assert picture(st) == picture(restart(tmp_path / "s")[1])


def test_readers_get_samples_and_skip_what_cannot_be_expanded(tmp_path, caplog):
    run(tmp_path / "c", compact_batch, roll_at=(6,))
    run(tmp_path / "s", sample_batch, roll_at=(6,))
    assert [b.SerializeToString() for b in stored_batches(str(tmp_path / "c"))] == \
        [b.SerializeToString() for b in stored_batches(str(tmp_path / "s"))]

    live = Feed(tmp_path / "c")
    r = StoreReader(live.store, "otlp")
    got, _ = r.read(max_batches=100)
    want = [sample_batch("A", "a1", s, (1, 2, 3) if s < 7 else (1, 2, 3, 4)) for s in range(1, 11)]
    want += [sample_batch("B", "b1", s, (1, 2)) for s in range(1, 4)]
    key = lambda b: (b.node_id, b.seq)   # noqa: E731
    assert sorted([b.SerializeToString() for b in got]) == sorted(b.SerializeToString() for b in want)
    assert sorted(map(key, got)) == sorted(map(key, want)) and r.unexpanded == 0

    # A cursor after the tables (as after a restart mid-segment): the live state's definitions.
    first_a = next(i for i, b in enumerate(got) if b.node_id == "A" and b.seq == 2)
    mid = StoreReader(live.store, "mid")
    mid.cursor = _position_of(tmp_path / "c", "A", 2)
    got2, _ = mid.read(max_batches=100)
    assert [b.SerializeToString() for b in got2] == [b.SerializeToString() for b in got[first_a:]]

    # Neither has a definition: not handed over, counted, said.
    live.state.dictionary.forget("A")
    alone = StoreReader(live.store, "alone")
    alone.cursor = _position_of(tmp_path / "c", "A", 2)
    with caplog.at_level(logging.WARNING, logger="xpusense.collector.store"):
        got3, _ = alone.read(max_batches=100)
    assert [(b.node_id, b.seq) for b in got3 if b.node_id == "A"] == [(("A", s)) for s in range(6, 11)]
    assert alone.unexpanded == 4 and live.store.stats()["reader_unexpanded_batches"] == 4
    assert "no definition for series_ref 1 of node 'A' boot 'a1'" in caplog.text
    live.store.close()


def _position_of(path, node, seq):
    """(segment, offset) of a batch's record."""
    for sid, p in segments(str(path)):
        with Segment(p) as seg:
            for span in seg.spans():
                rec = parse(span.payload)
                if rec[0] == "b":
                    b = pb.Batch.FromString(rec[1])
                    if (b.node_id, b.seq) == (node, seq):
                        return sid, span.start
    raise AssertionError("not found")


def test_a_batch_without_its_table_is_an_invalid_record_not_wrong_points(tmp_path):
    """A compact batch replayed with no definition for its refs is skipped and counted, its mark
    not taken (so a resend is stored)."""
    run(tmp_path / "c", compact_batch)
    (_, p), = segments(str(tmp_path / "c"))
    with Segment(p) as seg:
        at = [span.start for span in seg.spans() if parse(span.payload)[:2] == ["d", "B"]]
    raw = bytearray(open(p, "rb").read())
    raw[at[0] + 12] ^= 0xFF   # B's table damaged
    open(p, "wb").write(raw)
    fig, st = restart(tmp_path / "c")
    assert fig["damaged_ranges"] == 1 and fig["invalid_records"] == 3 and fig["batches"] == 10
    assert "B" not in st.nodes or st.nodes["B"].stored_up_to.get("b1", 0) == 0


def test_a_table_is_refused_when_the_store_holds_its_bound(tmp_path):
    live = Feed(tmp_path / "c")
    live.store.max_pending_bytes = 1

    async def go():
        live.store.append_nowait(["i", "A", "a1", b"x" * 10])   # held, not yet written
        with pytest.raises(StoreError, match="max_pending_bytes"):
            live.store.append_defs("A", table("a1", (1, 2, 3)))
    asyncio.run(go())
    assert live.store.refused_records == 1
    live.store.close()




def test_a_checkpoint_encodes_again_only_the_boots_defined_since():
    """A new segment begins with every boot's definitions: those unchanged since the last one are
    the same record, not encoded again on the event loop."""
    d = SeriesDictionary()
    d.add("A", "a1", defs((1, 2)))
    d.add("B", "b1", defs((1,)))
    t = Tables()
    first = t.records(t.take(d))
    d.add("A", "a1", defs((4,)))
    taken = t.take(d)
    assert [(n, b, c, x is None) for n, b, c, x in taken] == [("A", "a1", 3, False), ("B", "b1", 1, True)]
    second = t.records(taken)
    recs = [parse(s.payload) for s in scan(second, 0, len(second))]
    assert [(r[1], *read_table(r[1], r[2])) for r in recs] == [("A", "a1", defs((1, 2, 4))), ("B", "b1", defs((1,)))]
    frames = [[buf[s.start:s.end] for s in scan(buf, 0, len(buf))] for buf in (first, second)]
    assert frames[1][1] == frames[0][1] and frames[1][0] != frames[0][0]


def test_snapshots_of_compact_batches_are_no_larger_than_of_sample_messages(tmp_path):
    """The points are held the same either way; a full snapshot adds only the definitions (as
    compressed as on the wire), and a diff with no new definition adds nothing."""
    run(tmp_path / "c", compact_batch, snapshots=[(2, "full"), (4, "diff")])
    run(tmp_path / "s", sample_batch, snapshots=[(2, "full"), (4, "diff")])
    sizes = {}
    for enc in "cs":
        for _, p in listed(str(tmp_path / enc / "snapshots")):
            sizes[enc, "-on-" in p] = os.path.getsize(p)
    tables = len(table("a1", (1, 2, 3))) + len(table("b1", (1, 2)))
    assert sizes["s", False] < sizes["c", False] <= sizes["s", False] + tables + 64
    assert abs(sizes["c", True] - sizes["s", True]) <= 16


def test_a_compact_store_kept_on_disk_replays_and_reads_the_same(tmp_path):
    """tests/fixtures/ondisk/store-compact: series tables, compact batches in two segments (the
    second beginning with every boot's definitions), a full snapshot and a diff with the
    dictionary. Every later release must read it to the points of the Sample encoding."""
    data = tmp_path / "store"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "fixtures", "ondisk", "store-compact"), data)
    fig, st = restart(data)
    assert fig["snapshot_loaded"] == 1 and fig["snapshot_diff_loaded"] == 1
    assert fig["batches"] == 2 and fig["invalid_records"] == 0 and fig["damaged_ranges"] == 0
    run(tmp_path / "s", sample_batch)
    assert picture(st) == picture(restart(tmp_path / "s")[1])
    kinds = []
    for _, p in segments(str(data)):
        with Segment(p) as seg:
            for span in seg.spans():
                rec = parse(span.payload)
                kinds.append(rec[0])
                assert frame(rec) == seg.buf[span.start:span.end]
    assert kinds.count("d") == 3 + 2 and kinds.count("b") == 13
    want = [sample_batch("A", "a1", s, (1, 2, 3) if s < 7 else (1, 2, 3, 4)) for s in range(1, 11)]
    want += [sample_batch("B", "b1", s, (1, 2)) for s in range(1, 4)]
    assert sorted(b.SerializeToString() for b in stored_batches(str(data))) == \
        sorted(b.SerializeToString() for b in want)


def test_a_full_snapshot_encodes_again_only_the_definitions_given_since_the_last(tmp_path, monkeypatch):
    """Snapshots reuse the definitions they encoded while the dictionary holds the very same ones; a
    definition given again for a ref it holds (as many definitions as before) is encoded anew, and
    the restart has it."""
    encoded: list[int] = []
    encode = compact.encode_defs

    def counted(d):
        if threading.current_thread().name.startswith("store-snapshot"):
            encoded.append(len(d))
        return encode(d)
    monkeypatch.setattr(compact, "encode_defs", counted)
    live = Feed(tmp_path / "c")
    counts = []

    async def go():
        live.hello("A", "a1", "host-a")
        live.hello("B", "b1", "host-b")
        live.table("A", "a1", (1, 2, 3))
        live.table("B", "b1", (1, 2))
        await live.send(compact_batch("A", "a1", 1))
        await live.send(compact_batch("B", "b1", 1, (1, 2)))
        for seq in (2, 3):
            assert await live.snap.take("test", full=True) is not None
            counts.append(sorted(encoded))
            encoded.clear()
            await live.send(compact_batch("A", "a1", seq))
        again = pb.Sample(name="c", unit="kJ", kind=pb.COUNTER, series_ref=2)   # ref 2 of A given again, changed
        live.state.dictionary.add("A", "a1", [again])
        live.store.append_defs("A", pb.SeriesTable(boot_id="a1", defs=encode([again])).SerializeToString())
        await live.store.barrier()   # on disk before the snapshot: the restart reads it from the snapshot only
        assert await live.snap.take("test", full=True) is not None
        counts.append(sorted(encoded))
    asyncio.run(go())
    live.store.close()
    assert counts == [[2, 3], [], [3]]   # both boots; neither (the same ones); A's again
    fig, st = restart(tmp_path / "c")
    assert fig["snapshot_loaded"] == 1 and fig["batches"] == 0 and fig["series_tables"] == 0
    assert st.dictionary.definitions("A", "a1")[2].unit == "kJ" and len(st.dictionary.definitions("A", "a1")) == 3
    assert st.dictionary.definitions("B", "b1")[2].unit == "J"
