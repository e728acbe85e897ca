"""Long-lived background work that is never silently dead: run it, and start it again when it fails.

A background task of the collector (an asyncio coroutine: `Supervisor.task`) or of the agent (a
thread's loop: `Supervisor.thread`) runs under a Supervisor: a failure is logged, counted by task
name and restarted after a backoff; work that cannot be started again safely (`fatal=True`) makes
the process exit with EXIT_FATAL, so that its service manager starts it afresh."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable

from .backoff import backoff_delays

RESTART_INITIAL_S = 1.0    # the first restart's delay
RESTART_MAX_S = 30.0       # the longest delay between restarts of a task that keeps failing
RESTART_HEALTHY_S = 60.0   # a run this long was healthy: the next failure restarts after RESTART_INITIAL_S
EXIT_FATAL = 70            # EX_SOFTWARE: a task that cannot be restarted failed

log = logging.getLogger("xpusense.supervise")


class Supervisor:
    """Runs background work, restarts it when it fails, and counts the failures by task name.

    A failure is logged with its traceback and counted (`restarts`: the collector's `tasks.restarts`
    counter, the agent's `xpusense.agent.task.restarts`); the work starts again after a backoff of
    RESTART_INITIAL_S doubling up to RESTART_MAX_S (with jitter), back to the start once a run lasted
    RESTART_HEALTHY_S. Work that returns has ended on purpose and is not started again. With
    `fatal=True` the failure is logged and counted, then the process exits with EXIT_FATAL, so that
    systemd's `Restart=` or a pod's restart policy starts it afresh rather than it running without
    that work."""

    def __init__(self, initial_s: float = RESTART_INITIAL_S, max_s: float = RESTART_MAX_S,
                 healthy_s: float = RESTART_HEALTHY_S):
        self.initial_s, self.max_s, self.healthy_s = initial_s, max_s, healthy_s
        self.restarts: collections.Counter[str] = collections.Counter()   # failures by task name
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()   # held until done (the loop keeps only weak references)

    def total(self) -> int:
        with self._lock:
            return sum(self.restarts.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.restarts)

    # -- asyncio ------------------------------------------------------------------------------
    def task(self, name: str, work: Callable[[], Awaitable[object]], stop: asyncio.Event | None = None,
             fatal: bool = False) -> asyncio.Task:
        """Start `work()` (a coroutine function) on the running loop under supervision (`run`)."""
        t = asyncio.get_running_loop().create_task(self.run(name, work, stop, fatal), name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def run(self, name: str, work: Callable[[], Awaitable[object]], stop: asyncio.Event | None = None,
                  fatal: bool = False) -> None:
        """Await `work()` until it returns, is cancelled or `stop` is set; every exception is logged,
        counted and followed by a fresh `work()` after the backoff (or SystemExit when `fatal`)."""
        delays = self._delays()
        while stop is None or not stop.is_set():
            started = time.monotonic()
            try:
                await work()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed(name, e, fatal)
                if fatal:
                    raise SystemExit(EXIT_FATAL) from e   # ends asyncio.run: the process exits, cleanly
            if time.monotonic() - started >= self.healthy_s:
                delays = self._delays()
            delay = next(delays)
            if stop is None:
                await asyncio.sleep(delay)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)

    # -- threads ------------------------------------------------------------------------------
    def thread(self, name: str, work: Callable[[], object], stop: threading.Event | None = None,
               fatal: bool = False) -> threading.Thread:
        """A daemon thread (not started) that calls `work()` under supervision: restarted after an
        exception, until it returns or `stop` is set; `fatal`: the process exits instead."""
        return threading.Thread(target=self.run_sync, args=(name, work, stop, fatal), name=name, daemon=True)

    def run_sync(self, name: str, work: Callable[[], object], stop: threading.Event | None = None,
                 fatal: bool = False) -> None:
        delays = self._delays()
        while stop is None or not stop.is_set():
            started = time.monotonic()
            try:
                work()
                return
            except Exception as e:
                self._failed(name, e, fatal)
                if fatal:
                    for h in logging.getLogger().handlers:   # the line above is out before the exit
                        with contextlib.suppress(Exception):
                            h.flush()
                    os._exit(EXIT_FATAL)   # a thread cannot end the process otherwise
            if time.monotonic() - started >= self.healthy_s:
                delays = self._delays()
            delay = next(delays)
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                return

    # -- both ---------------------------------------------------------------------------------
    def _delays(self):
        return backoff_delays(self.initial_s, self.max_s)

    def _failed(self, name: str, e: BaseException, fatal: bool) -> None:
        with self._lock:
            self.restarts[name] += 1
            n = self.restarts[name]
        then = (f"the process exits ({EXIT_FATAL}) for its service manager to start it again" if fatal
                else "started again after a backoff")
        log.error("background task %s failed (%d times so far): %s: %s; %s (counted: task restarts)",
                  name, n, type(e).__name__, e, then, exc_info=e)


# The process's own: every background task of the collector or the agent runs under it, and its
# counts are their self-metrics.
TASKS = Supervisor()
