#!/usr/bin/env bash
# Device check on a machine with a real NVIDIA GPU (Hopper or newer for HBM bandwidth).
#
#   bench/device/nvml_check.sh [--dry-run] [SECONDS=30]
#
# Needs python3 with torch (CUDA), nvidia-ml-py; nothing is downloaded. Three checks:
# 1. HBM watch: runs the agent's NVML source for SECONDS at 1 s while a torch device-to-device copy
#    loop runs for the middle third, prints per-second DRAM bandwidth utilisation (GPM), SM
#    utilisation and power, and checks that DRAM bandwidth rises above 85% during the loop and falls
#    after it. The copy loop uses the training-side helper (xpusense.client.checkpoint), and the
#    agent's HBM watch (window 3 s) watches the GPU with NVML's real process list: the copy process
#    must receive exactly one checkpoint request.
# 2. Faults: on the real driver, makes one reading of GPU 0 fail for a few rounds (power Unknown,
#    GPM samples Unknown, memory Timeout, injected in front of the NVML calls) and checks that every
#    other reading keeps flowing, that GPU 0 is neither lost nor given up, that the failed readings
#    come back, and that two GPM rounds 20 ms apart give no HBM bandwidth (the 100 ms floor).
# 3. MIG: where a GPU already has MIG mode on, checks that every MIG instance reports its memory and
#    HBM bandwidth through its own handle. MIG mode is never changed here; with it off, said skipped.
# --dry-run runs checks 2 and 3 against the fake libnvidia-ml (tests/fakes/nvml; needs cc) instead
# of a GPU, and skips check 1 (no torch). Exit 0 when every check run passes. Takes SECONDS + ~40 s.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
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
from xpusense.agent.sources.nvml.source import NvmlSource
secs, t0, start, stop, req_dir = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
src = NvmlSource()
src.setup()
g0 = src.gpus[0]
print(f"GPU 0: {g0.name}, GPM {'yes' if g0.gpm_stream else 'no: ' + g0.gpm_reason}, driver {src.driver}", flush=True)
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

cat > "$work/faults.py" <<'PY'
import time
import pynvml
from xpusense.agent.sources.nvml.source import NvmlSource

UNKNOWN, TIMEOUT = pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT
src = NvmlSource(events=False)
src.setup()
g0 = src.gpus[0]
bad = {"on": False}


def failing(call, code):
    def wrapped(*args):
        if bad["on"]:
            raise pynvml.NVMLError(code)
        return call(*args)
    return wrapped


def gpu0_only(call, code):
    def wrapped(handle):
        if bad["on"] and handle is g0.handle:
            raise pynvml.NVMLError(code)
        return call(handle)
    return wrapped


calls = src.round.calls
calls["power"] = gpu0_only(calls["power"], UNKNOWN)
calls["memory"] = gpu0_only(calls["memory"], TIMEOUT)
if g0.gpm_stream is not None:
    g0.gpm_stream.take = failing(g0.gpm_stream.take, UNKNOWN)
BW = "xpusense.accelerator.hbm.bandwidth.utilization"
names = {"hw.gpu.utilization": "util", "hw.gpu.memory.usage": "mem", BW: "hbm_bw", "hw.power": "power"}
problems, seen = [], {}
for i in range(12):
    bad["on"] = 3 <= i < 6
    t = time.monotonic()
    got = {}
    for tier in ("realtime", "offline"):
        for s in src.collect(tier):
            if s.name in names and "mig_instance" not in s.labels:
                got.setdefault(s.name, set()).add(s.labels["device"])
    seen[i] = got
    others = {g.id for g in src.gpus[1:] if g.opened}
    state = "FAULTS ON " if bad["on"] else "faults off"
    print(f"round {i:2d} {state}: " + "; ".join(f"{names[n]}={','.join(sorted(d))}" for n, d in sorted(got.items())),
          flush=True)
    if "gpu0" not in got.get("hw.gpu.utilization", set()) and not g0.mig:
        problems.append(f"round {i}: gpu0's utilisation stopped while other readings failed")
    for n in names:
        expect = {g.id for g in src.gpus[1:] if g.gpm_stream is not None} if n == BW else others
        missing = expect - got.get(n, set())
        if i >= 1 and missing and not (n == "hw.gpu.utilization" and all(g.mig for g in src.gpus[1:])):
            problems.append(f"round {i}: {n} missing on other GPUs {sorted(missing)}")
    time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
if g0.lost:
    problems.append("gpu0 was declared lost for transient errors")
late = [seen[i] for i in (10, 11)]
for n in ("hw.power", "hw.gpu.memory.usage") + ((BW,) if g0.gpm_stream is not None else ()):
    if g0.mig and n != "hw.power":
        continue
    if not any("gpu0" in r.get(n, set()) for r in late):
        problems.append(f"{n} of gpu0 did not come back after the faults")
    if any("gpu0" in seen[i].get(n, set()) for i in (4, 5)):
        problems.append(f"{n} of gpu0 reported while its call failed")
