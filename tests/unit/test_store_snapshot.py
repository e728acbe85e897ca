"""Snapshots of the fleet state (collector/store/snapshot_load.py, snapshot_taker.py, fleet_image.py):
a restart loads the newest good one and replays only the log after it, and ends with the state a
full replay of the log gives; a damaged or partial snapshot is counted and ignored, with nothing
lost."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

from xpusense.collector.state import FleetState
from xpusense.collector.store import Store, segments
from xpusense.collector.store.snapshot_load import TMP_PREFIX, listed
from xpusense.collector.store.snapshot_taker import Snapshotter
from xpusense.v1 import telemetry_pb2 as pb

T0 = 1_700_000_000 * 10**9


def batch(node, boot, seq, events=()):
    t = T0 + seq * 10**9
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq, sent_unix_nano=t)
    b.samples.add(name="x", unit="1", kind=pb.GAUGE, value=seq * 1.5, time_unix_nano=t, labels={"device": "0"},
                  series_ref=1)
    b.samples.add(name="c", unit="J", kind=pb.COUNTER, value=seq * 100.0, time_unix_nano=t, series_ref=2)
    # a moment later (a time of its own): x and c come together and are held in columns (collector/columns.py)
    h = b.samples.add(name="h", unit="s", kind=pb.HISTOGRAM, time_unix_nano=t + 1, series_ref=3)
    h.histogram.count, h.histogram.sum = seq, seq * 0.5
    h.histogram.bounds.extend([0.1, 1.0])
    h.histogram.counts.extend([seq, 0, 0])
    for e in events:
        b.events.append(e)
    return b


def diagnosis(did, state, t):
    return pb.Event(type="diagnosis", time_unix_nano=T0 + t * 10**9, message=f"{did} {state}",
                    attributes={"diagnosis.id": did, "diagnosis.state": state, "diagnosis.rule": "cpu_starvation"})


class Live:
    """A store and a fleet state driven as the server drives them: accept, submit, track, durable,
    apply, untrack (collector/server.py)."""

    def __init__(self, path, every_s=3600.0):
        self.state = FleetState(clock=lambda: T0 + 10**12)
        self.store = Store(str(path), segment_bytes=10**12, segment_s=10**9)
        self.snap = Snapshotter(self.store, self.state, every_s, chunk_series=4)   # small chunks: many of them
        self.store.open(self.state)

    def hello(self, node, boot, host):
        inv = pb.Inventory(hostname=host)
        self.state.hello(pb.Hello(node_id=node, boot_id=boot, inventory=inv))
        self.store.append_nowait(["i", node, boot, inv.SerializeToString()])
        self.state.disconnected(node, boot)

    def submit(self, b):
        assert self.state.accept(b, now_ns=b.sent_unix_nano) is not None
        fut = self.store.submit(["b", b.SerializeToString()])
        self.store.track(fut, b.node_id, b.boot_id, b.seq)
        return fut

    def apply(self, b, fut):
        self.state.apply(b)
        self.store.untrack(fut)

    async def store_all(self, batches):
        for b in batches:
            fut = self.submit(b)
            await fut
            self.apply(b, fut)


def scenario(path, every_s=3600.0):
    """Two nodes, a histogram, a counter, events, diagnoses, a second boot; a snapshot taken while
    batch a1/7 is durable-to-be but not applied. Returns (batches in the tail after the snapshot,
    the snapshot's path)."""
    live = Live(path, every_s)

    async def go():
        live.hello("A", "a1", "host-a")
        live.hello("B", "b1", "host-b")
        await live.store_all([batch("A", "a1", s, [diagnosis("d1", "open", s)] if s == 3 else
                                    [diagnosis("d2", "open", s)] if s == 5 else []) for s in range(1, 7)])
        await live.store_all([batch("B", "b1", s, [pb.Event(type="xid", message=f"e{s}")]) for s in range(1, 6)])
        b7 = batch("A", "a1", 7)
        fut7 = live.submit(b7)                       # accepted, its mark raised, not applied yet
        path_ = await live.snap.take("test")
        await fut7
        live.apply(b7, fut7)
        await live.store_all([batch("A", "a1", s, [diagnosis("d1", "closed", s)] if s == 8 else [])
                              for s in range(8, 11)])
        live.hello("B", "b2", "host-b2")
        await live.store_all([batch("B", "b2", s) for s in range(1, 6)])
        return path_
    snap_path = asyncio.run(go())
    live.store.close()
    assert snap_path is not None and os.path.exists(snap_path)
    return 1 + 3 + 5, snap_path, live.state


def restart(path):
    st = FleetState(clock=lambda: T0 + 10**12)
    figures = Store(str(path)).open(st)
    return figures, st


def full_replay(path, tmp_path):
    """The same log replayed whole, without any snapshot."""
    copy = tmp_path / "full"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("snapshots"))
    return restart(copy)


