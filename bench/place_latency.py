"""Scheduler decision latency: p50/p99 of Place at 1,000 and 10,000 nodes of 8 accelerators while
every node streams at 1 s, in one process and one asyncio loop as in the collector (run_size).

    .venv/bin/python bench/place_latency.py                      # 1,000 and 10,000 nodes, ~100 s
    .venv/bin/python bench/place_latency.py --nodes 1000 --seconds 10
    .venv/bin/python bench/place_latency.py --nodes 10000 --identical 1000   # + 1,000 nodes alike

Prints a table, then one line of JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import time

GOAL_P99_MS = 1.0    # at 1,000 nodes
DEVICES = 8
GiB = 2**30
KINDS = [  # type, vendor, model, memory attribute, HBM bytes, interconnect, device id pattern
    ("GPU", "nvidia", "A100-SXM4-80GB", "80GB", 80 * GiB, "NVLink", "gpu{}"),
    ("NPU", "huawei", "Ascend-910B", "64GB", 64 * GiB, "HCCS", "npu{}-0"),
    ("NPU", "huawei", "Ascend-910B4", "32GB", 32 * GiB, "HCCS", "npu{}-0"),
]
REGIONS = ["cn-beijing", "cn-shanghai", "cn-guangzhou", "cn-chengdu"]
SERIES = ["hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit",
          "xpusense.accelerator.hbm.bandwidth.utilization", "hw.gpu.memory.utilization"]
TEMPLATES = 16   # prebuilt batches per kind, values differ; each send stamps node, seq and time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin_client() -> None:
    """On a machine with more than one CPU: the gRPC client on the last one (the collector side,
    whose gRPC threads must not preempt its loop thread, keeps them all)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, cpus[-1:])


def pct(vals: list[float], q: float) -> float:
    if not vals:
        return float("nan")
    v = sorted(vals)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def requests():
    from xpusense.v1 import scheduler_pb2 as spb
    return [
        spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=40 * GiB, count=2,
                         data_region="cn-beijing", replica_zones=["cn-beijing-a", "cn-shanghai-b"]),
        spb.PlaceRequest(accelerator=spb.ACCELERATOR_ANY, memory_bytes=16 * GiB, count=8, same_domain=True,
                         data_region="cn-shanghai"),
        spb.PlaceRequest(accelerator=spb.ACCELERATOR_NPU, memory_bytes=32 * GiB, count=4,
                         residency=spb.RESIDENCY_REGION, data_region="cn-guangzhou"),
        spb.PlaceRequest(accelerator=spb.ACCELERATOR_ANY, memory_bytes=60 * GiB, count=1,
                         allowed_regions=["cn-beijing", "cn-chengdu"], replica_zones=["cn-chengdu-a"]),
    ]


def config():
    """Collector config with a region matrix, through the checked loader."""
    import tempfile

    from xpusense.collector.config import load_collector
    lines = ["[scheduler.region_latency_ms]"]
    lines += [f'"{a}/{b}" = {10 + 10 * abs(i - j)}' for i, a in enumerate(REGIONS) for j, b in enumerate(REGIONS) if i < j]
    lines += ["[scheduler.region_transfer_cost]"]
    lines += [f'"{a}/{b}" = 0.02' for i, a in enumerate(REGIONS) for b in REGIONS[i + 1:]]
    lines += ["[scheduler.peak_tflops]", '"Ascend-910B" = 300']
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        return load_collector(f.name, env={})
    finally:
        os.unlink(f.name)


