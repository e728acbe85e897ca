"""The scheduler index's sorted fit values (collector/scheduler/ranked.py, filed per placement key
and count by index.py): the multiset against a plain sorted list, and the indexed search that
counts from them against the full scan, with blocks small enough that a bucket has many."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_sim import KINDS, GiB, apply_fit_op, assert_same_answer, dev_id, event, inventory, readings

from xpusense.collector.config import load_collector
from xpusense.collector.scheduler import ranked
from xpusense.collector.scheduler.core import Scheduler
from xpusense.collector.scheduler.index import CMAX, FEWER_AT_ALL, FEWER_OFFERED, SETTLE_NS, Entry
from xpusense.collector.scheduler.ranked import Ranked
from xpusense.collector.state import FleetState
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import telemetry_pb2 as pb

DEFAULTS = load_collector(None, env={})
VALUES = st.sampled_from([FEWER_AT_ALL, FEWER_OFFERED, 0.0, 1.0, 2.5, 16.0, 40.0, 64.0]) | st.floats(0, 80)
OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "replace", "replace_each"]), VALUES, st.integers(0, 10**6)),
               max_size=300)


@settings(max_examples=150, deadline=None)
@given(load=st.sampled_from([1, 2, 3, 8]), ops=OPS, probes=st.lists(VALUES, max_size=6))
def test_ranked_counts_as_a_sorted_list_does(load, ops, probes):
    old_load, ranked.LOAD = ranked.LOAD, load
    try:
        r, ref = Ranked(), []
        for op, v, pick in ops:
            apply_fit_op(r, ref, op, v, pick)
            assert r.maxes == [b[-1] for b in r.blocks] and all(0 < len(b) <= 2 * load for b in r.blocks)
        assert r.values() == sorted(ref) and len(r) == len(ref)
        for x in probes + [-3.0, 100.0] + ref[:5]:
            assert r.at_least(x) == sum(1 for y in ref if y >= x)
        with pytest.raises(ValueError):
            r.remove(1000.0)
        with pytest.raises(ValueError):
            r.replace(-5.0, 1.0)
    finally:
        ranked.LOAD = old_load


def check_index(sch: Scheduler) -> None:
    """Each type pool bucket's sorted values per count are its fresh nodes' fit rows, which are
    their groups' as last refreshed; a node is marked stale in every pool when the last decision
    found it stale (FleetView.stale_known), and only then."""
    view = sch.view
    for pool in view.pools:
        for b in pool.buckets.values():
            entries = b.one_group + list(b.many_groups.values())
            assert b.stale == {e.summary.node_id: e for e in entries if e.stale}
            for e in entries:
                assert e.stale == e.summary.stale == (e.summary.node_id in view.stale_known)
    for pool in view.pools[:2]:
        for b in pool.buckets.values():
            assert b.counts is not None and not b.many_groups
            for e in b.one_group:
                assert e.group is not None and e.row is e.group.fit_row
            for c in range(CMAX):
                assert b.counts[c].values() == sorted(e.row[c] for e in b.one_group if not e.stale)
    # Every one-group node filed once per count it offers: under its tie key when settled, else
    # under its id, at its group's level; an Alike's members are the nodes of its tie key.
    for pool in view.pools:
        for b in pool.buckets.values():
            for c in range(1, CMAX + 1):
                filed = {}
                for level, nodes in enumerate(b.by_level[c]):
                    assert bool(nodes) == bool(b.nonempty[c] >> level & 1)
                    for key, v in nodes.items():
                        members = [v] if isinstance(v, Entry) else list(v.members.values())
                        assert members and (isinstance(v, Entry) or v.order in (None, sorted(v.members)))
                        for e in members:
                            assert e.summary.node_id not in filed
                            filed[e.summary.node_id] = (level, key)
                expected = {}
                for e in b.one_group:
                    assert e.group is not None and e.levels is e.group.levels and e.ties is e.group.ties
                    if e.levels[c] >= 0:
                        key = e.ties[c] if e.settled else e.summary.node_id
                        expected[e.summary.node_id] = (e.levels[c], key)
                assert filed == expected


def assert_same_details(fast: spb.PlaceReply, ref: spb.PlaceReply, where: str) -> None:
    """The candidates' dimensions and penalties, in the same words."""
    def details(reply: spb.PlaceReply) -> list:
        return [[(d.dimension, d.detail) for d in c.dimensions] + [p.detail for p in c.penalties]
                for c in reply.candidates]
    assert details(fast) == details(ref), where


