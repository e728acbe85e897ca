"""The simulated agents of bench/collector_ingest.py and bench/fleet_scale.py: one load generator
with one interface (start() below), in C (the default, CAgents) or in Python (PyAgents)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import select
import shutil
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("c", "python")


def build_c(name: str = "ingest_agents") -> str:
    """bench/loadgen/NAME.c's binary (the C agents, or `place_calls`), compiled into
    bench/loadgen/build/ when missing or older than its source."""
    source = os.path.join(HERE, "loadgen", f"{name}.c")
    binary = os.path.join(HERE, "loadgen", "build", name)
    if os.path.exists(binary) and os.path.getmtime(binary) >= os.path.getmtime(source):
        return binary
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit(f"bench: needs gcc to build {source} (apt-get install gcc libnghttp2-dev), "
                         "or the Python client (--generator / --client python)")
    os.makedirs(os.path.dirname(binary), exist_ok=True)
    tmp = binary + f".{os.getpid()}"
    r = subprocess.run([cc, "-O2", "-Wall", "-o", tmp, source, "-lnghttp2", "-lz", "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        hint = (" (apt-get install libnghttp2-dev)" if "nghttp2" in r.stderr
                else " (apt-get install zlib1g-dev)" if "zlib" in r.stderr else "")
        raise SystemExit(f"bench: building {source} failed{hint}, or use the Python client "
                         f"(--generator / --client python):\n{r.stderr}")
    os.replace(tmp, binary)
    return binary


def plan_lines(ag) -> list[str]:
    """One SimAgent (bench/collector_ingest.py) as the C generator's plan: its Hello, its batch's
    head (node and boot ids), the samples' bytes with the offsets where values and times go."""
    pb = ag.pb
    times = set(ag.time_at)
    offsets, pos = [], 0
    for i, piece in enumerate(ag.pieces):
        offsets.append(pos)
        pos += 9 if i in times else 8 if isinstance(piece, float) else len(piece)
    body = ag.packer.pack(*(b"\0" * 9 if i in times else p for i, p in enumerate(ag.pieces)))
    assert len(body) == pos, "the template's pieces and its packer disagree"
    node_id, boot_id = ag.header
    head = pb.Batch(node_id=node_id, boot_id=boot_id).SerializeToString()
    values = ([f"V {offsets[i]} g {ag.pieces[i]!r} {base!r}" for i, base in ag.gauges_at]
              + [f"V {offsets[i]} c {ag.pieces[i]!r} {step!r}" for i, step in ag.counters_at])
    table = [f"S {ag.series_table().hex()}"] if ag.compact_mode else []
    return [f"A {ag.node_id} {ag.phase_s!r} {int(ag.idle)} {ag.hello.SerializeToString().hex()} {head.hex()} "
            f"{body.hex()} {len(values)} {len(times)}", *values, "T " + " ".join(str(offsets[i]) for i in ag.time_at),
            *table]


def write_plan(path: str, agents: list, address: str, rate: float, window: int, keepalive_ms: int) -> None:
    host, port = address.rsplit(":", 1)
    with open(path, "w") as f:
        f.write(f"host {host}\nport {port}\nrate {rate!r}\nwindow {window}\nkeepalive_ms {keepalive_ms}\n"
                f"compact {int(agents[0].compact_mode) if agents else 0}\nagents {len(agents)}\n")
        for ag in agents:
            f.write("\n".join(plan_lines(ag)) + "\n")


