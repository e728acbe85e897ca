"""Cost of the eBPF probes in ns/event from bpf_stats, side by side with bcc's and bpftrace's own tools.

bench/footprint.py supersedes it for the README figures: there the agent and each peer run alone;
here the peers attach after the agent, so run second on shared tracepoints (cheaper per event).

    sudo .venv/bin/python bench/ebpf_cost.py [--seconds 20] [--json]"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

GOAL_AGENT_CPU_PCT = 2.0
GOAL_STARTUP_S = 3.0
BPF_SYSCALL_NR = {"x86_64": 321, "aarch64": 280}

PING_PONG = """
import os, sys, time
secs, rate = float(sys.argv[1]), float(sys.argv[2])     # rate: round trips/s, 0 = as fast as it goes
r1, w1 = os.pipe(); r2, w2 = os.pipe()
if os.fork() == 0:
    while True:
        b = os.read(r1, 1)
        if not b or b == b"q":
            os._exit(0)
        os.write(w2, b)
n, t0 = 0, time.monotonic()
end = t0 + secs
while True:
    now = time.monotonic()
    if now >= end:
        break
    if rate and n >= (now - t0) * rate:
        time.sleep(0.001)
        continue
    os.write(w1, b"x"); os.read(r2, 1); n += 1
os.write(w1, b"q")
print(n)
"""

FSYNC_WRITER = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
n = 0
while time.monotonic() < end:
    os.pwrite(fd, b"x" * 4096, (n % 256) * 4096); os.fsync(fd); n += 1
    time.sleep(0.005)
os.close(fd); os.unlink(sys.argv[2])
print(n)
"""

UDP_SENDER = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
n = 0
while time.monotonic() < end:
    for _ in range(20):
        s.sendto(b"x" * 1000, (sys.argv[2], 9)); n += 1
    time.sleep(0.01)
