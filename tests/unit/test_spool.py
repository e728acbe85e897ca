"""The agent's spool on its own: order, acks, restart, damaged bytes, a full disk, budgets."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess

import msgpack
import pytest

from xpusense.agent.spool import Spool, SpoolError, peek, records


def fill(sp, boot, seqs, size=100):
    return {seq: sp.append(boot, seq, 3, bytes([seq % 256]) * size) for seq in seqs}


def killed(sp):
    """As if the agent were killed: the kernel drops the lock, nothing else is closed or written."""
    sp._stop.set()
    sp._lockf.close()


def segment_records(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return list(records.scan(fd))
    finally:
        os.close(fd)


def test_unacknowledged_batches_come_back_after_a_restart_in_order(tmp_path):
    sp = Spool(str(tmp_path), segment_bytes=1000)
    sp.open()
    locs = fill(sp, "b1", range(1, 21))
    assert sp.read(locs[7]) == bytes([7]) * 100
    for seq in range(1, 11):
        sp.ack("b1", seq, locs[seq])
    sp.close()
    again = Spool(str(tmp_path), segment_bytes=1000)
    found = again.open()
    assert [k for k, _ in found] == [("b1", s) for s in range(11, 21)]
    assert [again.read(loc) for _, loc in found][0] == bytes([11]) * 100
    # Fully acknowledged segments were deleted: only the ones holding 11..20 (and the new one) remain.
    assert len(list(tmp_path.glob("*.seg"))) <= 3
    assert again.damaged_records == 0
    again.close()


def test_a_torn_last_record_is_skipped_counted_and_kept_aside(tmp_path):
    sp = Spool(str(tmp_path))
    sp.open()
    fill(sp, "b1", range(1, 4))
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    whole = records.encode("b1", 4, 3, b"x" * 100)
    with open(seg, "ab") as f:
        f.write(whole[:30])     # the start of a 4th record, cut short by a crash
    killed(sp)
    again = Spool(str(tmp_path))
    found = again.open()
    assert [k for k, _ in found] == [("b1", 1), ("b1", 2), ("b1", 3)]
    assert again.damaged_records == 1 and again.lost_at_open["damaged_records"] == 1
    kept = list((tmp_path / "damaged").iterdir())
    assert [p.read_bytes() for p in kept] == [whole[:30]]
    again.close()


@pytest.mark.parametrize("where", ["magic", "length", "checksum", "payload"])
def test_one_damaged_byte_costs_one_record_and_the_later_ones_are_found(tmp_path, where):
    """The issue's 'bad framing byte': 13 later records were dropped with one warning. Now the
    damaged record alone is skipped, counted, logged with its position and kept aside."""
    sp = Spool(str(tmp_path))
    sp.open()
    locs = fill(sp, "b1", range(1, 21))
    killed(sp)
    loc = locs[7]
    at = loc.offset + {"magic": 1, "length": 5, "checksum": 9, "payload": 40}[where]
    seg = tmp_path / f"{loc.segment:08d}.seg"
    data = bytearray(seg.read_bytes())
    data[at] ^= 0x5A
    seg.write_bytes(bytes(data))
    again = Spool(str(tmp_path))
    found = again.open()
    assert [k[1] for k, _ in found] == [s for s in range(1, 21) if s != 7]
    assert again.damaged_records == 1 and again.damaged_bytes == loc.length
    assert [again.read(where) for _, where in found][-1] == bytes([20]) * 100
    kept = tmp_path / "damaged" / f"{loc.segment:08d}@{loc.offset}.bin"
    assert kept.read_bytes() == bytes(data[loc.offset:loc.offset + loc.length])
    again.close()


def test_a_record_the_validator_refuses_is_never_handed_out(tmp_path, caplog):
    """A record whose framing and checksum are right but whose batch is not one (the issue's
    undecodable protobuf record) is damaged: skipped, counted, kept aside."""
    sp = Spool(str(tmp_path))
    sp.open()
    fill(sp, "b1", [1])
    sp.append("b1", 2, 3, b"\xff\xff\xff garbage")
    fill(sp, "b1", [3])
    killed(sp)
    validate = lambda boot, seq, data: "not a Batch" if data.startswith(b"\xff") else None
    again = Spool(str(tmp_path), validate=validate)
    with caplog.at_level(logging.WARNING, "xpusense.agent.spool"):
        found = again.open()
    assert [k for k, _ in found] == [("b1", 1), ("b1", 3)] and again.damaged_records == 1
    line = next(r.getMessage() for r in caplog.records if "damaged record at byte" in r.getMessage())
    assert "not a Batch" in line and "00000001.seg" in line
    again.close()


def test_a_batch_set_aside_at_run_time_stays_aside_after_a_restart(tmp_path):
    sp = Spool(str(tmp_path))
    sp.open()
    locs = fill(sp, "b1", range(1, 6))
    sp.set_aside(("b1", 3), locs[3], "refused")
    assert sp.damaged_records == 1
    sp.close()
    again = Spool(str(tmp_path))
    found = again.open()
    assert [k[1] for k, _ in found] == [1, 2, 4, 5]
    assert again.damaged_records == 0, "counted once, when it was set aside"
    assert len(list((tmp_path / "damaged").iterdir())) == 1
    again.close()


def test_a_record_read_back_is_checked(tmp_path):
    sp = Spool(str(tmp_path))
    sp.open()
    locs = fill(sp, "b1", range(1, 4))
    seg = tmp_path / f"{locs[2].segment:08d}.seg"
    with open(seg, "r+b") as f:
        f.seek(locs[2].offset + 30)
        f.write(b"\x00\x01")
    with pytest.raises(records.RecordError, match="checksum"):
        sp.read(locs[2])
    with pytest.raises(records.RecordError, match="holds batch"):
        sp.read(locs[3], ("b1", 9))
    sp.close()


def test_over_budget_the_oldest_go_and_are_counted(tmp_path):
    dropped = []
    sp = Spool(str(tmp_path), max_bytes=2500, segment_bytes=1000, on_drop=lambda keys, n: dropped.append((keys, n)))
    sp.open()
    fill(sp, "b1", range(1, 41))
    assert sp.bytes_used() <= 2500 + 1000
    lost = [k for keys, _ in dropped for k in keys]
    assert lost == [("b1", s) for s in range(1, len(lost) + 1)] and sp.dropped_batches == len(lost) > 0
    assert sp.dropped_samples == 3 * len(lost) == sum(n for _, n in dropped)
    sp.close()


def test_over_max_batches_the_oldest_go_and_are_counted(tmp_path):
    """Tiny records cannot make the agent keep millions of batches in memory."""
    sp = Spool(str(tmp_path), max_batches=64)
    sp.open()
    fill(sp, "b1", range(1, 301), size=1)
    left = sp.status()["batches"]
    assert left <= 64 and sp.dropped_batches == 300 - left
    killed(sp)
    # A segment written by someone else, holding many more than max_batches records.
    with open(tmp_path / "00000900.seg", "wb") as f:
        for seq in range(1, 5001):
            f.write(records.encode("other", seq, 1, b"x"))
    again = Spool(str(tmp_path), max_batches=64)
    found = again.open()
    assert len(found) <= 64 and found[-1][0] == ("other", 5000)
    assert again.lost_at_open["dropped_batches"] == 5000 + left - len(found)
    again.close()


def test_files_that_are_not_the_agents_are_left_alone(tmp_path, caplog):
    (tmp_path / "notes.seg").write_text("hello")
    (tmp_path / "acked.json").write_text("{not json")
    sp = Spool(str(tmp_path))
    with caplog.at_level(logging.WARNING, "xpusense.agent.spool"):
        assert sp.open() == []
    assert (tmp_path / "notes.seg").exists()
    assert any("acked.json unreadable" in r.getMessage() for r in caplog.records)
    sp.close()


def test_segments_of_the_format_before_framing_are_replayed(tmp_path):
    with open(tmp_path / "00000003.seg", "wb") as f:
        for seq in range(1, 6):
            f.write(msgpack.packb(["old", seq, 2, bytes([seq]) * 10], use_bin_type=True))
    (tmp_path / "acked.json").write_text(json.dumps({"old": 2}))
    sp = Spool(str(tmp_path))
    found = sp.open()
    assert [k for k, _ in found] == [("old", 3), ("old", 4), ("old", 5)]
    assert sp.read(found[0][1]) == bytes([3]) * 10
    assert not (tmp_path / "00000003.seg").exists()
    sp.close()


def test_damaged_copies_stay_within_their_budget(tmp_path):
    sp = Spool(str(tmp_path), damaged_max_bytes=300)
    sp.open()
    locs = fill(sp, "b1", range(1, 11))
    killed(sp)
    seg = tmp_path / f"{locs[1].segment:08d}.seg"
    data = bytearray(seg.read_bytes())
    for seq in (2, 4, 6, 8):
        data[locs[seq].offset + 40] ^= 1
    seg.write_bytes(bytes(data))
    again = Spool(str(tmp_path), damaged_max_bytes=300)
    again.open()
    kept = list((tmp_path / "damaged").iterdir())
    assert again.damaged_records == 4
    assert sum(p.stat().st_size for p in kept) <= 300 and again.aside.removed >= 1
    again.close()


def test_one_agent_per_spool_directory(tmp_path):
    a = Spool(str(tmp_path))
    a.open()
    with pytest.raises(SpoolError, match="in use by another agent"):
        Spool(str(tmp_path)).open()
    a.close()


def test_unwritable_directory_says_what_to_do(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpoolError, match=r"\[spool\] dir"):
        Spool(str(tmp_path / "file" / "spool")).open()


# -- a full disk, for real: a small tmpfs ------------------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(path, size="2m"):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (mount -t tmpfs -o size=2m)")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_up(path, keep_free=0):
    """Fill the filesystem at `path`, but for `keep_free` bytes freed at the end; the filler's path."""
    spare = path / "spare"
    if keep_free:
        spare.write_bytes(b"\0" * keep_free)
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)
    if keep_free:
        spare.unlink()
    return filler