class Fleet:
    """n varied nodes, then `identical` nodes alike in everything but their id: node 0's inventory
    and labels, and always its first batch's values (a homogeneous fleet, idle)."""

    def __init__(self, n: int, rng: random.Random, identical: int = 0):
        from xpusense.v1 import telemetry_pb2 as pb
        self.pb = pb
        self.varied = n
        self.n = n = n + identical
        self.ids = [f"node-{i:05d}" for i in range(n)]
        self.kind = [i % 3 if i < self.varied else 0 for i in range(n)]
        self.seq = [0] * n
        self.templates = [[self._batch(k, rng) for _ in range(TEMPLATES)] for k in range(len(KINDS))]
        self.rng = rng
        self.events = 0

    def inventory(self, i: int):
        pb = self.pb
        hostname, i = self.ids[i], i if i < self.varied else 0
        rtype, vendor, model, mem, _, link, pattern = KINDS[self.kind[i]]
        region = REGIONS[i % len(REGIONS)]
        labels = {"cloud": "bench", "region": region, "zone": f"{region}-{'abc'[(i // 4) % 3]}",
                  "price": f"{1.0 + (i % 7) * 0.5:.1f}"}
        if i % 5 == 0:
            labels["encryption"] = "tdx"
        if i % 10 == 0:
            labels["attestation"] = "tpm2"
        inv = pb.Inventory(hostname=hostname, labels=labels)
        for d in range(DEVICES):
            r = inv.resources.add(type=rtype, vendor=vendor, model=model, id=pattern.format(d),
                                  attributes={"memory": mem, **({"nvlink_count": "12"} if rtype == "GPU" else {})})
            r.interconnects.add(type=link)
        return inv

    def _batch(self, k: int, rng: random.Random):
        pb = self.pb
        _, vendor, _, _, hbm, _, pattern = KINDS[k]
        b = pb.Batch()
        for d in range(DEVICES):
            lab = {"device": pattern.format(d), "vendor": vendor}
            util = rng.random()
            used = hbm * rng.random() * 0.6
            vals = [util, used, float(hbm), rng.random() * 0.9, used / hbm]
            for j, (name, v) in enumerate(zip(SERIES, vals)):
                b.samples.add(name=name, unit="1", kind=pb.GAUGE, labels=lab, value=v,
                              series_ref=d * len(SERIES) + j + 1)
        return b

    def hello(self, i: int):
        return self.pb.Hello(node_id=self.ids[i], boot_id="bench-boot", agent_version="bench",
                             inventory=self.inventory(i), time_unix_nano=time.time_ns())

    def batch(self, i: int):
        """The next batch of node i: a template stamped with node, seq and now (ingest is synchronous,
        so one template object can serve many nodes in turn)."""
        self.seq[i] += 1
        alike = i >= self.varied
        b = self.templates[self.kind[i]][0 if alike else self.seq[i] % TEMPLATES]
        b.node_id, b.boot_id, b.seq = self.ids[i], "bench-boot", self.seq[i]
        t = time.time_ns()
        b.sent_unix_nano = t
        for s in b.samples:
            s.time_unix_nano = t
        del b.events[:]
        if alike:
            return b
        r = self.rng.random()
        if r < 0.001:      # about one node in a thousand per second: an XID, or the HBM watch firing
            kind, pattern = KINDS[self.kind[i]][0], KINDS[self.kind[i]][6]
            etype = "xid" if kind == "GPU" and r < 0.0005 else "checkpoint_request"
            device = pattern.format(self.rng.randrange(DEVICES))
            b.events.add(id=f"e{self.events}", type=etype, severity="critical", device=device,
                         message="bench", attributes={"xid": "79"} if etype == "xid" else {}, time_unix_nano=t)
            self.events += 1
        return b


def grpc_client(addr: str, seconds: float, pause_s: float, conn) -> None:
    """Closed-loop Place calls from another process (grpc's sync stub); sends back the latencies (ms)."""
    pin_client()
    import grpc

    from xpusense.v1 import scheduler_pb2_grpc as spb_grpc
    reqs = requests()
    lat = []
    with grpc.insecure_channel(addr) as ch:
        stub = spb_grpc.SchedulerStub(ch)
        stub.Place(reqs[0], timeout=10)   # connect before the clock starts
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            t = time.perf_counter_ns()
            stub.Place(reqs[i % len(reqs)], timeout=10)
            lat.append((time.perf_counter_ns() - t) / 1e6)
            i += 1
            time.sleep(pause_s)
    conn.send(lat)
    conn.close()


CLIENTS = ("c", "python")


class PlaceCalls:
    """Closed-loop Place calls to `addr` from another process, pinned by pin_client(): `kind` "c",
    bench/loadgen/place_calls.c (one HTTP/2 connection, the requests' bytes as protobuf makes them;
    the default), or "python", grpc_client() above (grpc's sync stub: ~1 ms of CPU a call of its
    own, in the figure)."""

    def __init__(self, kind: str, addr: str, seconds: float, pause_s: float):
        self.kind = kind
        if kind == "c":
            import tempfile

            from load_agents import build_c
            binary = build_c("place_calls")
            with tempfile.NamedTemporaryFile("w", suffix=".hex", delete=False) as f:
                f.write("".join(r.SerializeToString().hex() + "\n" for r in requests()))
            self.path = f.name
            self.proc = subprocess.Popen([binary, addr, f.name, repr(seconds), repr(pause_s)], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, preexec_fn=pin_client)
            self.pid = self.proc.pid
        elif kind == "python":
            self.conn, child = mp.get_context("spawn").Pipe(duplex=False)
            self.client = mp.get_context("spawn").Process(target=grpc_client, args=(addr, seconds, pause_s, child),
                                                          daemon=True)
            self.client.start()
            self.pid = self.client.pid
        else:
            raise ValueError(f"Place client {kind!r}: one of {', '.join(CLIENTS)}")

    def latencies(self, timeout_s: float) -> list[float]:
        """The calls' latencies (ms) once the client is done; a failed call is an error naming its status."""
        if self.kind == "python":
            lat = self.conn.recv() if self.conn.poll(timeout_s) else []
            self.client.join(10)
            return lat
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        finally:
            os.unlink(self.path)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the C Place client exited {self.proc.returncode}: {err.strip()}")
        r = json.loads(out)
        if r["errors"]:
            raise RuntimeError(f"{r['errors']} Place calls failed, the first with {r['first_error']}")
        return r["latencies_ms"]


