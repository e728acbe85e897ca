"""Shared test helpers: waiting on conditions with deadlines, free ports, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# The sources that need no hardware or privileges: host (and the agent itself); accelerators,
# eBPF and the HBM watch off. Tests put their own [tiers] / [stream] before it.
HOST_SOURCES_ONLY = """
[sources.ebpf]
enabled = false
[sources.nvml]
enabled = false
[sources.npu_smi]
enabled = false
[hbm_watch]
enabled = false
"""

# An agent config for delivery tests: fast tiers, fast reconnects, host source only.
FAST_HOST_ONLY = """
[tiers]
realtime_s = 0.2
nearline_s = 0.5
offline_s = 5.0
[stream]
flush_s = 0.05
backoff_initial_s = 0.05
backoff_max_s = 0.3
""" + HOST_SOURCES_ONLY

# An agent on the fake NVML with every tier within 3 s and no eBPF (tests attach probes only to
# namespaces they create).
FAST_NO_EBPF = """
[tiers]
realtime_s = 1.0
nearline_s = 2.0
offline_s = 3.0
[stream]
flush_s = 0.1
[sources.ebpf]
enabled = false
"""


# Figures of the fault and attack tests (produced, stored, duplicated, dropped, RSS...), printed at
# the end of the run by tests/conftest.py.
FIGURES: list[dict] = []


def record_figure(test: str, **figures) -> None:
    FIGURES.append({"test": test, **figures})


def wait_until(cond, timeout_s: float = 60.0, interval_s: float = 0.05, what: str | Callable[[], str] = "condition"):
    """Poll `cond` until it returns a truthy value or the deadline passes (then fail the test,
    saying `what`: a callable is called then, to tell the state the condition was waiting on)."""
    deadline = time.monotonic() + timeout_s
    last_exc = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:  # the thing polled may not be ready yet
            last_exc = e
        time.sleep(interval_s)
    if callable(what):
        what = what()
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


async def until(cond, what: str, timeout_s: float = 60.0, interval_s: float = 0.02) -> None:
    """wait_until on the running event loop, for what that loop itself makes true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


def replay_rounds(diagnoser, start_s: int, end_s: int, rounds: tuple[list, list], t0_ns: int) -> list:
    """The events `diagnoser` gives when a source's round of samples, `rounds` = (realtime,
    nearline), is replayed on a simulated timeline from second `start_s` to `end_s`: the realtime
    samples every second, the nearline ones every 15 s, each copy stamped t0_ns + t seconds."""
    rt, nl = rounds
    events = []
    for t in range(start_s, end_s):
        due = rt + nl if t % 15 == 0 else rt
        events += diagnoser.observe([dataclasses.replace(s, labels=dict(s.labels), time_ns=t0_ns + t * 1_000_000_000)
                                     for s in due])
    return events


def diagnosis_states(events) -> list[tuple[str, str, str]]:
    """(rule, device, state) of each diagnosis event, in order."""
    return [(e.attributes["diagnosis.rule"], e.device, e.attributes["diagnosis.state"]) for e in events]


def _below_ephemeral() -> range:
    """Ports under the kernel's ephemeral range (ip_local_port_range), from 10000: no connection
    opened on this machine, and no bind to port 0, is given one of them."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    return range(10000, low)


_PORTS = _below_ephemeral()
_port_tries = itertools.count(random.randrange(len(_PORTS) or 1))   # a random start, then each in turn


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, for a server a test starts. Taken below the ephemeral
    range, each once per process, so that no new connection, bind to port 0 or earlier free_port()
    takes it before the server binds it, as one could a port bind(0) gave. Where that range is under
    1,000 ports, bind(0)'s."""
    if len(_PORTS) < 1000:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_port_tries) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:   # in use, or a connection on it in TIME_WAIT
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


# How long a process may take to stop cleanly after SIGTERM: generous, for a busy machine (a CI run
# beside other work saw an agent's clean stop take over 10 s while the disk was flushing gigabytes).
STOP_WAIT_S = 30.0


class Proc:
    """A real xpusense process with its output captured to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.p = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig=signal.SIGKILL) -> int:
        """Send `sig` and wait for the exit (its status); SIGKILL after STOP_WAIT_S (status -9)."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            return self.p.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()
        finally:
            self._log.close()


@contextlib.contextmanager
def tmpfs(directory: Path, size: str):
    """A tmpfs of `size` (mount's size=, e.g. "2m") mounted on `directory` for the block, unmounted
    after it; the test is skipped, saying why, where it cannot be mounted (not root, no mount(8))."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {size} tmpfs (a full-disk test); CI runs it as root")
    if not shutil.which("mount"):
        pytest.skip("needs mount(8)")
    directory.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def nodes_json(address: str) -> dict:
    out = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", address, "--format", "json",
                          "--timeout-s", "2"], capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip())
    return json.loads(out.stdout)


def series(node: dict, name: str, **labels) -> list[dict]:
    return [s for s in node["series"] if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items())]


class InProcessCollector:
    """The real collector gRPC server on its own event loop thread, in the test's process.
    `start_kw` goes to collector.server.start_server (limits=, security=, credentials=...)."""

    def __init__(self, port: int | None = None, state=None, max_message_bytes: int = 16 * 1024 * 1024,
                 **start_kw):
        import asyncio
        import threading

        from xpusense.collector import server as server_mod
        from xpusense.collector.state import FleetState
        self._asyncio = asyncio
        self.addr = f"127.0.0.1:{port or free_port()}"
        self.state = state or FleetState()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(server_mod.start_server(self.addr, self.state, max_message_bytes, **start_kw))

    def call(self, coro):
        return self._asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def on_loop(self, fn):
        async def run():
            return fn()
        return self.call(run())

    def stop(self):
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def validate_manifests(documents, folder: str) -> list[str]:
    """Each (file name, document) of a deploy folder against the Kubernetes schemas (strict), failing
    the test with the file, kind, name and path of the first error; the documents' kinds."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is a dev dependency (pip install -e '.[dev]')")
    version = kv.latest_version()
    kinds = []
    for name, doc in documents:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{folder}/{name}: {doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")
        kinds.append(doc["kind"])
    return kinds