def test_full_disk_is_a_state_and_writing_resumes_when_space_returns(tmp_path, caplog):
    with small_tmpfs(tmp_path / "mnt") as mnt:
        sp = Spool(str(mnt / "spool"), segment_bytes=64 * 1024)
        sp.open()
        written = {k: loc for k, loc in ((s, sp.append("b1", s, 1, os.urandom(9000))) for s in range(1, 6))}
        assert all(written.values()) and sp.state == "ok"
        seg = mnt / "spool" / f"{written[5].segment:08d}.seg"
        size = seg.stat().st_size
        filler = fill_up(mnt, keep_free=4096)   # room for part of one record: a partial write, cut back
        with caplog.at_level(logging.WARNING, "xpusense.agent.spool"):
            failed = [sp.append("b1", s, 1, os.urandom(9000)) for s in range(6, 26)]
            assert failed == [None] * 20 and sp.state == "failing" and "No space left" in sp.error
            assert sp.write_failures == 20 and seg.stat().st_size == size
            assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1, "logged once per state change"
            filler.unlink()
            loc = sp.append("b1", 26, 1, b"after")
            assert loc is not None and sp.state == "ok"
            assert sum("writable again" in r.getMessage() for r in caplog.records) == 1
        assert sp.read(loc) == b"after" and sp.read(written[5])[:1] is not None
        sp.close()
        again = Spool(str(mnt / "spool"))
        found = again.open()
        assert [k[1] for k, _ in found] == [1, 2, 3, 4, 5, 26]
        assert again.damaged_records == 0, "the partial writes were cut back, not left as damage"
        again.close()


