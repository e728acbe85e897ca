"""The bytes the store writes (collector/store/): snapshot frames zstd-compressed and read back to
the same state, a compressed frame that does not decompress found damaged, a series new since the
full snapshot written alone in a diff (not its node whole), and the counters of bytes written to
the log and to snapshots."""

from __future__ import annotations

import asyncio
import os
import shutil

from helpers import until
from test_store_snapshot import Live, batch, full_replay, picture, restart

from xpusense.collector.store import snapshot_file
from xpusense.collector.store.segment_file import RECORD_MAGIC
from xpusense.collector.store.snapshot_file import Damaged, Reader
from xpusense.collector.store.snapshot_load import records
from xpusense.common import framing
from xpusense.v1 import telemetry_pb2 as pb


def with_z(b):
    """A batch with one more series, "z" (a histogram: never held in columns with others)."""
    h = b.samples.add(name="z", unit="s", kind=pb.HISTOGRAM, time_unix_nano=b.sent_unix_nano + 2, series_ref=5)
    h.histogram.count, h.histogram.sum = b.seq, b.seq * 0.25
    h.histogram.bounds.extend([1.0])
    h.histogram.counts.extend([b.seq, 1])
    return b


def run(d, level: int, steps) -> tuple[Live, list[str]]:
    """A Live store at zstd `level`; `steps`: (batches, snapshot kind or None) in turn; the paths."""
    live = Live(d)
    live.snap.level = level
    paths = []

    async def go():
        live.hello("A", "a1", "host-a")
        for batches, kind in steps:
            await live.store_all(batches)
            if kind:
                paths.append(await live.snap.take(kind, full=kind == "full"))
    asyncio.run(go())
    live.store.close()
    return live, paths


def test_compressed_snapshots_are_a_fraction_of_raw_and_restore_exactly(tmp_path):
    steps = [([batch("A", "a1", s) for s in range(1, 301)], "full"), ([batch("A", "a1", s) for s in range(301, 331)],
                                                                       "diff"), ([batch("A", "a1", 331)], None)]
    raw_live, raw = run(tmp_path / "raw", 0, steps)
    z_live, z = run(tmp_path / "z", 1, steps)
    raw_bytes = [os.path.getsize(p) for p in raw]
    z_bytes = [os.path.getsize(p) for p in z]
    assert z_bytes[0] * 3 < raw_bytes[0] and z_bytes[1] * 2 < raw_bytes[1], (z_bytes, raw_bytes)
    assert z_live.snap.bytes_written == sum(z_bytes)
    for p in z:
        with Reader(p) as r:
            assert r.version == 4
    figures, st = restart(tmp_path / "z")
    _, full = full_replay(tmp_path / "z", tmp_path)
    assert figures["snapshot_loaded"] == 1 and figures["snapshot_diff_loaded"] == 1 and figures["batches"] == 1
    assert picture(st) == picture(full) and picture(st)["A"] == picture(z_live.state)["A"]
    _, st_raw = restart(tmp_path / "raw")
    assert picture(st_raw) == picture(st)


def _rewrite_frame(path: str, index: int, payload: bytes) -> None:
    """Frame `index` (0: the header) of a snapshot replaced by one with `payload` and a good checksum."""
    raw = open(path, "rb").read()
    head = len(snapshot_file.MAGIC) + 1
    frames = list(framing.scan(raw, head, len(raw), RECORD_MAGIC, 2**31))
    out = [raw[:head]] + [framing.encode(RECORD_MAGIC, payload if i == index else bytes(f.payload))
                          for i, f in enumerate(frames)]
    with open(path, "wb") as f:
        f.write(b"".join(out))


def test_a_compressed_frame_that_does_not_decompress_is_damaged_and_the_log_replayed(tmp_path):
    d = tmp_path / "d"
    live, [p] = run(d, 1, [([batch("A", "a1", s) for s in range(1, 6)], "full"), ([batch("A", "a1", 6)], None)])
    _rewrite_frame(p, 2, bytes([snapshot_file.ZSTD]) + b"not a zstd frame")   # 0: header, 1: "f", 2: "n"
    try:
        list(records(p))
        raise AssertionError("read whole")
    except Damaged as e:
        assert "content size" in str(e), e
    figures, st = restart(d)
    _, full = full_replay(d, tmp_path)
    assert figures["snapshot_damaged"] == 1 and figures["snapshot_loaded"] == 0 and figures["batches"] == 6
    assert picture(st) == picture(full)


def test_a_frame_of_an_unknown_codec_is_damaged(tmp_path):
    live, [p] = run(tmp_path / "d", 1, [([batch("A", "a1", 1)], "full")])
    _rewrite_frame(p, 1, bytes([7]) + b"\x00" * 8)
    try:
        list(records(p))
        raise AssertionError("read whole")
    except Damaged as e:
        assert "codec 7" in str(e), e


