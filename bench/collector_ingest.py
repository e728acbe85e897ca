"""Collector ingest: stored batches/s and sample-to-stored latency of a real collector on one core,
under simulated agents (bench/load_agents.py) each on its own connection and Ingest stream.

    .venv/bin/python bench/collector_ingest.py --agents 8 --rate 0 --seconds 30      # saturation
    .venv/bin/python bench/collector_ingest.py --agents 2000 --rate 1 --seconds 30   # fleet at 1 s

What it measures and how: bench/README.md. --memory-nodes N (memory_mode): the fleet state's memory
per node in process; --durable: with a durable store, its bytes per batch and a restart's replay."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import load_agents
from _proc import cpu_s, free_port, machine_ticks, steal_pct, stop, tail, tool, wait_collector, write_bytes

GOAL_BATCHES_S = 2000.0
GOAL_P99_MS = 100.0
DEVICES = 8
# Without series_ref the collector reads every sample's labels (the slow path); set by --no-series-ref
# through the environment so that spawned load-generator processes see it too.
NO_SERIES_REF = os.environ.get("XPUSENSE_BENCH_NO_SERIES_REF") == "1"
BDP_PROBE = os.environ.get("XPUSENSE_BENCH_BDP_PROBE") == "1"   # --bdp-probe, likewise
COMPACT = os.environ.get("XPUSENSE_BENCH_COMPACT", "0") in ("1", "chained")   # --compact, likewise
CHAINED = os.environ.get("XPUSENSE_BENCH_COMPACT") == "chained"               # --chained
# The compact encoding the simulated agents speak: version 1's blocks, the one the C generator
# writes (its values are float64; version 2 would write most of them as digits, as a real agent
# does); --chained: those blocks chained, offered as columns-zlib-2-chained (which reads any block).
SIM_ENCODING, SIM_VERSION = ("columns-zlib-2-chained" if CHAINED else "columns-zlib-1"), 1
# --idle-share: this share of the agents (every agent whose index % 100 is below it x 100) send
# idle accelerators: their gauges the same every round (utilisation, HBM used, bandwidth...), their
# counters still counting; the others' gauges move every round (the default: all of them).
IDLE_SHARE = float(os.environ.get("XPUSENSE_BENCH_IDLE_SHARE", "0"))

# 20 series per device: (name, unit, kind) with kind "g" gauge / "c" counter (running total).
SERIES = [
    ("hw.gpu.utilization", "1", "g"),
    ("hw.gpu.memory.utilization", "1", "g"),
    ("hw.gpu.memory.usage", "By", "g"),
    ("hw.gpu.memory.limit", "By", "g"),
    ("xpusense.accelerator.hbm.bandwidth.utilization", "1", "g"),
    ("xpusense.accelerator.hbm.read.io", "By", "c"),
    ("xpusense.accelerator.hbm.write.io", "By", "c"),
    ("hw.gpu.power", "W", "g"),
    ("hw.gpu.energy", "J", "c"),
    ("hw.gpu.temperature", "Cel", "g"),
    ("xpusense.accelerator.hbm.temperature", "Cel", "g"),
    ("hw.gpu.clock.sm", "Hz", "g"),
    ("hw.gpu.clock.memory", "Hz", "g"),
    ("xpusense.accelerator.interconnect.receive.io", "By", "c"),
    ("xpusense.accelerator.interconnect.transmit.io", "By", "c"),
    ("xpusense.accelerator.pcie.receive.io", "By", "c"),
    ("xpusense.accelerator.pcie.transmit.io", "By", "c"),
    ("xpusense.accelerator.ecc.corrected", "{error}", "c"),
    ("xpusense.accelerator.throttle.active", "1", "g"),
    ("xpusense.accelerator.sm.occupancy", "1", "g"),
]
NODE_PREFIX = "bench-ingest-"
METHOD = "/xpusense.v1.Ingest/Stream"
CONNECT_ATTEMPTS = 5
CONNECTS_IN_FLIGHT = 32   # per load-generator process: a fleet does not connect all at once


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def merge_seconds(parts) -> dict[int, list[float]]:
    """Per-second latency lists (whole seconds since go) merged into one."""
    out: dict[int, list[float]] = {}
    for part in parts:
        for sec, vals in part.items():
            out.setdefault(sec, []).extend(vals)
    return out


def settled_second(by_second: dict[int, list[float]], goal_ms: float) -> int | None:
    """The first whole second since go from which every second's ack p99 is within `goal_ms` to the
    end of the run (the start-up backlog drained); None when the last second's is not."""
    settled = None
    for sec in sorted(by_second):
        if percentile(sorted(by_second[sec]), 0.99) > goal_ms:
            settled = None
        elif settled is None:
            settled = sec
    return settled


def percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[i]