def test_a_full_disk_taken_by_acknowledged_records_of_the_open_segment_is_given_back(tmp_path):
    """With the collector there, the open segment (4 MiB by default, more than a small disk) can
    fill the disk with records already acknowledged: the spool moves to a new segment and deletes
    the old one, instead of staying failed while the disk holds nothing it needs."""
    with small_tmpfs(tmp_path / "mnt") as mnt:
        sp = Spool(str(mnt / "spool"))
        sp.open()
        locs = {}
        while (loc := sp.append("b1", len(locs) + 1, 1, os.urandom(9000))) is not None:
            locs[len(locs) + 1] = loc
        assert len(locs) > 100 and sp.state == "failing"
        for seq, loc in locs.items():           # then the collector acknowledges them all
            sp.ack("b1", seq, loc)
        loc = sp.append("b1", len(locs) + 1, 1, b"retried")
        assert loc is not None and sp.state == "ok" and sp.read(loc) == b"retried"
        assert [p.name for p in (mnt / "spool").glob("*.seg")] == [f"{loc.segment:08d}.seg"]
        sp.close()


def test_interval_fsync_only_for_a_batch_that_waited_a_whole_interval(tmp_path, monkeypatch):
    """What the collector acknowledged needs no disk: a healthy stream's flushes do not fsync. A
    batch sent since the last flush is left for the next (its ack most likely comes first); one
    still waiting for its ack a whole interval later is fsynced."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    sp = Spool(str(tmp_path), fsync="interval", fsync_interval_s=3600)
    sp.open()
    try:
        locs = fill(sp, "b1", [1, 2])
        sp.ack("b1", 1, locs[1])
        sp._flush_once()
        assert synced == [] and sp._dirty   # seq 2 was written during this interval: not yet
        sp._flush_once()
        assert len(synced) == 1            # seq 2 waited a whole interval: on disk it must be
        locs.update(fill(sp, "b1", [3]))
        sp.ack("b1", 2, locs[2])
        synced.clear()
        sp._flush_once()
        assert synced == []                 # seq 3 is new since the last flush
        sp.ack("b1", 3, locs[3])
        sp._flush_once()
        assert synced == []                 # everything written was acknowledged: nothing to fsync
        assert not sp._dirty
    finally:
        sp.close()


def segment_marks(path):
    """The acknowledged marks recorded in the spool's segments, in order."""
    out = []
    for seg in sorted(path.glob("*.seg")):
        fd = os.open(seg, os.O_RDONLY)
        try:
            out += [r.marks for r in records.scan(fd) if isinstance(r, records.Acks)]
        finally:
            os.close(fd)
    return out