print(n)
"""

BPFTRACE = """
tracepoint:block:{start} {{ @start[args->dev, args->sector] = nsecs; }}
tracepoint:block:{done} /@start[args->dev, args->sector]/ {{
    @ns = hist(nsecs - @start[args->dev, args->sector]);
    delete(@start[args->dev, args->sector]);
}}
"""


def block_pair(plans: list) -> tuple[str, str]:
    """The block tracepoints (start, done) our blkio attaches here, from its planned variant's own
    list (probes/specs.py): the bpftrace peer times the same pair. block_rq_* when blkio does not plan."""
    for p in plans:
        if p.probe.name == "blkio":
            start, done = (tp.split(":", 1)[1] for tp in p.variant.tracepoints[:2])
            return start, done
    return "block_rq_issue", "block_rq_complete"


# ------------------------------------------------------------------------------------------ the agent child

def agent_child(cfg_json: str, ready_path: str) -> int:
    """Set up every probe through the real tier loop, report, run until stdin closes or says quit."""
    t_start = time.monotonic()
    from xpusense.agent.sources.ebpf.family import build, table_from
    from xpusense.agent.tiers import TierLoop, setup_sources

    sources = build(table_from(json.loads(cfg_json)))
    states, _events = setup_sources(sources)
    startup_s = time.monotonic() - t_start
    counted = {"samples": 0}

    def sink(samples, events):
        counted["samples"] += len(samples)

    loop = TierLoop(states, {"realtime": 1.0, "nearline": 15.0, "offline": 300.0}, sink)
    stop = threading.Event()
    runner = threading.Thread(target=loop.run, args=(stop,), daemon=True)
    runner.start()
    report = {
        "startup_s": startup_s,
        "sources": {st.name: {"state": st.state, "reason": st.reason,
                              "prog_ids": [p["prog_id"] for p in st.source.program_stats()] if st.state == "running" else [],
                              **({k: v for k, v in st.source.describe().items()
                                  if k in ("variant", "compile_s", "compile", "bpf_stats")})}
                    for st in states},
    }
    with open(ready_path + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(ready_path + ".tmp", ready_path)
    sys.stdin.readline()
    stop.set()
    runner.join(5)
    loop.close()
    print(json.dumps({"samples": counted["samples"]}), flush=True)
    return 0


# ------------------------------------------------------------------------------------------ helpers

def enable_bpf_stats() -> int | None:
    nr = BPF_SYSCALL_NR.get(platform.machine())
    if nr is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.c_uint32(0)   # BPF_STATS_RUN_TIME
    fd = libc.syscall(ctypes.c_long(nr), ctypes.c_int(32), ctypes.byref(attr), ctypes.c_uint(4))   # BPF_ENABLE_STATS
    return fd if fd >= 0 else None


def prog_stats(pid: int) -> dict[int, tuple[int, int]]:
    """prog_id -> (run_cnt, run_time_ns) for every BPF program fd the process holds."""
    out = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:bpf-prog":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = {}
                for line in f:
                    k, _, v = line.partition(":")
                    v = v.strip()
                    if v.isdigit():
                        info[k] = int(v)
        except OSError:
            continue
        out[info.get("prog_id", -1)] = (info.get("run_cnt", 0), info.get("run_time_ns", 0))
    return out


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])     # utime + stime


def ctxt() -> int:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("ctxt "):
                return int(line.split()[1])
    return 0


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise SystemExit(f"ebpf_cost: timed out after {timeout_s} s waiting for {what}")


def line_reader(proc) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)
    threading.Thread(target=pump, daemon=True).start()
    return q


def sh(*args):
    subprocess.run(args, check=True, capture_output=True)


def delta(before: dict, after: dict, ids) -> tuple[int, int]:
    cnt = sum(after.get(i, (0, 0))[0] - before.get(i, (0, 0))[0] for i in ids)
    ns = sum(after.get(i, (0, 0))[1] - before.get(i, (0, 0))[1] for i in ids)
    return cnt, ns


# ------------------------------------------------------------------------------------------ the bench

def main() -> int:
    """Under one fixed workload (pipe ping-pong for context switches, 4 KiB writes each fsync'ed on a
    file of the root disk, UDP over a veth pair between two namespaces of the bench's own), at the
    same time: an agent-like process (every probe of agent/sources/ebpf/ driven by the real tier
    loop, a discarding sink, tc_traffic on the bench's veth only); bcc's runqlat-bpfcc (the same
    three sched tracepoints, as raw tracepoints); a bpftrace histogram on blkio's block tracepoints.
    bpf_stats is on for the whole run; each tool's programs are found through /proc/PID/fdinfo of its
    bpf-prog fds; ns/event = delta run_time_ns / delta run_cnt over the window. Also the agent's CPU
    (user space; its programs' time is charged to the tasks that hit the tracepoints) and its
    start-up to all probes attached. About 40 s by default."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="workload duration (default 20)")
    ap.add_argument("--round-trips", type=float, default=21000.0,
                    help="pipe ping-pong round trips/s (each is 2-4 context switches; 0 = flat out; default 21000, "
                         "about the 50k context switches/s of the cost goal)")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    ap.add_argument("--agent-child", nargs=2, metavar=("CFG_JSON", "READY_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.agent_child:
        return agent_child(*args.agent_child)
    if os.geteuid() != 0:
        print("ebpf_cost: needs root (loads eBPF programs, creates network namespaces)", file=sys.stderr)
        return 1
    seconds = min(max(args.seconds, 5.0), 60.0)
    runqlat_tool = shutil.which("runqlat-bpfcc") or "/usr/sbin/runqlat-bpfcc"
    bpftrace = shutil.which("bpftrace")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, if_a, if_b = f"xpb-a-{tag}", f"xpb-b-{tag}", f"xba{tag}", f"xbb{tag}"
    tmp = tempfile.mkdtemp(prefix="xps-ebpf-bench-")
    procs: list[subprocess.Popen] = []
    stats_fd = enable_bpf_stats()
    result: dict = {"seconds": seconds, "kernel": platform.release(), "cpus": os.cpu_count()}
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        for ns, ifname, addr in ((ns_a, if_a, "10.232.0.1/30"), (ns_b, if_b, "10.232.0.2/30")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")

        # Which block tracepoint pair our blkio uses here decides bpftrace's.
        from xpusense.agent.sources.ebpf.family import plans_for, table_from
        cfg = {"tc_netns": ns_a, "tc_interfaces": [if_a]}
        plans, why = plans_for(table_from(cfg))
        blk_start, blk_done = block_pair(plans)

        # Start all three at once: each compiles/loads on its own.
        ready = os.path.join(tmp, "agent.json")
        t0 = time.monotonic()
        agent = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--agent-child", json.dumps(cfg), ready],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(agent)
        rq = None
        if os.path.exists(runqlat_tool):
            rq = subprocess.Popen([runqlat_tool, "3600", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            procs.append(rq)
            rq_lines = line_reader(rq)
        bt = None
        if bpftrace:
            script = os.path.join(tmp, "blk.bt")
            with open(script, "w") as f:
                f.write(BPFTRACE.format(start=blk_start, done=blk_done))
            bt = subprocess.Popen([bpftrace, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(bt)
            bt_lines = line_reader(bt)

        wait_for(lambda: os.path.exists(ready) or agent.poll() is not None, 60, "the agent's probes to attach")
        wall_startup_s = time.monotonic() - t0
        if agent.poll() is not None:
            raise SystemExit("ebpf_cost: the agent child exited during set-up")
        report = json.load(open(ready))
        result["agent"] = {"startup_s_in_process": round(report["startup_s"], 3),
                           "startup_s_from_exec": round(wall_startup_s, 3),
                           "sources": {k: {kk: vv for kk, vv in v.items() if kk != "prog_ids"}
                                       for k, v in report["sources"].items()}}

        def seen(q, text):
            lines = []
            while not q.empty():
                lines.append(q.get())
            seen.buf = getattr(seen, "buf", {})
            seen.buf.setdefault(id(q), []).extend(lines)
            return any(text in line for line in seen.buf[id(q)])
        if rq:
            wait_for(lambda: seen(rq_lines, "Tracing run queue latency") or rq.poll() is not None, 60, "runqlat-bpfcc")
        if bt:
            wait_for(lambda: (seen(bt_lines, "Attaching") and len(prog_stats(bt.pid)) >= 2) or bt.poll() is not None,
                     60, "bpftrace")

        before = {"agent": prog_stats(agent.pid), "rq": prog_stats(rq.pid) if rq else {},
                  "bt": prog_stats(bt.pid) if bt else {}}
        cpu0, ctxt0, w0 = cpu_ticks(agent.pid), ctxt(), time.monotonic()
        work = [
            subprocess.Popen([sys.executable, "-c", PING_PONG, str(seconds), str(args.round_trips)],
                             stdout=subprocess.PIPE, text=True),
            subprocess.Popen([sys.executable, "-c", FSYNC_WRITER, str(seconds), os.path.join(tmp, "fsync.dat")],
                             stdout=subprocess.PIPE, text=True),
            subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c", UDP_SENDER, str(seconds), "10.232.0.2"],
                             stdout=subprocess.PIPE, text=True),
        ]
        procs.extend(work)
        done = [int(p.communicate(timeout=seconds + 30)[0].strip() or 0) for p in work]
        wall = time.monotonic() - w0
        after = {"agent": prog_stats(agent.pid), "rq": prog_stats(rq.pid) if rq else {},
                 "bt": prog_stats(bt.pid) if bt else {}}
        cpu1, ctxt1 = cpu_ticks(agent.pid), ctxt()
        hz = os.sysconf("SC_CLK_TCK")
        result["workload"] = {"ping_pong_round_trips": done[0], "fsyncs": done[1], "udp_datagrams": done[2],
                              "context_switches_per_s": round((ctxt1 - ctxt0) / wall)}

        rows = []
        total_ns = 0
        for name, src in report["sources"].items():
            if src["state"] != "running":
                continue
            cnt, ns = delta(before["agent"], after["agent"], src["prog_ids"])
            total_ns += ns
            rows.append({"what": f"xpusense {name}" + (f" ({src.get('variant')})" if src.get("variant") else ""),
                         "events": cnt, "events_per_s": round(cnt / wall),
                         "ns_per_event": round(ns / cnt, 1) if cnt else None})
        if rq:
            cnt, ns = delta(before["rq"], after["rq"], after["rq"].keys())
            rows.append({"what": "bcc runqlat-bpfcc (raw tracepoints)", "events": cnt, "events_per_s": round(cnt / wall),
                         "ns_per_event": round(ns / cnt, 1) if cnt else None})
        else:
            rows.append({"what": "bcc runqlat-bpfcc", "missing": f"{runqlat_tool} not found (apt-get install bpfcc-tools)"})
        if bt:
            cnt, ns = delta(before["bt"], after["bt"], after["bt"].keys())
            rows.append({"what": f"bpftrace hist on block:{blk_start}/{blk_done}", "events": cnt,
                         "events_per_s": round(cnt / wall), "ns_per_event": round(ns / cnt, 1) if cnt else None})
        else:
            rows.append({"what": "bpftrace", "missing": "bpftrace not installed (apt-get install bpftrace)"})
        result["programs"] = rows
        result["agent"]["cpu_pct_of_one_core"] = round(100.0 * (cpu1 - cpu0) / hz / wall, 2)
        result["agent"]["probes_kernel_time_pct_of_one_core"] = round(100.0 * total_ns / 1e9 / wall, 2)
        result["agent"]["total_pct_of_one_core"] = round(result["agent"]["cpu_pct_of_one_core"]
                                                         + result["agent"]["probes_kernel_time_pct_of_one_core"], 2)
        result["bpf_stats"] = "BPF_ENABLE_STATS" if stats_fd is not None else "sysctl state as found"
        result["goals"] = {"agent_cpu_pct_max": GOAL_AGENT_CPU_PCT, "startup_s_max": GOAL_STARTUP_S}
    finally:
        for p in procs:
            if p.poll() is None:
                if p is procs[0]:
                    try:
                        p.stdin.write("quit\n")
                        p.stdin.flush()
                        p.wait(10)
                    except Exception:
                        p.kill()
                else:
                    p.send_signal(signal.SIGINT)
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
        subprocess.run(["ip", "netns", "del", ns_a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns_b], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if stats_fd is not None:
            os.close(stats_fd)

    if not args.json:
        a = result["agent"]
        print(f"kernel {result['kernel']}, {result['cpus']} CPUs, workload {seconds:.0f} s: "
              f"{result['workload']['context_switches_per_s']} context switches/s, "
              f"{result['workload']['fsyncs']} fsyncs, {result['workload']['udp_datagrams']} UDP datagrams over veth")
        print(f"{'programs':58} {'events':>10} {'events/s':>10} {'ns/event':>9}")
        for r in result["programs"]:
            if "missing" in r:
                print(f"{r['what']:58} {r['missing']}")
            else:
                print(f"{r['what']:58} {r['events']:>10} {r['events_per_s']:>10} {r['ns_per_event'] or '-':>9}")
        print(f"agent start-up to all probes attached: {a['startup_s_in_process']} s in process, "
              f"{a['startup_s_from_exec']} s from exec (goal <= {GOAL_STARTUP_S} s)")
        print(f"agent CPU (user space): {a['cpu_pct_of_one_core']} % of one core (goal <= {GOAL_AGENT_CPU_PCT} %); "
              f"probe programs in kernel: {a['probes_kernel_time_pct_of_one_core']} % of one core; "
              f"together {a['total_pct_of_one_core']} %")
        for name, s in a["sources"].items():
            if s["state"] != "running":
                print(f"  {name}: {s['state']}: {s['reason'][:120]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
