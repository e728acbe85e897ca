"""The whole agent's footprint beside Debian's node_exporter, and its probes' cost beside bcc's and bpftrace's.

Needs root, prometheus-node-exporter, bpfcc-tools and bpftrace (a missing peer is reported in its
row, not fatal), gcc and iproute2; what it runs and measures: main() and bench/README.md. Other
load on the machine shows in "machine busy": run it more than once and read the spread.

    sudo .venv/bin/python bench/footprint.py [--seconds 60] [--load-seconds 20] [--json]"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

from _proc import cpu_s, free_port, stop, tail, thread_schedstat, tool, wait_collector
from ebpf_cost import (
    FSYNC_WRITER,
    PING_PONG,
    UDP_SENDER,
    block_pair,
    ctxt,
    delta,
    enable_bpf_stats,
    prog_stats,
    sh,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"cpu_ratio_max": 0.7, "rss_steady_mb_max": 100.0, "rss_peak_mb_max": 130.0, "load_pct_max": 2.0,
         "ns_ratio_max": 1.0, "attach_s_max": 1.0}

IOCTLER = """
import fcntl, sys, termios, time
fd = open(sys.argv[1], "rb", buffering=0).fileno()
end, n, rate = time.monotonic() + float(sys.argv[2]), 0, float(sys.argv[3])
t0 = time.monotonic()
while (now := time.monotonic()) < end:
    if n >= (now - t0) * rate:
        time.sleep(0.002); continue
    try: fcntl.ioctl(fd, termios.TCGETS, bytes(64))
    except OSError: pass
    n += 1
print(n)
"""

CUDA_CALLER = """
import ctypes, sys, time
lib = ctypes.CDLL(sys.argv[1])
end, n, rate = time.monotonic() + float(sys.argv[2]), 0, float(sys.argv[3])
lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t]
buf = ctypes.create_string_buffer(4096)
lib.cuInit(0)
t0 = time.monotonic()
while (now := time.monotonic()) < end:
    if n >= (now - t0) * rate:
        time.sleep(0.002); continue
    lib.cuLaunchKernel(None, 1, 1, 1, 32, 1, 1, 0, None, None, None)
    lib.cuMemcpyHtoD_v2(0, buf, 4096)
    n += 2
print(n)
"""

# One bpftrace script per probe, on the same attach points our probe uses here, keeping the same kind of
# state (a histogram or per-key sums); {a}/{b} are the variant's tracepoints, {lib} the fake libcuda.
PEERS = {
    "blkio": ("block:{a}/{b} hist", """
tracepoint:block:{a} {{ @start[args->dev, args->sector] = nsecs; }}
tracepoint:block:{b} /@start[args->dev, args->sector]/ {{
    @ns[args->dev] = hist(nsecs - @start[args->dev, args->sector]); delete(@start[args->dev, args->sector]); }}
"""),
    "netio": ("sock_send/recv_length sums per cgroup", """
tracepoint:sock:sock_send_length /args->ret > 0/ {{ @tx[cgroup] = sum(args->ret); }}
tracepoint:sock:sock_recv_length /args->ret > 0/ {{ @rx[cgroup] = sum(args->ret); }}
tracepoint:tcp:tcp_retransmit_skb {{ @rt[args->family] = count(); }}
"""),
    "accel_ioctl": ("sys_enter/exit_ioctl latency hist per process", """
