"""The collector's durable store: group commit, replay, damage found at start, a failing disk,
readers with durable cursors. Real stores in tmp_path; the failing disk here is injected at the
write call (tests/e2e/test_faults_store.py fills a real tmpfs)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import struct
import time

import msgpack
import pytest
from helpers import record_figure
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpusense.collector.state import FleetState
from xpusense.collector.store import Store, StoreError, StoreMetrics, StoreReader, segments, stored_batches
from xpusense.collector.store.segment_file import RECORD_MAGIC, SEGMENT_MAGIC, Segment, frame, scan
from xpusense.v1 import telemetry_pb2 as pb


def batch(node, boot, seq, value):
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq, sent_unix_nano=seq * 10**9)
    b.samples.add(name="x", unit="1", kind=pb.GAUGE, value=value, time_unix_nano=seq * 10**9, series_ref=1)
    return b


async def store_all(store, state, batches):
    for b in batches:
        if state.accept(b) is not None:
            await store.append(["b", b.SerializeToString()])
            state.apply(b)


def write_store(path, n, per_segment=0, node="n", boot="b1", value=lambda s: s * 0.37):
    """A real store of `n` acknowledged batches (awaited: durable), `per_segment` batches per
    segment (0: one segment). Returns {seq: value}."""
    st_ = FleetState()
    store = Store(str(path), segment_bytes=10**12, segment_s=10**9)
    store.open(st_)

    async def go():
        st_.hello(pb.Hello(node_id=node, boot_id=boot, inventory=pb.Inventory(hostname="h")))
        store.append_nowait(["i", node, boot, pb.Inventory(hostname="h").SerializeToString()])
        for s in range(1, n + 1):
            if per_segment and s > 1 and (s - 1) % per_segment == 0:
                store.segment_bytes = 0          # the next group starts a new segment (with a checkpoint)
            await store_all(store, st_, [batch(node, boot, s, value(s))])
            store.segment_bytes = 10**12
    asyncio.run(go())
    store.close()
    return {s: value(s) for s in range(1, n + 1)}


def frame_map(path):
    """(segment path, start, end, seq) of every batch frame in the store."""
    out = []
    for _, p in segments(str(path)):
        with Segment(p) as seg:
            for span in seg.spans():
                rec = msgpack.unpackb(span.payload, raw=False)
                if rec[0] == "b":
                    out.append((p, span.start, span.end, pb.Batch.FromString(rec[1]).seq))
    return out


def sealed(raw: bytes) -> bool:
    """Whether a segment's bytes still hold its whole seal record (where the previous one ended)."""
    return any(sp.payload is not None and msgpack.unpackb(sp.payload)[0] == "s" for sp in scan(raw, 0, len(raw)))


def replayed(path):
    """Replay into a new state: (figures, {seq: value} from the history of series x)."""
    st_ = FleetState()
    figures = Store(str(path)).open(st_)
    h = st_.history("n", "x", {})
    return figures, st_, {round(p.time_unix_nano / 1e9): p.value for p in (h.points if h else [])}


def test_replay_restores_values_marks_and_inventory(tmp_path):
    st = FleetState()
    store = Store(str(tmp_path))
    store.open(st)
    st.hello(pb.Hello(node_id="n", boot_id="b1", inventory=pb.Inventory(hostname="h1")))
    store.append_nowait(["i", "n", "b1", pb.Inventory(hostname="h1").SerializeToString()])
    asyncio.run(store_all(store, st, [batch("n", "b1", s, s * 1.5) for s in range(1, 6)]))
    assert store.commits >= 1 and store.durable[1] > 0
    store.close()

    again = FleetState()
    figures = Store(str(tmp_path)).open(again)
    assert figures["batches"] == 5 and figures["damaged_ranges"] == 0
    n = again.view().nodes[0]
    assert n.inventory.hostname == "h1" and n.stored_up_to == 5
    assert [s.value for s in n.series] == [7.5]
    assert [p.value for p in again.history("n", "x", {}).points] == [1.5, 3.0, 4.5, 6.0, 7.5]
    # A resend of seq 3 after the restart is a duplicate; seq 6 is new.
    assert again.accept(batch("n", "b1", 3, 0)) is None and again.accept(batch("n", "b1", 6, 0)) == 5
    assert [b.seq for b in stored_batches(str(tmp_path))] == [1, 2, 3, 4, 5]


