"""The scheduler replica's own parts (collector/cluster/scheduler.py) with the core over them: a
listed node's next summary update is deferred like any other (a summary carries its readings, so
there is no first batch to wait for)."""

from __future__ import annotations

import time

from sched_sim import GiB, inventory, readings

from xpusense.collector.cluster.scheduler import FleetIndex
from xpusense.collector.cluster.summary import NodeLatest
from xpusense.collector.config import load_collector
from xpusense.collector.scheduler.core import Scheduler
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import telemetry_pb2 as pb

DEFAULTS = load_collector(None, env={})


def _node(nid: str, used: float) -> NodeLatest:
    n = NodeLatest(nid, 0)
    n.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inventory("a100", 8, region="r1", price="2")), "s", "", 1)
    n.apply(pb.Batch(node_id=nid, boot_id="b", seq=1, samples=readings("a100", 8, used_gib=used)), time.time_ns())
    return n


def test_update_after_a_listed_node_is_deferred_and_answered_with():
    idx = FleetIndex()
    nodes = {nid: _node(nid, 10.0) for nid in ("n1", "n2")}
    for i, n in enumerate(nodes.values()):
        idx.apply(n.encode("w", time.time_ns()), revision=i + 1)
    sch = Scheduler(idx, DEFAULTS.scheduler, DEFAULTS.stale_s, refresh_ms=1000.0)
    view = sch.view
    n1 = sch.view.summaries["n1"]
    assert n1.devices[0].free == 70 * GiB                      # the listed readings, without a batch
    nodes["n1"].apply(pb.Batch(node_id="n1", boot_id="b", seq=2, samples=readings("a100", 8, used_gib=75.0)),
                      time.time_ns())
    before = view.refreshes
    idx.apply(nodes["n1"].encode("w", time.time_ns()), revision=3)
    assert "n1" in view.dirty and not view.first and view.refreshes == before   # marked, not refreshed at once
    req = spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=40 * GiB, count=1, limit=5, max_excluded=10)
    reply = sch.place(req)                                     # no loop: catch_up refreshes it first
    assert [c.node_id for c in reply.candidates] == ["n2"] and not view.dirty
    assert n1.devices[0].free == 5 * GiB


def test_a_long_healthy_watch_starts_the_restart_backoff_over(monkeypatch):
    import asyncio

    from xpusense.collector.cluster import scheduler as replica
    index = FleetIndex()
    now = [0.0]
    index.watch_clock = lambda: now[0]
    lasted = iter([0.0, 0.0, 0.0, 2 * replica.WATCH_HEALTHY_S, 0.0])
    slept: list[float] = []

    async def a_round(js, kv, bucket):
        now[0] += next(lasted)
        raise ConnectionError("the server went")

    async def sleep(delay):
        slept.append(delay)
        if len(slept) == 5:
            raise asyncio.CancelledError

    monkeypatch.setattr(index, "_list_and_watch", a_round)
    monkeypatch.setattr(replica.asyncio, "sleep", sleep)
    try:
        asyncio.run(index.follow(None, None, "fleet"))
    except asyncio.CancelledError:
        pass
    first, longest = replica.WATCH_BACKOFF_S
    assert len(slept) == 5 and index.watch_restarts == 5
    assert slept[2] >= 2 * first         # failing at once: the wait grew (d/2..d, d doubling)
    assert slept[3] <= first             # after a watch that followed for long: back to the first wait
    assert all(d <= longest for d in slept)