# -- one worker process: several simulated agents on one asyncio loop ---------------------------------
class SimAgent:
    def __init__(self, index: int, vendor: str):
        from xpusense.common import compact
        from xpusense.v1 import telemetry_pb2 as pb
        self.pb, self.compact = pb, compact
        self.compact_mode = 2 if CHAINED else int(COMPACT)   # the C generator's plan says it so
        self.chain = None
        self.node_id = f"{NODE_PREFIX}{index:05d}"
        self.idle = index % 100 < IDLE_SHARE * 100
        self.boot_id = uuid.uuid4().hex
        self.seq = 0
        self.sent_ns: dict[int, int] = {}
        self.acked = self.duplicates = self.sent = 0
        self.window_acked = 0
        self.latencies_ms: list[float] = []
        self.by_second: dict[int, list[float]] = {}   # whole seconds since go -> the latencies of acks then
        self.connect_retries = 0
        self.connect_errors: list[str] = []
        msg = pb.AgentMessage()
        b = msg.batch
        b.node_id, b.boot_id = self.node_id, self.boot_id
        kinds = {"g": pb.GAUGE, "c": pb.COUNTER}
        self.counters = []   # (sample, step) for running totals
        self.gauges = []     # (sample, base)
        rng = random.Random(index)
        for d in range(DEVICES):
            for name, unit, kind in SERIES:
                s = b.samples.add(name=name, unit=unit, kind=kinds[kind], labels={"device": str(d), "vendor": vendor},
                                  series_ref=0 if NO_SERIES_REF else len(b.samples) + 1)
                if kind == "c":
                    s.value = float(rng.randrange(10**6, 10**9))   # byte and event counts: whole numbers
                    self.counters.append((s, float(rng.randrange(1, 10**6))))
                else:
                    self.gauges.append((s, float(rng.randrange(10, 90))))   # a percentage (value: / 100)
        self.msg = msg
        self._template(b)
        self.hello = pb.AgentMessage(hello=pb.Hello(
            node_id=self.node_id, boot_id=self.boot_id, agent_version="bench", time_unix_nano=time.time_ns(),
            batch_encodings=[SIM_ENCODING] if self.compact_mode else [],
            inventory=pb.Inventory(hostname=self.node_id, labels={"cloud": "bench"}, resources=[
                pb.Resource(type="GPU" if vendor == "nvidia" else "NPU", vendor=vendor,
                            model="A100-SXM4-40GB" if vendor == "nvidia" else "Ascend-910B", id=str(d),
                            attributes={"memory": "40GB"}) for d in range(DEVICES)])))

    def _template(self, b) -> None:
        """The samples' bytes as protobuf writes them, cut where each sample's value and time go:
        a batch is then one struct.pack of the pieces with the new values (~4x cheaper than setting
        160 samples' fields and serializing; the bytes are protobuf's own, checked below)."""
        import struct
        pieces: list = []
        fmt = ["<"]
        self.counters_at, self.gauges_at = [], []   # (piece index of the value, step or base)
        steps = dict((id(s), step) for s, step in self.counters)
        bases = dict((id(s), base) for s, base in self.gauges)
        mark_v, mark_t = 1.2345678901234567e-300, (1 << 62) + 12345
        for s in b.samples:
            value = s.value
            s.value, s.time_unix_nano = mark_v, mark_t
            # tag, length, the sample's fields (a map's entries in key order: protobuf's own order
            # may differ from one map object to another)
            raw = b.__class__(samples=[s]).SerializeToString(deterministic=True)
            s.value = value
            at_v = raw.index(struct.pack("<d", mark_v))
            at_t = raw.index(_varint(mark_t), at_v + 8)
            if id(s) in steps:
                self.counters_at.append((len(pieces) + 1, steps[id(s)]))
            else:
                self.gauges_at.append((len(pieces) + 1, bases[id(s)]))
            pieces += [raw[:at_v], value, raw[at_v + 8:at_t], b"", raw[at_t + 9:]]
            fmt.append(f"{at_v}sd{at_t - at_v - 8}s9s{len(raw) - at_t - 9}s")
        self.pieces = pieces
        self.packer = struct.Struct("".join(fmt))
        self.time_at = range(3, len(pieces), 5)
        self.header = (b.node_id, b.boot_id)
        # The same bytes as protobuf's serialization (deterministic: map entries by key), for one
        # batch (a mistake here would measure a collector fed something else than agents send).
        seq, now = 7, time.time_ns()
        for s in b.samples:
            s.time_unix_nano = now
        for (s, base), (i, _) in zip(self.gauges, self.gauges_at):   # a gauge's 0.0 is not written
            s.value = pieces[i] = base / 100
        b.seq, b.sent_unix_nano = seq, now
        mine = self._bytes(seq, now)
        if mine != self.msg.SerializeToString(deterministic=True):
            assert self.pb.AgentMessage.FromString(mine) == self.msg, f"{self.node_id}: bench batch != protobuf's"

    def series_table(self) -> bytes:
        """AgentMessage{series}: every series' definition, sent first on a compact stream."""
        defs = []
        for s in self.msg.batch.samples:
            d = self.pb.Sample()
            d.CopyFrom(s)
            d.ClearField("value")
            d.ClearField("time_unix_nano")
            defs.append(d)
        return self.pb.AgentMessage(series=self.pb.SeriesTable(
            boot_id=self.boot_id, defs=self.compact.encode_defs(defs))).SerializeToString()

    def _compact_bytes(self, seq: int, now: int) -> bytes:
        """The batch in the compact encoding: the samples' values in their order (the pieces hold
        them at 1, 6, 11, ...), refs 1..N, one time."""
        rows = [(i + 1, now, v) for i, v in enumerate(self.pieces[1::5])]
        block = self.compact.encode_columns(rows, version=SIM_VERSION)
        if self.compact_mode == 2:
            from xpusense.common.compact_chain import Chain
            self.chain = self.chain or Chain(len(rows))
            block = self.chain.send(block)
        batch = self.pb.Batch(node_id=self.header[0], boot_id=self.header[1], seq=seq, sent_unix_nano=now,
                              columns=block).SerializeToString()
        return b"\x12" + _varint(len(batch)) + batch

    def _bytes(self, seq: int, now: int) -> bytes:
        pb, pieces = self.pb, self.pieces
        t = _varint(now)
        for i in self.time_at:
            pieces[i] = t
        node_id, boot_id = self.header
        head = pb.Batch(node_id=node_id, boot_id=boot_id, seq=seq).SerializeToString()
        batch = head + self.packer.pack(*pieces) + pb.Batch(sent_unix_nano=now).SerializeToString()
        return b"\x12" + _varint(len(batch)) + batch   # AgentMessage.batch (field 2, length-delimited)

    def next_batch(self, now: int | None = None) -> bytes:
        """The next batch, serialized; every sample stamped now (that is the latency's start), or
        at `now` (--memory-nodes feeds 15 minutes of history in a few)."""
        self.seq += 1
        now = time.time_ns() if now is None else now
        wobble = 0 if self.idle else self.seq % 17
        pieces = self.pieces
        for i, base in self.gauges_at:   # a utilisation as NVML gives it: whole percent / 100
            pieces[i] = (base + wobble) / 100
        for i, step in self.counters_at:
            pieces[i] += step
        self.sent_ns[self.seq] = now
        self.sent += 1
        return (self._compact_bytes if self.compact_mode else self._bytes)(self.seq, now)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