def test_indexed_search_answers_as_the_full_scan_does_with_many_blocks_per_bucket(monkeypatch):
    """Few placement keys and blocks of 2-4 values: every bucket's sorted values span many blocks
    that split and merge as readings, health, labels and inventories change; GPU, NPU, mixed
    and several-domain nodes (910A: two HCCS rings; A100 PCIe: a domain per device); stale nodes."""
    monkeypatch.setattr(ranked, "LOAD", 2)
    rng = random.Random(16)
    clock = [10**18]
    st_ = FleetState(clock=lambda: clock[0])
    sch = Scheduler(st_, DEFAULTS.scheduler, DEFAULTS.stale_s)
    kinds = ["a100", "910b", "910b4", "910a", "a100pcie"]
    nodes: dict[str, list] = {}
    last: dict[str, pb.Batch] = {}

    def hello(nid: str) -> None:
        kind = rng.choice(kinds)
        devices = rng.choice((4, 8, 8))
        labels = {"region": rng.choice(["r1", "r2"]), "price": rng.choice(["1", "2.5", ""])}
        if rng.random() < 0.3:
            labels["encryption"] = "tdx"
        inv = inventory(kind, devices, **{k: v for k, v in labels.items() if v})
        if kind == "a100" and rng.random() < 0.15:   # GPUs and NPUs on one node
            inv.resources.extend(inventory("910b", 4).resources[:4])
        st_.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inv))
        nodes[nid] = [kind, devices, 0]

    def feed(nid: str) -> None:
        kind, devices, seq = nodes[nid]
        nodes[nid][2] = seq = seq + 1
        hbm = KINDS[kind][4] / GiB
        used = {d: rng.choice((0.0, rng.random() * hbm, hbm * 0.5)) for d in range(devices)}
        samples = readings(kind, devices, util={d: rng.random() for d in range(devices)}, used_gib=used,
                           health={d: rng.choice(["OK"] * 15 + ["Alarm"]) for d in range(devices)}, t_ns=clock[0])
        events = []
        if rng.random() < 0.05:
            events.append(event(rng.choice(["xid", "checkpoint_request"]), dev_id(kind, rng.randrange(devices)),
                                clock[0]))
        last[nid] = pb.Batch(node_id=nid, boot_id="b", seq=seq, samples=samples, events=events)
        st_.ingest(last[nid])

    for i in range(160):
        hello(f"n{i:03d}")
        feed(f"n{i:03d}")
    silent = set(rng.sample(sorted(nodes), 12))
    for step in range(4):
        clock[0] += int(rng.choice((5, 6, 7)) * 1e9)   # stale_s 10: the silent ones stale from step 1 or 2
        for nid in nodes:
            if nid not in silent and rng.random() < 0.8:
                feed(nid)
        for nid in rng.sample(sorted(nodes), 6):   # new inventories: other labels, types, device counts
            hello(nid)
            feed(nid)
        if step == 2:   # silent ones back: a resend (last seen now, nothing stored, no watcher called), a batch
            back = rng.sample(sorted(silent), 4)
            assert not st_.ingest(last[back[0]]) and not st_.ingest(last[back[1]])
            feed(back[2])
            silent -= set(back)
        if step:
            check_index(sch)
        for _ in range(25):
            req = spb.PlaceRequest(
                accelerator=rng.choice([spb.ACCELERATOR_ANY, spb.ACCELERATOR_GPU, spb.ACCELERATOR_NPU]),
                memory_bytes=int(rng.choice((0, 1, 16, 30, 32, 40, 60, 64, 79)) * GiB),
                count=rng.choice((1, 2, 4, 5, 8)), same_domain=rng.random() < 0.3,
                data_region=rng.choice(["", "r1"]), limit=rng.choice((1, 5)), max_excluded=400)
            if rng.random() < 0.2:
                req.allowed_regions.append("r2")
            if rng.random() < 0.15:
                req.require_encryption = True
            fast = sch.place(req)
            for x in sch.view.summaries.values():   # the reference works the candidates' details out afresh
                for g in {id(g): g for gs in x.pool_groups for g in gs}.values():
                    g.explained.clear()
            ref = sch.place(req, scan=True)
            where = f"step {step} request {req}"
            assert_same_answer(fast, ref, where)
            # The candidates' details, kept on the groups for the next request (explain.chosen_devices)
            # in the indexed answer, afresh in the reference: the same words.
            assert_same_details(fast, ref, where)
            check_index(sch)
        cut = clock[0] - sch.settings.stale_ns
        assert set(sch.view.stale_known) == {nid for nid in nodes if st_.nodes[nid].last_seen_ns < cut}
        assert step < 2 or silent & set(sch.view.stale_known)
    assert max(len(b.counts[0].blocks) for p in sch.view.pools[:2] for b in p.buckets.values() if b.counts) > 5