def test_acknowledgements_alone_are_recorded_in_the_segment_at_most_every_acks_save_s(tmp_path, monkeypatch):
    """Marks only save resending batches after a restart (the collector drops repeats): for
    acknowledgements alone they are appended to the open segment at most every ACKS_SAVE_S, and no
    acked.json is made for them (a new file is pages of metadata); a batch set aside writes acked.json
    at once."""
    from xpusense.agent.spool import store as store_mod
    sp = Spool(str(tmp_path), fsync_interval_s=3600)
    sp.open()
    try:
        locs = fill(sp, "b1", [1, 2, 3])
        sp.ack("b1", 1, locs[1])
        sp._flush_once()
        assert segment_marks(tmp_path) == [{"b1": 1}] and not (tmp_path / "acked.json").exists()
        sp.ack("b1", 2, locs[2])
        sp._flush_once()
        assert segment_marks(tmp_path) == [{"b1": 1}]   # not yet
        sp.set_aside(("b1", 3), locs[3], "test")
        sp._flush_once()
        saved = json.loads((tmp_path / "acked.json").read_text())
        assert saved["acked"] == {"b1": 2} and saved["aside"] == [["b1", 3, locs[3].segment]]
        monkeypatch.setattr(store_mod, "ACKS_SAVE_S", 0.0)
        locs = fill(sp, "b1", [4, 5])
        sp.ack("b1", 4, locs[4])
        sp._flush_once()
        assert segment_marks(tmp_path)[-1] == {"b1": 4}
        assert json.loads((tmp_path / "acked.json").read_text())["acked"] == {"b1": 2}
        assert peek.unacked(str(tmp_path)) == [("b1", 5)]
    finally:
        sp.close()


