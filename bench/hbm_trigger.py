#!/usr/bin/env python3
"""Trigger latency of the HBM bandwidth watch: threshold crossed -> the training helper's callback ran.

    .venv/bin/python bench/hbm_trigger.py [--cycles 8] [--window-s 2] [--realtime-s 1]

How it is set up and what latency counts: main()."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))

from _proc import free_port  # noqa: E402


def main() -> int:
    """A real collector, a real agent on the fake libnvidia-ml (one H100 whose DRAM bandwidth steps
    40% -> 92% -> 40% every --period-s), and the example training loop (examples/
    train_with_checkpoint.py, on xpusense.client.checkpoint) registered as the GPU's process;
    cooldown 0, so every ramp fires. Per request: crossed = the first 1 s sample at or above the
    threshold (the request file's crossed_time), callback = when the helper recorded it done.
    Latency is callback - crossed; minus the window it is what the watch, the signal/file delivery
    and the training loop's next safe point add."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=8)
    p.add_argument("--period-s", type=float, default=8.0)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--realtime-s", type=float, default=1.0)
    a = p.parse_args()
    from fakes.nvml import fakenvml
    high = a.period_s / 2
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lib = fakenvml.build(tmp / "lib")
        scn = fakenvml.scenario("ramp").read_text().splitlines()
        scn = [ln for ln in scn if not ln.startswith("gpm_dram_bw_util")]
        scn.insert(scn.index("[gpu 0]") + 1, f"repeat = {a.period_s:g}")
        scn.append(f"gpm_dram_bw_util = 0:40 1:40 1:92 {1 + high:g}:92 {1 + high:g}:40 {a.period_s:g}:40")
        (tmp / "ramp.scn").write_text("\n".join(scn) + "\n")
        req, ckpt = tmp / "req", tmp / "ckpt"
        req.mkdir()
        (tmp / "agent.toml").write_text(
            f"[tiers]\nrealtime_s = {a.realtime_s}\n[stream]\nflush_s = 0.05\n[sources.host]\nenabled = false\n"
            f"[hbm_watch]\nrequest_dir = \"{req}\"\nwindow_s = {a.window_s}\ncooldown_s = 0\n")
        addr = f"127.0.0.1:{free_port()}"
        try:
            trainer = subprocess.Popen([sys.executable, str(ROOT / "examples/train_with_checkpoint.py"),
                                        "--checkpoint-dir", str(ckpt), "--request-dir", str(req)],
                                       stdout=subprocess.DEVNULL)
            procs.append(trainer)
            (tmp / "procs").write_text(f"0 {trainer.pid} 8589934592\n")
            procs.append(subprocess.Popen([str(BIN / "xpusense-collector"), "serve", "--listen", addr],
                                          stderr=subprocess.DEVNULL))
            env = fakenvml.env(lib, tmp / "ramp.scn", procs=tmp / "procs")
            procs.append(subprocess.Popen([str(BIN / "xpusense-agent"), "run", "--config", str(tmp / "agent.toml"),
                                           "--collector", addr], env=env, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + a.cycles * a.period_s + 20
            while time.monotonic() < deadline and len(list(req.glob("*.done.json"))) < a.cycles:
                time.sleep(0.2)
        finally:
            for pr in procs:
                pr.send_signal(signal.SIGTERM)
            for pr in procs:
                try:
                    pr.wait(10)
                except subprocess.TimeoutExpired:
                    pr.kill()
        lat = []
        for done in req.glob("*.done.json"):
            d = json.loads(done.read_text())
            r = json.loads((req / f"{d['id']}.json").read_text())
            lat.append((d["time"] - r["crossed_time"]) * 1000)
    if not lat:
        print("no request was handled", file=sys.stderr)
        return 1
    lat.sort()
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))]  # noqa: E731
    res = {"bench": "hbm_trigger", "requests": len(lat), "window_s": a.window_s, "realtime_s": a.realtime_s,
           "p50_ms": round(q(0.5), 1), "p99_ms": round(q(0.99), 1), "max_ms": round(lat[-1], 1),
           "p50_over_window_ms": round(q(0.5) - a.window_s * 1000, 1),
           "p99_over_window_ms": round(q(0.99) - a.window_s * 1000, 1)}
    print(f"HBM watch trigger latency, {len(lat)} requests, window {a.window_s:g} s, realtime tier {a.realtime_s:g} s")
    print(f"  threshold crossed -> helper callback   p50 {res['p50_ms']:.0f} ms   p99 {res['p99_ms']:.0f} ms")
    print(f"  of which beyond the window             p50 {res['p50_over_window_ms']:.0f} ms"
          f"   p99 {res['p99_over_window_ms']:.0f} ms")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
