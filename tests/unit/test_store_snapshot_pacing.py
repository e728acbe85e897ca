"""A periodic snapshot paced to `[store] snapshot_cpu_share` of a core (collector/store/snapshot_taker.py),
so that ingest keeps up while a large fleet's snapshot is written; a stop ends the pacing at once,
and what was written restores the state exactly."""

from __future__ import annotations

import asyncio
import time

from helpers import until
from test_store_snapshot import Live, batch, full_replay, picture, restart

NODES = 1000


async def _fleet(live: Live) -> None:
    """NODES nodes of a few batches each, logged in group commits (not one fsync a batch)."""
    for i in range(NODES):
        live.hello(f"n{i}", "b1", f"host-{i}")
    for seq in range(1, 4):
        batches = [batch(f"n{i}", "b1", seq) for i in range(NODES)]
        futs = [live.submit(b) for b in batches]
        await asyncio.gather(*futs)
        for b, fut in zip(batches, futs):
            live.apply(b, fut)


def test_a_periodic_snapshot_keeps_to_its_cpu_share_and_a_stop_ends_the_pacing(tmp_path):
    live = Live(tmp_path / "d")
    snap = live.snap
    snap.chunk_series = 40   # ten nodes a chunk: many chunks, each paced
    snap.every_s, snap.after_records, snap.cpu_share = 0.01, 1, 0.05
    got: dict = {}

    async def go():
        await _fleet(live)
        stop = asyncio.Event()
        task = asyncio.create_task(snap.run(stop))
        await until(lambda: snap.periods >= 1, "the first period", 120)   # skipped: nothing logged since start
        live.hello("n0", "b1", "host-0")   # one record more: the next period writes a snapshot, from its start
        seen = snap.periods
        await until(lambda: snap.periods > seen, "the next period", 120)
        c0, t0 = time.process_time(), time.monotonic()
        await until(lambda: snap.written >= 1, "the periodic snapshot", 120)
        share = (time.process_time() - c0) / (time.monotonic() - t0)
        first = snap.last
        assert first["snapshot_nodes_written"] == NODES and first["snapshot_paced_ms"] > 0
        # The process as a whole (the snapshot's work on the loop and in its thread, and this test's
        # polling) used about a twentieth of a core while it was written: unpaced, it takes all it gets.
        assert share < 0.3, (share, first)
        assert first["snapshot_write_ms"] >= 0.8 * first["snapshot_work_ms"] / 0.05, first
        # The next one, paced to a hundredth of a core (100 times its work), ends at once on a stop.
        snap.cpu_share = 0.01
        live.hello("n0", "b1", "host-0")
        seen = snap.periods
        await until(lambda: snap.periods > seen, "the next period", 120)
        await until(lambda: snap.paced_s > 0, "the next snapshot paced", 120)
        t1 = time.monotonic()
        stop.set()
        await task
        got["stopped_in_s"] = time.monotonic() - t1
        got["cut"] = dict(snap.last)
        assert await snap.take("stop") is not None   # as cli.py does at a clean stop: never paced
        got["stop"] = dict(snap.last)
    asyncio.run(go())
    live.store.close()

    assert got["cut"]["snapshot_paced_ms"] > 0 and got["stopped_in_s"] < 0.5 * got["cut"]["snapshot_work_ms"] / 1000 / 0.01, got
    assert got["stop"]["snapshot_paced_ms"] == 0 and snap.written == 3   # periodic, cut short at stop, stop
    # What the snapshots hold restores the same state as the whole log.
    figures, st = restart(tmp_path / "d")
    assert figures["snapshot_loaded"] == 1 and figures["batches"] == 0
    _, full = full_replay(tmp_path / "d", tmp_path)
    want = picture(full)
    assert picture(st) == want and len(want) == 3 + NODES
    assert {k: v for k, v in picture(live.state).items() if k != "known"} == {k: v for k, v in want.items() if k != "known"}