def test_a_refresh_that_finds_nothing_moved_answers_as_one_that_regroups(monkeypatch):
    """An idle node's round (the same readings, health and no events: what most of a fleet's
    nodes send between jobs) keeps its groups and their filing (FleetView.unchanged counts it).
    Two cores follow one fleet state, the second regrouping on every refresh: every
    answer is the same, while nodes go idle, busy, unhealthy and back with the same readings,
    take XIDs and checkpoint requests, and those windows end."""
    from xpusense.collector.scheduler import fleet as fleet_mod

    rng = random.Random(7)
    clock = [10**18]
    st_ = FleetState(clock=lambda: clock[0])
    lazy = Scheduler(st_, DEFAULTS.scheduler, DEFAULTS.stale_s)
    eager = Scheduler(st_, DEFAULTS.scheduler, DEFAULTS.stale_s)
    refresh = fleet_mod.FleetView._refresh

    def always(self, s, now, force=False):
        refresh(self, s, now, force=force or self is eager.view)

    monkeypatch.setattr(fleet_mod.FleetView, "_refresh", always)
    for view in (lazy.view, eager.view):
        view.refresh_ns = 0   # every batch refreshes its node at once
    kinds = ["a100", "910b", "a100pcie"]
    nodes: dict[str, list] = {}
    for i in range(40):
        nid, kind = f"n{i:02d}", rng.choice(kinds)
        st_.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inventory(kind, 8, region=rng.choice(["r1", "r2"]),
                                                                            price="1")))
        nodes[nid] = [kind, 0, None]   # kind, seq, the readings sent last
    for step in range(12):
        clock[0] += int(rng.choice((1, 2, 30)) * 1e9)   # 30 s: XID and checkpoint windows end (expire)
        for nid, (kind, seq, last) in nodes.items():
            hbm = KINDS[kind][4] / GiB
            if last is None or rng.random() < 0.3:   # busy: readings move; else idle: the same again
                last = nodes[nid][2] = (
                    {d: rng.choice((0.0, 0.5)) for d in range(8)}, {d: rng.choice((0.0, hbm / 2)) for d in range(8)},
                    {d: rng.choice(["OK"] * 6 + ["Alarm"]) for d in range(8)})
            util, used, health = last
            if rng.random() < 0.1:   # a device's health changes, its readings do not
                health = {**health, (d := rng.randrange(8)): "Alarm" if health[d] == "OK" else "OK"}
                nodes[nid][2] = (util, used, health)
            events = []
            if rng.random() < 0.08:
                events.append(event(rng.choice(["xid", "checkpoint_request"]), dev_id(kind, rng.randrange(8)),
                                    clock[0]))
            nodes[nid][1] = seq = seq + 1
            assert st_.ingest(pb.Batch(node_id=nid, boot_id="b", seq=seq, events=events, samples=readings(
                kind, 8, util=util, used_gib=used, health=health, t_ns=clock[0])))
        for _ in range(15):
            req = spb.PlaceRequest(
                accelerator=rng.choice([spb.ACCELERATOR_ANY, spb.ACCELERATOR_GPU, spb.ACCELERATOR_NPU]),
                memory_bytes=int(rng.choice((0, 16, 32, 40, 64)) * GiB), count=rng.choice((1, 2, 4, 8)),
                same_domain=rng.random() < 0.3, limit=rng.choice((1, 5)), max_excluded=400)
            fast, ref = lazy.place(req), eager.place(req)
            where = f"step {step} request {req}"
            assert_same_answer(fast, ref, where)
            assert_same_details(fast, ref, where)
        check_index(lazy)
    assert lazy.view.unchanged > 150 and eager.view.unchanged == 0   # idle rounds were found, and kept


