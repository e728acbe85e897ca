"""Group commits at most every `[store] commit_interval_s` (collector/store/writer.py): records
queued within it wait for one write and fsync together, none is durable (its future done) before
that, and records still waiting for the interval at close are written then."""

from __future__ import annotations

import asyncio
import time

from test_store import batch

from xpusense.collector.state import FleetState
from xpusense.collector.store import Store

INTERVAL_S = 1.0


def test_records_queued_within_the_interval_share_one_group_commit(tmp_path):
    store = Store(str(tmp_path / "d"), segment_bytes=10**12, segment_s=10**9, commit_interval_s=INTERVAL_S)
    store.open(FleetState())
    got: dict = {}

    async def go():
        await store.append(["b", batch("n", "b1", 1, 1.0).SerializeToString()])   # the first: at once
        began = time.monotonic()
        assert store.commits == 1 and store.commit_waits == 0
        futs = []
        for s in range(2, 22):   # one at a time, the loop running between them (the I/O thread is idle)
            futs.append(store.submit(["b", batch("n", "b1", s, s * 1.0).SerializeToString()]))
            await asyncio.sleep(0)
        assert not any(f.done() for f in futs) and store.commits == 1   # none durable yet: not written
        await asyncio.gather(*futs)
        got["after_s"] = time.monotonic() - began
        got["commits"], got["waits"] = store.commits, store.commit_waits
        store.submit(["b", batch("n", "b1", 22, 22.0).SerializeToString()])   # waits for the interval: the stop comes first
    asyncio.run(go())
    store.close()   # writes what was queued (never acknowledged)

    assert got["commits"] == 2 and got["waits"] == 1, got   # the twenty in one group after the first
    assert got["after_s"] >= 0.9 * INTERVAL_S, got
    state = FleetState()
    figures = Store(str(tmp_path / "d")).open(state)
    assert figures["batches"] == 22 and state.nodes["n"].stored_up_to["b1"] == 22
