#!/usr/bin/env python3
"""Restart of a durable collector holding `--minutes` of `--nodes` nodes at 1 batch/s (goal: back to
serving in <= 10 s at 15 minutes of 1,000 nodes), without and with snapshots.

    .venv/bin/python bench/collector_restart.py --nodes 1000 --minutes 15            # whole_log
    .venv/bin/python bench/collector_restart.py --direct --nodes 1000 --minutes 15   # direct

"Ready" is from exec to the collector answering Health.Check SERVING (wait_serving). Prints a table,
then one line of JSON."""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from _proc import cpu_s, free_port, stop, tool
from collector_ingest import DEVICES, SERIES, SimAgent

from xpusense.collector.store.segment_file import SEGMENT_MAGIC, frame, segment_name

SNAP_LINE = re.compile(r"store snapshot \((\w+)\) \S+: (\d+) nodes, ([\d.]+) MB, (full|a diff), .*; "
                       r"([\d.]+) s \((\d+) ms of it")


class LogWriter:
    """Segments in the store's format, a new one every `segment_s` seconds of data."""

    def __init__(self, directory: str, first_id: int = 1):
        self.dir, self.seg_id, self.f = directory, first_id - 1, None
        self.bytes = 0

    def roll(self) -> None:
        if self.f is not None:
            self.f.close()
        self.seg_id += 1
        self.f = open(os.path.join(self.dir, segment_name(self.seg_id)), "wb")
        self.f.write(SEGMENT_MAGIC)

    def add(self, record: list) -> None:
        data = frame(record)
        assert self.f is not None
        self.f.write(data)
        self.bytes += len(data)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def step(agents: list[SimAgent], t: int, sec: int) -> None:
    """Every agent's batch for second `sec` (sample time t): the next seq, counters up, gauges moving."""
    for a in agents:
        a.seq += 1
        b = a.msg.batch
        b.seq, b.sent_unix_nano = a.seq, t
        for s, inc in a.counters:
            s.value += inc
        for i, (s, base) in enumerate(a.gauges):
            s.value = base + 0.05 * ((sec + i) % 7)
        for s in b.samples:
            s.time_unix_nano = t


def write_seconds(log: LogWriter, agents: list[SimAgent], start_ns: int, seconds: int, segment_s: int) -> None:
    for sec in range(seconds):
        if sec % segment_s == 0:
            log.roll()
        step(agents, start_ns + sec * 10**9, sec)
        for a in agents:
            log.add(["b", a.msg.batch.SerializeToString()])
    log.close()


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until the collector answers Health.Check SERVING: a fresh connection tried every 20 ms (a gRPC
    channel waiting for the port backs off, 1 s, 1.6 s, 2.6 s...: up to seconds late)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the collector exited ({proc.returncode}) before serving")
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except OSError:
            time.sleep(0.02)
            continue
        with grpc.insecure_channel(address) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.02)
    raise TimeoutError(f"the collector did not serve within {timeout_s} s")


COLLECTOR_CMD: list[str] = []   # --collector-cmd: another collector build to restart (default: xpusense-collector)