def picture(st: FleetState) -> dict:
    """Everything a reader sees of the state: node views, every history point, marks, diagnoses."""
    out = {"known": dict(st.known_marks), "opened": dict(st.diagnoses.opened),
           "counts": (st.series_total, st.history_slots)}
    for n in st.view().nodes:
        n.last_seen_unix_nano = 0
        node = st.nodes[n.node_id]
        out[n.node_id] = {
            "view": n.SerializeToString(deterministic=True),
            "marks": list(node.stored_up_to.items()), "mark_at": dict(node.mark_at),
            "history": {(s.name, tuple(sorted(s.labels.items()))): [(p.time_unix_nano, p.value) for p in
                                                                    st.history(n.node_id, s.name, dict(s.labels)).points]
                        for s in n.series},
            "diagnoses": list(node.diagnoses), "boot": (node.boot_id, node.diagnoses_boot),
            "refs": {boot: {ref: (ser.name, tuple(sorted(ser.labels.items()))) for ref, ser in refs.items()}
                     for boot, refs in node.refs.items() if refs}}
    return out


def test_snapshot_and_tail_give_the_state_of_a_full_replay(tmp_path):
    tail, _, live = scenario(tmp_path / "d")
    figures, st = restart(tmp_path / "d")
    full_fig, full = full_replay(tmp_path / "d", tmp_path)
    assert figures["snapshot_loaded"] == 1 and figures["snapshot_damaged"] == 0
    assert figures["snapshot_nodes"] == 2
    # Only the log after the snapshot: batch a1/7 (accepted, not applied when it was taken) and on.
    assert figures["batches"] == tail and figures["duplicates"] == 0
    assert full_fig["batches"] == 10 + 5 + 5 and full_fig["snapshot_loaded"] == 0
    got, want = picture(st), picture(full)
    assert got == want
    a = want["A"]
    assert [t for t, _ in a["history"][("x", (("device", "0"),))]] == [T0 + s * 10**9 for s in range(1, 11)]
    assert a["marks"] == [("a1", 10)] and a["diagnoses"] == ["d2"]
    assert want["B"]["marks"] == [("b1", 5), ("b2", 5)] and want["B"]["boot"] == ("b2", "b2")
    assert picture(live)["A"]["history"] == a["history"]
    # After the restart a resend is still a duplicate and the next batch is new.
    assert st.accept(batch("A", "a1", 10)) is None and st.accept(batch("A", "a1", 11)) == 10


def test_segments_before_the_snapshot_are_not_needed(tmp_path):
    d = tmp_path / "d"
    live = Live(d)

    async def go():
        live.hello("A", "a1", "host-a")
        for s in range(1, 10):
            live.store.segment_bytes = 0          # every batch in a segment of its own
            await live.store_all([batch("A", "a1", s)])
        live.store.segment_bytes = 10**12
        path_ = await live.snap.take("test")
        await live.store_all([batch("A", "a1", s) for s in (10, 11)])
        return path_
    path_ = asyncio.run(go())
    live.store.close()
    full_fig, full = full_replay(d, tmp_path)
    covered = listed(str(d / "snapshots"))[0][0]
    gone = [p for sid, p in segments(str(d)) if sid < covered[0]]
    assert len(gone) >= 8 and path_
    for p in gone:
        os.unlink(p)
    figures, st = restart(d)
    assert figures["snapshot_loaded"] == 1 and figures["batches"] == 2 and figures["damaged_ranges"] == 0
    assert picture(st) == picture(full) and full_fig["batches"] == 11
    assert [p.value for p in st.history("A", "x", {"device": "0"}).points] == [s * 1.5 for s in range(1, 12)]


def _damage_and_check(tmp_path, damage):
    tail, snap_path, _ = scenario(tmp_path / "d")
    damage(snap_path)
    figures, st = restart(tmp_path / "d")
    _, full = full_replay(tmp_path / "d", tmp_path)
    assert figures["snapshot_damaged"] == 1 and figures["snapshot_loaded"] == 0
    assert figures["batches"] == 20                       # the whole log, every acknowledged batch
    assert picture(st) == picture(full)
    assert not os.path.exists(snap_path)                  # moved aside, not tried again
    assert os.listdir(tmp_path / "d" / "damaged") == [os.path.basename(snap_path)]