async def run_agent(ag: SimAgent, address: str, rate: float, window: int, phase_s: float,
                    connect_slots: asyncio.Semaphore, connected: asyncio.Event, start: asyncio.Event,
                    times: dict, fails: list) -> None:
    """One simulated agent: connect and say Hello, wait for the start, send batches until t1, drain acks."""
    import grpc

    from xpusense.common.tls import channel_options
    pb = ag.pb
    # The agent's own channel options (common/tls.py: keepalive, no BDP probing on its stream), unless
    # --bdp-probe (gRPC's default: a ping and its ack per probe).
    options = channel_options(connect_timeout_s=5.0)
    if BDP_PROBE:
        options = [o for o in options if o[0] != "grpc.http2.bdp_probe"]
    channel = grpc.aio.insecure_channel(address, options=[
        ("grpc.use_local_subchannel_pool", 1),          # one connection per agent, as in a fleet
        *options])
    call = None
    try:
        # Batches are serialized by next_batch() (request_serializer None passes the bytes through).
        method = channel.stream_stream(METHOD, request_serializer=None,
                                       response_deserializer=pb.CollectorMessage.FromString)
        for attempt in range(CONNECT_ATTEMPTS):   # a real agent retries with backoff, so does this one
            try:
                async with connect_slots:
                    call = method()
                    await call.write(ag.hello.SerializeToString())
                    first = await call.read()
                if first is grpc.aio.EOF or not first.HasField("welcome"):
                    raise RuntimeError(f"no Welcome: {first!r}")
                if ag.compact_mode:
                    if first.welcome.batch_encoding != SIM_ENCODING:
                        raise RuntimeError(f"--compact: the collector chose {first.welcome.batch_encoding!r}")
                    await call.write(ag.series_table())
                break
            except grpc.aio.AioRpcError as e:
                call.cancel()
                if attempt == CONNECT_ATTEMPTS - 1:
                    raise
                ag.connect_retries += 1
                ag.connect_errors.append(e.code().name)
                await asyncio.sleep(random.uniform(0.1, 0.2) * 2 ** attempt)
        connected.set()
        await start.wait()
        go, t0, t1 = times["go"], times["t0"], times["t1"]
        slots = asyncio.Semaphore(window)
        done_sending = asyncio.Event()
        drained = asyncio.Event()

        async def reader():
            while True:
                m = await call.read()
                if m is grpc.aio.EOF:
                    break
                if not m.HasField("ack"):
                    continue
                now_ns, now_mono = time.time_ns(), time.monotonic()
                sent = ag.sent_ns.pop(m.ack.seq, None)
                if m.ack.duplicate:
                    ag.duplicates += 1
                else:
                    ag.acked += 1
                    if sent is not None:
                        ag.by_second.setdefault(int(now_mono - go), []).append((now_ns - sent) / 1e6)
                    if t0 <= now_mono < t1:
                        ag.window_acked += 1
                        if sent is not None:
                            ag.latencies_ms.append((now_ns - sent) / 1e6)
                slots.release()
                if done_sending.is_set() and not ag.sent_ns:
                    break
            drained.set()

        rtask = asyncio.create_task(reader())
        period = 1.0 / rate if rate > 0 else 0.0
        nxt = times["go"] + phase_s
        while True:
            if period:
                delay = nxt - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                nxt += period
            await slots.acquire()
            if time.monotonic() >= t1:
                break
            await call.write(ag.next_batch())
        done_sending.set()
        if ag.sent_ns:
            try:
                await asyncio.wait_for(drained.wait(), 15.0)
            except TimeoutError:
                fails.append(f"{ag.node_id}: {len(ag.sent_ns)} batches not acknowledged 15 s after the end")
        rtask.cancel()
        await call.done_writing()
    except Exception as e:   # report it; never hang the other agents
        fails.append(f"{ag.node_id}: {type(e).__name__}: {e}")
        connected.set()
    finally:
        if call is not None:
            call.cancel()
        await channel.close(grace=None)


