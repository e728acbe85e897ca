"""A collector whose store fills its own disk recovers without a restart once space returns: writes
and acknowledgements resume, snapshots are written again (the periodic task never dies of a full
disk), the retention floor moves and old segments are deleted. A real collector and a real agent,
the store on a small tmpfs."""

from __future__ import annotations

import os
import signal
import time

from helpers import free_port, nodes_json, record_figure, tmpfs, wait_until
from test_faults_store import collector, health

from xpusense.agent.sources.base import Sample
from xpusense.agent.stream import StreamClient
from xpusense.collector.store import segments
from xpusense.collector.store.snapshot_load import listed
from xpusense.v1 import telemetry_pb2 as pb

DISK = "8m"
BALLAST_BYTES = 7 * 2**20   # other data on the same file system: the store fills the rest (~1 MB)
FLOOD_BATCHES = 3000        # ~1.5 KB each: 4.5 MB offered, more than the room left
# Small writes (a batch or two at a time: max_pending_bytes) fill the disk to its last page, as a
# fleet's steady ingest does: a snapshot then finds no room at all. A group commit as soon as the
# last is on disk: at a batch or two a commit, the default interval would take minutes to fill it.
STORE = """
history_s = 10.0
[store]
commit_interval_s = 0
segment_s = 0.5
segment_bytes = 262144
snapshot_every_s = 0.3
snapshot_after_records = 1
snapshot_keep = 1
retry_s = 0.2
max_pending_bytes = 2048
[limits]
batches_per_s = 10000.0
burst_batches = 100000
"""


def batch_samples(k: int) -> list[Sample]:
    """~1.5 KB: the same 10 series each batch."""
    return [Sample("fill.v", float(k), "1", {"blob": f"{i}-" + "x" * 100}, time_ns=time.time_ns())
            for i in range(10)]


def test_a_store_that_filled_its_disk_recovers_without_a_restart(procs, tmp_path):
    """The store's own segments fill the disk beside a ballast file (other data on the file system)
    until writes fail with ENOSPC: health NOT_SERVING, nothing acknowledged, snapshots fail (counted)
    and are tried again. The ballast deleted (space freed by whoever owns it: the store cannot free
    what it must keep to replay), with the same collector process: SERVING, every batch held
    acknowledged, new snapshots written, segments from before the outage deleted by retention, no
    task failed or died ("Task exception was never retrieved"), and a clean stop."""
    with tmpfs(tmp_path / "disk", DISK) as disk:
        ballast = disk / "ballast"
        ballast.write_bytes(b"\0" * BALLAST_BYTES)
        addr, data = f"127.0.0.1:{free_port()}", disk / "data"
        coll = collector(procs, addr, data, STORE)
        counters = lambda: nodes_json(addr)["counters"]  # noqa: E731
        client = StreamClient(addr, "fill-node", "fboot", lambda: pb.Inventory(hostname="fill"), flush_s=3600,
                              queue_batches=FLOOD_BATCHES + 100, backoff_initial_s=0.05, backoff_max_s=0.2)
        client.start()
        client.put(batch_samples(0))
        client.flush()
        wait_until(lambda: client.pending() == 0, what="the first batch acknowledged")
        wait_until(lambda: counters()["store.snapshots_written"] >= 1, what="a first snapshot")
        for k in range(1, FLOOD_BATCHES + 1):
            client.put(batch_samples(k))
            client.flush()
        t_full = time.monotonic()
        wait_until(lambda: (c := counters())["store.unwritable_episodes"] >= 1 and c["store.snapshot_failures"] >= 1,
                   timeout_s=60, what=lambda: f"the store's own writes and a snapshot failing for space: {counters()}")
        assert "No space left on device (ENOSPC)" in coll.output()
        wait_until(lambda: health(addr) == "NOT_SERVING", what="health NOT_SERVING while the disk is full")
        assert counters()["store.writable"] == 0
        failures = counters()["store.snapshot_failures"]
        wait_until(lambda: counters()["store.snapshot_failures"] >= failures + 2,
                   what=lambda: f"snapshots tried again while the disk is still full: {counters()}")
        acked_full = client.acked
        written_full = counters()["store.snapshots_written"]
        segs_full = {sid for sid, _ in segments(str(data))}
        assert client.pending() > 0, "batches acknowledged while the disk was full"
        assert not any(n.startswith(".tmp-") for n in os.listdir(data / "snapshots")), \
            "a failed snapshot left its partial file behind"

        os.unlink(ballast)   # space back
        wait_until(lambda: health(addr) == "SERVING", timeout_s=30, what="SERVING again once there is space")
        wait_until(lambda: client.pending() == 0, timeout_s=60,
                   what=lambda: f"every batch acknowledged ({client.pending()} left, {client.acked - acked_full} since)")
        wait_until(lambda: counters()["store.snapshots_written"] >= written_full + 2, timeout_s=30,
                   what=lambda: f"snapshots written again after the outage: {counters()}")
        wait_until(lambda: min(sid for sid, _ in segments(str(data))) > min(segs_full), timeout_s=30,
                   what=lambda: f"retention deleting segments from before the outage (then {sorted(segs_full)}, now "
                                f"{[sid for sid, _ in segments(str(data))]}, snapshots {listed(str(data / 'snapshots'))})")
        recovery_s = time.monotonic() - t_full
        after = counters()
        client.stop(drain_s=0)
        assert after["store.writable"] == 1 and after["tasks.restarts"] == 0, after
        assert coll.p.poll() is None, "the collector exited"
        out = coll.output()
        assert "Task exception was never retrieved" not in out, out[-3000:]
        assert coll.kill(signal.SIGTERM) == 0, out[-2000:]
        record_figure("store fills its own disk, then space returns (tmpfs 8 MiB, real collector)",
                      recovery_s=round(recovery_s, 1), snapshot_failures=after["store.snapshot_failures"],
                      snapshots_after=after["store.snapshots_written"] - written_full,
                      write_errors=after["store.write_errors"], batches_acked=client.acked,
                      segments_deleted=len(segs_full - {sid for sid, _ in segments(str(data))}))
