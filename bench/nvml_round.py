#!/usr/bin/env python3
"""What one 1 s round of the NVML source costs the agent with 8 GPUs (fake libnvidia-ml).

CPU and wall time per realtime round, and NVML calls per round. The fake answers in microseconds,
so this is the Python and pynvml cost the agent adds, not a real driver's own latency.

    .venv/bin/python bench/nvml_round.py [--rounds 60] [--scenario h100x8]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CHILD = r"""
import json, statistics, sys, time
from xpusense.agent.sources.nvml.source import NvmlSource
rounds, gap = int(sys.argv[1]), float(sys.argv[2])
src = NvmlSource(events=True)
src.setup()
cpu, wall = [], []
try:
    src.collect("realtime")                      # the first GPM sample
    for _ in range(rounds):
        time.sleep(gap)                          # GPM needs time between two samples
        c0, w0 = time.process_time(), time.perf_counter()
        n = len(src.collect("realtime"))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
finally:
    src.close()
q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]
print(json.dumps({"samples_per_round": n, "cpu_ms_mean": statistics.mean(cpu) * 1e3, "cpu_ms_p99": q(cpu, 0.99) * 1e3,
                  "wall_ms_mean": statistics.mean(wall) * 1e3, "wall_ms_p99": q(wall, 0.99) * 1e3}))
"""


def main() -> int:
    """Builds the fake library (tests/fakes/nvml) and runs the NVML source in a child process with it
    on LD_LIBRARY_PATH: CPU time per round is time.process_time (all threads), NVML calls per round
    come from the fake's call counter."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--gap-s", type=float, default=0.2, help="time between rounds (GPM needs > 0.1 s)")
    p.add_argument("--scenario", default="h100x8")
    a = p.parse_args()
    from fakes.nvml import fakenvml
    with tempfile.TemporaryDirectory() as tmp:
        lib = fakenvml.build(tmp)
        calls = Path(tmp) / "calls.txt"
        env = fakenvml.env(lib, fakenvml.scenario(a.scenario), calls=calls)
        r = subprocess.run([sys.executable, "-c", CHILD, str(a.rounds), str(a.gap_s)], env=env,
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        res = json.loads(r.stdout)
        counts = fakenvml.read_calls(calls) if calls.exists() else {}
    total = counts.get("_total", 0)
    res.update({"bench": "nvml_round", "scenario": a.scenario, "rounds": a.rounds,
                "nvml_calls_per_round": round(total / (a.rounds + 1), 1) if total else None})
    print(f"NVML source, realtime round, scenario {a.scenario} ({a.rounds} rounds)")
    print(f"  samples per round          {res['samples_per_round']}")
    print(f"  agent CPU per round, ms    mean {res['cpu_ms_mean']:.2f}  p99 {res['cpu_ms_p99']:.2f}   (goal <= 100)")
    print(f"  wall time per round, ms    mean {res['wall_ms_mean']:.2f}  p99 {res['wall_ms_p99']:.2f}")
    print(f"  NVML calls (whole run / rounds + set-up)  {res['nvml_calls_per_round']}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
