#!/usr/bin/env bash
# Device check on a machine with a real NVIDIA GPU (Hopper or newer for HBM bandwidth).
#
#   bench/device/nvml_check.sh [SECONDS=30]
#
# Needs python3 with torch (CUDA), nvidia-ml-py; nothing is downloaded. Runs the agent's NVML
# source for SECONDS at 1 s while a torch device-to-device copy loop runs for the middle third,
# prints per-second DRAM bandwidth utilisation (GPM), SM utilisation and power, and checks that
# DRAM bandwidth rises above 85% during the loop and falls after it. The copy loop uses the
# training-side helper (xpusense.client.checkpoint), and the agent's HBM watch (window 3 s) watches
# the GPU with NVML's real process list: the check also requires that the copy process receives
# exactly one checkpoint request. Exit 0 when every check passes. Takes SECONDS + ~20 s.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
secs=${1:-30}
py=${PYTHON:-python3}
work=$(mktemp -d /tmp/xpusense-device.XXXXXX)
trap 'rm -rf "$work"' EXIT
# The repository's folders as the xpusense package, without installing anything.
mkdir -p "$work/pkg/xpusense"
cp "$root/proto/xpusense/__init__.py" "$work/pkg/xpusense/"
ln -s "$root/agent" "$work/pkg/xpusense/agent"
ln -s "$root/client" "$work/pkg/xpusense/client"
export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$work/req"

cat > "$work/copy_loop.py" <<'PY'
import os, signal, sys, time
import torch
from xpusense.client.checkpoint import CheckpointRequests
start, stop, req_dir = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dev = torch.device("cuda:0")
n = (2 << 30) // 4                        # 2 GiB per tensor
a = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
b = torch.empty_like(a)
torch.cuda.synchronize()
print(f"copy loop ready (pid {os.getpid()})", flush=True)
got = []
with CheckpointRequests(req_dir, signal.SIGUSR1, poll_s=0.05) as requests:
    while time.time() < start:
        time.sleep(0.01)
    copies = 0
    while time.time() < stop:
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
        copies += 10
        if requests.pending():            # the safe point
            r = requests.take()
            got.append(r.get("id", "signal"))
            requests.done(r, path="(device check: no checkpoint written)")
            print(f"checkpoint request received: {r.get('id', 'signal')} at {time.time():.3f}", flush=True)
    gbps = copies * 2 * a.numel() * 4 / (stop - start) / 1e9
    print(f"copy loop done: {copies} copies, {gbps:.0f} GB/s read+write; requests {got}", flush=True)
    time.sleep(2)
PY

cat > "$work/drive.py" <<'PY'
import json, sys, time
from xpusense.agent.hbm_watch import HbmWatch, Rule
from xpusense.agent.sources.nvml import NvmlSource
secs, t0, start, stop, req_dir = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
src = NvmlSource()
src.setup()
g0 = src.gpus[0]
print(f"GPU 0: {g0.name}, GPM {'yes' if g0.gpm else 'no: ' + g0.gpm_reason}, driver {src.driver}", flush=True)
watch = HbmWatch({"default": Rule(0.85, 3.0, 0.75, 600.0)}, src.processes, actions=("signal", "file"),
                 request_dir=req_dir, group_by="pid")
rows, fired = [], []
print(f"{'t':>5} {'phase':>6} {'dram_bw':>8} {'sm':>6} {'gpu':>6} {'power_W':>8}", flush=True)
next_t = t0
for i in range(secs):
    next_t += 1.0
    time.sleep(max(0.0, next_t - time.time()))
    rt = [s for s in src.collect("realtime") if s.labels.get("device") == "gpu0"]
    off = [s for s in src.collect("offline") if s.labels.get("device") == "gpu0"]
    for s in rt:
        s.time_ns = s.time_ns or time.time_ns()
    fired += watch.observe(rt) or []
    v = {s.name: s.value for s in rt + off}
    now = time.time()
    phase = "copy" if start <= now < stop else "idle"
    row = {"t": round(now - t0, 1), "phase": phase,
           "dram_bw": v.get("xpusense.accelerator.hbm.bandwidth.utilization"),
           "sm": v.get("xpusense.accelerator.sm.utilization"), "gpu": v.get("hw.gpu.utilization"),
           "power": v.get("hw.power")}
    rows.append(row)
    f = lambda x: "-" if x is None else f"{x:.2f}"
    print(f"{row['t']:>5} {phase:>6} {f(row['dram_bw']):>8} {f(row['sm']):>6} {f(row['gpu']):>6} {f(row['power']):>8}", flush=True)
src.close()
during = [r["dram_bw"] for r in rows if r["phase"] == "copy" and r["dram_bw"] is not None][2:]
after = [r["dram_bw"] for r in rows if r["t"] > stop - t0 + 3 and r["dram_bw"] is not None]
res = {"max_dram_bw_during": max(during, default=None), "mean_dram_bw_after": sum(after) / len(after) if after else None,
       "requests_sent": [(r.id, r.job, r.pids) for r in watch.sent]}
print(json.dumps(res), flush=True)
ok = bool(during) and max(during) > 0.85 and bool(after) and res["mean_dram_bw_after"] < 0.5 and len(watch.sent) == 1
print("DRAM bandwidth rose above 85% during the copy loop and fell after it; one request sent" if ok else
      "CHECK FAILED: see the figures above", flush=True)
sys.exit(0 if ok else 1)
PY

t0=$(date +%s.%N)
start=$(awk "BEGIN{printf \"%.3f\", $t0 + $secs / 3}")
stop=$(awk "BEGIN{printf \"%.3f\", $t0 + 2 * $secs / 3}")
"$py" "$work/copy_loop.py" "$start" "$stop" "$work/req" > "$work/copy.log" 2>&1 &
copy_pid=$!
rc=0
"$py" "$work/drive.py" "$secs" "$t0" "$start" "$stop" "$work/req" || rc=$?
wait "$copy_pid" || true
echo "--- copy loop:"
cat "$work/copy.log"
received=$(grep -c "checkpoint request received" "$work/copy.log" || true)
if [ "$received" != 1 ]; then
    echo "CHECK FAILED: the copy process received $received checkpoint requests (expected 1)"
    rc=1
fi
exit $rc
