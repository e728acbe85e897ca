"""Cluster mode at fleet scale: the tier per core and per node, projected to 100,000 nodes at 1 batch/s.

    .venv/bin/python bench/fleet_scale.py                 # whole_run: six steps, ~4 min on 2 cores
    .venv/bin/python bench/fleet_scale.py --place-only    # step 5 alone, ~1.5 min
    .venv/bin/python bench/fleet_scale.py --ack-only      # step 2 alone, ~1.5 min (--spy PY_SPY: stacks)

Prints a table, then one JSON line (figures, NATS mode, date, CPU model, steal): --record FILE
appends it to FILE (bench/results/); --nats-open runs NATS plaintext, for TLS's cost as a ratio."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from datetime import UTC, datetime
from types import SimpleNamespace

import collector_ingest
import load_agents
from _proc import cpu_s, free_port, machine_ticks, pin, run_delay_ms, steal_pct, stop, tail, wait_collector
from collector_ingest import DEVICES, SERIES, percentile, raise_nofile
from collector_ingest import SimAgent as LoadAgent
from place_latency import CLIENTS, Fleet, PlaceCalls, config, pct, requests

GOALS = {"gateway_per_core": 2500, "worker_per_core": 3000, "bytes_per_node": 64 * 1024, "ack_p99_ms": 100.0,
         "place_inproc_p99_ms": 1.0, "place_grpc_p99_ms": 5.0, "stream_mb_s_per_replica": 100.0}
TARGET_NODES = 100_000
UPDATE_PASSES = 5   # the CPU per summary update followed: the median of these passes over the fleet


def nats_keys(cluster) -> dict:
    """The [nats] keys a client of this LocalCluster needs: its URLs and, unless it is open to all,
    the TLS files with `{role}` in the certificate's path (each connection takes its role's)."""
    keys: dict = {"urls": cluster.urls}
    if not cluster.open_to_all:
        keys.update(zip(("tls_ca", "tls_cert", "tls_key"), cluster.tls_files("{role}")))
    return keys


def nats_mode(cluster) -> str:
    return "open" if cluster.open_to_all else "tls"


def nats_cfg(cluster, summary_s: float = 2.0) -> SimpleNamespace:
    from xpusense.collector.cluster.cli import load_config
    flags = {f"nats.{k}": v for k, v in nats_keys(cluster).items()}
    cfg = load_config(None, {**flags, "nats.summary_s": summary_s}, env={})
    return cfg


def collector_toml(tmp: str, cluster, top: str = "") -> str:
    path = os.path.join(tmp, "collector.toml")
    with open(path, "w") as f:
        f.write(top + "[limits]\nbatches_per_s = 1000000\nburst_batches = 1000000\n[nats]\n"
                + "".join(f"{k} = {json.dumps(v)}\n" for k, v in nats_keys(cluster).items()))
    return path


def cpu_model() -> str:
    """/proc/cpuinfo's first "model name" ('' where it has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def measured_rate(bytes_per_point: float | None) -> tuple[float, float, str] | None:
    """(bytes a point, points a second a node, from where) for the stream MB/s per replica: the newest
    line of bench/results/wire_bytes.jsonl (its "after" run, else "before"): the bytes of its batches
    and series tables a point (what the batch stream and the series bucket keep; Hellos and HTTP/2
    framing are not kept), else, in lines without that split, its wire bytes a point;
    `bytes_per_point` in place of that figure when given (points/s: the simulated agents' batch a
    second where no line is)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "wire_bytes.jsonl")
    lines: list[dict] = []
    try:
        with open(path) as f:
            lines = [x for x in map(json.loads, filter(str.strip, f)) if not x.get("npu")]
    except OSError:
        pass
    got = max(lines, key=lambda x: str(x.get("date", "")), default={})
    runs = got.get("runs", {}).get("after") or got.get("runs", {}).get("before") or {}
    pps = float(runs.get("points_per_s") or DEVICES * len(SERIES))
    if bytes_per_point is not None:
        return bytes_per_point, pps, "--bytes-per-point"
    when = got.get("date", "")[:10]
    if "batch_bytes_per_point" in runs:
        kept = float(runs["batch_bytes_per_point"]) + float(runs.get("series_bytes_per_point", 0.0))
        return round(kept, 2), pps, f"batches and series tables, wire_bytes.jsonl, {when}"
    if "wire_bytes_per_point" in runs:
        return float(runs["wire_bytes_per_point"]), pps, f"the wire, wire_bytes.jsonl, {when}"
    return None


def emit(args: argparse.Namespace, cluster, summary: dict) -> None:
    """The run's JSON line, the last of stdout, with the NATS mode, the date (UTC), the CPU model and
    the host's steal since the start; appended to --record FILE too."""
    line = json.dumps({**summary, "nats": nats_mode(cluster), "date": datetime.now(UTC).isoformat(timespec="seconds"),
                       "cpu_model": cpu_model(), "steal_pct": round(steal_pct(args.ticks, machine_ticks()), 2)})
    print(line, flush=True)
    if args.record:
        with open(args.record, "a") as f:
            f.write(line + "\n")


