"""The agent's spool on its own: order, acks, restart, torn records, budget."""

from __future__ import annotations

import pytest

from xpusense.agent.spool import Spool, SpoolError


def fill(sp, boot, seqs, size=100):
    return {seq: sp.append(boot, seq, 3, bytes([seq % 256]) * size) for seq in seqs}


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
    again.close()


def test_a_torn_last_record_is_skipped(tmp_path):
    sp = Spool(str(tmp_path))
    sp.open()
    fill(sp, "b1", range(1, 4))
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    sp._f.flush()
    with open(seg, "ab") as f:
        f.write(b"\x94\xa2b1\x04")  # the start of a 4th record, cut short by a crash
    sp._stop.set()
    sp._lockf.close()  # as if killed: the kernel drops the lock, nothing else is closed
    again = Spool(str(tmp_path))
    found = again.open()
    assert [k for k, _ in found] == [("b1", 1), ("b1", 2), ("b1", 3)] and again.torn_records == 1


def test_over_budget_the_oldest_go_and_are_counted(tmp_path):
    dropped = []
    sp = Spool(str(tmp_path), max_bytes=2500, segment_bytes=1000, on_drop=lambda keys, n: dropped.append((keys, n)))
    sp.open()
    fill(sp, "b1", range(1, 41))
    assert sp.bytes_used() <= 2500 + 1000
    lost = [k for keys, _ in dropped for k in keys]
    assert lost == [("b1", s) for s in range(1, len(lost) + 1)] and sp.dropped_batches == len(lost) > 0
    assert sp.dropped_samples == 3 * len(lost) == sum(n for _, n in dropped)


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