def test_a_series_new_since_the_full_snapshot_is_written_alone_in_the_diff(tmp_path):
    d = tmp_path / "d"
    live, [full, diff] = run(d, 0, [([batch("A", "a1", s) for s in range(1, 201)], "full"),
                                    ([with_z(batch("A", "a1", s)) for s in range(201, 204)], "diff"),
                                    ([with_z(batch("A", "a1", 204))], None)])
    [entry] = [e for rec in records(diff) if rec[0] == "n" for e in rec[1]]
    assert entry[10] == "I" and len(entry[12]) == 3 and [g[0] for g in entry[15]] == ["z"]
    assert [g[12] for g in entry[15]] == [3]                   # its three points, whole
    assert os.path.getsize(diff) * 5 < os.path.getsize(full)  # not the node's 200 points again
    figures, st = restart(d)
    _, whole = full_replay(d, tmp_path)
    assert figures["snapshot_diff_loaded"] == 1 and figures["batches"] == 1
    assert picture(st) == picture(whole) and picture(st)["A"] == picture(live.state)["A"]


def test_the_store_counts_the_bytes_it_writes_to_the_log(tmp_path):
    d = tmp_path / "d"
    live, _ = run(d, 1, [([batch("A", "a1", s) for s in range(1, 11)], None)])
    logs = sum(os.path.getsize(d / n) for n in os.listdir(d) if n.endswith(".log"))
    stats = live.store.stats()
    assert logs > 0 and stats["log_bytes_written"] == logs
    assert stats["snapshot_bytes_written"] == 0


def test_a_period_writes_a_snapshot_only_once_enough_records_were_logged_since_the_last(tmp_path):
    """snapshot_after_records: a small fleet's periods pass without rewriting its history; the
    snapshot comes once the log holds that many records after the last one."""
    live = Live(tmp_path / "d")
    snap = live.snap
    snap.every_s, snap.after_records, snap.max_s = 0.02, 6, 3600.0

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(snap.run(stop))
        await until(lambda: snap.periods, "the first period")                # (counts from its start)
        live.hello("A", "a1", "host-a")                                       # 1 record
        await live.store_all([batch("A", "a1", s) for s in range(1, 4)])     # 4
        seen = snap.periods
        await until(lambda: snap.periods >= seen + 5, "five periods")
        assert snap.written == 0 and snap.skipped >= 5
        await live.store_all([batch("A", "a1", s) for s in range(4, 6)])     # 6
        await until(lambda: snap.written == 1, "a snapshot")
        seen = snap.periods
        await until(lambda: snap.periods >= seen + 5, "five periods more")
        assert snap.written == 1                                              # nothing new since
        stop.set()
        await task
    asyncio.run(go())
    live.store.close()
    assert live.store.stats()["snapshot_periods_skipped"] >= 10


def test_a_period_writes_a_snapshot_once_the_last_is_max_s_old_if_anything_is_new(tmp_path):
    live = Live(tmp_path / "d")
    snap = live.snap
    snap.every_s, snap.after_records, snap.max_s = 0.02, 10**9, 0.1

    async def go():
        stop = asyncio.Event()
        task = asyncio.create_task(snap.run(stop))
        seen = snap.periods
        await until(lambda: snap.periods >= seen + 10, "ten periods")
        assert snap.written == 0                                              # nothing logged: no snapshot
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", 1)])
        await until(lambda: snap.written == 1, "a snapshot")
        stop.set()
        await task
    asyncio.run(go())
    live.store.close()
    figures, st = restart(tmp_path / "d")
    assert figures["snapshot_loaded"] == 1 and figures["batches"] == 0


def test_version_4_snapshots_kept_on_disk_load_as_the_version_3_ones_they_were_written_from(tmp_path):
    """tests/fixtures/ondisk/snapshots-v4: store-compact's full snapshot and diff written again as
    version 4 (zstd frames; same ids, positions, records). Every later release must load them."""
    fixtures = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ondisk")
    v3, v4 = tmp_path / "v3", tmp_path / "v4"
    shutil.copytree(os.path.join(fixtures, "store-compact"), v3)
    shutil.copytree(os.path.join(fixtures, "store-compact"), v4, ignore=shutil.ignore_patterns("*.snap"))
    for name in os.listdir(os.path.join(fixtures, "snapshots-v4")):
        shutil.copy(os.path.join(fixtures, "snapshots-v4", name), v4 / "snapshots" / name)
    assert sorted(os.listdir(v4 / "snapshots")) == sorted(os.listdir(v3 / "snapshots"))
    for name in os.listdir(v4 / "snapshots"):
        with Reader(str(v4 / "snapshots" / name)) as r:
            assert r.version == 4
        raw = open(v4 / "snapshots" / name, "rb").read()
        head = len(snapshot_file.MAGIC) + 1
        codecs = [bytes(f.payload)[0] for f in framing.scan(raw, head, len(raw), RECORD_MAGIC, 2**31)]
        assert codecs[0] == snapshot_file.RAW and set(codecs[1:]) == {snapshot_file.ZSTD}
    fig3, st3 = restart(v3)
    fig4, st4 = restart(v4)
    assert fig4["snapshot_loaded"] == 1 and fig4["snapshot_diff_loaded"] == 1 and fig4["snapshot_damaged"] == 0
    assert fig4["batches"] == fig3["batches"] == 2
    assert picture(st4) == picture(st3)