def run_collector(data: str, cfg: str, tmp: str, name: str) -> tuple[subprocess.Popen, float, str]:
    address = f"127.0.0.1:{free_port()}"
    log_path = os.path.join(tmp, f"{name}.log")
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        serve = ["serve", "--listen", address, "--log-level", "info", "--config", cfg, "--data-dir", data]
        proc = subprocess.Popen((COLLECTOR_CMD or tool("xpusense-collector")) + serve,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_serving(address, proc, 1800.0)
    except Exception:
        stop(proc)
        raise
    ready_s = time.monotonic() - t0
    print(f"{name}: serving {ready_s:.2f} s after exec, {cpu_s(proc.pid):.2f} s of CPU by then "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return proc, ready_s, log_path


def replay_line(text: str) -> dict:
    m = re.search(r"replayed: (\d+) batches.* in ([\d.]+) s", text)
    s = re.search(r"snapshot \S+ loaded: (\d+) nodes in ([\d.]+) s \(full ([\d.]+) s, diff ([\d.]+) s\)", text)
    return {"replayed": int(m.group(1)) if m else -1, "replay_s": float(m.group(2)) if m else -1.0,
            "snapshot_load_s": float(s.group(2)) if s else None, "full_load_s": float(s.group(3)) if s else None,
            "diff_load_s": float(s.group(4)) if s else None, "diff_loaded": bool(re.search(r"\.snap\+snapshot", text))}


def snap_line(text: str, why: str) -> dict:
    for m in SNAP_LINE.finditer(text):
        if m.group(1) == why:
            return {"mb": float(m.group(3)), "kind": m.group(4), "write_s": float(m.group(5)), "loop_ms": int(m.group(6))}
    return {"mb": -1.0, "kind": "", "write_s": -1.0, "loop_ms": -1}


def whole_log(args, tmp: str, data: str, cfg: str) -> dict:
    """The default run. A store is written directly in its own frame format: per node a Hello
    inventory, then one batch a second for `--minutes` (8 devices x 20 series, as collector_ingest.py
    sends), sample times ending now, segments of `--segment-s` of data each. `xpusense-collector
    serve` with snapshots on starts on it: no snapshot yet, so it replays the whole log ("without
    snapshot": ready time, and the replay's own count and seconds from its log); SIGTERM writes its
    snapshot on the way out. Then `--tail-s` more seconds of batches are appended (what a crash just
    before the next periodic snapshot leaves) and the caller starts it again: snapshot + tail."""
    seconds = int(args.minutes * 60)
    agents = [SimAgent(i, "nvidia") for i in range(args.nodes)]
    log = LogWriter(data)
    log.roll()
    for a in agents:
        log.add(["i", a.node_id, a.boot_id, a.hello.hello.inventory.SerializeToString()])
    t0 = time.monotonic()
    start_ns = time.time_ns() - (seconds + args.tail_s) * 10**9
    write_seconds(log, agents, start_ns, seconds, args.segment_s)
    print(f"store written: {args.nodes} nodes x {seconds} s = {args.nodes * seconds} batches "
          f"({DEVICES}x{len(SERIES)} samples), {log.bytes / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s", flush=True)
    proc, ready_full, path = run_collector(data, cfg, tmp, "full")
    stop(proc, timeout_s=600)
    text = open(path).read()
    full, snap = replay_line(text), snap_line(text, "stop")
    print(f"without snapshot: ready in {ready_full:.1f} s ({full['replayed']} batches replayed in "
          f"{full['replay_s']:.1f} s)", flush=True)
    tail = LogWriter(data, log.seg_id + 1)
    write_seconds(tail, agents, start_ns + seconds * 10**9, args.tail_s, args.segment_s)
    return {"batches": args.nodes * seconds, "store_gb": round(log.bytes / 1e9, 2),
            "ready_without_snapshot_s": round(ready_full, 2), "replay_without_snapshot_s": full["replay_s"],
            "replayed_without_snapshot": full["replayed"], "snapshot_mb": snap["mb"],
            "snapshot_write_s": snap["write_s"], "snapshot_loop_ms": snap["loop_ms"]}


def direct(args, data: str) -> dict:
    """The fleet state built in-process, snapshots taken by the real Snapshotter as data time passes
    (no whole log: minutes instead of a quarter of an hour at 1,000 nodes). One real batch a node,
    then `--minutes` of 1 s history put straight into the node's frame (its 160 series in columns,
    as a collector that has run that long holds them), and a full snapshot of it. Then batches are
    ingested (FleetState.ingest) with a snapshot every `--snapshot-every-s` seconds of data, full or
    diff as the Snapshotter decides, for at least `--run-s`, past a second full one (unless
    `--no-full-cycle`), until the next would be full: a crash there leaves the largest diff. Each
    snapshot's kind, size and write time is printed; bytes written per second of data is the write
    rate. The positions the snapshots cover are made up, one segment a snapshot (no log is written
    for those batches, none is read back). Then `--tail-s` seconds of batches go to the log only and
    the caller starts a real collector: ready time, snapshot load and tail replay from its log."""
    import asyncio
    from array import array

    from xpusense.collector import columns
    from xpusense.collector.series_history import History
    from xpusense.collector.state import FleetState
    from xpusense.collector.store import Store
    from xpusense.collector.store.snapshot_taker import DIFF_RATIO, Snapshotter

    seconds = int(args.minutes * 60)
    agents = [SimAgent(i, "nvidia") for i in range(args.nodes)]
    every = int(args.snapshot_every_s)
    start_ns = time.time_ns() - (seconds + args.run_s + 2 * args.tail_s + 10 * every) * 10**9
    state = FleetState()
    state.columns = False   # a node's frame set by hand below, as a collector that ran this long holds it
    c0, t0 = time.process_time(), time.monotonic()
    times = array("q", range(start_ns, start_ns + seconds * 10**9, 10**9))
    width = DEVICES * len(SERIES)
    rows = array("d", bytes(8 * seconds * width))   # a series' values: its own wave, the same on every node
    for i in range(width):
        rows[i::width] = array("d", [(i + 1) * (1 + 0.01 * ((k * (i + 3)) % 97)) for k in range(seconds)])
    for a in agents:   # one real batch a node (series made as the server makes them), then the rest of the history
        state.hello(a.hello.hello)
        state.disconnected(a.node_id, a.boot_id)
        step([a], start_ns, 0)
        state.ingest(a.msg.batch, now_ns=start_ns)
        a.seq = seconds
        n = state.nodes[a.node_id]
        n.stored_up_to[a.boot_id] = seconds
        refs = sorted(n.refs[a.boot_id].items())
        members = [ser for _, ser in refs]
        for ser in members:
            ser.history = History()
        columns.adopt(state, n, (a.boot_id, *(r for r, _ in refs)), members, array("q", times), array("d", rows),
                      times[-1], -1, 0)
    state.history_slots = state.frame_points
    state.columns = True
    print(f"fleet state built: {args.nodes} nodes x {seconds} s x {DEVICES * len(SERIES)} series in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    store = Store(data, fsync=False)
    snap = Snapshotter(store, state, 3600.0)
    store.open(state)
    seg = [1]

    def take(why: str) -> dict:
        store.durable = (seg[0], 0)   # a made-up position, a segment a snapshot (no log is written here)
        seg[0] += 1
        c, w = time.process_time(), time.monotonic()
        asyncio.run(snap.take(why))
        last = snap.last
        return {"kind": "full" if last["snapshot_full"] else "diff", "mb": round(last["snapshot_bytes"] / 1e6, 3),
                "write_s": round(time.monotonic() - w, 2), "cpu_s": round(time.process_time() - c, 2),
                "loop_ms": last["snapshot_loop_ms"]}

    shots = [take("start")]
    print(f"  t={0:5d} s  {shots[-1]}", flush=True)
    sec, ingest_cpu = 0, 0.0
    while True:
        c = time.process_time()
        for _ in range(every):
            sec += 1
            t = start_ns + (seconds + sec) * 10**9
            step(agents, t, seconds + sec)
            for a in agents:
                state.ingest(a.msg.batch, now_ns=t)
        ingest_cpu += time.process_time() - c
        cycle = any(s["kind"] == "full" for s in shots[1:]) or not args.full_cycle
        if sec >= args.run_s and cycle and snap.diff_bytes * DIFF_RATIO >= snap.base_bytes and len(shots) > 2:
            break   # the next one would be full: a crash here leaves the largest diff
        shots.append(take("periodic"))
        print(f"  t={sec:5d} s  {shots[-1]}", flush=True)
    store.close()
    # The write rate over one cycle: the diffs after the first full snapshot and the next full one
    # (without --full-cycle: every snapshot after the first, over the time they cover).
    ends = [i for i, s in enumerate(shots) if i and s["kind"] == "full"]
    cycle = shots[1:ends[0] + 1] if ends else shots[1:]
    cycle_s = (ends[0] if ends else len(shots) - 1) * every
    tail = LogWriter(data, seg[0] + 1)
    write_seconds(tail, agents, start_ns + (seconds + sec + 1) * 10**9, args.tail_s, args.segment_s)
    print(f"built and simulated in {time.process_time() - c0:.0f} s of CPU ({ingest_cpu / (sec * args.nodes) * 1e6:.0f} us "
          f"a batch ingested); then {args.tail_s} s of batches in the log only", flush=True)
    return {"simulated_s": sec, "snapshots": len(shots) - 1, "full_snapshots": sum(s["kind"] == "full" for s in shots[1:]),
            "full_mb": shots[0]["mb"], "last_diff_mb": shots[-1]["mb"] if shots[-1]["kind"] == "diff" else None,
            "diff_write_s_max": max((s["write_s"] for s in shots if s["kind"] == "diff"), default=None),
            "diff_loop_ms_max": max((s["loop_ms"] for s in shots if s["kind"] == "diff"), default=None),
            "full_write_s": shots[0]["write_s"], "full_loop_ms": shots[0]["loop_ms"],
            "write_mb_s": round(sum(s["mb"] for s in cycle) / cycle_s, 3), "cycle_s": cycle_s,
            "snapshot_every_s": every}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--tail-s", type=int, default=10, help="seconds of batches after the last snapshot (snapshot_every_s)")
    ap.add_argument("--segment-s", type=int, default=60)
    ap.add_argument("--direct", action="store_true", help="build the state in-process, no whole-log replay (see above)")
    ap.add_argument("--snapshot-every-s", type=float, default=10.0, help="--direct: seconds of data between snapshots")
    ap.add_argument("--run-s", type=int, default=120, help="--direct: seconds of data ingested after the first snapshot")
    ap.add_argument("--full-cycle", action=argparse.BooleanOptionalAction, default=True,
                    help="--direct: go on until a second full snapshot was written (the write rate covers a cycle)")
    ap.add_argument("--collector-cmd", metavar="CMD", help="another collector build to restart (default: "
                    "xpusense-collector); 'serve ...' is appended")
    ap.add_argument("--dir", help="where the store goes (default: a temporary directory, removed after)")
    args = ap.parse_args(argv)
    if args.collector_cmd:
        COLLECTOR_CMD[:] = shlex.split(args.collector_cmd)
    tmp = args.dir or tempfile.mkdtemp(prefix="xpusense-restart-")
    data = os.path.join(tmp, "data")
    os.makedirs(data, exist_ok=True)
    cfg = os.path.join(tmp, "collector.toml")
    with open(cfg, "w") as f:
        f.write("[store]\nsnapshot_every_s = 3600.0\n")   # only the snapshot on stop, in this bench
    try:
        figures: dict = {"nodes": args.nodes, "minutes": args.minutes, "tail_s": args.tail_s,
                         "load": os.getloadavg()[0]}
        figures.update(direct(args, data) if args.direct else whole_log(args, tmp, data, cfg))
        gc.collect()   # this process's copy of the fleet gone (--direct), what it wrote on disk: the restart alone
        os.sync()
        proc, ready_snap, path = run_collector(data, cfg, tmp, "snap")
        stop(proc, timeout_s=600)
        text = open(path).read()
        with_snap, stop_snap = replay_line(text), snap_line(text, "stop")
        figures.update({"ready_with_snapshot_s": round(ready_snap, 2), "snapshot_load_s": with_snap["snapshot_load_s"],
                        "full_load_s": with_snap["full_load_s"], "diff_load_s": with_snap["diff_load_s"],
                        "diff_loaded": with_snap["diff_loaded"], "replayed_tail": with_snap["replayed"],
                        "replay_tail_s": with_snap["replay_s"], "stop_snapshot_mb": stop_snap["mb"],
                        "stop_snapshot_kind": stop_snap["kind"], "stop_snapshot_write_s": stop_snap["write_s"],
                        "stop_snapshot_loop_ms": stop_snap["loop_ms"], "load_after": os.getloadavg()[0]})
        print(f"{'nodes x minutes':34} {args.nodes} x {args.minutes:g}")
        if args.direct:
            print(f"{'snapshots (every s of data)':34} {figures['snapshots']} in {figures['simulated_s']} s "
                  f"(every {figures['snapshot_every_s']} s), {figures['full_snapshots']} full; "
                  f"full {figures['full_mb']:.0f} MB "
                  f"in {figures['full_write_s']:.1f} s ({figures['full_loop_ms']} ms on the loop); last diff "
                  f"{figures['last_diff_mb']} MB; written {figures['write_mb_s']} MB per s of data "
                  f"(over {figures['cycle_s']} s)")
        else:
            print(f"{'restart without snapshot':34} ready in {figures['ready_without_snapshot_s']:.1f} s "
                  f"(replay {figures['replay_without_snapshot_s']:.1f} s)")
            print(f"{'snapshot at stop':34} {figures['snapshot_mb']:.0f} MB in {figures['snapshot_write_s']:.1f} s "
                  f"({figures['snapshot_loop_ms']} ms on the event loop)")
        print(f"{'restart with snapshot + tail':34} ready in {ready_snap:.1f} s (snapshot loaded in "
              f"{with_snap['snapshot_load_s']} s: full {with_snap['full_load_s']} s, diff {with_snap['diff_load_s']} s; "
              f"{with_snap['replayed']} tail batches in {with_snap['replay_s']:.1f} s)")
        print(f"{'goal':34} <= 10 s: {'met' if ready_snap <= 10 else 'missed'}")
        print(json.dumps(figures))
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