def load(address: str, agents: int, rate: float, window: int, seconds: float, warmup_s: float,
         gen_cpus: list[int], watch_pid: int, procs: int, also_pids: tuple[int, ...] = (), on_window=None,
         generator: str = "c") -> dict:
    """collector_ingest's simulated agents (bench/load_agents.py, `generator`) against `address`; the
    figures, watch_pid's CPU and the summed CPU of also_pids (the nats-servers) and of the load
    generator in the window; on_window() is called as the window opens."""
    gen = load_agents.start(generator, list(range(agents)), address, rate, window, gen_cpus, procs)
    try:
        fails, _, _ = gen.wait_ready(300.0)
        if fails:
            raise RuntimeError(f"{len(fails)} simulated agents failed to connect, e.g. {fails[0]}")
        gens = gen.pids
        (c0, o0, g0, w0), (c1, o1, g1, w1) = load_agents.window(
            gen, warmup_s, seconds,
            lambda: (cpu_s(watch_pid), sum(map(cpu_s, also_pids)), sum(map(cpu_s, gens)), time.monotonic()),
            on_window)
        results = gen.results(120.0)
    finally:
        gen.close()
    wall = w1 - w0
    lat = sorted(x for r in results for x in r["latencies_ms"])
    acked = sum(r["window_acked"] for r in results)
    return {"batches_s": acked / wall, "cpu": (c1 - c0) / wall, "others_cpu": (o1 - o0) / wall, "gen_cpu": (g1 - g0) / wall,
            "p50_ms": percentile(lat, 0.5), "p90_ms": percentile(lat, 0.9),
            "p99_ms": percentile(lat, 0.99), "max_ms": percentile(lat, 1.0),
            "errors": [f for r in results for f in r["fails"]], "sent": sum(r["sent"] for r in results)}


# -- 3. the worker --------------------------------------------------------------------------------------
async def worker_rate(cluster, timeout_s: float = 300.0) -> dict:
    from xpusense.collector.cluster.engine import connect, ensure
    from xpusense.collector.cluster.subjects import stream_name
    from xpusense.collector.cluster.worker import Worker
    cfg = nats_cfg(cluster, summary_s=2.0)
    n = cfg.nats
    nc = await connect(n, "bench-worker", role="worker")
    js = nc.jetstream(timeout=10)
    buckets = await ensure(js, n, create=False)   # the gateway made them
    total = stored = 0
    for i in range(n.streams):
        state = (await js.stream_info(stream_name(n.prefix, i))).state
        total += state.messages
        stored += state.bytes   # as JetStream keeps them: subject, headers and the batch
    w = Worker(js, buckets, n, "bench-worker")
    stop_ev = asyncio.Event()
    c0, t0 = time.process_time(), time.monotonic()
    task = asyncio.create_task(w.run(stop_ev))
    while time.monotonic() - t0 < timeout_s and w.messages < total:
        await asyncio.sleep(0.05)
    c1, t1 = time.process_time(), time.monotonic()
    stop_ev.set()
    await task
    await nc.close()
    return {"handled": w.handled, "in_stream": total, "messages": w.messages, "cpu_s": c1 - c0, "wall_s": t1 - t0,
            "per_core": w.handled / max(1e-9, c1 - c0), "nodes": len(w.nodes), "dropped": w.dropped,
            "stored_bytes_per_message": stored / max(1, total)}


# -- 4. memory per node -----------------------------------------------------------------------------
def summaries(count: int, seed: int = 7) -> tuple[list[bytes], int]:
    """`count` nodes' summaries as workers write them (NodeLatest after two 160-sample batches)
    and the worker state's Python allocations per node (tracemalloc)."""
    from xpusense.collector.cluster.summary import NodeLatest
    fleet = Fleet(count, random.Random(seed))
    agent = LoadAgent(0, "nvidia")
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    nodes = []
    for i in range(count):
        node = NodeLatest(fleet.ids[i], 0)
        node.hello(fleet.hello(i), "gw/1", "ipv4:10.0.0.1:5000", time.time_ns())
        for _ in range(2):
            agent.next_batch()
            b = agent.msg.batch
            b.node_id, b.boot_id = fleet.ids[i], "bench-boot"
            node.apply(b, time.time_ns())
            node.apply(fleet.batch(i), time.time_ns())
        nodes.append(node)
    per_node = (tracemalloc.get_traced_memory()[0] - before) / count
    tracemalloc.stop()
    return [n.encode("bench", time.time_ns()) for n in nodes], int(per_node)


def moved(data: list[bytes]) -> list[bytes]:
    """The summaries with every series' latest value changed (utilisation, free memory, bandwidth):
    what a node's next summary carries."""
    import msgpack

    from xpusense.collector.cluster.summary import decode
    out = []
    for raw in data:
        d = decode(raw)
        d["series"] = [[*row[:4], row[4] * 0.5 if isinstance(row[4], float) else row[4], *row[5:]] for row in d["series"]]
        out.append(msgpack.packb(d, use_bin_type=True))
    return out


def scheduler_memory(data: list[bytes]) -> tuple[int, float]:
    """Python allocations per node of a scheduler replica's FleetIndex + core over these summaries,
    and the CPU per summary update followed (the summaries again with every reading moved, and the
    index's refresh of the nodes they marked, as a replica's timer does it).

    The CPU is timed on a second index, built as a replica builds it (not traced), over UPDATE_PASSES
    passes, the median pass: the first pass after tracemalloc.stop() on the traced index cost 25-100
    us an update from run to run (the allocator's arenas changing hands, not the code), against a
    steady ~25 us."""
    from xpusense.collector.cluster.scheduler import FleetIndex
    from xpusense.collector.scheduler.core import Scheduler
    cfg = config()

    def built() -> tuple[FleetIndex, Scheduler]:
        idx = FleetIndex()
        for i, d in enumerate(data):
            idx.apply(d, i + 1)
        return idx, Scheduler(idx, cfg.scheduler, cfg.stale_s)

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    traced = built()
    per_node = (tracemalloc.get_traced_memory()[0] - before) / len(data)
    tracemalloc.stop()
    del traced
    idx, core = built()
    versions = (moved(data), data)   # each pass moves every reading a decision reads
    passes = []
    for p in range(1, UPDATE_PASSES + 1):
        c0 = time.process_time()
        for i, d in enumerate(versions[p % 2]):
            idx.apply(d, p * len(data) + i + 1)
        core.view.refresh_dirty()   # what a replica's timer does within index_refresh_ms of each
        passes.append((time.process_time() - c0) / len(data))
    assert core.view.summaries
    return int(per_node), statistics.median(passes)