# The GPM floor: a round 20 ms after the last one reports no HBM bandwidth.
if g0.gpm_stream is not None:
    src.collect("realtime")
    time.sleep(0.02)
    quick = [s for s in src.collect("realtime") if s.name == BW and s.labels["device"] == "gpu0"]
    if quick:
        problems.append(f"HBM bandwidth from GPM samples 20 ms apart: {quick[0].value}")
d = src.describe()
print("unavailable:", d["unavailable_readings"], "\nretrying:", d["retrying_readings"], "\ncalls:", d["calls"],
      d["memory_call"], "|", d["process_list"], flush=True)
src.close()
print("\n".join(problems) or "FAULTS OK: one reading failing on GPU 0 left the rest flowing, and it came back",
      flush=True)
raise SystemExit(1 if problems else 0)
PY

cat > "$work/mig.py" <<'PY'
import time
import pynvml
from xpusense.agent.sources.nvml.source import NvmlSource

src = NvmlSource(events=False)
src.setup()
migs = [g for g in src.gpus if g.mig]
if not migs:
    print("MIG: skipped (no GPU has MIG mode on; this check never changes it)", flush=True)
    src.close()
    raise SystemExit(0)
problems = []
src.collect("realtime")
time.sleep(1.0)
samples = src.collect("realtime")
for g in migs:
    for inst in g.migs:
        mine = {s.name for s in samples if s.labels.get("device") == g.id
                and s.labels.get("mig_instance") == str(inst.gi)}
        print(f"{inst.id} ({inst.name}): {sorted(mine)}", flush=True)
        if "hw.gpu.memory.usage" not in mine:
            problems.append(f"{inst.id}: no memory reading")
        if inst.gpm is not None and "xpusense.accelerator.hbm.bandwidth.utilization" not in mine:
            problems.append(f"{inst.id}: no HBM bandwidth from nvmlGpmMigSampleGet")
    if g.lost:
        problems.append(f"{g.id} declared lost")
print("why whole-GPU readings are missing:", {k: v for k, v in src.describe()["unavailable_readings"].items()
                                              if k.split("/")[0] in {g.id for g in migs}}, flush=True)
print("processes:", src.processes(), flush=True)
src.close()
print("\n".join(problems) or "MIG OK: every MIG instance reports through its own handle", flush=True)
raise SystemExit(1 if problems else 0)
PY

rc=0
if [ "$dry" = 1 ]; then
    # No GPU: the fake libnvidia-ml plays 8 H100s, and for the MIG check 2 H100s with MIG on (one
    # without the monitor capability). Check 1 needs torch and a GPU: skipped.
    echo "DRY RUN against the fake libnvidia-ml (tests/fakes/nvml): check 1 (HBM watch on a copy loop) skipped"
    lib=$(PYTHONPATH="$root/tests/fakes/nvml${PYTHONPATH:+:$PYTHONPATH}" "$py" -c \
        "import fakenvml, sys; print(fakenvml.build(sys.argv[1]))" "$work/fakelib")
    cat > "$work/mig.scn" <<'SCN'
gpu_count = 2
[gpu *]
name = NVIDIA H100 80GB HBM3
gpm = yes
mig_mode = 1
mig = 1 40GiB 10GiB 3g.40gb
mig = 2 20GiB 2GiB 2g.20gb
gpm_dram_bw_util = 50
[gpu 1]
mig_monitor = no
SCN
    export LD_LIBRARY_PATH="$lib"
    echo "--- faults (fake: $root/tests/fakes/nvml/scenarios/h100x8.scn)"
    FAKE_NVML_SCENARIO="$root/tests/fakes/nvml/scenarios/h100x8.scn" "$py" "$work/faults.py" || rc=$?
    echo "--- MIG (fake: 2 H100, MIG on)"
    FAKE_NVML_SCENARIO="$work/mig.scn" "$py" "$work/mig.py" || rc=$?
    exit $rc
fi

t0=$(date +%s.%N)
start=$(awk "BEGIN{printf \"%.3f\", $t0 + $secs / 3}")
stop=$(awk "BEGIN{printf \"%.3f\", $t0 + 2 * $secs / 3}")
"$py" "$work/copy_loop.py" "$start" "$stop" "$work/req" > "$work/copy.log" 2>&1 &
copy_pid=$!
"$py" "$work/drive.py" "$secs" "$t0" "$start" "$stop" "$work/req" || rc=$?
wait "$copy_pid" || true
echo "--- copy loop:"
cat "$work/copy.log"
received=$(grep -c "checkpoint request received" "$work/copy.log" || true)
if [ "$received" != 1 ]; then
    echo "CHECK FAILED: the copy process received $received checkpoint requests (expected 1)"
    rc=1
fi
echo "--- faults (real driver)"
"$py" "$work/faults.py" || rc=$?
echo "--- MIG (real driver)"
"$py" "$work/mig.py" || rc=$?
exit $rc