def same_answer(sch: Scheduler, req: spb.PlaceRequest, where: str) -> spb.PlaceReply:
    """The indexed answer and the full scan's: the same counts, candidates in the same order (ties
    by node id), the same excluded nodes."""
    fast = sch.place(req)
    ref = sch.place(req, scan=True)
    assert_same_answer(fast, ref, where)
    return fast


def test_many_identical_nodes_rank_as_the_full_scan_does():
    """Hundreds of nodes with the same inventory, labels and readings (a homogeneous fleet, idle):
    they score alike, so the top K among them is by node id. Some keep sending the same readings
    (settled at their next refresh), some send once (settled by a decision once unchanged for
    SETTLE_NS), some start to differ or go stale, some come back alike; varied nodes beside them.
    The indexed answer is the scan's throughout, and alike nodes end up filed by tie key."""
    rng = random.Random(21)
    clock = [10**18]
    st_ = FleetState(clock=lambda: clock[0])
    sch = Scheduler(st_, DEFAULTS.scheduler, DEFAULTS.stale_s)
    seq: dict[str, int] = {}

    def send(nid: str, kind: str, used, util=0.0, health=None) -> None:
        seq[nid] = seq.get(nid, 0) + 1
        st_.ingest(pb.Batch(node_id=nid, boot_id="b", seq=seq[nid], samples=readings(
            kind, 8, util=util, used_gib=used, health=health, t_ns=clock[0])))

    alike = [f"a{i:03d}" for i in rng.sample(range(400), 300)]   # ids not in the order they come in
    for nid in alike:
        st_.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inventory("a100", 8, region="r1", price="2")))
        send(nid, "a100", 0.0)
    varied = [f"v{i:03d}" for i in range(60)]
    for nid in varied:
        kind = rng.choice(["a100", "910b"])
        st_.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inventory(kind, 8, region=rng.choice(["r1", "r2"]),
                                                                        price=rng.choice(["1", "2"]))))
        seq[nid] = 0
        send(nid, kind, {d: rng.random() * 60 for d in range(8)}, util={d: rng.random() for d in range(8)})
    kinds = {nid: "a100" for nid in alike} | {nid: st_.nodes[nid].inventory.resources[0].vendor == "nvidia" and
                                                "a100" or "910b" for nid in varied}
    reqs = [spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=40 * GiB, count=2, limit=5),
            spb.PlaceRequest(accelerator=spb.ACCELERATOR_ANY, memory_bytes=16 * GiB, count=8, same_domain=True,
                             limit=20, data_region="r1"),
            spb.PlaceRequest(accelerator=spb.ACCELERATOR_ANY, memory_bytes=60 * GiB, count=1, limit=1,
                             allowed_regions=["r1"]),
            spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=79 * GiB, count=4, limit=3)]
    repeating = set(alike[:100])
    silent = set(alike[250:])
    for r in reqs:
        r.max_excluded = 1000   # all listed: which few are listed is not an order the ranking sets
    for step in range(8):
        clock[0] += SETTLE_NS // 2
        for nid in alike:
            if nid in silent:
                continue
            if nid in repeating:
                send(nid, "a100", 0.0)
            elif rng.random() < 0.1:   # busy for a while: its readings move, then alike again
                send(nid, "a100", {d: rng.random() * 80 for d in range(8)}, util=rng.random())
            elif rng.random() < 0.3:
                send(nid, "a100", 0.0, health={0: "Alarm"} if rng.random() < 0.1 else None)
        for nid in varied:
            send(nid, kinds[nid], {d: rng.random() * 60 for d in range(8)}, util={d: rng.random() for d in range(8)})
        if step == 5:   # the silent ones back, alike
            for nid in silent:
                send(nid, "a100", 0.0)
            silent = set()
        for req in reqs:
            same_answer(sch, req, f"step {step} request {req}")
        check_index(sch)
    gpu = sch.view.pools[0]
    settled = [e for e in gpu.entries.values() if e.summary.node_id.startswith("a") and e.settled]
    assert len(settled) > 200
    top = same_answer(sch, spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=79 * GiB, count=4,
                                            limit=50, max_excluded=1000), "end")
    assert len(top.candidates) == 50 and len({c.score for c in top.candidates}) == 1   # alike nodes only
    assert [c.node_id for c in top.candidates] == sorted(c.node_id for c in top.candidates)