class Feeder:
    """Each node's next batch once a second through FleetState.ingest, the nodes spread over the
    second on a 5 ms tick so that ingest interleaves with decisions; `ingested` counts them and
    `lag_ms` how late each tick's batches were."""

    def __init__(self, state, fleet: Fleet, rng: random.Random, tick_s: float = 0.005):
        self.state, self.fleet, self.rng, self.tick_s = state, fleet, rng, tick_s
        self.ingested = 0
        self.lag_ms: list[float] = []

    async def run(self, stop: asyncio.Event) -> None:
        state, fleet, n = self.state, self.fleet, self.fleet.n
        phase = [self.rng.random() for _ in range(n)]               # each node's offset within the second
        order = sorted(range(n), key=lambda i: phase[i])
        start = time.monotonic()
        pos, rnd = 0, 0
        while not stop.is_set():
            now = time.monotonic()
            due = (now - start) - rnd   # seconds into the current round
            burst = 0
            while pos < n and phase[order[pos]] <= due:
                state.ingest(fleet.batch(order[pos]))
                self.ingested += 1
                pos += 1
                burst += 1
                if burst % 25 == 0:      # let decisions and gRPC in, as separate streams would
                    await asyncio.sleep(0)
            if pos >= n and due >= 1.0:
                pos, rnd = 0, rnd + 1
            target = start + rnd + (phase[order[pos]] if pos < n else 1.0)
            self.lag_ms.append(max(0.0, now - target) * 1e3 if pos < n and target < now else 0.0)
            await asyncio.sleep(self.tick_s)


async def run_size(n: int, seconds: float, warmup_s: float, interval_ms: float, seed: int,
                   identical: int = 0, client_kind: str = "c") -> dict:
    """One fleet size: a FleetState with the scheduler core attached (following the state through its
    watcher) and the real gRPC server (Ingest, Query, Scheduler) on 127.0.0.1; the collector's
    gc.freeze() routine as in `serve`. Every node says Hello with an inventory of 8 devices (a third
    each A100-SXM4-80GB with NVLink, Ascend-910B 64GB, Ascend-910B4 32GB; labels region, zone, price,
    some encryption/attestation), then one Batch a second through FleetState.ingest (8 devices x 5
    realtime series, series_ref set, values changing; now and then an XID or a checkpoint request),
    spread over the second on a 5 ms tick so that ingest interleaves with decisions.

    Measured over `seconds` after `warmup_s`:
    - in process: Scheduler.place(request) on the loop, timed around the call (answer proto
      included), one decision every `interval_ms` (x n / 2,000 above 2,000 nodes), requests rotating
      over the four shapes of requests(); `inproc_cpu` is the same calls' CPU time on the loop thread
      (time.thread_time), which leaves out what preempted the thread;
    - over gRPC: PlaceCalls in a closed loop, loopback and the wait for the ingesting loop included;
    - ingest achieved (batches/s against the target), so that an overloaded loop shows.
    """
    from xpusense.collector.gc_policy import freeze_long_lived
    from xpusense.collector.server import start_server
    from xpusense.collector.state import FleetState

    rng = random.Random(seed)
    cfg = config()
    state = FleetState(history_s=60.0)
    addr = f"127.0.0.1:{free_port()}"
    server = await start_server(addr, state, config=cfg)
    sched = server.scheduler
    stop = asyncio.Event()
    asyncio.get_running_loop().create_task(freeze_long_lived(stop))
    fleet = Fleet(n, rng, identical)
    n = fleet.n   # the identical nodes stream too
    t_setup = time.perf_counter()
    for i in range(n):
        state.hello(fleet.hello(i))
        state.ingest(fleet.batch(i))
        if i % 200 == 0:
            await asyncio.sleep(0)
    setup_s = time.perf_counter() - t_setup

    reqs = requests()
    inproc: list[float] = []
    inproc_cpu: list[float] = []
    counts: dict = {}

    async def decider():
        i = 0
        while not stop.is_set():
            req = reqs[i % len(reqs)]
            c = time.thread_time_ns()
            t = time.perf_counter_ns()
            reply = sched.place(req)
            inproc.append((time.perf_counter_ns() - t) / 1e6)
            inproc_cpu.append((time.thread_time_ns() - c) / 1e6)
            if i < len(reqs):
                counts[i] = (reply.nodes_feasible, dict(reply.excluded_counts), len(reply.candidates))
            i += 1
            await asyncio.sleep(interval_ms / 1000)

    feeder = Feeder(state, fleet, rng)
    feed = asyncio.create_task(feeder.run(stop))
    await asyncio.sleep(warmup_s)
    ingested_at_start, t0 = feeder.ingested, time.monotonic()
    feeder.lag_ms.clear()
    client = PlaceCalls(client_kind, addr, seconds, interval_ms / 1000)
    dec = asyncio.create_task(decider())
    await asyncio.sleep(seconds)
    stop.set()
    window_s = time.monotonic() - t0
    batches_s = (feeder.ingested - ingested_at_start) / window_s
    await asyncio.gather(feed, dec)
    over_grpc = await asyncio.get_running_loop().run_in_executor(None, lambda: client.latencies(60.0))
    await server.stop(0)
    inproc_steady = inproc[len(reqs):]   # the first round of each shape is not in the figures
    cpu_steady = inproc_cpu[len(reqs):]
    return {
        "nodes": n - identical, "identical": identical, "devices": n * DEVICES, "setup_s": round(setup_s, 2),
        "ingest_target_batches_s": n, "ingest_batches_s": round(batches_s, 1),
        "ingest_lag_p99_ms": round(pct(feeder.lag_ms, 0.99), 2),
        "inproc": summary(inproc_steady), "inproc_cpu": summary(cpu_steady), "grpc": summary(over_grpc),
        "first_round": {str(k): v for k, v in counts.items()},
    }


