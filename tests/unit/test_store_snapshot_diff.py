"""Diffs and the snapshot format (version 4) (collector/store/fleet_image.py, snapshot_file.py,
snapshot_load.py): a restart from a full snapshot and a diff on it ends with the state a full replay
of the log gives; a damaged or unfitting diff falls back to its full snapshot (and a longer replay),
counted and logged; snapshots written by the versions before are still read; retention keeps what
fallbacks need."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil

import pytest
from test_store_snapshot import T0, Live, batch, diagnosis, full_replay, picture, restart

from xpusense.collector.columns import held
from xpusense.collector.state import FleetState
from xpusense.collector.store.segment_file import frame
from xpusense.collector.store.snapshot_file import entries
from xpusense.collector.store.snapshot_load import records
from xpusense.v1 import telemetry_pb2 as pb


def with_new_series(b):
    b.samples.add(name="y", unit="1", kind=pb.GAUGE, value=b.seq * 2.0, time_unix_nano=b.sent_unix_nano,
                  labels={"device": "1"}, series_ref=4)
    return b


def scenario(path, history_s=900.0, a_before=8, a_between=6):
    """A full snapshot, then: more batches on A (with diagnoses), a series new on B (B written whole
    in the diff), a node D new since, C unchanged; batch A/next accepted but not applied when the
    diff is taken; then a tail in the log only (A, and a second boot of B). Returns (live, full
    snapshot, diff, tail batches)."""
    live = Live(path)
    live.state.history_ns = int(history_s * 1e9)
    live.state.history_points = live.state.history_cap = int(history_s * 4) + 16
    a_end = a_before + a_between

    async def go():
        for node in "ABC":
            live.hello(node, f"{node.lower()}1", f"host-{node.lower()}")
        await live.store_all([batch("A", "a1", s) for s in range(1, a_before + 1)])
        await live.store_all([batch("B", "b1", s) for s in range(1, 6)])
        await live.store_all([batch("C", "c1", s) for s in range(1, 4)])
        full = await live.snap.take("full")
        await live.store_all([batch("A", "a1", s, [diagnosis("d1", "open", s)] if s == a_before + 2 else [])
                              for s in range(a_before + 1, a_end + 1)])
        await live.store_all([with_new_series(batch("B", "b1", s)) for s in range(6, 9)])
        live.hello("D", "d1", "host-d")
        await live.store_all([batch("D", "d1", s, [pb.Event(type="xid", message=f"e{s}")]) for s in range(1, 4)])
        b = batch("A", "a1", a_end + 1)
        fut = live.submit(b)
        diff = await live.snap.take("diff")
        await fut
        live.apply(b, fut)
        await live.store_all([batch("A", "a1", s) for s in range(a_end + 2, a_end + 4)])
        live.hello("B", "b2", "host-b2")
        await live.store_all([batch("B", "b2", s) for s in (1, 2)])
        return full, diff
    full, diff = asyncio.run(go())
    live.store.close()
    assert live.snap.last["snapshot_full"] == 0 and "-on-" in os.path.basename(diff)
    modes = {e[0]: e[10] for r in records(diff) if r[0] == "n" for e in r[1]}
    assert modes == {"A": "I", "B": "F", "C": "I", "D": "F"}   # B: a new series; D: a new node
    return live, full, diff, 3 + 2


def restart_with(path, history_s=900.0):
    st = FleetState(history_s=history_s, clock=lambda: T0 + 10**12)
    from xpusense.collector.store import Store
    return Store(str(path)).open(st), st


def full_replay_with(path, tmp_path, history_s=900.0):
    copy = tmp_path / "full"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("snapshots"))
    return restart_with(copy, history_s)


def test_full_and_diff_give_the_state_of_a_full_replay(tmp_path):
    live, _, _, tail = scenario(tmp_path / "d")
    figures, st = restart(tmp_path / "d")
    full_fig, full = full_replay(tmp_path / "d", tmp_path)
    assert figures["snapshot_loaded"] == 1 and figures["snapshot_diff_loaded"] == 1 and figures["snapshot_damaged"] == 0
    assert figures["batches"] == tail and figures["duplicates"] == 0 and figures["snapshot_nodes"] == 4
    assert full_fig["batches"] == 14 + 1 + 2 + 5 + 3 + 3 + 3 + 2
    got, want = picture(st), picture(full)
    assert got == want
    assert [t for t, _ in want["A"]["history"][("x", (("device", "0"),))]] == [T0 + s * 10**9 for s in range(1, 18)]
    assert ("y", (("device", "1"),)) in want["B"]["history"] and want["A"]["diagnoses"] == ["d1"]
    assert picture(live.state)["A"]["history"] == want["A"]["history"]
    assert got["A"]["refs"] == {"a1": {1: ("x", (("device", "0"),)), 2: ("c", ()), 3: ("h", ())}}
    assert set(got["B"]["refs"]["b1"]) == {1, 2, 3, 4}


def test_points_let_go_between_full_and_diff(tmp_path):
    """A short history: most points of the full snapshot are gone by the diff, and more were appended
    since than a series holds (the diff carries only the newest)."""
    live, _, _, tail = scenario(tmp_path / "d", history_s=4.0, a_before=30, a_between=25)
    figures, st = restart_with(tmp_path / "d", 4.0)
    _, full = full_replay_with(tmp_path / "d", tmp_path, 4.0)
    assert figures["snapshot_diff_loaded"] == 1 and figures["batches"] == tail
    assert picture(st) == picture(full)
    ts = held(st.nodes["A"].series[("x", (("device", "0"),))])[0]
    assert len(ts) < 10 and ts[-1] == T0 + 58 * 10**9   # of the 30 the full snapshot held, none


def test_history_shortened_by_the_memory_budget_between_full_and_diff(tmp_path):
    """[state] max_memory cuts every series' history (History.shrink) after the full snapshot: the
    diff says so, and the restart holds exactly the live state's points."""
    d = tmp_path / "d"
    live = Live(d)

    async def go():
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", s) for s in range(1, 101)])
        await live.snap.take("full")
        live.state.configure(max_memory=live.state.memory_bytes() - 50 * 17 * 3)
        assert live.state.history_cap < 100
        await live.store_all([batch("A", "a1", s) for s in range(101, 106)])
        await live.snap.take("diff")
    asyncio.run(go())
    live.store.close()
    figures, st = restart(d)
    assert figures["snapshot_diff_loaded"] == 1 and figures["batches"] == 0
    for key, ser in live.state.nodes["A"].series.items():
        got, live_ = held(st.nodes["A"].series[key]), held(ser)
        let_go = ser.history.dropped + (ser.frame.dropped if ser.frame is not None else 0)
        assert let_go > 0 and list(got[0]) == list(live_[0]) and list(got[1]) == list(live_[1])
    assert st.history_slots == live.state.history_slots
    assert picture(st)["A"]["refs"] == picture(live.state)["A"]["refs"] != {}   # from the snapshot: nothing replayed


