#!/usr/bin/env python3
"""Restart of a durable collector holding `--minutes` of `--nodes` nodes at 1 batch/s (issue 15
item 4: back to serving in <= 10 s at 15 minutes of 1,000 nodes), without and with a snapshot.

1. A store is written directly (the store's own frame format, collector/store/frames.py): per node
   a Hello inventory, then one batch a second for `--minutes` (8 devices x 20 series, as
   collector_ingest.py sends), sample times ending now. Segments of `--segment-s` of data each.
2. `xpusense-collector serve` with snapshots on starts on it: no snapshot yet, so it replays the
   whole log ("without snapshot": from exec to the gRPC port ready, and the replay's own count and
   seconds from its log). It is stopped with SIGTERM: it writes its snapshot on the way out (size
   and time from its log).
3. `--tail-s` more seconds of batches are appended (a crash just before the next periodic snapshot
   leaves at most snapshot_every_s of them), and the collector starts again: it loads the snapshot
   and replays only that tail ("with snapshot").
Prints a table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from _proc import free_port, stop, tool, wait_collector
from collector_ingest import DEVICES, SERIES, SimAgent

from xpusense.collector.store.frames import SEGMENT_MAGIC, frame, segment_name


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


def write_seconds(log: LogWriter, agents: list[SimAgent], start_ns: int, seconds: int, segment_s: int) -> None:
    for sec in range(seconds):
        if sec % segment_s == 0:
            log.roll()
        t = start_ns + sec * 10**9
        for a in agents:
            a.seq += 1
            b = a.msg.batch
            b.seq, b.sent_unix_nano = a.seq, t
            for s, step in a.counters:
                s.value += step
            for i, (s, base) in enumerate(a.gauges):
                s.value = base + 0.05 * ((sec + i) % 7)
            for s in a.samples:
                s.time_unix_nano = t
            log.add(["b", b.SerializeToString()])
    log.close()


def run_collector(data: str, cfg: str, tmp: str, name: str) -> tuple[subprocess.Popen, float, str]:
    address = f"127.0.0.1:{free_port()}"
    log_path = os.path.join(tmp, f"{name}.log")
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(tool("xpusense-collector") + ["serve", "--listen", address, "--log-level", "info",
                                                              "--config", cfg, "--data-dir", data],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_collector(address, 1800.0)
    except Exception:
        stop(proc)
        raise
    return proc, time.monotonic() - t0, log_path


def replay_line(text: str) -> dict:
    m = re.search(r"replayed: (\d+) batches.* in ([\d.]+) s", text)
    s = re.search(r"snapshot \S+ loaded: (\d+) nodes in ([\d.]+) s", text)
    return {"replayed": int(m.group(1)) if m else -1, "replay_s": float(m.group(2)) if m else -1.0,
            "snapshot_load_s": float(s.group(2)) if s else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--tail-s", type=int, default=30, help="seconds of batches after the snapshot (snapshot_every_s)")
    ap.add_argument("--segment-s", type=int, default=60)
    ap.add_argument("--dir", help="where the store goes (default: a temporary directory, removed after)")
    args = ap.parse_args(argv)
    tmp = args.dir or tempfile.mkdtemp(prefix="xpusense-restart-")
    data = os.path.join(tmp, "data")
    os.makedirs(data, exist_ok=True)
    cfg = os.path.join(tmp, "collector.toml")
    with open(cfg, "w") as f:
        f.write("[store]\nsnapshot_every_s = 3600.0\n")   # only the snapshot on stop, in this bench
    try:
        seconds = int(args.minutes * 60)
        agents = [SimAgent(i, "nvidia") for i in range(args.nodes)]
        log = LogWriter(data)
        log.roll()
        for a in agents:
            log.add(["i", a.node_id, a.boot_id, a.hello.hello.inventory.SerializeToString()])
        t0 = time.monotonic()
        start_ns = time.time_ns() - (seconds + args.tail_s) * 10**9
        write_seconds(log, agents, start_ns, seconds, args.segment_s)
        gen_s = time.monotonic() - t0
        print(f"store written: {args.nodes} nodes x {seconds} s = {args.nodes * seconds} batches "
              f"({DEVICES}x{len(SERIES)} samples), {log.bytes / 1e9:.2f} GB in {gen_s:.0f} s", flush=True)

        proc, ready_full, path = run_collector(data, cfg, tmp, "full")
        stop(proc, timeout_s=600)
        text = open(path).read()
        full = replay_line(text)
        snap = re.search(r"store snapshot \(stop\) \S+: (\d+) nodes, ([\d.]+) MB, .*; ([\d.]+) s \((\d+) ms of it", text)
        print(f"without snapshot: ready in {ready_full:.1f} s ({full['replayed']} batches replayed in "
              f"{full['replay_s']:.1f} s)", flush=True)

        tail = LogWriter(data, log.seg_id + 1)
        write_seconds(tail, agents, start_ns + seconds * 10**9, args.tail_s, args.segment_s)
        proc, ready_snap, path = run_collector(data, cfg, tmp, "snap")
        stop(proc, timeout_s=600)
        with_snap = replay_line(open(path).read())
        figures = {"nodes": args.nodes, "minutes": args.minutes, "batches": args.nodes * seconds,
                   "store_gb": round(log.bytes / 1e9, 2), "ready_without_snapshot_s": round(ready_full, 2),
                   "replay_without_snapshot_s": full["replay_s"], "replayed_without_snapshot": full["replayed"],
                   "snapshot_mb": float(snap.group(2)) if snap else -1,
                   "snapshot_write_s": float(snap.group(3)) if snap else -1,
                   "snapshot_loop_ms": int(snap.group(4)) if snap else -1,
                   "tail_s": args.tail_s, "ready_with_snapshot_s": round(ready_snap, 2),
                   "snapshot_load_s": with_snap["snapshot_load_s"], "replayed_tail": with_snap["replayed"],
                   "replay_tail_s": with_snap["replay_s"]}
        print(f"{'nodes x minutes':34} {args.nodes} x {args.minutes:g} ({figures['batches']} batches, "
              f"{figures['store_gb']} GB of log)")
        print(f"{'restart without snapshot':34} ready in {ready_full:.1f} s (replay {full['replay_s']:.1f} s)")
        print(f"{'snapshot at stop':34} {figures['snapshot_mb']:.0f} MB in {figures['snapshot_write_s']:.1f} s "
              f"({figures['snapshot_loop_ms']} ms on the event loop)")
        print(f"{'restart with snapshot + tail':34} ready in {ready_snap:.1f} s (snapshot loaded in "
              f"{with_snap['snapshot_load_s']} s, {with_snap['replayed']} tail batches in {with_snap['replay_s']:.1f} s)")
        print(f"{'goal':34} <= 10 s: {'met' if ready_snap <= 10 else 'missed'}")
        print(json.dumps(figures))
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