def test_marks_in_a_segment_cover_batches_after_a_kill(tmp_path, monkeypatch):
    """Killed with only the marks in its segments (acked.json older, or none): a restart hands out
    only the batches above them, across segments and boots, and the mark of a later record wins."""
    from xpusense.agent.spool import store as store_mod
    monkeypatch.setattr(store_mod, "ACKS_SAVE_S", 0.0)
    sp = Spool(str(tmp_path), fsync_interval_s=3600, segment_bytes=600)
    sp.open()
    locs = fill(sp, "b1", [1, 2, 3, 4, 5])
    locs2 = fill(sp, "b2", [1, 2])
    assert len(list(tmp_path.glob("*.seg"))) > 1
    for seq in (1, 2, 3):
        sp.ack("b1", seq, locs[seq])
    sp._flush_once()
    sp.ack("b2", 1, locs2[1])
    sp._flush_once()
    killed(sp)
    assert not (tmp_path / "acked.json").exists()
    assert segment_marks(tmp_path)[-1] == {"b1": 3, "b2": 1}
    again = Spool(str(tmp_path))
    assert [k for k, _ in again.open()] == [("b1", 4), ("b1", 5), ("b2", 2)]
    assert again.lost_at_open == {"dropped_batches": 0, "dropped_samples": 0, "damaged_records": 0}
    again.close()


def test_series_definitions_are_fsynced_before_the_spool_fsyncs_a_batch(tmp_path, monkeypatch):
    """Definitions are written when given but fsynced only when the spool fsyncs (a healthy
    stream's batches are acknowledged first and never are): then before the segment, so a batch on
    disk has its definitions on disk; once each."""
    from xpusense.agent.spool.defs import SeriesDefs
    from xpusense.v1 import telemetry_pb2 as pb
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    sp = Spool(str(tmp_path), fsync="batch")
    sp.open()
    try:
        defs = SeriesDefs.beside(sp, 100)
        defs.add("b1", pb.Sample(name="gpu.temp", series_ref=1))
        defs.save()
        assert (tmp_path / "series-b1.xsd").stat().st_size > 0 and synced == []
        fill(sp, "b1", [1])
        assert synced == ["series-b1.xsd", "00000001.seg"]
        fill(sp, "b1", [2])
        assert synced[2:] == ["00000001.seg"]
    finally:
        sp.close()


def test_a_batch_is_kept_without_the_node_and_boot_ids_and_handed_back_whole(tmp_path):
    """With its node id the spool leaves out the first bytes of a batch that are that node's and the
    record's boot (~50 bytes a batch, the most of what a compact batch adds to its columns), and
    puts them back: on reading, for the check at start, and for a record written with them."""
    from xpusense.v1 import telemetry_pb2 as pb
    whole = {seq: pb.Batch(node_id="node-a", boot_id="b1", seq=seq, columns=b"c" * 40).SerializeToString()
             for seq in (1, 2)}
    old = Spool(str(tmp_path))                        # a spool of the version before: batches as given
    old.open()
    old.append("b1", 1, 3, whole[1])
    killed(old)
    seen = []
    sp = Spool(str(tmp_path), node_id="node-a", validate=lambda boot, seq, data: seen.append(data))
    locs = dict(sp.open())
    loc2 = sp.append("b1", 2, 3, whole[2])
    other = pb.Batch(node_id="node-b", boot_id="b1", seq=3).SerializeToString()
    loc3 = sp.append("b1", 3, 3, other)
    assert seen == [whole[1]]
    assert sp.read(locs[("b1", 1)]) == whole[1] and sp.read(loc2) == whole[2] and sp.read(loc3) == other
    killed(sp)
    stored = {}
    for seg in sorted(tmp_path.glob("*.seg")):
        fd = os.open(seg, os.O_RDONLY)
        stored.update({r.seq: r.batch for r in records.scan(fd) if isinstance(r, records.Good)})
        os.close(fd)
    assert stored[2] == whole[2][len(pb.Batch(node_id="node-a", boot_id="b1").SerializeToString()):]
    assert stored[1] == whole[1] and stored[3] == other
    seen.clear()
    again = Spool(str(tmp_path), node_id="node-a", validate=lambda boot, seq, data: seen.append(data))
    assert [again.read(loc) for _, loc in again.open()] == [whole[1], whole[2], other]
    assert seen == [whole[1], whole[2], other]
    again.close()