def test_a_diff_holds_only_what_changed(tmp_path):
    d = tmp_path / "d"
    live = Live(d)
    live.snap.level = 0   # raw frames: the bytes are the points and rows written

    async def go():
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", s) for s in range(1, 301)])
        await live.snap.take("full")
        full = live.snap.last["snapshot_bytes"]
        await live.store_all([batch("A", "a1", s) for s in range(301, 304)])
        await live.snap.take("diff")
        return full, live.snap.last["snapshot_bytes"]
    full, diff = asyncio.run(go())
    live.store.close()
    assert live.snap.last["snapshot_full"] == 0 and diff * 10 < full   # 3 points of 303 a series, and the rest


def test_a_full_snapshot_again_once_diffs_have_grown(tmp_path):
    """The policy: a diff while the last one was under 1/DIFF_RATIO of the full one, then a full one."""
    from xpusense.collector.store.snapshot_taker import DIFF_RATIO
    d = tmp_path / "d"
    live = Live(d)

    async def go():
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", s) for s in range(1, 201)])
        kinds = []
        for k in range(12):
            await live.store_all([batch("A", "a1", s) for s in range(201 + 10 * k, 211 + 10 * k)])
            await live.snap.take("periodic")
            kinds.append((bool(live.snap.last["snapshot_full"]), live.snap.last["snapshot_bytes"]))
        return kinds
    kinds = asyncio.run(go())
    live.store.close()
    base, last_diff = None, 0
    for full, size in kinds:
        assert full == (base is None or last_diff * DIFF_RATIO >= base), kinds
        base, last_diff = (size, 0) if full else (base, size)
    assert sum(f for f, _ in kinds) >= 2 and sum(not f for f, _ in kinds) >= 4, kinds


