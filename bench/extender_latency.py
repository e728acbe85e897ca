"""kube-scheduler's extender beside Place: p50/p99 of one filter + prioritize pair over HTTP
(NodeNames of every node, nodeCacheCapable) and of Place over gRPC, in the same run, on one collector
holding 5,000 nodes of 8 accelerators that stream at 1 s (place_latency's fleet and ingest), or with
--replica on a cluster-mode scheduler replica following their summaries (fleet_scale's step 5),
and the pair's round trips alone (each request's send to its reply's last byte). Prints a table,
then one line of JSON.

    .venv/bin/python bench/extender_latency.py                  # 5,000 nodes, 15 s each
    .venv/bin/python bench/extender_latency.py --replica        # --nodes 1000 --seconds 5: smaller"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import random
import sys
import time

from place_latency import Feeder, Fleet, PlaceCalls, config, free_port, pct, pin_client, summary

# The pods of place_latency's four request shapes, as a pod asks (docs/kubernetes.md)
PODS = [
    ({"nvidia.com/gpu": "2"}, {"xpusense.io/memory-per-device": "40GB", "xpusense.io/data-region": "cn-beijing",
                               "xpusense.io/replica-zones": "cn-beijing-a,cn-shanghai-b"}),
    ({"huawei.com/Ascend910": "8"}, {"xpusense.io/memory-per-device": "16GB", "xpusense.io/same-domain": "true",
                                     "xpusense.io/data-region": "cn-shanghai"}),
    ({"huawei.com/Ascend910": "4"}, {"xpusense.io/memory-per-device": "32GB", "xpusense.io/residency": "region",
                                     "xpusense.io/data-region": "cn-guangzhou"}),
    ({"nvidia.com/gpu": "1"}, {"xpusense.io/memory-per-device": "60GB", "xpusense.io/regions": "cn-beijing,cn-chengdu",
                               "xpusense.io/replica-zones": "cn-chengdu-a"}),
]


def pod(resources: dict, annotations: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "bench", "namespace": "default", "annotations": annotations},
            "spec": {"containers": [{"name": "main", "image": "bench", "resources": {"limits": resources}}]}}


def extender_client(address: str, names: list[str], seconds: float, pause_s: float, conn) -> None:
    """Closed-loop filter then prioritize (the nodes that passed) on one keep-alive connection, as
    kube-scheduler calls them for a pod; sends back each pair's latency (ms) and the passed counts."""
    pin_client()
    host, port = address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)

    waited = [0]   # ns from each request's send to its reply's last byte

    def post(verb: str, doc: dict):
        out = json.dumps(doc)
        t = time.perf_counter_ns()
        c.request("POST", f"/{verb}", body=out, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        body = r.read()
        waited[0] += time.perf_counter_ns() - t
        if r.status != 200:
            raise RuntimeError(f"/{verb}: HTTP {r.status}: {body[:200]!r}")
        return json.loads(body)

    pods = [pod(*p) for p in PODS]
    post("filter", {"Pod": pods[0], "NodeNames": names})   # connect before the clock starts
    lat, trips, passed = [], [], []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        p = pods[i % len(pods)]
        t = time.perf_counter_ns()
        waited[0] = 0
        f = post("filter", {"Pod": p, "Nodes": None, "NodeNames": names})
        if f["Error"]:
            raise RuntimeError(f["Error"])
        post("prioritize", {"Pod": p, "Nodes": None, "NodeNames": f["NodeNames"]})
        lat.append((time.perf_counter_ns() - t) / 1e6)
        trips.append(waited[0] / 1e6)
        passed.append(len(f["NodeNames"]))
        i += 1
        time.sleep(pause_s)
    conn.send((lat, trips, passed[:len(pods)]))
    conn.close()


async def run(n: int, seconds: float, warmup_s: float, pause_ms: float, seed: int) -> dict:
    from xpusense.collector.extender_http import start_extender
    from xpusense.collector.gc_policy import freeze_long_lived
    from xpusense.collector.server import start_server
    from xpusense.collector.state import FleetState

    rng = random.Random(seed)
    cfg = config()
    ext = cfg.kubernetes.extender
    ext.enabled, ext.listen = True, f"127.0.0.1:{free_port()}"
    state = FleetState(history_s=60.0)
    addr = f"127.0.0.1:{free_port()}"
    server = await start_server(addr, state, config=cfg)
    extender = await start_extender(cfg, server.scheduler, None, state.counters)
    assert extender is not None
    stop = asyncio.Event()
    asyncio.get_running_loop().create_task(freeze_long_lived(stop))
    fleet = Fleet(n, rng)
    for i in range(n):
        state.hello(fleet.hello(i))
        state.ingest(fleet.batch(i))
        if i % 200 == 0:
            await asyncio.sleep(0)
    feeder = Feeder(state, fleet, rng)
    feed = asyncio.create_task(feeder.run(stop))
    await asyncio.sleep(warmup_s)
    loop = asyncio.get_running_loop()
    # Place over gRPC, then the extender, each alone with the ingest beside it
    t0, ingested0 = time.monotonic(), feeder.ingested
    place = PlaceCalls("c", addr, seconds, pause_ms / 1000)
    over_grpc = await loop.run_in_executor(None, lambda: place.latencies(seconds + 60.0))
    recv, child = mp.get_context("spawn").Pipe(duplex=False)
    client = mp.get_context("spawn").Process(target=extender_client, daemon=True,
                                             args=(ext.listen, fleet.ids, seconds, pause_ms / 1000, child))
    client.start()
    got = await loop.run_in_executor(None, lambda: recv.recv() if recv.poll(seconds + 120.0) else None)
    client.join(10)
    batches_s = (feeder.ingested - ingested0) / (time.monotonic() - t0)
    stop.set()
    await feed
    await extender.stop()
    await server.stop(0)
    if got is None:
        raise RuntimeError(f"the extender client gave no answer (exit {client.exitcode})")
    pairs, trips, passed = got
    return {"nodes": n, "devices": n * 8, "grpc_place": summary(over_grpc), "extender_pair": summary(pairs),
            "extender_round_trips": summary(trips), "passed_per_pod": passed, "ingest_target_batches_s": n,
            "ingest_batches_s": round(batches_s, 1),
            "pair_p99_over_place_p99": round(pct(pairs, 0.99) / pct(over_grpc, 0.99), 2)}


def run_replica(n: int, seconds: float, pause_ms: float, seed: int) -> dict:
    """The same two paths against a `scheduler` replica process (pinned to the first CPU) whose fleet
    bucket holds `n` nodes' summaries, each written again once a second meanwhile."""
    import os
    import tempfile

    from _proc import stop
    from fleet_scale import fill_bucket, refresh_for, split_cpus, start_replica, summaries

    from xpusense.collector.cluster.localnats import LocalCluster
    from xpusense.collector.cluster.summary import decode

    tmp = tempfile.mkdtemp(prefix="xpusense-extender-")
    with LocalCluster(3, os.path.join(tmp, "nats")) as cluster:
        cpus, mine, others = split_cpus(cluster)
        data, _ = summaries(n, seed=seed)
        names = [decode(raw)["node"] for raw in data]

        async def fill() -> None:
            wc, _, _ = await fill_bucket(cluster, data)
            await wc.close()
        asyncio.run(fill())
        addr, listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        p, _ = start_replica(tmp, cluster, addr, mine,
                             f'[kubernetes.extender]\nenabled = true\nlisten = "{listen}"\n')
        try:
            os.sched_setaffinity(0, others)
            place = PlaceCalls("c", addr, seconds, pause_ms / 1000)
            asyncio.run(refresh_for(cluster, data, float(n), seconds))
            over_grpc = place.latencies(seconds + 60.0)
            recv, child = mp.get_context("spawn").Pipe(duplex=False)
            client = mp.get_context("spawn").Process(target=extender_client, daemon=True,
                                                     args=(listen, names, seconds, pause_ms / 1000, child))
            client.start()
            # the summaries written again until the client has its figures (it starts slower than Place's)
            asyncio.run(refresh_for(cluster, data, float(n), seconds + 5.0))
            got = recv.recv() if recv.poll(120.0) else None
            client.join(10)
        finally:
            stop(p)
            os.sched_setaffinity(0, set(cpus))
    if got is None:
        raise RuntimeError(f"the extender client gave no answer (exit {client.exitcode})")
    pairs, trips, passed = got
    return {"replica": True, "nodes": n, "devices": n * 8, "grpc_place": summary(over_grpc),
            "extender_pair": summary(pairs), "extender_round_trips": summary(trips), "passed_per_pod": passed,
            "summary_updates_s": n,
            "pair_p99_over_place_p99": round(pct(pairs, 0.99) / pct(over_grpc, 0.99), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--seconds", type=float, default=15.0, help="measured window of each path")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--pause-ms", type=float, default=10.0, help="pause between calls of each client")
    p.add_argument("--seed", type=int, default=9)
    p.add_argument("--replica", action="store_true", help="against a cluster-mode scheduler replica")
    args = p.parse_args()
    r = run_replica(args.nodes, args.seconds, args.pause_ms, args.seed) if args.replica \
        else asyncio.run(run(args.nodes, args.seconds, args.warmup_s, args.pause_ms, args.seed))
    print(f"{'nodes':>6} {'path':<28} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for path, label in (("grpc_place", "Place over gRPC"), ("extender_pair", "extender filter + prioritize"),
                        ("extender_round_trips", "  its two round trips")):
        s = r[path]
        print(f"{r['nodes']:>6} {label:<28} {s['n']:>6} {s['p50_ms']:>8.3f} {s['p99_ms']:>8.3f} {s['max_ms']:>8.3f}")
    goal = r["extender_pair"]["p99_ms"] <= r["grpc_place"]["p99_ms"]
    print(f"goal: filter + prioritize p99 <= Place's over gRPC: {'met' if goal else 'NOT met'}; "
          + (f"a replica following {r['summary_updates_s']} summary updates/s" if args.replica else
             f"ingest {r['ingest_batches_s']:.0f} batches/s (target {r['ingest_target_batches_s']})"))
    print(json.dumps({"bench": "extender_latency", "args": " ".join(sys.argv[1:]), "goal_met": goal, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