def test_quiet_busy_nodes_settle_on_the_timer(monkeypatch):
    """Alike nodes whose readings moved at their last refresh are filed by id (busy); once quiet for
    SETTLE_NS the view's settling timer on the loop files them by tie key, with no decision needed
    for it, and the indexed answer is the scan's before and after (with SETTLE_NS short here)."""
    from xpusense.collector.scheduler import fleet
    monkeypatch.setattr(fleet, "SETTLE_NS", 200_000_000)
    monkeypatch.setattr(fleet, "SETTLE_EVERY_S", 0.05)

    async def run() -> None:
        st_ = FleetState()
        sch = Scheduler(st_, DEFAULTS.scheduler, DEFAULTS.stale_s, refresh_ms=0)   # refreshed at each batch
        seq: dict[str, int] = {}

        def send(nid: str, used) -> None:
            seq[nid] = seq.get(nid, 0) + 1
            st_.ingest(pb.Batch(node_id=nid, boot_id="b", seq=seq[nid], samples=readings("a100", 8, used_gib=used)))

        alike = [f"a{i:03d}" for i in range(150)]
        for nid in alike:
            st_.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inventory("a100", 8, region="r1", price="2")))
            send(nid, 0.0)
            send(nid, 5.0)   # its readings moved: busy, filed by id
            send(nid, {0: 9.0})
        gpu = sch.view.pools[0]
        assert all(gpu.entries[nid].settled is False for nid in alike) and len(sch.view.busy) == len(alike)
        reqs = [spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=40 * GiB, count=2, limit=5,
                                 max_excluded=1000),
                spb.PlaceRequest(accelerator=spb.ACCELERATOR_ANY, memory_bytes=16 * GiB, count=8, same_domain=True,
                                 limit=20, max_excluded=1000)]
        for req in reqs:
            same_answer(sch, req, f"busy {req}")
        deadline = time.monotonic() + 60
        while sch.view.busy and time.monotonic() < deadline:   # the timer's work, on this loop
            await asyncio.sleep(0.01)
        assert not sch.view.busy and sch.view.settled >= len(alike)
        assert all(gpu.entries[nid].settled for nid in alike)
        for req in reqs:
            top = same_answer(sch, req, f"settled {req}")
            assert [c.node_id for c in top.candidates] == sorted(c.node_id for c in top.candidates)
        check_index(sch)
        send(alike[0], 30.0)   # busy again: noted, with the timer armed for it
        assert alike[0] in sch.view.busy and sch.view.settle_timer is not None

    asyncio.run(run())