def test_flipped_bytes_in_a_snapshot_are_found_and_it_is_ignored(tmp_path):
    def flip(p):
        data = bytearray(open(p, "rb").read())
        mid = len(data) // 2
        data[mid:mid + 8] = bytes(x ^ 0xFF for x in data[mid:mid + 8])
        open(p, "wb").write(data)
    _damage_and_check(tmp_path, flip)


def test_a_cut_snapshot_is_found_and_ignored(tmp_path):
    def cut(p):
        data = open(p, "rb").read()
        open(p, "wb").write(data[:len(data) - 20])      # the end record's frame is cut
    _damage_and_check(tmp_path, cut)


def test_a_snapshot_cut_at_a_frame_boundary_is_found(tmp_path):
    from xpusense.collector.store.snapshot_load import records
    def cut(p):
        data = open(p, "rb").read()
        n = sum(1 for _ in records(p))                  # the frames before the end record
        assert n >= 3
        end = data.rindex(b"\xc1XR\x02")                # the end record's frame: gone whole
        open(p, "wb").write(data[:end])
    _damage_and_check(tmp_path, cut)


def test_a_partial_temp_file_is_removed_and_counted(tmp_path):
    tail, snap_path, _ = scenario(tmp_path / "d")
    tmp = os.path.join(os.path.dirname(snap_path), f"{TMP_PREFIX}snapshot-00000001-000000000999.snap.1")
    with open(snap_path, "rb") as f, open(tmp, "wb") as g:
        g.write(f.read()[:300])
    figures, st = restart(tmp_path / "d")
    _, full = full_replay(tmp_path / "d", tmp_path)
    assert figures["snapshot_damaged"] == 1 and figures["snapshot_loaded"] == 1 and figures["batches"] == tail
    assert not os.path.exists(tmp) and picture(st) == picture(full)


def test_a_damaged_newest_snapshot_falls_back_to_the_one_before(tmp_path):
    d = tmp_path / "d"
    live = Live(d)

    async def go():
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", s) for s in range(1, 4)])
        first = await live.snap.take("one")
        await live.store_all([batch("A", "a1", s) for s in range(4, 7)])
        second = await live.snap.take("two")
        await live.store_all([batch("A", "a1", s) for s in range(7, 9)])
        return first, second
    first, second = asyncio.run(go())
    live.store.close()
    assert [p for _, p in listed(str(d / "snapshots"))] == [second, first]
    with open(second, "r+b") as f:
        f.seek(40)
        f.write(b"\x00" * 16)
    figures, st = restart(d)
    _, full = full_replay(d, tmp_path)
    assert figures["snapshot_damaged"] == 1 and figures["snapshot_loaded"] == 1
    assert figures["batches"] == 5                        # the log after the first snapshot: 4..8
    assert picture(st) == picture(full)


def test_retention_keeps_what_no_snapshot_covers(tmp_path):
    """With snapshots on, a segment past the history kept is deleted only once the oldest snapshot
    kept covers it."""
    d = tmp_path / "d"
    live = Live(d)
    live.store.history_s, live.store.segment_s = 0.0, 0.0   # every closed segment is past the history at once

    async def go():
        live.hello("A", "a1", "host-a")
        for s in range(1, 6):
            live.store.segment_bytes = 0
            await live.store_all([batch("A", "a1", s)])
        old = time.time() - 3600
        for _, p in segments(str(d)):
            os.utime(p, (old, old))
        made = len(segments(str(d)))
        live.store._retire()
        before = len(segments(str(d)))
        assert made == before >= 5                    # nothing covered: nothing deleted
        await live.snap.take("one")
        await live.snap.take("two")                   # the floor: the older of the two kept
        return before
    before = asyncio.run(go())
    after = segments(str(d))
    live.store.close()
    floor = listed(str(d / "snapshots"))[-1][0]
    assert len(after) < before and all(sid >= floor[0] for sid, _ in after)
    figures, st = restart(d)
    assert figures["snapshot_loaded"] == 1
    assert [p.value for p in st.history("A", "x", {"device": "0"}).points] == [s * 1.5 for s in range(1, 6)]