def _damaged_diff(tmp_path, damage, caplog):
    live, full_path, diff_path, tail = scenario(tmp_path / "d")
    damage(diff_path)
    with caplog.at_level(logging.WARNING, logger="xpusense.collector.store"):
        figures, st = restart(tmp_path / "d")
    _, full = full_replay(tmp_path / "d", tmp_path)
    assert figures["snapshot_damaged"] == 1 and figures["snapshot_loaded"] == 1 and figures["snapshot_diff_loaded"] == 0
    assert figures["batches"] == 6 + 3 + 3 + 1 + 2 + 2          # the log after the full snapshot
    assert picture(st) == picture(full)
    assert not os.path.exists(diff_path) and os.listdir(tmp_path / "d" / "damaged") == [os.path.basename(diff_path)]
    assert f"store snapshot {diff_path} is damaged" in caplog.text


def test_flipped_bytes_in_a_diff_fall_back_to_its_full_snapshot(tmp_path, caplog):
    def flip(p):
        data = bytearray(open(p, "rb").read())
        at = len(data) * 2 // 3
        data[at:at + 4] = bytes(x ^ 0x5A for x in data[at:at + 4])
        open(p, "wb").write(data)
    _damaged_diff(tmp_path, flip, caplog)


def test_a_cut_diff_falls_back_to_its_full_snapshot(tmp_path, caplog):
    _damaged_diff(tmp_path, lambda p: os.truncate(p, os.path.getsize(p) - 7), caplog)


@pytest.mark.parametrize("where", ["history", "frame"])
def test_a_diff_that_does_not_fit_its_full_snapshot_is_not_kept(tmp_path, caplog, where):
    """Points let go behind History.dropped's back, or rows behind Frame.dropped's (what a miscount
    would do): the diff reads back whole but its points do not follow on from the full snapshot's;
    found, counted, and the full snapshot is loaded again without it."""
    def drop_uncounted(live):
        node = live.state.nodes["A"]
        if where == "history":   # h, a histogram, is on its own
            h = node.series[("h", ())].history
            del h.t[:2]
            del h.v[:2]
        else:                    # x and c are held in columns
            [f] = node.frames.values()
            del f.t[:2]
            del f.v[:2 * f.k]
    d = tmp_path / "d"
    live = Live(d)

    async def go():
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", s) for s in range(1, 9)])
        await live.snap.take("full")
        await live.store_all([batch("A", "a1", s) for s in range(9, 12)])
        drop_uncounted(live)
        return await live.snap.take("diff")
    diff = asyncio.run(go())
    live.store.close()
    with caplog.at_level(logging.WARNING, logger="xpusense.collector.store"):
        figures, st = restart(d)
    _, full = full_replay(d, tmp_path)
    assert figures["snapshot_damaged"] == 1 and figures["snapshot_diff_loaded"] == 0 and figures["batches"] == 3
    assert picture(st) == picture(full) and "do not follow on" in caplog.text and not os.path.exists(diff)


