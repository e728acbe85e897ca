"""Agent overhead: CPU (% of one core) and peak RSS of a real `xpusense-agent run`, from /proc.

A real collector and agent (default tiers, or nearline at 1 s with --tiers-fast) on loopback; after
the warm-up, utime+stime of the agent over --seconds, its VmHWM, and the batches the collector stored
for it. Prints a small table and, last, a one-line JSON summary.

    .venv/bin/python bench/agent_overhead.py --seconds 60"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
from _proc import cpu_s, free_port, stop, tail, tool, wait_collector

GOAL_CPU_PCT = 1.0
GOAL_RSS_MB = 80.0


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def nodes_json(address: str, node_id: str) -> dict:
    out = subprocess.run(tool("xpusense-collector") + ["nodes", "--collector", address, "--node", node_id,
                                                       "--format", "json"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`xpusense-collector nodes` exited {out.returncode}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="measurement window after warm-up (default 60)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="excluded from the CPU figure (default 5)")
    p.add_argument("--tiers-fast", action="store_true", help="nearline tier at 1 s instead of 15 s")
    p.add_argument("--all-sources", action="store_true",
                   help="every source this host has (eBPF probes included) instead of the host source alone")
    p.add_argument("--node-id", default=f"bench-agent-{os.getpid()}")
    args = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="xpusense-bench-")
    address = f"127.0.0.1:{free_port()}"
    collector = agent = None
    try:
        col_log = os.path.join(tmp, "collector.log")
        with open(col_log, "w") as log:
            collector = subprocess.Popen(tool("xpusense-collector") + ["serve", "--listen", address,
                                                                      "--log-level", "warning"],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_collector(address, 20.0)
        except Exception:
            print(f"collector did not come up on {address}:\n{tail(col_log)}", file=sys.stderr)
            return 1

        cmd = tool("xpusense-agent") + ["run", "--collector", address, "--node-id", args.node_id,
                                       "--log-level", "warning"]
        cfg = os.path.join(tmp, "agent.toml")
        with open(cfg, "w") as f:
            if args.tiers_fast:
                f.write("[tiers]\nnearline_s = 1.0\n")
            if not args.all_sources:  # the goal is stated for the host source alone
                f.write("[sources.nvml]\nenabled = false\n[sources.npu_smi]\nenabled = false\n"
                        "[sources.ebpf]\nenabled = false\n")
        cmd += ["--config", cfg]
        agent_log = os.path.join(tmp, "agent.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("XPUSENSE_")}
        with open(agent_log, "w") as log:
            t_start = time.monotonic()
            agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        pid = agent.pid

        time.sleep(args.warmup_s)
        if agent.poll() is not None:
            print(f"agent exited {agent.returncode} during warm-up:\n{tail(agent_log)}", file=sys.stderr)
            return 1
        startup_cpu_s = cpu_s(pid)
        stored0 = nodes_json(address, args.node_id)["nodes"]
        stored0 = stored0[0]["batches_stored"] if stored0 else 0
        w0, c0 = time.monotonic(), cpu_s(pid)
        col0 = cpu_s(collector.pid)
        samples = []   # (t, cpu%, rss MB) every 10 s, to show a trend
        end = w0 + args.seconds
        last_t, last_c = w0, c0
        while (now := time.monotonic()) < end:
            time.sleep(min(10.0, end - now))
            if agent.poll() is not None:
                print(f"agent exited {agent.returncode} while measured:\n{tail(agent_log)}", file=sys.stderr)
                return 1
            t, c = time.monotonic(), cpu_s(pid)
            samples.append((t - w0, 100 * (c - last_c) / (t - last_t), status_kb(pid, "VmRSS") / 1024))
            last_t, last_c = t, c
        w1, c1 = time.monotonic(), cpu_s(pid)
        col1 = cpu_s(collector.pid)
        hwm_mb = status_kb(pid, "VmHWM") / 1024
        rss_mb = status_kb(pid, "VmRSS") / 1024
        threads = psutil.Process(pid).num_threads()
        nodes = nodes_json(address, args.node_id)["nodes"]
        if not nodes:
            print(f"collector has no node {args.node_id!r}:\n{tail(agent_log)}", file=sys.stderr)
            return 1
        node = nodes[0]
        cpu_pct = 100 * (c1 - c0) / (w1 - w0)
        batches = node["batches_stored"]

        print(f"agent overhead: {args.seconds:.0f} s after {args.warmup_s:.0f} s warm-up, "
              f"tiers {'fast (nearline 1 s)' if args.tiers_fast else 'default (1 s / 15 s / 5 min)'}, "
              f"pid {pid}, {threads} threads")
        print(f"  {'t (s)':>6} {'cpu %':>7} {'rss MB':>7}")
        for t, c, r in samples:
            print(f"  {t:6.0f} {c:7.2f} {r:7.1f}")
        print()
        print(f"  {'figure':<34} {'value':>10}  {'goal':>8}  ok")
        rows = [
            ("agent CPU, % of one core", f"{cpu_pct:.2f}", f"<= {GOAL_CPU_PCT:g}", cpu_pct <= GOAL_CPU_PCT),
            ("agent peak RSS (VmHWM), MB", f"{hwm_mb:.1f}", f"<= {GOAL_RSS_MB:g}", hwm_mb <= GOAL_RSS_MB),
            ("agent RSS at end (VmRSS), MB", f"{rss_mb:.1f}", "", None),
            ("agent CPU during start-up+warm-up, s", f"{startup_cpu_s:.2f}", "", None),
            ("collector CPU, % of one core", f"{100 * (col1 - col0) / (w1 - w0):.2f}", "", None),
            ("batches stored (whole run)", f"{batches}", "", None),
            ("batches stored in window, per s", f"{(batches - stored0) / (w1 - w0):.2f}", "", None),
            ("series held for the node", f"{len(node['series'])}", "", None),
        ]
        for name, val, goal, ok in rows:
            print(f"  {name:<34} {val:>10}  {goal:>8}  {'' if ok is None else ('yes' if ok else 'NO')}")
        summary = {"bench": "agent_overhead", "seconds": round(w1 - w0, 1), "warmup_s": args.warmup_s,
                   "tiers": "fast" if args.tiers_fast else "default", "cpu_pct_one_core": round(cpu_pct, 3),
                   "peak_rss_mb": round(hwm_mb, 1), "rss_mb": round(rss_mb, 1), "threads": threads,
                   "batches_stored": batches, "batches_duplicate": node["batches_duplicate"],
                   "series": len(node["series"]), "wall_since_start_s": round(time.monotonic() - t_start, 1),
                   "goal_cpu_met": cpu_pct <= GOAL_CPU_PCT, "goal_rss_met": hwm_mb <= GOAL_RSS_MB}
        print(json.dumps(summary))
        return 0
    finally:
        rc = stop(agent)
        if rc not in (None, 0):
            print(f"agent exited {rc} on SIGTERM", file=sys.stderr)
        stop(collector)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