class CAgents:
    """The C generator: bench/loadgen/ingest_agents.c, one process on libnghttp2 and epoll for every
    agent, pinned to `cpus`, built on first use (gcc, Debian's libnghttp2-dev). Each agent still has
    its own connection, HTTP/2 session and Ingest stream, sends the same bytes (the Python agent's
    template, filled in the same way: held equal by tests/e2e/test_bench_load_agents.py) on the same
    schedule, and pings as the agent's channel does. It costs a fraction of the Python generator's
    CPU a batch, so that on a 2-CPU machine the latency figure is the server's, not the generator's."""

    def __init__(self, indices: list[int], address: str, rate: float, window: int, cpus: list[int]):
        from collector_ingest import SimAgent

        from xpusense.common.tls import CHANNEL_OPTIONS
        binary = build_c()
        rng = random.Random(indices[0] if indices else 0)
        agents = []
        for i in indices:
            ag = SimAgent(i, "nvidia" if i % 2 == 0 else "huawei")
            ag.phase_s = rng.random() / rate if rate > 0 else 0.0
            agents.append(ag)
        self.tmp = tempfile.mkdtemp(prefix="xpusense-agents-")
        plan = os.path.join(self.tmp, "plan")
        write_plan(plan, agents, address, rate, window, dict(CHANNEL_OPTIONS)["grpc.keepalive_time_ms"])
        self.err_path = os.path.join(self.tmp, "stderr")
        pin = (lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([binary, plan], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, preexec_fn=pin)
        self.pids = (self.proc.pid,)

    def _line(self, timeout_s: float, what: str) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            with open(self.err_path) as f:
                err = f.read().strip()
            raise RuntimeError(f"the C load generator gave no {what} within {timeout_s:g} s"
                               + (f": {err}" if err else f" (exit status {self.proc.poll()})"))
        return json.loads(line)

    def wait_ready(self, timeout_s: float) -> tuple[list[str], int, list[str]]:
        r = self._line(timeout_s, "ready line")
        return r["fails"], r["retries"], r["codes"]

    def go(self, go: float, t0: float, t1: float) -> None:
        self.proc.stdin.write(f"go {go!r} {t0!r} {t1!r}\n")
        self.proc.stdin.flush()

    def results(self, timeout_s: float) -> list[dict]:
        r = self._line(timeout_s, "results")
        r["by_second"] = {int(k): v for k, v in r["by_second"].items()}
        return [r]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()   # end of input: it stops
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


class PyAgents:
    """collector_ingest.worker processes (grpc aio), the agents spread over `procs` of them: about
    10x the C generator's CPU a batch, to compare with figures taken with it."""

    def __init__(self, indices: list[int], address: str, rate: float, window: int, cpus: list[int], procs: int):
        from collector_ingest import worker
        ctx = mp.get_context("spawn")
        self.shared = ctx.Array("d", 3, lock=False)
        self.ready_q, self.out_q = ctx.Queue(), ctx.Queue()
        procs = max(1, min(procs, len(indices)))
        self.workers = []
        for k in range(procs):
            w = ctx.Process(target=worker, args=(indices[k::procs], address, rate, window, cpus,
                                                 self.ready_q, self.shared, self.out_q), daemon=True)
            w.start()
            self.workers.append(w)
        self.pids = tuple(w.pid for w in self.workers if w.pid is not None)

    def wait_ready(self, timeout_s: float) -> tuple[list[str], int, list[str]]:
        fails, retries, codes = [], 0, set()
        deadline = time.monotonic() + timeout_s
        for _ in self.workers:
            try:
                _, f, r, c = self.ready_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                raise RuntimeError(f"simulated agents did not connect within {timeout_s:g} s") from None
            fails += f
            retries += r
            codes.update(c)
        return fails, retries, sorted(codes)

    def go(self, go: float, t0: float, t1: float) -> None:
        self.shared[1], self.shared[2] = t0, t1
        self.shared[0] = go

    def results(self, timeout_s: float) -> list[dict]:
        out = []
        for _ in self.workers:
            try:
                out.append(self.out_q.get(timeout=timeout_s))
            except Exception:
                raise RuntimeError(f"a load-generator process did not report within {timeout_s:g} s") from None
        return out

    def close(self) -> None:
        self.shared[2] = self.shared[2] or -1.0   # a worker still waiting for go gives up
        for w in self.workers:
            w.join(10)
            if w.is_alive():
                w.terminate()
                w.join(5)


def start(kind: str, indices: list[int], address: str, rate: float, window: int, cpus: list[int],
          procs: int) -> CAgents | PyAgents:
    """The generator of `kind` ("c" or "python"), started:

        gen.wait_ready(timeout_s)  -> (connect fails, connect retries, retry codes)
        gen.go(go, t0, t1)            CLOCK_MONOTONIC seconds: sending starts at go, the window is [t0, t1)
                                      (or window() below: go, then sample() as the window opens and closes)
        gen.results(timeout_s)     -> [the per-process figures: acked, window_acked, duplicates, sent,
                                       latencies_ms (in the window), by_second, fails]
        gen.pids                      the processes whose CPU is the generator's
        gen.close()
    """
    if kind == "c":
        return CAgents(indices, address, rate, window, cpus)
    if kind == "python":
        return PyAgents(indices, address, rate, window, cpus, procs)
    raise ValueError(f"load generator {kind!r}: one of {', '.join(KINDS)}")


def window(gen: CAgents | PyAgents, warmup_s: float, seconds: float, sample, on_window=None) -> tuple:
    """Sending starts 0.2 s from now; after `warmup_s` the window of `seconds` opens (on_window()
    is called, then `sample()`), and as it closes `sample()` is called again: the two samples."""
    go = time.monotonic() + 0.2
    t0, t1 = go + warmup_s, go + warmup_s + seconds
    gen.go(go, t0, t1)
    time.sleep(max(0.0, t0 - time.monotonic()))
    if on_window is not None:
        on_window()
    before = sample()
    time.sleep(max(0.0, t1 - time.monotonic()))
    return before, sample()