def test_a_damaged_full_snapshot_is_not_saved_by_its_diff(tmp_path):
    live, full_path, diff_path, tail = scenario(tmp_path / "d")
    with open(full_path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    figures, st = restart(tmp_path / "d")
    _, full = full_replay(tmp_path / "d", tmp_path)
    assert figures["snapshot_damaged"] == 1 and figures["snapshot_loaded"] == 0
    assert figures["batches"] == 14 + 1 + 2 + 5 + 3 + 3 + 3 + 2    # the whole log
    assert picture(st) == picture(full)
    assert not os.path.exists(diff_path)                            # no full snapshot kept for it: removed


def test_a_diff_on_a_full_snapshot_rewritten_at_its_position_is_not_applied(tmp_path):
    d = tmp_path / "d"
    live = Live(d)

    async def go():
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", s) for s in range(1, 6)])
        await live.snap.take("full")
        diff = await live.snap.take("diff", full=False)
        kept = open(diff, "rb").read()
        await live.snap.take("again", full=True)       # the same position: it replaces the first
        assert not os.path.exists(diff)                 # and its diffs go with it
        open(diff, "wb").write(kept)                    # ...unless a crash came between
        return diff
    diff = asyncio.run(go())
    live.store.close()
    figures, st = restart(d)
    assert figures["snapshot_loaded"] == 1 and figures["snapshot_diff_loaded"] == 0 and figures["snapshot_damaged"] == 0
    assert [p.value for p in st.history("A", "x", {"device": "0"}).points] == [s * 1.5 for s in range(1, 6)]
    assert not os.path.exists(diff)                     # of no use: removed


def test_retention_keeps_full_snapshots_and_the_diffs_fallbacks_need(tmp_path):
    d = tmp_path / "d"
    live = Live(d)
    kinds = [True, False, False, False, True, False, True, False, False, False]

    async def go():
        live.hello("A", "a1", "host-a")
        made = []
        for s, full in enumerate(kinds, 1):
            await live.store_all([batch("A", "a1", s)])
            made.append(await live.snap.take("t", full=full))
        return made
    made = asyncio.run(go())
    live.store.close()
    kept = [e.path for e in entries(str(d / "snapshots"))]
    # the two newest full ones; of the newest the two newest diffs; of the one before its newest diff
    assert kept == [made[9], made[8], made[6], made[5], made[4]]
    assert live.store.snapshot_floor == entries(str(d / "snapshots"))[-1].pos
    figures, st = restart(d)
    assert figures["snapshot_diff_loaded"] == 1 and figures["batches"] == 0
    assert [p.value for p in st.history("A", "x", {"device": "0"}).points] == [s * 1.5 for s in range(1, 11)]


def write_v1(path, state, pos):
    """A snapshot as the version before wrote it (a msgpack list a node, history bytes inside)."""
    recs = [["h", 1, pos[0], pos[1], 0],
            ["f", [[[nid, b, q] for (nid, b), q in state.known_marks.items()], dict(state.counters), {}]]]
    nodes = []
    for n in state.nodes.values():
        series = [[s.name, s.unit, s.kind, s.labels, s.value, s.time_ns, s.prev_value, s.prev_time_ns,
                   s.histogram.SerializeToString() if s.histogram is not None else None,
                   held(s)[0].tobytes(), held(s)[1].tobytes(), -1, 0]
                  for s in n.series.values()]
        nodes.append([n.node_id, n.boot_id, n.last_seen_ns, n.inventory.SerializeToString(),
                      [[b, q, n.mark_at.get(b, 0)] for b, q in n.stored_up_to.items()], n.batches_stored,
                      n.batches_duplicate, [e.SerializeToString() for e in n.events],
                      [[k, e.SerializeToString()] for k, e in n.diagnoses.items()], n.diagnoses_boot, series])
    recs.append(["n", nodes])
    with open(path, "wb") as f:
        f.write(b"XPSSNP\x00\x01")
        for r in recs:
            f.write(frame(r))
        f.write(frame(["e", len(nodes), len(recs)]))


def five_then_a_snapshot_then_two(d, columns: bool = True) -> str:
    """Node A: five batches, a snapshot (its path is returned), two more batches."""
    live = Live(d)
    live.state.columns = columns

    async def go():
        live.hello("A", "a1", "host-a")
        await live.store_all([batch("A", "a1", s) for s in range(1, 6)])
        p = await live.snap.take("test")
        await live.store_all([batch("A", "a1", s) for s in range(6, 8)])
        return p
    p = asyncio.run(go())
    live.store.close()
    return p


def test_a_version_1_snapshot_is_still_loaded(tmp_path):
    d = tmp_path / "d"
    p = five_then_a_snapshot_then_two(d)
    pos = entries(str(d / "snapshots"))[0].pos
    os.unlink(p)
    b = FleetState(clock=lambda: T0 + 10**12)
    for s in range(1, 6):
        b.ingest(batch("A", "a1", s), now_ns=batch("A", "a1", s).sent_unix_nano)
    b.nodes["A"].inventory.hostname = "host-a"
    write_v1(p, b, pos)
    assert [r[0] for r in records(p)] == ["f", "n"]
    figures, st = restart(d)
    _, full = full_replay(d, tmp_path)
    assert figures["snapshot_loaded"] == 1 and figures["snapshot_damaged"] == 0 and figures["batches"] == 2
    assert picture(st)["A"]["history"] == picture(full)["A"]["history"]


def test_a_version_2_snapshot_is_still_loaded(tmp_path, monkeypatch):
    """Version 2 (before frames were written): a node's entry has no frames, its series hold all
    their points; loaded as such, the series on their own."""
    from xpusense.collector.store import fleet_image, snapshot_file
    capture = fleet_image.capture
    monkeypatch.setattr(snapshot_file, "VERSION", 2)
    monkeypatch.setattr(fleet_image, "capture", lambda *a: capture(*a)[:14])
    d = tmp_path / "d"
    p = five_then_a_snapshot_then_two(d, columns=False)   # no frames: what version 2 wrote
    from xpusense.collector.store.snapshot_file import Reader
    with Reader(p) as r:
        assert r.version == 2 and all(len(e) == 14 for rec, _ in r.records() if rec[0] == "n" for e in rec[1])
    monkeypatch.undo()
    figures, st = restart(d)
    _, full = full_replay(d, tmp_path)
    assert figures["snapshot_loaded"] == 1 and figures["snapshot_damaged"] == 0 and figures["batches"] == 2
    assert picture(st) == picture(full)


def test_history_bytes_are_outside_the_msgpack_records(tmp_path):
    """A node record's history is the frame's blob (read with array.frombytes from the mapped file),
    a node's series that share their times have them written once, and (version 3) a frame's rows
    are written as it holds them: one run of times, the values row by row."""
    from xpusense.collector.store.snapshot_file import Reader
    live, full_path, _, _ = scenario(tmp_path / "d")
    with Reader(full_path) as r:
        assert r.version == 4
        found = [(rec, len(blob)) for rec, blob in r.records() if rec[0] == "n" and rec[1][0][0] == "A"]
    [(rec, blob_bytes)] = found
    entry = rec[1][0]
    # x and c: their first point on their own (the frame formed at the second batch), then 7 rows
    # of the frame; h (a histogram) on its own, 8 points
    assert entry[10] == "F" and entry[11] == [1, 8, 7]
    assert [s[0] for s in entry[12]] == ["x", "c", "h"] and [s[12] for s in entry[12]] == [1, 1, 8]
    assert [s[11] for s in entry[12]] == [0, 0, 1]
    assert all(not isinstance(x, bytes) for s in entry[12] for i, x in enumerate(s) if i != 8)   # 8: the histogram
    [(key, members, run, rows, *_)] = entry[14]
    assert key == ["a1", 1, 2] and members == [0, 1] and run == 2 and rows == 7
    assert blob_bytes == (1 + 8 + 7) * 8 + (1 + 1 + 8) * 8 + 7 * 2 * 8   # runs, own values, rows