def worker(indices: list[int], address: str, rate: float, window: int, cpus: list[int],
           ready_q, shared_times, out_q) -> None:
    """A load-generator process: the agents `indices`, each its own connection, on one asyncio loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    raise_nofile()

    async def amain():
        agents = [SimAgent(i, "nvidia" if i % 2 == 0 else "huawei") for i in indices]
        fails: list[str] = []
        connected = [asyncio.Event() for _ in agents]
        start = asyncio.Event()
        connect_slots = asyncio.Semaphore(CONNECTS_IN_FLIGHT)
        times: dict = {}
        rng = random.Random(indices[0])
        tasks = [asyncio.create_task(run_agent(ag, address, rate, window,
                                               rng.random() / rate if rate > 0 else 0.0,
                                               connect_slots, ev, start, times, fails))
                 for ag, ev in zip(agents, connected)]
        await asyncio.gather(*(ev.wait() for ev in connected))
        ready_q.put((len(agents), list(fails), sum(a.connect_retries for a in agents),
                     sorted({c for a in agents for c in a.connect_errors})))
        while shared_times[0] == 0.0:       # the parent sets go/t0/t1 once every worker is connected
            if shared_times[2] < 0:         # the parent gave up
                for t in tasks:
                    t.cancel()
                break
            await asyncio.sleep(0.01)
        times.update(go=shared_times[0], t0=shared_times[1], t1=shared_times[2])
        start.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        out_q.put({"acked": sum(a.acked for a in agents), "window_acked": sum(a.window_acked for a in agents),
                   "duplicates": sum(a.duplicates for a in agents), "sent": sum(a.sent for a in agents),
                   "latencies_ms": [x for a in agents for x in a.latencies_ms], "fails": fails,
                   "by_second": merge_seconds(a.by_second for a in agents)})

    asyncio.run(amain())


# -- the parent: collector, workers, figures ------------------------------------------------------------
def restart_figures(prefix: list[str], data_dir: str, cfg_path: str, tmp: str) -> dict:
    """A second collector on the store the run left: what it replays, and how long that takes."""
    store_bytes = sum(os.path.getsize(os.path.join(data_dir, n)) for n in os.listdir(data_dir)
                      if n.endswith(".log"))
    address = f"127.0.0.1:{free_port()}"
    log_path = os.path.join(tmp, "collector-restart.log")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(prefix + ["serve", "--listen", address, "--log-level", "info", "--config", cfg_path,
                                          "--data-dir", data_dir], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        wait_collector(address, 300.0)
        ready_s = time.monotonic() - t0
        holds = sum(n.batches_stored for n in list_bench_nodes(address)[0])   # from the snapshot and the log
    finally:
        stop(proc)
    with open(log_path) as f:
        text = f.read()
    m = re.search(r"replayed: (\d+) batches.* in ([\d.]+) s", text)
    return {"store_bytes": store_bytes, "replayed": int(m.group(1)) if m else -1,
            "replay_s": float(m.group(2)) if m else -1.0, "ready_s": round(ready_s, 2), "holds": holds,
            # the stop wrote a snapshot: the log after it holds only what came later (often nothing)
            "snapshot": "after a snapshot of" in text}



def list_bench_nodes(address: str) -> tuple[list, dict[str, float]]:
    """The simulated agents' nodes, and the collector's counters."""
    import grpc

    from xpusense.collector.views import fetch_all
    from xpusense.v1 import telemetry_pb2 as pb
    from xpusense.v1 import telemetry_pb2_grpc as pb_grpc
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 * 1024 * 1024)]) as ch:
        stub = pb_grpc.QueryStub(ch)
        # Every page; a prefix no series has: node figures without every series' latest value.
        reply = fetch_all(lambda req: stub.ListNodes(req, timeout=60), pb.ListNodesRequest(name_prefix="\x00none"))
    return [n for n in reply.nodes if n.node_id.startswith(NODE_PREFIX)], dict(reply.counters)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_mode(nodes: int, history_s: float, trace: bool) -> int:
    """N nodes x history_s of 1 s batches into an in-process FleetState (limits and scheduler index
    in, as `serve` has them; synthetic timestamps, so 15 minutes of history take less): RSS and
    tracemalloc growth per node with a full history, the state's own estimate ([state] max_memory
    counts with it), and the CPU each batch costs on the way."""
    import gc
    import tracemalloc

    from xpusense.collector.columns import held
    from xpusense.collector.config import load_collector
    from xpusense.collector.limits import Limits
    from xpusense.collector.scheduler.core import Scheduler
    from xpusense.collector.state import FleetState
    from xpusense.v1 import telemetry_pb2 as pb
    cfg = load_collector(None, env={})
    agents = [SimAgent(i, "nvidia" if i % 2 == 0 else "huawei") for i in range(nodes)]
    gc.collect()
    rss0 = rss_bytes()
    if trace:
        tracemalloc.start()
    state = FleetState(history_s=history_s, events_kept=cfg.events_kept)
    limits = Limits.from_config(cfg.limits, clock=lambda: 0.0)   # synthetic time: no rate limit hit
    state.max_series_per_node = limits.max_series_per_node
    core = Scheduler(state, cfg.scheduler, cfg.stale_s)
    for a in agents:
        state.hello(a.hello.hello)
    rounds = int(history_s)
    t_base = time.time_ns() - rounds * 10**9
    cpu_s_ = 0.0   # limits, state and index only (not making the batches)
    clock = time.process_time
    for k in range(rounds):
        t = t_base + k * 10**9
        for a in agents:
            b = pb.AgentMessage.FromString(a.next_batch(now=t)).batch
            c0 = clock()
            if limits.check(a.node_id, b, state) is None and state.accept(b, now_ns=t) is not None:
                state.apply(b)
            cpu_s_ += clock() - c0
        c0 = clock()
        core.view.refresh_dirty()   # what the loop's timer does each index_refresh_ms
        cpu_s_ += clock() - c0
    traced = tracemalloc.get_traced_memory()[0] if trace else 0
    if trace:
        tracemalloc.stop()
    gc.collect()
    rss1 = rss_bytes()
    points = sum(len(held(ser)[0]) for n in state.nodes.values() for ser in n.series.values())
    series = sum(len(n.series) for n in state.nodes.values())
    per_node = (rss1 - rss0) / nodes
    print(f"collector fleet state in-process: {nodes} nodes x {DEVICES}x{len(SERIES)} series x {rounds} s of 1 s "
          f"batches (synthetic timestamps), limits and scheduler index in")
    rows = [("points held / series", f"{points}/{series}", f"{points / max(series, 1):.0f} a series"),
            ("RSS growth per node, MB", f"{per_node / 1e6:.2f}", "goal <= 3 MB"),
            ("tracemalloc per node, MB", f"{traced / nodes / 1e6:.2f}" if trace else "-", ""),
            ("state's own estimate per node, MB", f"{state.memory_bytes() / nodes / 1e6:.2f}", "[state] max_memory"),
            ("RSS growth per point, bytes", f"{(rss1 - rss0) / max(points, 1):.1f}", ""),
            ("2,000 nodes would take, GB", f"{per_node * 2000 / 1e9:.1f}", "goal <= 6 GB"),
            ("CPU per batch in-process, us", f"{cpu_s_ / (rounds * nodes) * 1e6:.0f}",
             "limits, state, index refresh; no gRPC, no parse")]
    for name, val, note in rows:
        print(f"  {name:<44} {val:>14}  {note}")
    print(json.dumps({"bench": "collector_memory", "nodes": nodes, "history_s": history_s, "points": points,
                      "series": series, "rss_per_node_mb": round(per_node / 1e6, 3),
                      "traced_per_node_mb": round(traced / nodes / 1e6, 3) if trace else None,
                      "estimate_per_node_mb": round(state.memory_bytes() / nodes / 1e6, 3),
                      "cpu_us_per_batch": round(cpu_s_ / (rounds * nodes) * 1e6, 1),
                      "goal_met": per_node <= 3e6}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=8, help="simulated agents, one stream each (default 8)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="batches/s per agent; 0 = as fast as acks allow (default 0)")
    p.add_argument("--window", type=int, default=8, help="batches in flight per agent at most (default 8)")
    p.add_argument("--seconds", type=float, default=30.0, help="measurement window (default 30)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="sending before the window (default 5)")
    p.add_argument("--generator", choices=load_agents.KINDS, default="c",
                   help="the simulated agents: c (bench/loadgen/ingest_agents.c, one process; default) or python "
                        "(grpc aio, several processes, ~10x the CPU a batch)")
    p.add_argument("--procs", type=int, default=0,
                   help="with --generator python: its processes (default min(agents, 8, 2 x the generator's CPUs))")
    p.add_argument("--collector-cpu", type=int, default=0, help="the one CPU the collector runs on (default 0)")
    p.add_argument("--durable", action="store_true",
                   help="collector with a durable store (--data-dir in a temporary directory); adds store size "
                        "and restart replay figures")
    p.add_argument("--data-dir", metavar="DIR",
                   help="the durable store here (implies --durable; DIR must not hold a store yet, and is kept)")
    p.add_argument("--commit-interval-s", type=float, default=None, metavar="S",
                   help="with --durable: the store's [store] commit_interval_s (default: the collector's)")
    p.add_argument("--compact", action="store_true",
                   help="agents send the compact encoding (series definitions once, then columns)")
    p.add_argument("--chained", action="store_true",
                   help="--compact with each agent's blocks chained (columns-zlib-2-chained, common/compact_chain.py)")
    p.add_argument("--no-series-ref", action="store_true",
                   help="send samples without series_ref (the collector then keys every sample by its labels)")
    p.add_argument("--bdp-probe", action="store_true",
                   help="simulated agents probe bandwidth (gRPC's default; real agents do not), "
                        "to compare with figures taken that way")
    p.add_argument("--profile", metavar="FILE", help="run the collector under cProfile, stats to FILE")
    p.add_argument("--collector-cmd", metavar="CMD",
                   help="another collector build to measure (default: xpusense-collector); "
                        "'serve --listen ...' is appended")
    p.add_argument("--idle-share", type=float, default=0.0, metavar="F",
                   help="share of the agents (0..1) whose accelerators are idle: the same gauges every round "
                        "(default 0: every agent's gauges move every round)")
    p.add_argument("--index-refresh-ms", type=float, default=None,
                   help="the collector's [scheduler] index_refresh_ms (default: its own, 1000)")
    p.add_argument("--memory-nodes", type=int, default=0, metavar="N",
                   help="in-process memory figure: N nodes x --history-s of 1 s history (no collector process)")
    p.add_argument("--history-s", type=float, default=900.0, help="with --memory-nodes: history fed (default 900)")
    p.add_argument("--tracemalloc", action="store_true", help="with --memory-nodes: also tracemalloc (slower)")
    args = p.parse_args(argv)
    if args.memory_nodes:
        return memory_mode(args.memory_nodes, args.history_s, args.tracemalloc)
    if args.data_dir:
        args.durable = True
        if os.path.isdir(args.data_dir) and any(n.endswith(".log") for n in os.listdir(args.data_dir)):
            p.error(f"--data-dir {args.data_dir} already holds a store: give an empty or new directory")
    if args.agents < 1 or args.window < 1 or args.rate < 0 or args.seconds <= 0:
        p.error("--agents and --window must be >= 1, --rate >= 0, --seconds > 0")
    if args.bdp_probe and args.generator != "python":
        p.error("--bdp-probe is a grpc channel option: with --generator python")
    if not 0.0 <= args.idle_share <= 1.0:
        p.error(f"--idle-share {args.idle_share:g}: a share of the agents, 0..1")
    raise_nofile()

    all_cpus = sorted(os.sched_getaffinity(0))
    col_cpu = args.collector_cpu if args.collector_cpu in all_cpus else all_cpus[0]
    gen_cpus = [c for c in all_cpus if c != col_cpu]
    # More generator processes than twice its CPUs only switch between each other: on 2 cores, 8 of them
    # used 89-98% of the generator's core at 2,000 agents, 2 of them 70-74%; at saturation 8 offered
    # 2,964-3,890 batches/s, 2 offered 5,555-6,721/s (the collector's core then 93-95% busy).
    procs = args.procs or min(args.agents, 8, 2 * max(1, len(gen_cpus)))
    procs = 1 if args.generator == "c" else max(1, min(procs, args.agents))
    if gen_cpus:
        os.sched_setaffinity(0, set(gen_cpus))   # keep this process off the collector's core too

    tmp = tempfile.mkdtemp(prefix="xpusense-ingest-")
    address = f"127.0.0.1:{free_port()}"
    col_log = os.path.join(tmp, "collector.log")
    # Saturation sends far more than a real agent's few batches a second: lift the per-node rate limit.
    cfg_path = os.path.join(tmp, "collector.toml")
    restart: dict = {}
    with open(cfg_path, "w") as f:
        f.write("[limits]\nbatches_per_s = 1000000\nburst_batches = 1000000\n")
        if args.index_refresh_ms is not None:   # how old the scheduler index may be (its refresh off ingest)
            f.write(f"[scheduler]\nindex_refresh_ms = {args.index_refresh_ms:g}\n")
        if args.commit_interval_s is not None:
            f.write(f"[store]\ncommit_interval_s = {args.commit_interval_s:g}\n")
    serve = ["serve", "--listen", address, "--log-level", "warning", "--config", cfg_path]
    data_dir = os.path.abspath(args.data_dir) if args.data_dir else os.path.join(tmp, "collector-data")
    if args.durable:   # every batch fsync'ed to the store before its ack (group commit)
        serve += ["--data-dir", data_dir]
    if args.profile:
        prefix = [sys.executable, "-m", "cProfile", "-o", os.path.abspath(args.profile), "-m", "xpusense.collector.main"]
    elif args.collector_cmd:
        prefix = shlex.split(args.collector_cmd)
    else:
        prefix = tool("xpusense-collector")
    cmd = prefix + serve

    def pin_collector():
        os.sched_setaffinity(0, {col_cpu})
        raise_nofile()

    if args.no_series_ref:
        os.environ["XPUSENSE_BENCH_NO_SERIES_REF"] = "1"
    if args.compact or args.chained:
        os.environ["XPUSENSE_BENCH_COMPACT"] = "chained" if args.chained else "1"
    if args.bdp_probe:
        os.environ["XPUSENSE_BENCH_BDP_PROBE"] = "1"
    os.environ["XPUSENSE_BENCH_IDLE_SHARE"] = repr(args.idle_share)
    collector = None
    gen = None
    try:
        with open(col_log, "w") as log:
            collector = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=pin_collector)
        try:
            wait_collector(address, 20.0)
        except Exception:
            print(f"collector did not come up on {address}:\n{tail(col_log)}", file=sys.stderr)
            return 1

        gen = load_agents.start(args.generator, list(range(args.agents)), address, args.rate, args.window,
                                gen_cpus, procs)
        t_conn = time.monotonic()
        try:
            connect_fails, connect_retries, retry_codes = gen.wait_ready(120.0 + args.agents / 100)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        connect_s = time.monotonic() - t_conn
        if connect_fails:
            print(f"{len(connect_fails)} simulated agents failed to connect, e.g. {connect_fails[0]}", file=sys.stderr)
            return 1

        pid, gen_pids = collector.pid, gen.pids
        (c0, g0, w0, m0, d0), (c1, g1, w1, m1, d1) = load_agents.window(
            gen, args.warmup_s, args.seconds,
            lambda: (cpu_s(pid), sum(map(cpu_s, gen_pids)), time.monotonic(), machine_ticks(), write_bytes(pid)))
        stolen = steal_pct(m0, m1)

        try:
            results = gen.results(60.0)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        if collector.poll() is not None:
            print(f"collector exited {collector.returncode}:\n{tail(col_log)}", file=sys.stderr)
            return 1
        nodes, counters = list_bench_nodes(address)
        if args.durable:
            stop(collector)
            restart = restart_figures(tool("xpusense-collector") if args.profile else prefix, data_dir, cfg_path, tmp)
    finally:
        if gen is not None:
            gen.close()
        stop(collector)
        shutil.rmtree(tmp, ignore_errors=True)

    wall = w1 - w0
    acked = sum(r["acked"] for r in results)
    window_acked = sum(r["window_acked"] for r in results)
    fails = [f for r in results for f in r["fails"]]
    lat = sorted(x for r in results for x in r["latencies_ms"])
    by_second = merge_seconds(r["by_second"] for r in results)
    settled = settled_second(by_second, GOAL_P99_MS)
    # The start-up: every agent's first batches (and the Hellos just before) at once, then the
    # backlog they left; the window's figures are steady state only once it has drained.
    startup_p99 = percentile(sorted(x for sec, v in by_second.items() if sec < args.warmup_s for x in v), 0.99)
    stored = sum(n.batches_stored for n in nodes)
    dup_stored = sum(n.batches_duplicate for n in nodes)
    rate_s = window_acked / wall
    p50, p90, p99, pmax = (percentile(lat, q) for q in (0.5, 0.9, 0.99, 1.0))
    col_pct = 100 * (c1 - c0) / wall
    cpu_us = 1e6 * (c1 - c0) / max(window_acked, 1)   # steadier than batches/s on a shared machine
    gen_pct = 100 * (g1 - g0) / wall
    # Everything the collector had written to storage in the window (log, snapshots; a page each time
    # one is dirtied again after an fsync) a sample acknowledged in it.
    disk_per_sample = (d1 - d0) / max(window_acked * DEVICES * len(SERIES), 1)
    store_written = {k: counters.get(f"store.{k}_bytes_written", 0) / max(stored * DEVICES * len(SERIES), 1)
                     for k in ("log", "snapshot")}
    # Saturation: the rate; at a cadence, everything offered (acks in a window of wall
    # seconds come in a hair under rate x agents even when none is late)
    goal_rate = GOAL_BATCHES_S if args.rate == 0 else 0.995 * args.rate * args.agents
    goal_label = f">= {GOAL_BATCHES_S:g}" if args.rate == 0 else "offered"
    mode = "saturation (rate 0)" if args.rate == 0 else f"cadence {args.rate:g} batch/s per agent"
    print(f"collector ingest: {mode}, {args.agents} agents in {procs} {args.generator} load-generator processes, "
          f"window {args.window}, "
          f"{DEVICES}x{len(SERIES)} samples/batch, {wall:.1f} s after {args.warmup_s:g} s warm-up"
          + (f", {args.idle_share:.0%} of the agents idle (the same gauges every round)" if args.idle_share else ""))
    print(f"  collector on CPU {col_cpu}; load generator on CPUs {gen_cpus or [col_cpu]} "
          f"(of {len(all_cpus)}); {len(nodes)} agents connected in {connect_s:.1f} s"
          + (f", {connect_retries} connect retries ({', '.join(sorted(retry_codes))})" if connect_retries else ""))
    print()
    print(f"  {'figure':<44} {'value':>10}  {'goal':>8}  ok")
    rows = [
        ("stored batches/s (acks in window)", f"{rate_s:.0f}", goal_label, rate_s >= goal_rate),
        ("latency p50, ms (sample time -> ack at agent)", f"{p50:.1f}", "", None),
        ("latency p90, ms", f"{p90:.1f}", "", None),
        ("latency p99, ms (upper bound on -> stored)", f"{p99:.1f}", f"<= {GOAL_P99_MS:g}", p99 <= GOAL_P99_MS),
        ("latency max, ms", f"{pmax:.1f}", "", None),
        ("warm-up latency p99, ms (start-up backlog)", f"{startup_p99:.1f}", "", None),
        ("p99 within goal every second from, s", "never" if settled is None else f"{settled}",
         f"<= {args.warmup_s:g}", settled is not None and settled <= args.warmup_s),
        ("samples stored/s", f"{rate_s * DEVICES * len(SERIES):.0f}", "", None),
        ("collector CPU, % of one core", f"{col_pct:.0f}", "", None),
        ("collector CPU per stored batch, us", f"{cpu_us:.0f}", "", None),
        ("load generator CPU, % of one core (all procs)", f"{gen_pct:.0f}", "", None),
        ("machine's CPU time stolen by the host, %", f"{stolen:.1f}", "", None),
        ("offered batches/s (rate x agents)", "max" if args.rate == 0 else f"{args.rate * args.agents:.0f}", "", None),
        ("acked whole run / collector batches_stored", f"{acked}/{stored}", "equal", acked == stored),
        ("duplicates (acked / collector)", f"{sum(r['duplicates'] for r in results)}/{dup_stored}", "", None),
    ]
    if args.durable:
        rows += [
            ("store on disk, bytes per stored batch", f"{restart['store_bytes'] / max(stored, 1):.0f}", "", None),
            ("collector disk writes in the window, B/sample", f"{disk_per_sample:.2f}", "", None),
            ("  the store wrote to its log, whole run, B/sample", f"{store_written['log']:.2f}", "", None),
            ("  the store wrote to snapshots, whole run, B/sample", f"{store_written['snapshot']:.2f}", "", None),
            ("restart: batches replayed" + (" after the snapshot" if restart["snapshot"] else ""),
             f"{restart['replayed']}", "", None if restart["snapshot"] else restart["replayed"] == stored),
            ("restart: batches the nodes hold after it", f"{restart['holds']}", "= stored", restart["holds"] == stored),
            ("restart: replay, s (collector's log)", f"{restart['replay_s']}", "", None),
            ("restart: listening after, s", f"{restart['ready_s']:.1f}", "", None),
        ]
    for name, val, goal, ok in rows:
        print(f"  {name:<44} {val:>10}  {goal:>8}  {'' if ok is None else ('yes' if ok else 'NO')}")
    print("  latency is measured to the Ack's arrival at the simulated agent: an upper bound on sample-to-stored.")
    if gen_pct >= 90 * max(1, len(gen_cpus)):
        print(f"  the load generator's CPUs were {gen_pct:.0f}% busy: its own delays are in the latency, and it may "
              "not have offered the rate on time")
    shown = sorted(by_second)[:max(int(args.warmup_s), (settled or 0) + 2, 2)]
    print("  start-up, per second since go (acks, p99 ms): " + ", ".join(
        f"{sec}: {len(by_second[sec])} {percentile(sorted(by_second[sec]), 0.99):.0f}" for sec in shown))
    if fails:
        print(f"  {len(fails)} agent errors, e.g. {fails[0]}")
    if args.profile:
        import pstats
        print(f"\ncollector profile ({args.profile}), top 25 by own time:")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
    summary = {"bench": "collector_ingest", "mode": "saturation" if args.rate == 0 else "cadence",
               "agents": args.agents, "rate_per_agent": args.rate, "window": args.window, "procs": procs,
               "generator": args.generator, **({"compact": True} if args.compact or args.chained else {}),
               **({"chained": True} if args.chained else {}),
               **({"commit_interval_s": args.commit_interval_s} if args.commit_interval_s is not None else {}),
               "idle_share": args.idle_share,
               "seconds": round(wall, 1), "batches_per_s": round(rate_s, 1),
               "samples_per_s": round(rate_s * DEVICES * len(SERIES)), "p50_ms": round(p50, 2),
               "p90_ms": round(p90, 2), "p99_ms": round(p99, 2), "max_ms": round(pmax, 2),
               "collector_cpu_pct": round(col_pct, 1), "collector_cpu_us_per_batch": round(cpu_us),
               "generator_cpu_pct": round(gen_pct, 1), "steal_pct": round(stolen, 1),
               "acked": acked, "collector_batches_stored": stored, "nodes_listed": len(nodes),
               "node_events": sum(len(n.events) for n in nodes),
               "node_diagnoses": sum(len(n.diagnoses) for n in nodes), "cross_check_ok": acked == stored,
               "connect_s": round(connect_s, 1), "connect_retries": connect_retries, "errors": len(fails),
               "goal_batches_met": rate_s >= goal_rate, "goal_p99_met": p99 <= GOAL_P99_MS,
               "warmup_p99_ms": round(startup_p99, 2), "p99_settled_s": settled,
               **({"durable": True, **restart, "bytes_per_batch": round(restart["store_bytes"] / max(stored, 1)),
                   "disk_write_bytes_per_sample": round(disk_per_sample, 2),
                   **{f"store_{k}_bytes_per_sample": round(v, 2) for k, v in store_written.items()}}
                  if args.durable else {})}
    print(json.dumps(summary))
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