def test_nodes_of_one_device_domains_misfit_as_the_full_scan_says():
    """Nodes whose devices are each a domain of their own (A100 PCIe), asked for several devices in
    one domain: misfits without a look at their groups, each classified once per request shape
    until a refresh changes its groups (Entry.misfit); the same answers as the scan throughout,
    as readings and health move."""
    rng = random.Random(5)
    clock = [10**18]
    st_ = FleetState(clock=lambda: clock[0])
    sch = Scheduler(st_, DEFAULTS.scheduler, DEFAULTS.stale_s)
    seq: dict[str, int] = {}

    def feed(nid: str) -> None:
        seq[nid] = seq.get(nid, 0) + 1
        used = {d: rng.choice((0.0, 20.0, 39.0)) for d in range(8)}
        health = {d: rng.choice(["OK"] * 6 + ["Alarm"]) for d in range(8)}
        st_.ingest(pb.Batch(node_id=nid, boot_id="b", seq=seq[nid], samples=readings(
            "a100pcie", 8, util={d: rng.random() for d in range(8)}, used_gib=used, health=health, t_ns=clock[0])))

    pcie = [f"p{i:03d}" for i in range(120)]
    for nid in pcie + [f"n{i:02d}" for i in range(30)]:
        kind = "a100pcie" if nid in pcie else rng.choice(["a100", "910a"])
        st_.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inventory(kind, 8, region=rng.choice(["r1", "r2"]))))
        if kind == "a100pcie":
            feed(nid)
    shapes = [spb.PlaceRequest(accelerator=a, memory_bytes=m * GiB, count=c, same_domain=True, limit=5, max_excluded=x)
              for a in (spb.ACCELERATOR_ANY, spb.ACCELERATOR_GPU) for m in (1, 30) for c in (1, 2, 4, 8)
              for x in (3, 400)]
    for step in range(3):
        clock[0] += 10**9
        for nid in rng.sample(pcie, 40):   # refreshed: their misfit reasons worked out again
            feed(nid)
        for _ in range(2):   # each shape twice: the second from what the first kept
            for req in shapes:
                same_answer(sch, req, f"step {step} request {req}")
        check_index(sch)
    kept = [e for p in sch.view.pools[3:] for e in p.entries.values() if e.summary.node_id in pcie and e.misfit]
    assert kept and all(e.most_offered <= 1 for e in kept)
    # ...and the misfits' sums per bucket and shape (search._MisfitSums), answered from since the last refresh
    summed = [m for p in sch.view.pools[3:] for b in p.buckets.values() for m in b.misfit_sums.values()
              if m.version == b.version and m.listed]
    assert summed


class _Node:
    price: float | None = 2.0


def _reference_figures(devs: list, factor: float, inv_best: float) -> dict:
    """A Group's figures worked out as its docstring defines them, one device at a time."""
    from xpusense.collector.scheduler.index import INF, LEVELS
    from xpusense.collector.scheduler.scoring import value_norm, value_per_price
    offered = sorted([d for d in devs if d.excluded is None], key=lambda d: d.choice_order)
    free_desc = sorted((d.free for d in offered), reverse=True)
    min_free, mean_free, penalty = [INF], [0.0], [1.0]
    for c in range(1, len(offered) + 1):
        first = offered[:c]
        min_free.append(min(min(d.free for d in first), float(INF)))
        mean_free.append(sum(d.free_score for d in first) / c)
        penalty.append(factor if any(d.penalty is not None for d in first) else 1.0)
    tflops = min(d.tflops for d in devs) if all(d.tflops is not None for d in devs) else None
    norm = value_norm(value_per_price(tflops, _Node.price), inv_best)
    compute = [norm * f for f in mean_free]
    levels = [-1] + [(LEVELS - 1 if compute[c] >= 1.0 else int(compute[c] * LEVELS)) if c < len(compute) else -1
                     for c in range(1, CMAX + 1)]
    return {"devices": offered, "free_desc": free_desc, "free_all_desc": sorted((d.free for d in devs), reverse=True),
            "min_free": min_free, "mean_free": mean_free, "penalty": penalty, "compute": compute, "levels": levels,
            "fit_row": [free_desc[c - 1] if c <= len(offered) else FEWER_OFFERED if c <= len(devs) else FEWER_AT_ALL
                        for c in range(1, CMAX + 1)],
            "ties": [None] + [(compute[c], penalty[c], min_free[c], free_desc[c - 1]) if levels[c] >= 0 else None
                              for c in range(1, CMAX + 1)],
            "n_all": len(devs), "tflops": tflops, "value_norm": norm}


