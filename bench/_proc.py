"""What the benchmarks share: finding the console scripts, a free loopback port, a process's CPU
time from /proc, waiting for the collector, stopping a process, the tail of a log."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys


def tool(name: str) -> list[str]:
    """The console script next to this interpreter (the venv's), else `python -m` its module."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(here, os.X_OK):
        return [here]
    found = shutil.which(name)
    if found:
        return [found]
    module = {"xpusense-agent": "xpusense.agent.cli", "xpusense-collector": "xpusense.collector.main"}[name]
    return [sys.executable, "-m", module]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """utime+stime of the whole process (every thread), seconds, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # fields 14, 15 of proc(5)


def write_bytes(pid: int) -> int:
    """The bytes process `pid` has sent to the storage layer so far (/proc/PID/io write_bytes: a page
    counts each time it is dirtied, so an fsync'ed append of a few bytes counts a whole page)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def machine_ticks(cpu: int | None = None) -> tuple[int, int]:
    """(all CPU time, stolen time) of the machine (or of one CPU) so far, in clock ticks (/proc/stat's
    `cpu` or `cpuN` line): on a VM, stolen time is when the host ran something else while this
    machine wanted a CPU."""
    name = "cpu" if cpu is None else f"cpu{cpu}"
    with open("/proc/stat") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if head == name:
                fields = [int(x) for x in rest.split()]
                return sum(fields[:8]), fields[7]   # user nice system idle iowait irq softirq steal (guest is in user)
    raise ValueError(f"/proc/stat has no {name} line")


def thread_ids(pid: int) -> list[str]:
    """The thread ids of process `pid` now (/proc/PID/task); [] when it is gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def thread_schedstat(pid: int) -> dict[str, tuple[int, int, int]]:
    """Per thread of `pid`: tid -> (ns on CPU, ns runnable but waiting for a CPU, times scheduled
    in), from /proc/PID/task/*/schedstat. A thread gone between listing and reading is left out."""
    out = {}
    for tid in thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, slices = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
        out[tid] = (run_ns, wait_ns, slices)
    return out


def run_delay_ms(pid: int) -> float:
    """The time the threads of process `pid` have spent runnable but waiting for a CPU so far, in ms:
    preempted by other tasks."""
    return sum(wait_ns for _run, wait_ns, _slices in thread_schedstat(pid).values()) / 1e6


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (sched_setaffinity on a pid moves only that one
    thread: a running nats-server's other threads, Go's, would stay free to run anywhere). Threads
    started meanwhile inherit from the one that starts them, so passes go on until none is new."""
    done: set[int] = set()
    while True:
        tids = {int(t) for t in thread_ids(pid)} - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass
        done |= tids


def steal_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's CPU time stolen between two machine_ticks(), in %."""
    total = after[0] - before[0]
    return 100.0 * (after[1] - before[1]) / total if total > 0 else 0.0


def wait_collector(address: str, timeout_s: float) -> None:
    import grpc
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout_s)


def stop(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after timeout_s; the exit status (None when there was no process)."""
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""