# -- 5. Place from the KV-fed index ---------------------------------------------------------------------
def refreshed(data: list[bytes]) -> list[tuple[str, bytes]]:
    """(key, summary) with the node seen now, as its worker would write it next."""
    import msgpack

    from xpusense.collector.cluster.subjects import partition, token
    from xpusense.collector.cluster.summary import decode, fleet_key
    now = time.time_ns()
    out = []
    for raw in data:
        d = decode(raw)
        d["last_seen_ns"] = d["written_ns"] = now
        out.append((fleet_key(partition(d["node"], 12), token(d["node"])), msgpack.packb(d, use_bin_type=True)))
    return out


async def refresher(kv, data: list[bytes], per_s: float, stop_ev: asyncio.Event) -> int:
    """Summaries written again at `per_s` a second (fresh last-seen), as workers do: the index follows."""
    sent, i, t0 = 0, 0, time.monotonic()
    while not stop_ev.is_set():
        due = int((time.monotonic() - t0) * per_s) - sent
        if due > 0:
            chunk = refreshed([data[(i + k) % len(data)] for k in range(min(due, 200))])
            await asyncio.gather(*(kv.put(k, v) for k, v in chunk))
            sent += len(chunk)
            i += len(chunk)
        await asyncio.sleep(0.02)
    return sent


async def fill_bucket(cluster, data: list[bytes]):
    """The streams and buckets made (as a gateway makes them) and `data` written to the fleet bucket
    (as workers write it): (the writer's connection, the buckets, seconds the writes took)."""
    from xpusense.collector.cluster.engine import connect, ensure
    n = nats_cfg(cluster).nats
    setup = await connect(n, "bench-setup", role="gateway")
    await ensure(setup.jetstream(timeout=30), n)
    await setup.close()
    wc = await connect(n, "bench-writer", role="worker")
    buckets = await ensure(wc.jetstream(timeout=30), n, create=False)
    t0 = time.monotonic()
    for i in range(0, len(data), 500):
        await asyncio.gather(*(buckets.fleet.put(k, v) for k, v in refreshed(data[i:i + 500])))
    return wc, buckets, time.monotonic() - t0