def test_segments_start_with_a_checkpoint_and_old_ones_may_go(tmp_path):
    """A checkpoint is written with the marks of batches accepted at that moment; those batches
    follow it in the same segment and must still be replayed (not taken for resends)."""
    write_store(tmp_path, 9, per_segment=3)
    assert len(segments(str(tmp_path))) == 3
    figures, st_, values = replayed(tmp_path)
    assert sorted(values) == list(range(1, 10)) and figures["duplicates"] == 0
    # Without the first segment, the second's checkpoint still carries the inventory and the mark.
    os.unlink(segments(str(tmp_path))[0][1])
    _, st_, values = replayed(tmp_path)
    assert sorted(values) == list(range(4, 10))
    assert st_.view().nodes[0].inventory.hostname == "h" and st_.known_marks[("n", "b1")] == 9


# -- damage found at start: the attacks, one by one -------------------------------------------
def _flip(path, offsets):
    data = bytearray(path.read_bytes())
    for o in offsets:
        data[o] ^= 0x5A
    path.write_bytes(bytes(data))


def _seg(tmp_path, i=0):
    import pathlib
    return pathlib.Path(segments(str(tmp_path))[i][1])


def _attack_eight_flipped_bytes(tmp_path, frames):
    p, start, end, _ = frames[len(frames) // 2]
    _flip(_seg(tmp_path), range(start + 20, start + 28))      # eight bytes inside one record
    return {frames[len(frames) // 2][3]}


def _attack_zeroed_tail(tmp_path, frames):
    seg = _seg(tmp_path)
    data = bytearray(seg.read_bytes())
    cut = frames[-3][1] + 5                                    # from inside the third-last record to the end
    data[cut:] = bytes(len(data) - cut)
    seg.write_bytes(bytes(data))
    return {f[3] for f in frames[-3:]}


def _attack_zero_filled_segment(tmp_path, frames):
    seg = _seg(tmp_path, 1)                                    # the second of three segments, all zeros
    lost = {f[3] for f in frames if f[0] == str(seg)}
    seg.write_bytes(bytes(seg.stat().st_size))
    return lost


def _attack_stray_msgpack_integer(tmp_path, frames):
    seg = _seg(tmp_path)
    data = seg.read_bytes()
    at = frames[4][2]                                          # between two records
    seg.write_bytes(data[:at] + msgpack.packb(7) + data[at:])
    return set()


def _attack_byte_in_a_double(tmp_path, frames):
    seg = _seg(tmp_path)
    data = seg.read_bytes()
    p, start, end, seq = frames[6]
    at = data.index(struct.pack("<d", seq * 0.37), start, end)   # the sample's value, little-endian double
    _flip(seg, [at + 7])                                       # the exponent: 0.37 would read 6.65e307
    return {seq}


ATTACKS = {"eight flipped bytes": (_attack_eight_flipped_bytes, 0),
           "zeroed tail": (_attack_zeroed_tail, 0),
           "zero-filled segment": (_attack_zero_filled_segment, 10),
           "stray msgpack integer": (_attack_stray_msgpack_integer, 0),
           "changed byte in a double": (_attack_byte_in_a_double, 0)}


@pytest.mark.parametrize("attack", ATTACKS)
def test_damaged_bytes_cost_only_the_records_they_touch(tmp_path, attack, caplog):
    fn, per_segment = ATTACKS[attack]
    written = write_store(tmp_path, 30, per_segment=per_segment)
    lost = fn(tmp_path, frame_map(tmp_path))
    with caplog.at_level(logging.WARNING, logger="xpusense.collector.store"):
        figures, st_, values = replayed(tmp_path)       # never raises: the collector starts
    assert values == {s: v for s, v in written.items() if s not in lost}, "an undamaged batch was lost or changed"
    assert figures["damaged_ranges"] >= 1 and figures["damaged_bytes"] > 0
    assert st_.view().nodes[0].stored_up_to == max(set(written) - lost)
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage() and "bytes" in r.getMessage()]
    assert lines and all(".log bytes " in x for x in lines[:-1]), lines   # the file and byte position
    kept = sorted(os.listdir(tmp_path / "damaged"))
    assert kept and all(".log." in k for k in kept)
    assert figures["kept_aside_bytes"] + sum(1 for k in kept if k.endswith(".zeros")) > 0
    record_figure(f"store damage: {attack}", batches_acked=len(written), damaged_ranges=figures["damaged_ranges"],
                  damaged_bytes=figures["damaged_bytes"], batches_in_damage=len(lost),
                  batches_lost_beyond_damaged=len(set(written) - lost - set(values)), kept_aside=kept)


def test_damage_found_again_is_not_copied_twice(tmp_path):
    write_store(tmp_path, 10)
    _attack_eight_flipped_bytes(tmp_path, frame_map(tmp_path))
    first, _, _ = replayed(tmp_path)
    again, _, _ = replayed(tmp_path)
    assert first["kept_aside_bytes"] > 0 and again["kept_aside_bytes"] == 0 and again["damaged_ranges"] == 1
    assert len(os.listdir(tmp_path / "damaged")) == 1


def test_kept_aside_within_its_budget(tmp_path):
    write_store(tmp_path, 10)
    _attack_eight_flipped_bytes(tmp_path, frame_map(tmp_path))
    st_ = FleetState()
    figures = Store(str(tmp_path), damaged_keep_bytes=10).open(st_)
    assert figures["not_kept_bytes"] > 0 and figures["kept_aside_bytes"] == 0
    assert not (tmp_path / "damaged").exists() or not os.listdir(tmp_path / "damaged")


def test_a_cut_or_missing_segment_is_found(tmp_path):
    """Each segment says where the previous one ended: a segment cut at a record boundary, or one
    deleted between two others, is counted as damage, not taken for a shorter log."""
    write_store(tmp_path, 12, per_segment=3)              # four segments of three batches
    frames = frame_map(tmp_path)
    first = _seg(tmp_path, 0)
    cut_at = [f for f in frames if f[0] == str(first)][-2][2]    # a record boundary: the last record gone
    first.write_bytes(first.read_bytes()[:cut_at])
    os.unlink(_seg(tmp_path, 2))                          # the third (the fourth says how long it was)
    figures, _, values = replayed(tmp_path)
    assert sorted(values) == [1, 2, 4, 5, 6, 10, 11, 12]
    assert figures["damaged_ranges"] == 2 and not os.path.exists(tmp_path / "damaged")   # nothing there to keep


def test_retention_by_history_keeps_what_a_reader_has_not_read(tmp_path):
    """Segments wholly older than history_s go at the next new segment, except those an exporter's
    reader has not read yet; the newest segment's checkpoint carries the marks."""
    write_store(tmp_path, 9, per_segment=3)
    old = time.time() - 3600
    for _, p in segments(str(tmp_path)):
        os.utime(p, (old, old))
    st_ = FleetState()
    store = Store(str(tmp_path), history_s=60, segment_s=1)
    reader = StoreReader(store, "otlp")                  # has read nothing: cursor (0, 0)
    store.open(st_)

    async def roll():
        await store.append(["m", "n", "b1", 9])          # the first write starts a new segment
    asyncio.run(roll())
    assert len(segments(str(tmp_path))) == 4, "a segment the reader has not read was deleted"
    got, cur = reader.read(max_batches=100)
    assert [b.seq for b in got] == list(range(1, 10))
    reader.commit(cur)
    store.segment_bytes = 0

    async def roll_again():
        await store.append(["m", "n", "b1", 9])
    asyncio.run(roll_again())
    store.close()
    assert [sid for sid, _ in segments(str(tmp_path))] == [4, 5]
    again = FleetState()
    Store(str(tmp_path)).open(again)
    assert again.known_marks[("n", "b1")] == 9 and again.view().nodes[0].inventory.hostname == "h"


def test_invalid_record_with_a_good_checksum_is_skipped(tmp_path):
    """A frame whose checksum holds around something this store never writes (a forged or buggy
    record): skipped and counted, the rest replayed."""
    write_store(tmp_path, 5)
    seg = _seg(tmp_path)
    with open(seg, "ab") as f:
        f.write(frame(["b", b"\xff\xff not a batch"]) + frame([7]) + frame(["m", "n", "b1", "x"]))
    figures, _, values = replayed(tmp_path)
    assert sorted(values) == [1, 2, 3, 4, 5] and figures["invalid_records"] == 3


def test_legacy_segment_without_checksums_is_read(tmp_path):
    """Format 1 (bare msgpack records, before checksums) is still replayed; a stray value in it is
    skipped, not a TypeError at start."""
    recs = [["i", "n", "b1", pb.Inventory(hostname="old").SerializeToString()]]
    recs += [["b", batch("n", "b1", s, s * 2.0).SerializeToString()] for s in range(1, 4)]
    data = b"".join(msgpack.packb(r, use_bin_type=True) for r in recs)
    (tmp_path / "00000001.log").write_bytes(data + msgpack.packb(7) + msgpack.packb(["m", "n", "b1", 3]))
    figures, st_, values = replayed(tmp_path)
    assert values == {1: 2.0, 2: 4.0, 3: 6.0} and figures["legacy_segments"] == 1
    assert figures["invalid_records"] == 1 and st_.view().nodes[0].inventory.hostname == "old"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_every_undamaged_acknowledged_batch_survives(tmp_path_factory, data):
    """Random damage to a real three-segment store (flipped bytes, zeroed or cut ranges, inserted
    bytes): every batch whose frame was not touched is replayed with its value, none with a
    changed one, and the damage is counted."""
    path = tmp_path_factory.mktemp("prop")
    written = write_store(path, 24, per_segment=8)
    frames = frame_map(path)
    segs = [p for _, p in segments(str(path))]
    touched: dict[str, list[int]] = {p: [] for p in segs}
    before = {q: open(fp, "rb").read()[s:e] for fp, s, e, q in frames}
    silent: set[int] = set()
    boundary_cuts: list[tuple[str, int]] = []
    for _ in range(data.draw(st.integers(1, 4), label="damages")):
        p = data.draw(st.sampled_from(segs), label="segment")
        raw = bytearray(open(p, "rb").read())
        kind = data.draw(st.sampled_from(["flip", "zero", "cut", "insert"]), label="kind")
        at = data.draw(st.integers(0, max(0, len(raw) - 1)), label="at")
        n = data.draw(st.integers(1, 64), label="n")
        if kind == "flip":
            for i in range(at, min(at + n, len(raw))):
                raw[i] ^= data.draw(st.integers(1, 255), label="mask")
            touched[p] += list(range(at, min(at + n, len(raw))))
        elif kind == "zero":
            if any(raw[at:at + n]):
                touched[p] += [i for i in range(at, min(at + n, len(raw))) if raw[i]]
            raw[at:at + n] = bytes(len(raw[at:at + n]))
        elif kind == "cut":
            touched[p] += list(range(at, len(raw)))
            if at in {0, *(sp.end for sp in scan(raw, 0, len(raw)))}:
                boundary_cuts.append((p, at))
            del raw[at:]
        else:
            ins = data.draw(st.binary(min_size=1, max_size=n), label="inserted")
            raw[at:at] = ins
            n = len(ins)   # frames after it move; the one around it is hit
            touched[p] = [i + n * (i >= at) for i in touched[p]] + [at]
            frames = [(fp, s + n * (s >= at and fp == p), e + n * (e > at and fp == p), q) for fp, s, e, q in frames]
        with open(p, "wb") as f:
            f.write(raw)
    for p, at in boundary_cuts:
        # A cut at a record boundary cannot be told from a shorter log unless the next segment still
        # holds its seal (where this one ended): never for the newest segment, nor when the next one
        # lost its seal too.
        nxt = segs[segs.index(p) + 1] if p != segs[-1] else None
        if nxt is None or not sealed(open(nxt, "rb").read()):
            silent |= {q for fp, s_, e, q in frames if fp == p and s_ >= at}
    hit = {q for fp, s, e, q in frames if any(s <= i < e or (i == s and i == e) for i in touched[fp])}
    figures, _, values = replayed(path)
    for seq, v in values.items():
        assert written[seq] == v, f"batch {seq} replayed with a changed value"
    assert set(written) - hit <= set(values), f"undamaged batches lost: {sorted(set(written) - hit - set(values))}"
    # Damage that undid itself (a byte flipped twice with one mask, or flipped back to what it was
    # before being zeroed) leaves the frame as written: nothing to count for it.
    after = {p: open(p, "rb").read() for p in segs}
    changed = {q for fp, s, e, q in frames if q in hit and after[fp][s:e] != before[q]}
    if changed - silent:
        assert figures["damaged_ranges"] + figures["invalid_records"] >= 1, "damage not counted"


# -- a failing disk -----------------------------------------------------------------------------------
class FailingDisk:
    """Injects ENOSPC at the store's write call (the segment's own code runs otherwise)."""

    def __init__(self, store):
        self.full = False
        self.calls = 0
        real = store._io.write

        def write(data, roll):
            self.calls += 1
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(data, roll)
        store._io.write = write


def test_full_disk_is_a_state_not_a_crash(tmp_path, caplog):
    st_ = FleetState()
    store = Store(str(tmp_path), retry_s=0.02, max_pending_bytes=40_000)
    store.open(st_)
    disk = FailingDisk(store)
    changes: list[bool] = []
    store.on_change.append(changes.append)

    async def go():
        st_.hello(pb.Hello(node_id="n", boot_id="b1"))
        await store_all(store, st_, [batch("n", "b1", 1, 1.0)])
        segs_before = len(segments(str(tmp_path)))
        disk.full = True
        held = [store.submit(["b", batch("n", "b1", s, float(s)).SerializeToString()]) for s in range(2, 6)]
        while disk.calls < 8:                       # a few retries go by, nothing acknowledged
            await asyncio.sleep(0.01)
        assert not any(f.done() for f in held) and store.failing and changes == [False]
        # Past the bound: refused at once, counted.
        big = store.submit(["b", b"x" * 50_000])
        assert big.done() and isinstance(big.exception(), StoreError) and "retry later" in str(big.exception())
        barrier = store.barrier()
        assert not barrier.done()
        assert len(segments(str(tmp_path))) == segs_before, "a segment per failure"
        disk.full = False
        await asyncio.wait_for(asyncio.gather(*held, barrier), 10)
        assert changes == [False, True] and not store.failing
        return segs_before

    with caplog.at_level(logging.INFO, logger="xpusense.collector.store"):
        segs_before = asyncio.run(go())
    store.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device (ENOSPC)" in errors[0].getMessage()
    assert sum("writable again" in r.getMessage() for r in caplog.records) == 1
    s = store.stats()
    assert s["write_errors"] >= 7 and s["unwritable_episodes"] == 1 and s["refused_records"] == 1
    assert s["max_held_bytes"] <= 40_000
    assert [b.seq for b in stored_batches(str(tmp_path))] == [1, 2, 3, 4, 5]
    assert len(segments(str(tmp_path))) == segs_before
    record_figure("store full disk (injected)", write_errors=s["write_errors"], refused=s["refused_records"],
                  max_held_bytes=s["max_held_bytes"], segments=segs_before, error_lines=len(errors))


def test_streams_wait_for_room_under_the_bound(tmp_path):
    """wait_room(): past max_pending_bytes a stream waits (is not read) until writes free room."""
    st_ = FleetState()
    store = Store(str(tmp_path), retry_s=0.01, max_pending_bytes=1000)
    store.open(st_)
    disk = FailingDisk(store)

    async def go():
        await store.wait_room(10**6)                    # nothing held: any record may come
        disk.full = True
        f = store.submit(["b", b"x" * 900])
        waiter = asyncio.ensure_future(store.wait_room(300))
        while disk.calls < 3:
            await asyncio.sleep(0.01)
        assert not waiter.done() and store.room_waits == 1
        disk.full = False
        await asyncio.wait_for(waiter, 10)
        assert f.done() and store.held_bytes() == 0
    asyncio.run(go())
    store.close()
    assert store.refused_records == 0


def test_failed_write_leaves_no_partial_record(tmp_path):
    """A write that fails part way (ENOSPC after some bytes) is cut back: the retry's records
    follow the last durable one directly, and nothing damaged is found at the next start."""
    st_ = FleetState()
    store = Store(str(tmp_path), retry_s=0.01)
    store.open(st_)
    real_pwrite = os.pwrite
    state = {"fail": 0}

    def pwrite(fd, data, off):
        if state["fail"]:
            state["fail"] -= 1
            real_pwrite(fd, bytes(data[:7]), off)        # some bytes land, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, off)

    async def go():
        await store_all(store, st_, [batch("n", "b1", 1, 1.0)])
        state["fail"] = 3
        os.pwrite = pwrite
        try:
            await store_all(store, st_, [batch("n", "b1", 2, 2.0)])
        finally:
            os.pwrite = real_pwrite
    asyncio.run(go())
    store.close()
    figures, _, values = replayed(tmp_path)
    assert values == {1: 1.0, 2: 2.0} and figures["damaged_ranges"] == 0 and store.write_errors == 3


def test_resends_wait_for_what_they_resend(tmp_path):
    """barrier(): a duplicate's ack (or a Welcome) waits until everything queued before it is durable."""
    st_ = FleetState()
    store = Store(str(tmp_path), retry_s=0.01)
    store.open(st_)
    disk = FailingDisk(store)

    async def go():
        assert store.barrier().done()                 # nothing queued: at once
        disk.full = True
        f = store.submit(["b", batch("n", "b1", 1, 1.0).SerializeToString()])
        b = store.barrier()
        while disk.calls < 3:
            await asyncio.sleep(0.01)
        assert not b.done() and not f.done()
        disk.full = False
        await asyncio.wait_for(b, 10)
        assert f.done() and f.exception() is None
    asyncio.run(go())
    store.close()


def test_close_writes_what_was_queued(tmp_path):
    st_ = FleetState()
    store = Store(str(tmp_path))
    store.open(st_)

    async def go():
        store.submit(["b", batch("n", "b1", 1, 1.0).SerializeToString()])
        store.submit(["b", batch("n", "b1", 2, 2.0).SerializeToString()])
    asyncio.run(go())
    store.close()
    assert [b.seq for b in stored_batches(str(tmp_path))] == [1, 2]


def test_open_refuses_only_an_unusable_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="data_dir .* is not writable"):
        Store(str(tmp_path / "file" / "data")).open(FleetState())
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.log").write_text("not a segment")   # other files are left alone
    assert Store(str(tmp_path / "d")).open(FleetState())["segments"] == 0


# -- readers -----------------------------------------------------------------------------------------
def test_reader_cursor_survives_and_sees_only_new_batches(tmp_path):
    st = FleetState()
    store = Store(str(tmp_path))
    store.open(st)

    async def go():
        await store_all(store, st, [batch("n", "b", s, s) for s in range(1, 4)])
        r = StoreReader(store, "otlp")
        got, cur = r.read()
        assert [b.seq for b in got] == [1, 2, 3]
        r.commit(cur)
        await store_all(store, st, [batch("n", "b", s, s) for s in range(4, 6)])
        r2 = StoreReader(store, "otlp")   # as after a restart: the cursor is read back
        got, cur = r2.read()
        assert [b.seq for b in got] == [4, 5]
        got, _ = r2.read(max_batches=1)
        assert [b.seq for b in got] == [4]
    asyncio.run(go())
    store.close()


def test_reader_skips_damage_and_goes_on(tmp_path, caplog):
    write_store(tmp_path, 12, per_segment=4)
    frames = frame_map(tmp_path)
    p, start, _, seq = frames[5]
    import pathlib
    _flip(pathlib.Path(p), [start + 30])
    st_ = FleetState()
    store = Store(str(tmp_path))
    store.open(st_)
    r = StoreReader(store, "otlp")
    got, seen = [], 0
    while True:
        batches, cur = r.read(max_batches=3)
        assert len(batches) <= 3
        if not batches:
            break
        got += [b.seq for b in batches]
        r.commit(cur)
        seen += 1
    assert got == [s for s in range(1, 13) if s != seq] and r.skipped_ranges == 1
    assert store.stats()["reader_skipped_ranges"] == 1
    store.close()


def test_store_metrics_for_prometheus(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    write_store(tmp_path, 6)
    _attack_eight_flipped_bytes(tmp_path, frame_map(tmp_path))
    store = Store(str(tmp_path))
    store.open(FleetState())
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreMetrics(store))
    text = generate_latest(reg).decode()
    assert "xpusense_collector_store_writable 1.0" in text
    assert "xpusense_collector_store_replay_damaged_ranges 1.0" in text
    assert "xpusense_collector_store_refused_records_total 0.0" in text
    store.close()


def test_segment_format_markers():
    assert len(SEGMENT_MAGIC) == 8 and RECORD_MAGIC[0] == 0xC1   # 0xc1: never a msgpack byte