def summary(vals: list[float]) -> dict:
    return {"n": len(vals), "p50_ms": round(pct(vals, 0.50), 3), "p90_ms": round(pct(vals, 0.90), 3),
            "p99_ms": round(pct(vals, 0.99), 3), "max_ms": round(max(vals), 3) if vals else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1000,10000", help="fleet sizes, comma separated")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per size")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--interval-ms", type=float, default=10.0, help="pause between in-process decisions")
    p.add_argument("--seed", type=int, default=9)
    p.add_argument("--identical", type=int, default=0,
                   help="nodes alike in everything but their id, besides each size's varied nodes (default 0)")
    p.add_argument("--client", choices=CLIENTS, default="c",
                   help="the gRPC client: c (bench/loadgen/place_calls.c, default) or python (grpc's stub: "
                        "its own ~1 ms of CPU a call is in the figure)")
    args = p.parse_args()
    sizes = [int(x) for x in args.nodes.split(",") if x]
    results = []
    for n in sizes:
        # Fewer in-process decisions at 10,000 nodes, so the loop still has room to ingest.
        interval = args.interval_ms * max(1.0, n / 2000)
        results.append(asyncio.run(run_size(n, args.seconds, args.warmup_s, interval, args.seed, args.identical,
                                           args.client)))
    head = (f"{'nodes':>6} {'path':<10} {'decisions':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}"
            "  ingest batches/s (target)")
    print(head)
    for r in results:
        for path in ("inproc", "inproc_cpu", "grpc"):
            s = r[path]
            print(f"{r['nodes']:>6} {path:<10} {s['n']:>9} {s['p50_ms']:>8.3f} {s['p90_ms']:>8.3f} {s['p99_ms']:>8.3f} "
                  f"{s['max_ms']:>8.3f}  {r['ingest_batches_s']:.0f} ({r['ingest_target_batches_s']})")
    first = next((r for r in results if r["nodes"] == 1000), None)
    goal = None if first is None else first["inproc"]["p99_ms"] <= GOAL_P99_MS
    print(f"goal: p99 <= {GOAL_P99_MS} ms per decision at 1,000 nodes (in-process, wall clock): "
          + ("n/a" if goal is None else "met" if goal else "NOT met")
          + ("" if first is None else f"; CPU p99 {first['inproc_cpu']['p99_ms']:.3f} ms; "
             f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"))
    print(json.dumps({"bench": "place_latency", "goal_p99_ms": GOAL_P99_MS, "goal_met": goal, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