tracepoint:syscalls:sys_enter_ioctl {{ @start[tid] = nsecs; }}
tracepoint:syscalls:sys_exit_ioctl /@start[tid]/ {{ @ns[pid, comm] = hist(nsecs - @start[tid]); delete(@start[tid]); }}
"""),
}
# bpftrace 0.17 cannot attach uprobes here (it takes tracefs's uprobe_events path); bcc's funccount
# attaches through the uprobe PMU as our loader does, and counts calls per function.
FUNCCOUNT_RE = "^(cuLaunchKernel|cuMemcpyHtoD_v2)$"


# ------------------------------------------------------------------------------------------ bpf objects

def prog_maps(prog_id: int) -> list[str]:
    """Names of the maps a program uses (BPF_PROG_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD)."""
    import ctypes
    import struct

    from xpusense.agent.sources.ebpf.bpfmap import bpf
    attr = ctypes.create_string_buffer(struct.pack("=III", prog_id, 0, 0), 16)
    fd = bpf(13, attr)                                   # BPF_PROG_GET_FD_BY_ID
    try:
        ids = (ctypes.c_uint32 * 64)()
        info = ctypes.create_string_buffer(80)
        struct.pack_into("=I", info, 52, 64)             # nr_map_ids
        struct.pack_into("=Q", info, 56, ctypes.addressof(ids))
        bpf(15, ctypes.create_string_buffer(struct.pack("=IIQ", fd, 80, ctypes.addressof(info)), 16))
        n = struct.unpack_from("=I", info, 52)[0]
        names = []
        for map_id in list(ids)[:min(n, 64)]:
            mfd = bpf(14, ctypes.create_string_buffer(struct.pack("=III", map_id, 0, 0), 16))
            try:
                minfo = ctypes.create_string_buffer(40)
                bpf(15, ctypes.create_string_buffer(struct.pack("=IIQ", mfd, 40, ctypes.addressof(minfo)), 16))
                names.append(minfo.raw[24:40].split(b"\0", 1)[0].decode())
            finally:
                os.close(mfd)
        return names
    finally:
        os.close(fd)


def probe_of(prog_id: int, probes: list[str]) -> str:
    """Which of our probes a program belongs to: the one whose map-name prefix its maps carry."""
    for name in prog_maps(prog_id):
        for p in probes:
            if name.startswith(p.split("_")[0] + "_"):
                return p
    return "?"


# ------------------------------------------------------------------------------------------ helpers

def status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def thread_ns(pid: int) -> dict[str, tuple[int, int]]:
    """Per thread of `pid`: tid:name -> (ns on CPU, times it was scheduled in), from
    /proc/PID/task/*/schedstat and comm. A thread gone between listing and reading is left out."""
    out = {}
    for t, (run_ns, _wait_ns, slices) in thread_schedstat(pid).items():
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[f"{t}:{name}"] = (run_ns, slices)
    return out


def python_thread_names(pid: int) -> dict[str, str]:
    """tid -> Python thread name (the agent's threads all carry the process's comm), from py-spy
    next to this interpreter; {} without it."""
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.access(spy, os.X_OK):
        return {}
    try:
        got = subprocess.run([spy, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True, timeout=30)
        return {str(t["os_thread_id"]): str(t["thread_name"]) for t in json.loads(got.stdout)
                if t.get("os_thread_id") and t.get("thread_name")}
    except (OSError, ValueError, subprocess.TimeoutExpired, KeyError, TypeError):
        return {}


def thread_groups(before: dict, after: dict, wall: float, names: dict[str, str]) -> dict[str, dict]:
    """Threads grouped by name (the Python name where py-spy told it) without its trailing number:
    ms of CPU and wake-ups per second of wall, and how many threads, biggest first."""
    groups: dict[str, list] = {}
    for key, (ns1, n1) in after.items():
        ns0, n0 = before.get(key, (0, 0))
        tid, comm = key.split(":", 1)
        name = re.sub(r"[_-]?\d+$", "", names.get(tid, comm)) or "?"
        g = groups.setdefault(name, [0, 0, 0])
        g[0] += ns1 - ns0
        g[1] += n1 - n0
        g[2] += 1
    rows = {k: {"ms_per_s": round(v[0] / 1e6 / wall, 3), "wakeups_per_s": round(v[1] / wall, 1), "threads": v[2]}
            for k, v in groups.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms_per_s"]))


def busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def prog_fd_count(pid: int) -> int:
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:bpf-prog"
            except OSError:
                pass
    except OSError:
        pass
    return n


def children(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out.update(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


def watch_start(pid: int, t_exec: float, out: dict) -> threading.Thread:
    """Polls every 5 ms, from the agent's exec: when its loader process appears (loader_started_s) and
    when the agent holds the probes' programs (attached_s: the loader attached them just before)."""
    def run():
        deadline = t_exec + 120
        while time.monotonic() < deadline:
            if "loader_started_s" not in out and children(pid):
                out["loader_started_s"] = time.monotonic() - t_exec
            if prog_fd_count(pid):
                out["attached_s"] = time.monotonic() - t_exec
                return
            time.sleep(0.005)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class Sampler:
    """Every second: scrape node_exporter's /metrics, read VmRSS of the watched processes."""

    def __init__(self, url: str, pids: dict[str, int]):
        self.url, self.pids = url, pids
        self.rss: dict[str, list[float]] = {k: [] for k in pids}
        self.scrapes = self.scrape_errors = self.scrape_bytes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        nxt = time.monotonic()
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    self.scrape_bytes += len(r.read())
                self.scrapes += 1
            except Exception:
                self.scrape_errors += 1
            for k, pid in self.pids.items():
                self.rss[k].append(status_kb(pid, "VmRSS") / 1024)
            nxt += 1.0
            self.stop.wait(max(0.0, nxt - time.monotonic()))


def start_peer(argv: list[str], ready: str, what: str, procs: list) -> tuple[subprocess.Popen | None, str]:
    """(the running peer, "") or (None, why it is not running)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(p)
    buf: list[str] = []

    def pump():
        for line in p.stdout:
            buf.append(line)
    threading.Thread(target=pump, daemon=True).start()
    if ready:
        wait_for(lambda: any(ready in line for line in buf) or p.poll() is not None, 90, what)
    if p.poll() is None:
        wait_for(lambda: prog_stats(p.pid) or p.poll() is not None, 30, f"{what}'s programs")
    if p.poll() is not None:
        return None, f"{what} exited: " + " | ".join(x.strip() for x in buf if x.strip())[-300:]
    return p, ""


def make_fakes(tmp: str) -> tuple[dict, str, str]:
    """(agent environment with the fake NVML, fake libcuda path, accel device glob)."""
    sys.path.insert(0, str(ROOT / "tests" / "fakes" / "nvml"))
    import fakenvml
    env = fakenvml.env(fakenvml.build(os.path.join(tmp, "nvml")), fakenvml.scenario("h100x8"))
    env = {k: v for k, v in env.items() if not k.startswith("XPUSENSE_")}
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise SystemExit("footprint: needs gcc for the fake libcuda (apt-get install gcc)")
    lib = os.path.join(tmp, "libcuda.so.1")
    sh(cc, "-shared", "-fPIC", "-O1", "-o", lib, str(ROOT / "tests/fakes/libcuda/fakecuda.c"))
    dev = os.path.join(tmp, "accel0")
    os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))
    return env, lib, os.path.join(tmp, "accel*")


def agent_config(tmp: str, ns: str, ifname: str, lib: str, glob: str) -> str:
    path = os.path.join(tmp, "agent.toml")
    with open(path, "w") as f:
        f.write(f'[spool]\ndir = "{tmp}/spool"\n[sources.npu_smi]\nenabled = false\n'
                f'[sources.ebpf]\ntc_netns = "{ns}"\ntc_interfaces = ["{ifname}"]\ncuda_library = "{lib}"\n'
                f'device_globs = ["/dev/nvidia*", "/dev/davinci*", "{glob}"]\n')
    return path


def loader_line(log_path: str) -> dict:
    """The agent's log line about its loader process: total and compile seconds, peak RSS."""
    m = re.search(r"eBPF loader process(?:es)? built (\[.*?\]) in ([\d.]+) s \(compile ([\d.]+) s.*?peak RSS (\d+) MB"
                  r"(?:.*?request ([\d.]+) s, done ([\d.]+) s)?", tail(log_path, 400))
    if not m:
        return {}
    out = {"probes": m.group(1), "total_s": float(m.group(2)), "compile_s": float(m.group(3)),
           "peak_rss_mb": float(m.group(4))}
    if m.group(5):      # from the loader's start: the agent's plan came, the hand-over was done
        out.update(request_after_s=float(m.group(5)), done_after_s=float(m.group(6)))
    ahead = re.search(r"compiling ahead: (.*?)\), peak RSS", m.group(0))
    if ahead:           # the early loader's guess: compiled (and when), or why not
        out["ahead"] = ahead.group(1)
    return out


# ------------------------------------------------------------------------------------------ the bench

def quiet_window(agent: subprocess.Popen, ne: subprocess.Popen, ne_url: str, seconds: float) -> dict:
    sampler = Sampler(ne_url, {"agent": agent.pid, "node_exporter": ne.pid})
    t0 = thread_ns(agent.pid)
    a0, n0, m0, w0 = cpu_s(agent.pid), cpu_s(ne.pid), busy_ticks(), time.monotonic()
    sampler.thread.start()
    time.sleep(seconds)
    sampler.stop.set()
    sampler.thread.join(10)
    a1, n1, m1, w1 = cpu_s(agent.pid), cpu_s(ne.pid), busy_ticks(), time.monotonic()
    wall = w1 - w0
    t1 = thread_ns(agent.pid)
    out = {"seconds": round(wall, 1), "scrapes": sampler.scrapes, "scrape_errors": sampler.scrape_errors,
           "scrape_kb": round(sampler.scrape_bytes / max(1, sampler.scrapes) / 1024, 1),
           "machine_busy_pct": round(100 * (m1[0] - m0[0]) / max(1, m1[1] - m0[1]), 1)}
    for name, proc, c0, c1 in (("agent", agent, a0, a1), ("node_exporter", ne, n0, n1)):
        rss = sampler.rss[name] or [0.0]
        out[name] = {"cpu_pct": round(100 * (c1 - c0) / wall, 3), "rss_steady_mb": round(statistics.median(rss), 1),
                     "rss_max_mb": round(max(rss), 1), "rss_peak_mb": round(status_kb(proc.pid, "VmHWM") / 1024, 1),
                     "threads": len(os.listdir(f"/proc/{proc.pid}/task"))}
    out["cpu_ratio"] = round(out["agent"]["cpu_pct"] / max(1e-9, out["node_exporter"]["cpu_pct"]), 2)
    out["agent_threads"] = thread_groups(t0, t1, wall, python_thread_names(agent.pid))
    out["rss_ratio"] = round(out["agent"]["rss_steady_mb"] / max(1e-9, out["node_exporter"]["rss_steady_mb"]), 2)
    return out


def run_workload(tmp: str, lib: str, net: tuple, seconds: float, round_trips: float, procs: list) -> dict:
    """The fixed workload, for `seconds`: what it did and the context switches per second."""
    ns_a, _ns_b, addr_b = net
    py = sys.executable
    x0, w0 = ctxt(), time.monotonic()
    work = [subprocess.Popen([py, "-c", PING_PONG, str(seconds), str(round_trips)], stdout=subprocess.PIPE, text=True),
            subprocess.Popen([py, "-c", FSYNC_WRITER, str(seconds), os.path.join(tmp, "fsync.dat")],
                             stdout=subprocess.PIPE, text=True),
            subprocess.Popen(["ip", "netns", "exec", ns_a, py, "-c", UDP_SENDER, str(seconds), addr_b],
                             stdout=subprocess.PIPE, text=True),
            subprocess.Popen([py, "-c", IOCTLER, os.path.join(tmp, "accel0"), str(seconds), "1000"],
                             stdout=subprocess.PIPE, text=True),
            subprocess.Popen([py, "-c", CUDA_CALLER, lib, str(seconds), "1000"], stdout=subprocess.PIPE, text=True)]
    procs.extend(work)
    done = [int((p.communicate(timeout=seconds + 60)[0] or "0").strip() or 0) for p in work]
    wall = time.monotonic() - w0
    return {"seconds": round(wall, 1), "context_switches_per_s": round((ctxt() - x0) / wall),
            "work_done": dict(zip(("round_trips", "fsyncs", "udp", "ioctls", "cuda_calls"), done))}


def agent_window(agent: subprocess.Popen, probes: list[str], variants: dict, tmp: str, lib: str, net: tuple,
                 seconds: float, round_trips: float, procs: list) -> dict:
    """The workload with the agent alone on the hooks: ns/event per probe, the agent's CPU and its
    programs' kernel time (bpf_stats) as % of one core."""
    progs = prog_stats(agent.pid)
    owner = {pid: probe_of(pid, probes) for pid in progs}
    c0 = cpu_s(agent.pid)
    out = run_workload(tmp, lib, net, seconds, round_trips, procs)
    wall = out["seconds"]
    agent_pct = 100 * (cpu_s(agent.pid) - c0) / wall
    after = prog_stats(agent.pid)
    rows, kernel_ns = {}, 0
    for probe in probes:
        ids = [i for i, p in owner.items() if p == probe]
        cnt, ns = delta(progs, after, ids)
        kernel_ns += ns
        rows[probe] = {"probe": probe, "variant": variants.get(probe, ""), "events_per_s": round(cnt / wall),
                       "ns_per_event": round(ns / cnt, 1) if cnt else None, "pct": round(100 * ns / 1e9 / wall, 3)}
    out.update({"probes": rows, "agent_cpu_pct": round(agent_pct, 2), "programs_pct": round(100 * kernel_ns / 1e9 / wall, 2),
                "total_pct": round(agent_pct + 100 * kernel_ns / 1e9 / wall, 2)})
    return out


def start_peers(probes: list[str], variants: dict, blk_pair: tuple[str, str], tmp: str, lib: str,
                procs: list) -> dict:
    """bcc's and bpftrace's tools on the same events as our probes: probe -> (what, process or None, why not)."""
    peers: dict[str, tuple[str, subprocess.Popen | None, str]] = {}
    for probe, what, exe, argv, ready in (
            ("runqlat", "bcc runqlat-bpfcc", "runqlat-bpfcc", ["3600", "1"], "Tracing run queue latency"),
            ("cuda_uprobe", "bcc argdist-bpfcc: calls per process", "argdist-bpfcc",
             ["-i", "3600", "-C", f"p:{lib}:cuLaunchKernel():u32:$PID", "-C", f"p:{lib}:cuMemcpyHtoD_v2():u32:$PID"],
             "")):
        if probe not in probes:
            continue
        path = shutil.which(exe) or f"/usr/sbin/{exe}"
        if os.path.exists(path):
            peers[probe] = (what, *start_peer([path, *argv], ready, exe, procs))
        else:
            peers[probe] = (what, None, f"{path} not found (apt-get install bpfcc-tools)")
    bpftrace = shutil.which("bpftrace")
    for probe, (what, text) in PEERS.items():
        # The bpftrace peer sums sock_send/recv_length per cgroup: the hooks of both socket variants.
        if probe not in probes or (probe == "netio" and variants.get("netio") not in ("sock", "sock_cgroup")):
            continue
        a, b = blk_pair
        what = "bpftrace " + what.format(a=a, b=b)
        if not bpftrace:
            peers[probe] = (what, None, "bpftrace not installed (apt-get install bpftrace)")
            continue
        script = os.path.join(tmp, f"{probe}.bt")
        Path(script).write_text(text.format(a=a, b=b, lib=lib))
        peers[probe] = (what, *start_peer([bpftrace, script], "Attaching", f"bpftrace for {probe}", procs))
    return peers


def peers_window(peers: dict, tmp: str, lib: str, net: tuple, seconds: float, round_trips: float,
                 procs: list) -> dict:
    """The same workload with the peer tools alone on the hooks (the agent stopped): ns/event each."""
    before = {p: prog_stats(proc.pid) for p, (_w, proc, _m) in peers.items() if proc}
    out = run_workload(tmp, lib, net, seconds, round_trips, procs)
    wall = out["seconds"]
    rows = {}
    for probe, (what, proc, missing) in peers.items():
        if proc is None:
            rows[probe] = {"peer": what, "missing": missing}
            continue
        after = prog_stats(proc.pid)
        cnt, ns = delta(before[probe], after, after.keys())
        rows[probe] = {"peer": what, "events_per_s": round(cnt / wall), "ns_per_event": round(ns / cnt, 1) if cnt else None,
                       "pct": round(100 * ns / 1e9 / wall, 3)}
    out["peers"] = rows
    return out


def compare(agent_w: dict, peers_w: dict) -> list[dict]:
    rows = []
    for probe, r in agent_w["probes"].items():
        row = dict(r)
        p = peers_w.get("peers", {}).get(probe)
        if p:
            row["peer"] = p["peer"]
            if "missing" in p:
                row["peer_missing"] = p["missing"]
            else:
                row.update(peer_events_per_s=p["events_per_s"], peer_ns_per_event=p["ns_per_event"], peer_pct=p["pct"])
                if row["ns_per_event"] and p["ns_per_event"]:
                    row["ratio"] = round(row["ns_per_event"] / p["ns_per_event"], 2)
        rows.append(row)
    return rows


def main() -> int:
    """In one run, as root:

    1. A collector on loopback, Debian's node_exporter (default collectors, scraped every 1 s) and the
       whole agent: host source at its default tiers, NVML over the fake libnvidia-ml with 8 GPUs
       (h100x8) at 1 s, every eBPF probe that runs here (tc_traffic on a veth of the bench's own
       namespaces, accel_ioctl also on a device node of its own, cuda_uprobe on the fake libcuda).
       Start-up: the agent's exec to it holding the probes' programs (the loader attached them).
    2. Quiet window (--seconds after --warmup-s): CPU (utime+stime) and RSS (VmRSS every second:
       median = steady, max; VmHWM = peak since exec) of both, and the ratios.
    3. Load windows (--load-seconds each) under one fixed workload (pipe ping-pong for about 50k
       context switches/s, fsync'ed writes, UDP over the veth, ioctls on the device node, calls into
       the fake libcuda): the agent alone, then (agent stopped) the peers alone: runqlat-bpfcc,
       argdist-bpfcc, one bpftrace script per other probe. Each side alone, because on a shared
       tracepoint the program attached first runs first and pays the cache misses. bpf_stats gives
       each program's run_cnt and run_time_ns (/proc/PID/fdinfo); the agent's programs are told
       apart by the maps they use. Per probe: ns/event and % of a core against its peer.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="quiet side-by-side window (default 60)")
    ap.add_argument("--warmup-s", type=float, default=10.0, help="after start, before the window (default 10)")
    ap.add_argument("--load-seconds", type=float, default=20.0, help="workload window, 0 to skip (default 20)")
    ap.add_argument("--round-trips", type=float, default=21000.0,
                    help="pipe ping-pong round trips/s in the load window (default 21000: about 50k switches/s)")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("footprint: needs root (the agent loads eBPF programs; network namespaces)", file=sys.stderr)
        return 1
    ne_bin = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if not ne_bin:
        print("footprint: needs Debian's prometheus-node-exporter (apt-get install prometheus-node-exporter, "
              "or scripts/setup.sh)", file=sys.stderr)
        return 1
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, if_a, if_b = f"xfp-a-{tag}", f"xfp-b-{tag}", f"xfa{tag}", f"xfb{tag}"
    tmp = tempfile.mkdtemp(prefix="xfp", dir="/tmp")     # short: accel_ioctl's prefixes are < 32 bytes
    procs: list[subprocess.Popen] = []
    stats_fd = enable_bpf_stats()
    with open("/proc/loadavg") as f:
        result: dict = {"kernel": os.uname().release, "cpus": os.cpu_count(), "loadavg_at_start": f.read().split()[:3]}
    collector = agent = ne = None
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        for ns, ifname, addr in ((ns_a, if_a, "10.233.0.1/30"), (ns_b, if_b, "10.233.0.2/30")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")
        env, lib, glob = make_fakes(tmp)
        cfg = agent_config(tmp, ns_a, if_a, lib, glob)
        from xpusense.agent.sources.ebpf.family import plans_for, table_from
        plans, why = plans_for(table_from({"tc_netns": ns_a, "tc_interfaces": [if_a], "cuda_library": lib,
                                           "device_globs": ["/dev/nvidia*", "/dev/davinci*", glob]}))
        probes = [p.probe.name for p in plans]
        variants = {p.probe.name: p.variant.name for p in plans}
        result["probes_not_here"] = why

        address = f"127.0.0.1:{free_port()}"
        col_log = os.path.join(tmp, "collector.log")
        collector = subprocess.Popen(tool("xpusense-collector") + ["serve", "--listen", address, "--log-level", "warning"],
                                     stdout=open(col_log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_collector(address, 30)
        ne_port = free_port()
        ne = subprocess.Popen([ne_bin, f"--web.listen-address=127.0.0.1:{ne_port}"], stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(tmp, "node_exporter.log"), "w"), stdin=subprocess.DEVNULL)
        ne_url = f"http://127.0.0.1:{ne_port}/metrics"
        wait_for(lambda: _answers(ne_url), 30, "node_exporter")
        agent_log = os.path.join(tmp, "agent.log")
        started: dict = {}
        t_exec = time.monotonic()
        agent = subprocess.Popen(tool("xpusense-agent") + ["run", "--config", cfg, "--collector", address, "--node-id",
                                                          f"footprint-{tag}", "--log-level", "info"],
                                 stdout=open(agent_log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        watch_start(agent.pid, t_exec, started).join(130)
        time.sleep(args.warmup_s)
        if agent.poll() is not None:
            raise SystemExit(f"footprint: the agent exited {agent.returncode}:\n{tail(agent_log)}")
        result["start"] = {"exec_to_probes_held_s": round(started.get("attached_s", -1), 3),
                           "exec_to_loader_started_s": round(started.get("loader_started_s", -1), 3),
                           "loader": loader_line(agent_log), "probes": probes, "variants": variants}
        result["quiet"] = quiet_window(agent, ne, ne_url, args.seconds)
        if args.load_seconds > 0:
            # Each side alone on the hooks, under the same workload: on a shared tracepoint, the program
            # attached first runs first and takes the cache misses (+40-70% measured here).
            net = (ns_a, ns_b, "10.233.0.2")
            load = agent_window(agent, probes, variants, tmp, lib, net, args.load_seconds, args.round_trips, procs)
            stop(agent)
            peers = start_peers(probes, variants, block_pair(plans), tmp, lib, procs)
            peer_w = peers_window(peers, tmp, lib, net, args.load_seconds, args.round_trips, procs)
            load["peers_window"] = {k: peer_w[k] for k in ("seconds", "context_switches_per_s", "work_done")}
            load["rows"] = compare(load, peer_w)
            del load["probes"]
            result["load"] = load
        result["bpf_stats"] = "BPF_ENABLE_STATS" if stats_fd is not None else "as found"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(2)   # SIGINT: bcc tools and bpftrace detach and exit
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        for p in (agent, ne, collector):
            stop(p)
        subprocess.run(["ip", "netns", "del", ns_a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns_b], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if stats_fd is not None:
            os.close(stats_fd)
    result["goals"] = verdicts(result)
    if not args.json:
        report(result)
    print(json.dumps(result))
    return 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def verdicts(r: dict) -> dict:
    q, g = r.get("quiet", {}), GOALS
    out = {}
    if q:
        out["cpu <= 0.7x node_exporter"] = q["cpu_ratio"] <= g["cpu_ratio_max"]
        out["rss steady <= 100 MB"] = q["agent"]["rss_steady_mb"] <= g["rss_steady_mb_max"]
        out["rss peak <= 130 MB"] = q["agent"]["rss_peak_mb"] <= g["rss_peak_mb_max"]
    if "load" in r:
        out["agent + programs <= 2% at ~50k switches/s"] = r["load"]["total_pct"] <= g["load_pct_max"]
        ratios = [p.get("ratio") for p in r["load"]["rows"] if "peer" in p]
        out["every probe <= 1.0x its peer (ns/event)"] = bool(ratios) and all(x is not None and x <= g["ns_ratio_max"]
                                                                               for x in ratios)
    held = r.get("start", {}).get("exec_to_probes_held_s", -1)
    out["probes attached within 1 s of exec"] = 0 <= held <= g["attach_s_max"]
    return out


def report(r: dict) -> None:
    q = r["quiet"]
    print(f"kernel {r['kernel']}, {r['cpus']} CPUs, load average at start {' '.join(r['loadavg_at_start'])}")
    s = r["start"]
    print(f"start: exec -> loader process started {s['exec_to_loader_started_s']} s, -> probes held by the agent "
          f"{s['exec_to_probes_held_s']} s; loader process {s['loader']}")
    print(f"quiet window {q['seconds']} s (machine busy {q['machine_busy_pct']}%), node_exporter scraped "
          f"{q['scrapes']}x ({q['scrape_kb']} KB each, {q['scrape_errors']} errors)")
    print(f"  {'':16} {'CPU %':>7} {'RSS steady':>11} {'RSS max':>8} {'VmHWM':>7} {'threads':>8}")
    for k in ("agent", "node_exporter"):
        v = q[k]
        print(f"  {k:16} {v['cpu_pct']:7.3f} {v['rss_steady_mb']:9.1f}MB {v['rss_max_mb']:6.1f}MB "
              f"{v['rss_peak_mb']:5.1f}MB {v['threads']:8}")
    print(f"  agent / node_exporter: CPU {q['cpu_ratio']}x, RSS {q['rss_ratio']}x")
    print(f"  agent threads (schedstat), per second: {'ms CPU':>7} {'wake-ups':>9} {'threads':>8}")
    for name, v in q.get("agent_threads", {}).items():
        print(f"    {name:40} {v['ms_per_s']:7.3f} {v['wakeups_per_s']:9.1f} {v['threads']:8}")
    if "load" in r:
        ld, pw = r["load"], r["load"]["peers_window"]
        print(f"load windows {ld['seconds']} s each, the same workload: agent alone {ld['context_switches_per_s']} "
              f"context switches/s, then peers alone {pw['context_switches_per_s']}/s; work {ld['work_done']}")
        print(f"  {'probe':22} {'events/s':>9} {'ns/event':>9} {'core %':>7}   {'peer':40} {'events/s':>9} "
              f"{'ns/event':>9} {'core %':>7} {'ratio':>6}")
        for p in ld["rows"]:
            ours = (f"  {p['probe'] + ' ' + p['variant']:22} {p['events_per_s']:9} {p['ns_per_event'] or '-':>9} "
                    f"{p['pct']:7.3f}")
            if "peer_missing" in p:
                print(f"{ours}   {p['peer']}: {p['peer_missing']}")
            elif "peer" in p:
                print(f"{ours}   {p['peer']:40} {p['peer_events_per_s']:9} {p['peer_ns_per_event'] or '-':>9} "
                      f"{p['peer_pct']:7.3f} {p.get('ratio', ''):>6}")
            else:
                print(f"{ours}   (no peer tool)")
        print(f"  agent CPU {ld['agent_cpu_pct']}% + its programs {ld['programs_pct']}% = {ld['total_pct']}% of one core")
    for goal, ok in r["goals"].items():
        print(f"  goal {goal}: {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