@settings(max_examples=300, deadline=None)
@given(devs=st.lists(st.tuples(st.sampled_from([0.0, 1e9, 2e10, 4e10, float("inf")]), st.floats(0, 1),
                               st.booleans(), st.booleans(), st.sampled_from([None, 100.0, 312.0])),
                     min_size=1, max_size=CMAX + 3),
       inv_best=st.sampled_from([0.0, 0.003, 0.02]), with_static=st.booleans())
def test_a_group_holds_the_figures_its_docstring_defines(devs, inv_best, with_static):
    """Group works its figures out with shortcuts (one device; what changes only with the inventory,
    group_static, given by the caller): they are those of the definitions, device by device."""
    from xpusense.collector.scheduler.index import Device, Group, group_static
    made = []
    for i, (free, score, penalised, excluded, tflops) in enumerate(devs):
        d = Device(str(i), "GPU", "A100", 4e10, tflops, "pcie:0")
        d.free, d.free_score = free, score
        d.penalty = "HBM watch" if penalised else None
        d.excluded = ("xid", "XID 79") if excluded else None
        d.choice_order = (d.penalty is not None, -score, -free)
        made.append(d)
    node = _Node()
    g = Group(node, "GPU", "", made, 0.7, group_static(node, made) if with_static else None)  # type: ignore[arg-type]
    g.rescale(inv_best)
    for name, want in _reference_figures(made, 0.7, inv_best).items():
        got = getattr(g, name)
        got = list(got) if name == "fit_row" else got
        assert got == want, (name, got, want)


@settings(max_examples=300, deadline=None)
@given(dev=st.tuples(st.sampled_from([0.0, 1e9, 4e10, float("inf")]), st.floats(0, 1), st.booleans(), st.booleans(),
                     st.sampled_from([None, 100.0, 312.0])),
       inv_best=st.sampled_from([0.0, 0.003, 0.02]))
def test_one_device_group_is_the_general_one(dev, inv_best):
    """Group.of_one (a refresh's one-device domain groups, made in one step) holds every figure the
    general constructor and rescale() give the same device."""
    from xpusense.collector.scheduler.index import Device, Group, group_static
    free, score, penalised, excluded, tflops = dev
    d = Device("0", "GPU", "A100", 4e10, tflops, "pcie:0")
    d.free, d.free_score = free, score
    d.penalty = "HBM watch" if penalised else None
    d.excluded = ("xid", "XID 79") if excluded else None
    node = _Node()
    static = group_static(node, [d])  # type: ignore[arg-type]
    want = Group(node, "GPU", "pcie:0", [d], 0.7, static)  # type: ignore[arg-type]
    want.rescale(inv_best)
    got = Group.of_one(node, "GPU", "pcie:0", d, 0.7, static, inv_best)  # type: ignore[arg-type]
    for name in Group.__slots__:
        a, b = getattr(got, name), getattr(want, name)
        assert (list(a) if name == "fit_row" else a) == (list(b) if name == "fit_row" else b), (name, a, b)
        assert type(a) is type(b), name