async def place_from_bucket(cluster, data: list[bytes], seconds: float, updates_s: float) -> dict:
    from xpusense.collector.cluster.engine import connect, ensure
    from xpusense.collector.cluster.scheduler import follow_fleet
    from xpusense.collector.gc_policy import freeze_long_lived
    cfg = config()
    cfg.nats = nats_cfg(cluster).nats
    cfg.stale_s = 3600.0         # what is measured is the decision, not how long the bench took to set up
    n = cfg.nats
    wc, buckets, put_s = await fill_bucket(cluster, data)
    nc = await connect(n, "bench-place", role="scheduler")   # the index, as a replica follows it
    js = nc.jetstream(timeout=30)
    t0 = time.monotonic()
    sched = await follow_fleet(js, (await ensure(js, n, create=False)).fleet, cfg, timeout_s=300)
    list_s = time.monotonic() - t0
    # The replica's garbage-collection policy (run_scheduler): without it this process's full
    # collections walked the 10,000 nodes' index, 39 of up to 0.66 s in a 15 s window.
    gc_stop = asyncio.Event()
    gc_policy = asyncio.create_task(freeze_long_lived(gc_stop))
    reqs = requests()
    lat, cpu = [], []
    for r in reqs:
        sched.core.place(r)          # the first of each shape is not counted
    stop_ev = asyncio.Event()
    refresh = asyncio.create_task(refresher(buckets.fleet, data, updates_s, stop_ev))
    u0 = sched.index.updates
    end = time.monotonic() + seconds
    i = 0
    view = sched.core.view
    caught_up = caught_up_nodes = 0   # decisions that refreshed nodes first (the timer behind), and how many
    # Off its CPU in the window (read once each side: a /proc read before every decision cost it
    # ~40 us of CPU at p50, caches): waiting behind another task, and the host's steal.
    mine_cpu = min(os.sched_getaffinity(0))   # the decisions' CPU (place_step pins them to one)
    ticks0, delay0 = machine_ticks(mine_cpu), run_delay_ms(os.getpid())
    while time.monotonic() < end:
        r0 = view.refreshes
        c, t = time.thread_time_ns(), time.perf_counter_ns()
        sched.core.place(reqs[i % len(reqs)])
        lat.append((time.perf_counter_ns() - t) / 1e6)
        cpu.append((time.thread_time_ns() - c) / 1e6)
        caught_up += view.refreshes > r0
        caught_up_nodes += view.refreshes - r0
        i += 1
        await asyncio.sleep(0.002)
    ticks1, delay1 = machine_ticks(mine_cpu), run_delay_ms(os.getpid())
    stop_ev.set()
    await refresh
    gc_stop.set()
    await gc_policy
    followed = (sched.index.updates - u0) / seconds
    slow = sorted(range(len(lat)), key=lat.__getitem__)[-max(1, len(lat) // 100):]   # the slowest 1%
    listed = len(sched.index.nodes)
    await sched.close()
    await nc.close()
    await wc.close()
    return {"put_s": put_s, "list_s": list_s, "listed": listed, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
            "cpu_p50_ms": pct(cpu, 0.5), "cpu_p99_ms": pct(cpu, 0.99), "n": len(lat), "followed_s": followed,
            "caught_up": caught_up, "caught_up_nodes": caught_up_nodes, "settled": getattr(view, "settled", 0),
            # Where the slowest 1% went: the decision's own CPU time; the rest was off its CPU
            # (preempted by another task: the window's waits; the host's steal; interrupts).
            "slow_ms": sum(lat[k] for k in slow) / len(slow), "slow_cpu_ms": sum(cpu[k] for k in slow) / len(slow),
            "waited_ms": delay1 - delay0,
            "steal_pct": steal_pct(ticks0, ticks1)}


def start_replica(tmp: str, cluster, addr: str, cpus: set[int] | None = None,
                  extra_toml: str = "") -> tuple[subprocess.Popen, str]:
    """A `scheduler` replica process on `addr` (pinned to `cpus`), once it places: (process, log path).
    `extra_toml`: config sections of its own (the extender's)."""
    cfg_path = collector_toml(tmp, cluster, "stale_s = 3600.0\n" + extra_toml)
    log_path = os.path.join(tmp, "scheduler.log")
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "xpusense.collector.cluster", "scheduler", "--config", cfg_path,
                              "--listen", addr, "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    if cpus:
        pin(p.pid, cpus)   # pinned from here (no preexec_fn next to gRPC's threads)
    try:
        wait_collector(addr, 300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:   # listening comes after the list: ready
            try:
                import grpc

                from xpusense.v1 import scheduler_pb2_grpc as spb_grpc
                with grpc.insecure_channel(addr) as ch:
                    spb_grpc.SchedulerStub(ch).Place(requests()[0], timeout=10)
                break
            except Exception:
                time.sleep(1)
    except Exception:
        print(tail(log_path), file=sys.stderr)
        stop(p)
        raise
    return p, log_path


def place_over_grpc(tmp: str, cluster, data: list[bytes], seconds: float, updates_s: float,
                    spy: str = "", replica_cpus: set[int] | None = None, client_kind: str = "c") -> dict:
    """A `scheduler` replica process answering a client over gRPC while the bucket changes at
    updates_s; also the replica's CPU in the window (a share of a core). `spy`: py-spy's binary, to
    record the replica's stacks over the window (raw, for flame graphs; tmp/scheduler.spy.txt).
    `replica_cpus`: the replica pinned to these (the client and the writer run where this process may)."""
    addr = f"127.0.0.1:{free_port()}"
    p, log_path = start_replica(tmp, cluster, addr, replica_cpus)
    try:
        spy_proc = None
        if spy:
            spy_proc = subprocess.Popen([spy, "record", "--pid", str(p.pid), "--format", "raw", "--rate", "250",
                                         "--duration", str(int(seconds)), "--output",
                                         os.path.join(tmp, "scheduler.spy.txt"), "--nonblocking"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = PlaceCalls(client_kind, addr, seconds, 0.002)
        c0, w0, d0 = cpu_s(p.pid), time.monotonic(), (run_delay_ms(p.pid), run_delay_ms(c.pid))
        asyncio.run(refresh_for(cluster, data, updates_s, seconds))
        c1, w1, d1 = cpu_s(p.pid), time.monotonic(), (run_delay_ms(p.pid), run_delay_ms(c.pid))
        lat = c.latencies(120.0)
        rss = _rss_kb(p.pid)
        if spy_proc is not None:
            spy_proc.wait(60)
    except Exception:
        print(tail(log_path), file=sys.stderr)
        raise
    finally:
        stop(p)
    return {"p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "n": len(lat), "rss_mb": rss / 1024,
            "replica_cpu": (c1 - c0) / max(1e-9, w1 - w0),
            # Time the replica's threads and the client's waited behind other tasks in the window, a call
            "replica_waited_ms": (d1[0] - d0[0]) / max(1, len(lat)), "client_waited_ms": (d1[1] - d0[1]) / max(1, len(lat))}


async def refresh_for(cluster, data: list[bytes], updates_s: float, seconds: float) -> None:
    from xpusense.collector.cluster.engine import connect, ensure
    n = nats_cfg(cluster).nats
    nc = await connect(n, "bench-refresh", role="worker")   # the summaries' writer, as workers are
    buckets = await ensure(nc.jetstream(timeout=30), n, create=False)
    stop_ev = asyncio.Event()
    task = asyncio.create_task(refresher(buckets.fleet, data, updates_s, stop_ev))
    await asyncio.sleep(seconds)
    stop_ev.set()
    await task
    await nc.close()


def split_cpus(cluster, shared: bool = False) -> tuple[list[int], set[int], set[int]]:
    """(this process's CPUs, the first for the replica, the others), the NATS servers pinned to the
    others; every CPU both where `shared` or on a 1-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    mine, others = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 and not shared else (set(cpus), set(cpus))
    for srv in cluster.servers:
        if srv.proc is not None:
            pin(srv.proc.pid, others)
    return cpus, mine, others


def place_step(args: argparse.Namespace, cluster, tmp: str) -> tuple[dict, dict]:
    """Step 5, as a replica runs (a core of its own; NATS on other machines): the decisions, in this
    process and then in the replica process, pinned to the first CPU; the NATS servers, the bucket's
    writer and the gRPC client to the others (all CPUs alike with --shared-cpus, or on a 1-CPU machine)."""
    cpus, mine, others = split_cpus(cluster, args.shared_cpus)
    print(f"5. Place at {args.place_nodes} nodes from the fleet bucket (decisions on CPUs {sorted(mine)}, "
          f"NATS, writer and client on {sorted(others)}) ...", flush=True)
    big, _ = summaries(args.place_nodes, seed=11)
    try:
        os.sched_setaffinity(0, mine)
        inproc = asyncio.run(place_from_bucket(cluster, big, args.seconds, args.updates_s))
        os.sched_setaffinity(0, others)
        over = place_over_grpc(tmp, cluster, big, args.seconds, args.updates_s, args.spy, mine, args.client)
    finally:
        os.sched_setaffinity(0, set(cpus))
        for srv in cluster.servers:
            if srv.proc is not None and srv.proc.poll() is None:
                pin(srv.proc.pid, set(cpus))
    return inproc, over


def place_only(args: argparse.Namespace) -> int:
    """Step 5 alone: Place in process and over gRPC from a replica following the fleet bucket."""
    from xpusense.collector.cluster.localnats import LocalCluster
    tmp = tempfile.mkdtemp(prefix="xpusense-fleet-")
    with LocalCluster(3, os.path.join(tmp, "nats"), open_to_all=args.nats_open) as cluster:
        inproc, over = place_step(args, cluster, tmp)
    print(f"Place at {inproc['listed']:,} nodes, {inproc['followed_s']:,.0f} summary updates/s followed: in process "
          f"p50 {inproc['p50_ms']:.3f} ms, p99 {inproc['p99_ms']:.3f} ms (goal <= 1; CPU p50 {inproc['cpu_p50_ms']:.3f}, "
          f"p99 {inproc['cpu_p99_ms']:.3f} ms; {inproc['n']} decisions, {inproc['caught_up']} of them refreshed "
          f"{inproc['caught_up_nodes']} nodes first; the slowest 1% {inproc['slow_ms']:.3f} ms on average, "
          f"{inproc['slow_cpu_ms']:.3f} ms of it on its CPU; in the window {inproc['waited_ms']:.1f} ms waiting "
          f"behind other tasks, its CPU's steal {inproc['steal_pct']:.1f}%); over gRPC p50 {over['p50_ms']:.3f} ms, "
          f"p99 {over['p99_ms']:.3f} ms (goal <= 5; {over['n']} calls; the replica's CPU meanwhile "
          f"{100 * over['replica_cpu']:.0f}% of a core; waits behind other tasks, a call on average: the "
          f"replica's threads {over['replica_waited_ms']:.3f} ms, the client's {over['client_waited_ms']:.3f} ms); "
          f"load average {os.getloadavg()[0]:.2f}"
          + (f"; py-spy profile of the replica: {os.path.join(tmp, 'scheduler.spy.txt')}" if args.spy else ""))
    emit(args, cluster, {"bench": "fleet_scale", "place_only": True, "place_nodes": inproc["listed"],
                         "place_inproc": {k: round(v, 3) if isinstance(v, float) else v for k, v in inproc.items()},
                         "place_grpc": {k: round(v, 3) if isinstance(v, float) else v for k, v in over.items()}})
    return 0


def gateway_proc(tmp: str, cluster, cpu: int) -> tuple[subprocess.Popen, str, str]:
    """A `serve --nats` gateway process pinned to `cpu`, serving: (process, address, log path)."""
    cfg_path = collector_toml(tmp, cluster)
    address = f"127.0.0.1:{free_port()}"
    log_path = os.path.join(tmp, "gateway.log")
    with open(log_path, "w") as log:
        gw = subprocess.Popen([sys.executable, "-m", "xpusense.collector.cluster", "serve", "--config", cfg_path,
                               "--listen", address, "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    pin(gw.pid, {cpu})   # pinned from here (no preexec_fn next to gRPC's threads)
    try:
        wait_collector(address, 60)
    except Exception:
        stop(gw)
        print(tail(log_path), file=sys.stderr)
        raise
    return gw, address, log_path


def publish_probe(cluster, every_s: float, stop_ev, out: list[float], marks: list[float] | None = None) -> None:
    """JetStream's own publish-ack latency meanwhile (the servers' share of the ack): one R3
    publish every `every_s`, to each stream in turn, from this process (idle but for this), timed
    here, as a gateway; a node id no agent has. Runs in a thread until stop_ev is set. `marks`: the
    arrival time (monotonic) of every write to the marks bucket meanwhile, as a worker's KV watch
    (an ordered consumer of the bucket's stream, new writes only) sees it."""
    from nats.js import api

    from xpusense.collector.cluster.engine import connect
    from xpusense.collector.cluster.subjects import node_subject
    n = nats_cfg(cluster).nats

    async def run() -> None:
        nc = await connect(n, "bench-probe", role="gateway")
        js = nc.jetstream(timeout=10)
        watcher = None
        if marks is not None:
            async def seen(_msg) -> None:
                marks.append(time.monotonic())
            watcher = await connect(n, "bench-marks", role="worker")
            await watcher.jetstream(timeout=10).subscribe(
                f"$KV.{n.marks_bucket}.>", stream=f"KV_{n.marks_bucket}", cb=seen, ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.NEW)
        i = 0
        while not stop_ev.is_set():
            i += 1
            t0 = time.perf_counter()
            await js.publish(node_subject(n.prefix, "probe", i % n.partitions, "bench-probe"), b"x",
                             headers={"Nats-Msg-Id": f"bench-probe:{i}"})
            out.append(1e3 * (time.perf_counter() - t0))
            await asyncio.sleep(every_s)
        await nc.close()
        if watcher is not None:
            await watcher.close()
    asyncio.run(run())


def marks_bins(times: list[float], bin_s: float = 0.5) -> list[int]:
    """Writes per `bin_s` from the first to the last (bursts show as a few full bins)."""
    if not times:
        return []
    t0 = min(times)
    bins = [0] * (int((max(times) - t0) / bin_s) + 1)
    for t in times:
        bins[int((t - t0) / bin_s)] += 1
    return bins


def ack_only(args: argparse.Namespace) -> int:
    """Step 2 alone: --fleet agents x 1 batch/s through one gateway; ack p50/p90/p99/max, the
    gateway's CPU and the nats-servers' CPU in the window, the load average; with --spy PY_SPY a
    py-spy profile of the gateway over the run (raw/collapsed stacks, for flame graphs)."""
    from xpusense.collector.cluster.localnats import LocalCluster
    cpus = sorted(os.sched_getaffinity(0))
    gw_cpu, gen_cpus = cpus[0], cpus[1:] or cpus
    tmp = tempfile.mkdtemp(prefix="xpusense-fleet-")
    spy = None
    with LocalCluster(3, os.path.join(tmp, "nats"), open_to_all=args.nats_open) as cluster:
        servers = tuple(s.proc.pid for s in cluster.servers if s.proc is not None)
        gw, address, log_path = gateway_proc(tmp, cluster, gw_cpu)
        try:
            if args.spy:
                out_path = os.path.join(tmp, "gateway.spy.txt")
                spy = subprocess.Popen([args.spy, "record", "--pid", str(gw.pid), "--format", "raw", "--rate", "200",
                                        "--output", out_path, "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"2. gateway at 1 s: {args.fleet} agents x 1 batch/s, {args.seconds:g} s ...", flush=True)
            probed: list[float] = []
            marks: list[float] = []
            probe_stop = threading.Event()
            probe = threading.Thread(target=publish_probe, args=(cluster, 0.05, probe_stop, probed, marks),
                                     daemon=True)
            la0 = os.getloadavg()[0]
            try:
                window: list[float] = []
                fleet = load(address, args.fleet, 1.0, 8, args.seconds, 5.0, gen_cpus, gw.pid, 4, servers,
                             generator=args.generator, on_window=lambda: (window.append(time.monotonic()), probe.start()))
            finally:
                probe_stop.set()
            la1 = os.getloadavg()[0]
            probe.join(30)
            probed.sort()
        except Exception:
            print(tail(log_path), file=sys.stderr)
            raise
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            stop(gw)
    print(f"ack at {args.fleet} agents x 1/s through one gateway: p50 {fleet['p50_ms']:.1f} ms, p90 "
          f"{fleet['p90_ms']:.1f} ms, p99 {fleet['p99_ms']:.1f} ms (goal <= 100), max {fleet['max_ms']:.1f} ms; "
          f"{fleet['batches_s']:,.0f} acked/s; gateway CPU {100 * fleet['cpu']:.0f}% "
          f"({1e6 * fleet['cpu'] / max(1.0, fleet['batches_s']):.0f} us a batch), 3 nats-servers' CPU "
          f"{100 * fleet['others_cpu']:.0f}%, the agents' (load generator) {100 * fleet['gen_cpu']:.0f}%; "
          f"load average {la0:.2f} before, {la1:.2f} after; JetStream's own publish ack meanwhile (a probe "
          f"publishing 20/s from the bench process): p50 {percentile(probed, 0.5):.1f} ms, p99 "
          f"{percentile(probed, 0.99):.1f} ms, max {percentile(probed, 1.0):.1f} ms ({len(probed)} publishes)"
          + (f"; {len(fleet['errors'])} agent errors, e.g. {fleet['errors'][0]}" if fleet["errors"] else ""))
    # In the window only: the agents' streams end after it, and each flushes its mark then.
    marks = [t for t in marks if window and t < window[0] + args.seconds]
    per_bin = marks_bins(marks)
    print(f"marks bucket writes meanwhile: {len(marks) / args.seconds:.0f}/s, the busiest 0.5 s held "
          f"{max(per_bin, default=0)} (mean {sum(per_bin) / max(1, len(per_bin)):.0f})")
    if spy is not None:
        print(f"py-spy profile of the gateway: {out_path}")
    emit(args, cluster, {"bench": "fleet_scale", "ack_only": True, "fleet": args.fleet,
                         "marks_writes_s": round(len(marks) / args.seconds, 1),
                         "marks_peak_per_0_5s": max(per_bin, default=0),
                         **{k: round(v, 3) for k, v in fleet.items() if isinstance(v, float)},
                         "load_average": [round(la0, 2), round(la1, 2)], "errors": len(fleet["errors"]),
                         "probe_p50_ms": round(percentile(probed, 0.5), 2),
                         "probe_p99_ms": round(percentile(probed, 0.99), 2), "probe_n": len(probed)})
    return 0


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# -- the run ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="each measurement window (default 20)")
    p.add_argument("--agents", type=int, default=8, help="agents for the saturation step (default 8)")
    p.add_argument("--fleet", type=int, default=1000, help="agents at 1 batch/s through one gateway (default 1000)")
    p.add_argument("--mem-nodes", type=int, default=2000, help="nodes for the memory figures (default 2000)")
    p.add_argument("--place-nodes", type=int, default=10000, help="nodes in the fleet bucket for Place (default 10000)")
    p.add_argument("--updates-s", type=float, default=1000.0,
                   help="summary updates/s the index follows while Place is measured (default 1000)")
    p.add_argument("--generator", choices=load_agents.KINDS, default="c",
                   help="the simulated agents: c (default) or python (grpc aio)")
    p.add_argument("--client", choices=CLIENTS, default="c",
                   help="step 5's gRPC client: c (bench/loadgen/place_calls.c, default) or python (grpc's stub: "
                        "its own ~1 ms of CPU a call is in the figure)")
    p.add_argument("--place-only", action="store_true", help="only step 5, Place from the fleet bucket")
    p.add_argument("--ack-only", action="store_true",
                   help="only step 2, ack latency of --fleet agents x 1 batch/s through one gateway")
    p.add_argument("--shared-cpus", action="store_true",
                   help="step 5: the decisions share every CPU with NATS (not pinned)")
    p.add_argument("--spy", metavar="PY_SPY", default="",
                   help="with --ack-only: the py-spy binary to profile the gateway with (raw stacks); "
                        "with --place-only: the scheduler replica over gRPC")
    p.add_argument("--nats-open", action="store_true",
                   help="run the NATS cluster plaintext, anonymous and without permissions (default: as deployed, "
                        "TLS with one certificate and its permissions per role), for the cost of TLS as a ratio")
    p.add_argument("--bytes-per-point", type=float, default=None, metavar="B",
                   help="bytes a point on the wire for the stream MB/s per replica at 100,000 nodes (default: the "
                        "newest bench/results/wire_bytes.jsonl run)")
    p.add_argument("--compact", action="store_true",
                   help="the simulated agents send the compact encoding (default: Sample messages)")
    p.add_argument("--record", metavar="FILE", default="",
                   help="also append the JSON line to FILE (e.g. bench/results/fleet_scale.jsonl)")
    args = p.parse_args(argv)
    if args.compact:   # this process's agents (the C generator's plan) and the Python generator's workers
        collector_ingest.COMPACT = True
        os.environ["XPUSENSE_BENCH_COMPACT"] = "1"
    raise_nofile()
    ticks = args.ticks = machine_ticks()
    try:
        if args.place_only:
            return place_only(args)
        if args.ack_only:
            return ack_only(args)
        return whole_run(args)
    finally:   # on stderr: the last line of stdout stays the JSON summary
        print(f"the machine's CPU time stolen by its host over the run: {steal_pct(ticks, machine_ticks()):.1f}% "
              "(a busy host: figures are its, not the code's)", file=sys.stderr)


def whole_run(args) -> int:
    """A real 3-server NATS JetStream cluster on loopback (R3, default sync policy) run as deployed:
    TLS, each connection on its role's certificate and permissions (nats_auth.py), or plaintext and
    anonymous with --nats-open, to measure TLS's cost as a ratio. Then, one after the other:

    1. gateway saturation: a `serve --nats` gateway pinned to CPU 0, simulated agents (load_agents.py,
       8 devices x 20 series a batch) on the other CPUs as fast as acks allow; acked batches/s
       divided by the gateway's CPU (utime+stime) = batches/s per core;
    2. a fleet at 1 s: --fleet agents x 1 batch/s through it; ack p99 (sample time -> Ack);
    3. worker: a worker in this process takes every partition and reads the backlog of 1 and 2;
    4. memory per node (tracemalloc): --mem-nodes nodes' worker state and, from their summaries,
       a scheduler replica's index;
    5. Place at --place-nodes nodes from the `fleet` bucket, in process and over gRPC (place_step);
    6. the projection for 100,000 nodes at 1 batch/s from the rates and sizes above.
    """
    from xpusense.collector.cluster.localnats import LocalCluster
    cpus = sorted(os.sched_getaffinity(0))
    gw_cpu, gen_cpus = cpus[0], cpus[1:] or cpus
    tmp = tempfile.mkdtemp(prefix="xpusense-fleet-")
    out: dict = {"cpus": len(cpus), "samples_per_batch": DEVICES * len(SERIES)}
    with LocalCluster(3, os.path.join(tmp, "nats"), open_to_all=args.nats_open) as cluster:
        gw, address, log_path = gateway_proc(tmp, cluster, gw_cpu)
        try:
            print(f"1. gateway saturation: {args.agents} agents, {args.seconds:g} s ...", flush=True)
            sat = load(address, args.agents, 0.0, 8, args.seconds, 3.0, gen_cpus, gw.pid, min(args.agents, 4),
                       generator=args.generator)
            print(f"2. gateway at 1 s: {args.fleet} agents x 1 batch/s, {args.seconds:g} s ...", flush=True)
            fleet = load(address, args.fleet, 1.0, 8, args.seconds, 5.0, gen_cpus, gw.pid, 4, generator=args.generator)
        except Exception:
            print(tail(log_path), file=sys.stderr)
            raise
        finally:
            stop(gw)
        print("3. worker: the backlog of steps 1 and 2 ...", flush=True)
        wrk = asyncio.run(worker_rate(cluster))
        print(f"4. memory per node: {args.mem_nodes} nodes ...", flush=True)
        data, worker_bytes = summaries(args.mem_nodes)
        sched_bytes, update_s = scheduler_memory(data)
        inproc, over = place_step(args, cluster, tmp)
    gw_per_core = sat["batches_s"] / max(1e-9, sat["cpu"])
    proj = {
        "gateway_cores": TARGET_NODES / gw_per_core,
        "worker_cores": TARGET_NODES / wrk["per_core"],
        "scheduler_cores_per_replica": TARGET_NODES / nats_cfg(cluster).nats.summary_s * update_s,
        "worker_memory_gb": TARGET_NODES * worker_bytes / 1e9,
        "scheduler_memory_gb_per_replica": TARGET_NODES * sched_bytes / 1e9,
        "stream_mb_s_per_replica": TARGET_NODES * len(LoadAgent(0, "nvidia").next_batch()) / 1e6,
    }
    # What JetStream keeps a message beyond the batch the agent sent (subject, headers, its own).
    sent = len(LoadAgent(0, "nvidia").next_batch()) - 3   # less AgentMessage's tag and length
    overhead = wrk["stored_bytes_per_message"] - sent
    proj["stream_mb_s_per_replica_stored"] = TARGET_NODES * wrk["stored_bytes_per_message"] / 1e6
    measured = measured_rate(args.bytes_per_point)
    if measured:   # a real agent's batch a second and its series tables (bytes a point), and that overhead
        proj["stream_mb_s_per_replica_measured"] = TARGET_NODES * (measured[0] * measured[1] + overhead) / 1e6
    rows = [
        ("gateway batches/s per core, R3 acks", f"{gw_per_core:,.0f}", f">= {GOALS['gateway_per_core']:,}",
         gw_per_core >= GOALS["gateway_per_core"]),
        ("  (acked/s, gateway CPU %)", f"{sat['batches_s']:,.0f}, {100 * sat['cpu']:.0f}%", "", None),
        ("worker batches/s per core", f"{wrk['per_core']:,.0f}", f">= {GOALS['worker_per_core']:,}",
         wrk["per_core"] >= GOALS["worker_per_core"]),
        ("  (messages read / in the streams; batches)", f"{wrk['messages']:,}/{wrk['in_stream']:,}; {wrk['handled']:,}",
         "", None),
        ("worker memory per node, bytes", f"{worker_bytes:,}", "<= 65,536", worker_bytes <= GOALS["bytes_per_node"]),
        ("scheduler memory per node, bytes", f"{sched_bytes:,}", "<= 65,536", sched_bytes <= GOALS["bytes_per_node"]),
        (f"ack p99, {args.fleet} agents x 1/s, one gateway, ms", f"{fleet['p99_ms']:.1f}", "<= 100",
         fleet["p99_ms"] <= GOALS["ack_p99_ms"]),
        ("  (acked/s, p50 ms, gateway CPU %)", f"{fleet['batches_s']:,.0f}, {fleet['p50_ms']:.1f}, "
                                               f"{100 * fleet['cpu']:.0f}%", "", None),
        (f"Place p99 in process, {inproc['listed']:,} nodes, ms", f"{inproc['p99_ms']:.2f}", "<= 1",
         inproc["p99_ms"] <= GOALS["place_inproc_p99_ms"]),
        (f"Place p99 over gRPC, {inproc['listed']:,} nodes, ms", f"{over['p99_ms']:.2f}", "<= 5",
         over["p99_ms"] <= GOALS["place_grpc_p99_ms"]),
        ("  (its CPU time p99, ms; updates/s followed meanwhile)", f"{inproc['cpu_p99_ms']:.2f}; "
                                                                  f"{inproc['followed_s']:,.0f}", "", None),
        ("  (slowest 1%: ms, its CPU; window: ms behind others)", f"{inproc['slow_ms']:.2f}, "
         f"{inproc['slow_cpu_ms']:.2f}; {inproc['waited_ms']:.1f}", "", None),
        ("  (gRPC: run-queue wait a call, replica; client, ms)", f"{over['replica_waited_ms']:.2f}; "
                                                                  f"{over['client_waited_ms']:.2f}", "", None),
        ("  (decisions that refreshed nodes first; those nodes)", f"{inproc['caught_up']:,}; "
                                                                 f"{inproc['caught_up_nodes']:,}", "", None),
        ("  (scheduler replica RSS, MB)", f"{over['rss_mb']:.0f}", "", None),
        ("100k nodes x 1/s: gateway cores", f"{proj['gateway_cores']:.0f}", "", None),
        ("100k nodes x 1/s: worker cores", f"{proj['worker_cores']:.0f}", "", None),
        ("100k nodes: scheduler cores per replica (summary_s 2)", f"{proj['scheduler_cores_per_replica']:.1f}", "", None),
        ("  (CPU per summary update followed, us)", f"{update_s * 1e6:.0f}", "", None),
        ("100k nodes: worker memory, GB (all workers)", f"{proj['worker_memory_gb']:.1f}", "", None),
        ("100k nodes: scheduler memory per replica, GB", f"{proj['scheduler_memory_gb_per_replica']:.1f}", "", None),
        ("100k nodes x 1/s: MB/s into the streams (x3 copies)", f"{proj['stream_mb_s_per_replica']:.0f}", "", None),
    ]
    mb_s = proj["stream_mb_s_per_replica_stored"]
    rows += [("100k nodes: MB/s per stream replica, as stored here", f"{mb_s:,.1f}", "<= 100",
              mb_s <= GOALS["stream_mb_s_per_replica"]),
             ("  (bytes a message stored; the batch, the rest)", f"{wrk['stored_bytes_per_message']:,.0f}; "
                                                                f"{sent:,}, {overhead:,.0f}", "", None)]
    if measured:
        mb_s = proj["stream_mb_s_per_replica_measured"]
        rows += [("100k nodes: MB/s per stream replica, a real agent", f"{mb_s:,.1f}", "<= 100",
                  mb_s <= GOALS["stream_mb_s_per_replica"]),
                 (f"  (B/point, points/s a node; {measured[2]})", f"{measured[0]:g}, {measured[1]:g}", "", None)]
    mode = "plaintext, no permissions" if args.nats_open else "TLS, a certificate per role"
    print(f"\nfleet scale on {len(cpus)} CPUs: 3 nats-servers R3 on loopback ({mode}), gateway on CPU {gw_cpu}, "
          f"{DEVICES * len(SERIES)} samples a batch")
    print(f"  {'figure':<52} {'value':>14}  {'goal':>10}  ok")
    for name, val, goal, ok in rows:
        print(f"  {name:<52} {val:>14}  {goal:>10}  {'' if ok is None else ('yes' if ok else 'NO')}")
    errors = sat["errors"] + fleet["errors"]
    if errors:
        print(f"  {len(errors)} agent errors, e.g. {errors[0]}")
    out.update(bench="fleet_scale", gateway_per_core=round(gw_per_core), gateway_acked_s=round(sat["batches_s"]),
               gateway_cpu=round(sat["cpu"], 3), worker_per_core=round(wrk["per_core"]), worker_handled=wrk["handled"],
               # read short of what the streams held: the worker waited until its timeout, its CPU with it
               worker_read=[wrk["messages"], wrk["in_stream"]], worker_wall_s=round(wrk["wall_s"], 1),
               worker_bytes_per_node=worker_bytes, scheduler_bytes_per_node=sched_bytes,
               ack_p99_ms=round(fleet["p99_ms"], 1), fleet_acked_s=round(fleet["batches_s"]),
               place_inproc_p99_ms=round(inproc["p99_ms"], 3), place_grpc_p99_ms=round(over["p99_ms"], 3),
               place_nodes=inproc["listed"], compact=args.compact,
               stored_bytes_per_message=round(wrk["stored_bytes_per_message"]),
               projection={k: round(v, 2) for k, v in proj.items()}, errors=len(errors))
    emit(args, cluster, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
