"""Running npu-smi: one call with a deadline, or a round of calls at once under one deadline.

Each call is its own subprocess (argv list, never a shell, own process group). A call still running
at its deadline is killed with its process group; one that will not die (stuck in the kernel) is
reaped in a later round. In a round, a call whose previous round's call is still being killed is
not started again: it is reported late, and the round is counted as skipped (never queued behind).
"""

from __future__ import annotations

import concurrent.futures
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Iterable

from ..base import SourceError

KILL_GRACE_S = 1.0  # how long a round waits, past its deadline, for killed calls to be reaped
DEFAULT_MAX_OUTPUT_BYTES = 4 * 2**20   # `npu-smi info` of 16 NPUs prints about 10 KB

Job = tuple[tuple, list[str]]                       # (key, npu-smi arguments)
Result = tuple[tuple, list[str], str | BaseException]  # (key, arguments, output or error)


class TimedOut(Exception):
    """The call did not finish before its deadline (and was killed)."""


class CommandFailed(Exception):
    """npu-smi exited with a status other than 0; the message has the first line it printed."""

    def __init__(self, command: str, returncode: int, text: str):
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "(no output)")
        super().__init__(f"`{command}` exited with {returncode}: {first[:200]}")
        self.command, self.returncode, self.text = command, returncode, text


class OutputTooLarge(CommandFailed):
    """The call printed more than the configured bound, and was killed: a failed call."""

    def __init__(self, command: str, limit: int):
        Exception.__init__(self, f"`{command}` printed more than {limit} bytes ([sources.npu_smi] "
                                 f"max_output_bytes): killed, its output ignored")
        self.command, self.returncode, self.text = command, -signal.SIGKILL, ""


def command_line(args: list[str]) -> str:
    """`npu-smi ARGS` as shown in messages."""
    return " ".join(["npu-smi", *args])


class Runner:
    """Runs the npu-smi at `exe`; `start()` makes one pool of `max_workers` threads per tier for rounds."""

    def __init__(self, tiers: Iterable[str], max_workers: int,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> None:
        self.exe = ""
        self.tiers = tuple(tiers)
        self.max_workers = max_workers
        self.max_output_bytes = max_output_bytes
        self.oversized = 0   # calls killed for printing more than max_output_bytes
        self._lock = threading.Lock()
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._inflight: dict[tuple, concurrent.futures.Future] = {}
        self._stragglers: list[subprocess.Popen] = []
        self._live: set[subprocess.Popen] = set()   # calls running now; close() kills them
        self._skipped = {t: 0 for t in self.tiers}
        self._last_round_s: dict[str, float] = {}
        self._late: dict[str, list[str]] = {}

    def run(self, args: list[str], deadline: float) -> str:
        """Run `npu-smi ARGS` until `deadline` (time.monotonic()); kill it when late.

        Raises TimedOut, OutputTooLarge, CommandFailed, or OSError when it cannot be started.
        """
        if deadline - time.monotonic() <= 0:
            raise TimedOut(command_line(args))
        proc = subprocess.Popen([self.exe, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        with self._lock:
            self._live.add(proc)
        try:
            out, err = self._read_bounded(proc, deadline)
        except TimedOut:
            self._kill(proc)
            raise TimedOut(command_line(args)) from None
        except OutputTooLarge:
            self._kill(proc)
            with self._lock:
                self.oversized += 1
            raise OutputTooLarge(command_line(args), self.max_output_bytes) from None
        finally:
            with self._lock:
                self._live.discard(proc)
        text = out.decode("utf-8", "replace")
        if proc.returncode != 0:
            raise CommandFailed(command_line(args), proc.returncode, err.decode("utf-8", "replace") + "\n" + text)
        return text

    def _read_bounded(self, proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes]:
        """stdout and stderr of `proc` until it exits; TimedOut at the deadline, OutputTooLarge past
        max_output_bytes (both together): an endless or huge output never grows the agent."""
        assert proc.stdout is not None and proc.stderr is not None
        chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
        total = 0
        with selectors.DefaultSelector() as sel:
            for f in (proc.stdout, proc.stderr):
                sel.register(f, selectors.EVENT_READ)
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimedOut()
                for key, _ in sel.select(timeout=remaining):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(data)
                    if total > self.max_output_bytes:
                        raise OutputTooLarge("", self.max_output_bytes)
                    chunks[key.fd].append(data)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:   # closed its output but goes on running
            raise TimedOut() from None
        return b"".join(chunks[proc.stdout.fileno()]), b"".join(chunks[proc.stderr.fileno()])

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        try:
            proc.communicate(timeout=KILL_GRACE_S / 2)
        except subprocess.TimeoutExpired:  # stuck in the kernel (D state): reap it in a later round
            with self._lock:
                self._stragglers.append(proc)

    def _reap(self) -> None:
        with self._lock:
            self._stragglers = [p for p in self._stragglers if p.poll() is None]

    def start(self) -> None:
        """Make the pools rounds run in."""
        self._pools = {t: concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix=f"npu-smi-{t}")
                       for t in self.tiers}

    def round(self, tier: str, jobs: list[Job], budget_s: float) -> tuple[list[Result], list[tuple]]:
        """Run every job at once under one deadline: (finished (key, args, text or error), keys that were late).

        Raises SourceError before start() or after close().
        """
        self._reap()
        t0 = time.monotonic()
        deadline = t0 + budget_s
        pool = self._pools.get(tier)
        if pool is None:
            raise SourceError("the npu-smi source is not set up (setup() failed or close() was called)")
        futures, late = self._submit(pool, jobs, deadline)
        _, not_done = concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()) + KILL_GRACE_S)
        finished: list[Result] = []
        for fut, (key, args) in futures.items():
            if fut in not_done:
                late.append(key)
                continue
            exc = fut.exception()
            if isinstance(exc, TimedOut):
                late.append(key)
            else:
                finished.append((key, args, exc if exc is not None else fut.result()))
        with self._lock:
            self._last_round_s[tier] = time.monotonic() - t0
            self._late[tier] = [command_line(a) for k, a in jobs if k in late]
            if late:
                self._skipped[tier] += 1
        return finished, late

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, jobs: list[Job],
                deadline: float) -> tuple[dict[concurrent.futures.Future, Job], list[tuple]]:
        """Start the jobs whose previous call has ended: (future -> job, keys of the others)."""
        futures: dict[concurrent.futures.Future, Job] = {}
        late: list[tuple] = []
        for key, args in jobs:
            with self._lock:
                prev = self._inflight.get(key)
                if prev is not None and not prev.done():  # last round's call still being killed
                    late.append(key)
                    continue
                try:
                    fut = pool.submit(self.run, args, deadline)
                except RuntimeError:  # close() shut the pool down under us
                    raise SourceError("the npu-smi source was closed during a round") from None
                self._inflight[key] = fut
            futures[fut] = (key, args)
        return futures, late

    def skipped(self, tier: str) -> int:
        """Rounds of `tier` that had a call late."""
        with self._lock:
            return self._skipped[tier]

    def describe(self) -> dict:
        with self._lock:
            return {
                "rounds_skipped": dict(self._skipped),
                "calls_killed_for_output_size": self.oversized,
                "last_round_s": {t: round(v, 6) for t, v in self._last_round_s.items()},
                "last_late_commands": {t: list(v) for t, v in self._late.items() if v},
            }

    def close(self) -> None:
        """Stop the pools and kill every call still running (a setup() waiting on a hung npu-smi too)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools = {}
        with self._lock:
            live = list(self._live)
        for proc in live:
            self._kill(proc)
        self._reap()
