"""A real collector with a durable store, restarted: after a clean stop it takes compact batches
whose series were defined only before it (its snapshot keeps the dictionary), and after a kill it
replays them from the snapshot and the log after it (a new segment begins with every boot's
definitions); it holds exactly the points of the same batches sent as Sample messages."""

from __future__ import annotations

import signal

from compact_support import rounds
from test_compact_ingest import Collector, acks, compact_messages, hello, stream

from xpusense.v1 import telemetry_pb2 as pb

SNAPSHOT_ON_STOP = "[store]\nsnapshot_every_s = 3600\n"   # one snapshot, on the clean stop
NO_SNAPSHOTS = "[store]\nsnapshot_every_s = 0\n"


def test_restart_from_a_snapshot_and_the_log_after_it(procs, tmp_path):
    coll = Collector(procs, tmp_path, config=SNAPSHOT_ON_STOP, data_dir=True)
    full = rounds("full", n=8)
    replies, err = stream(coll.addr, [hello("full", offer=False)] + [pb.AgentMessage(batch=b) for b in full])
    assert err is None and acks(replies) == [(b.seq, False) for b in full]
    want = coll.held("full")

    small = rounds("small", n=8)
    msgs = compact_messages(small)
    cut = next(i for i, m in enumerate(msgs) if m.HasField("batch") and m.batch.seq == 5)
    assert sum(m.HasField("series") for m in msgs[:cut]) == 4 and not any(m.HasField("series") for m in msgs[cut:])
    replies, err = stream(coll.addr, [hello("small", offer=True)] + msgs[:cut])
    assert err is None and acks(replies) == [(s, False) for s in range(1, 5)]
    assert coll.proc.kill(signal.SIGTERM) == 0   # the snapshot on stop covers every table and batch so far

    # Batches 5-8 with no table before them on their stream: taken only because the snapshot's
    # dictionary defines their series.
    second = Collector(procs, tmp_path, config=NO_SNAPSHOTS, data_dir=True)
    assert second.counters()["store.snapshot_loaded"] == 1
    replies, err = stream(second.addr, [hello("small", offer=True)] + msgs[cut:])
    assert err is None and acks(replies) == [(s, False) for s in range(5, 9)]
    assert second.held("small") == want
    second.proc.kill(signal.SIGKILL)

    # Replayed from the same snapshot and the log after it: its segment's checkpoint defines them.
    third = Collector(procs, tmp_path, config=NO_SNAPSHOTS, data_dir=True)
    c = third.counters()
    assert c["store.snapshot_loaded"] == 1 and c["store.replay_batches"] == 4
    assert c["store.replay_invalid_records"] == 0 and c["store.replay_series_tables"] == 1
    assert third.held("small") == want and third.held("full") == want
