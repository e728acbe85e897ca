"""systemd readiness and watchdog notifications (sd_notify(3)) over $NOTIFY_SOCKET, standard library
only: READY=1 once the agent runs, WATCHDOG=1 while what it watches makes progress (Watchdog), and
STATUS= texts for `systemctl status`. Outside systemd ($NOTIFY_SOCKET unset) it does nothing."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from xpusense.common.supervise import TASKS

log = logging.getLogger("xpusense.agent.sdnotify")


def notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Send one datagram to $NOTIFY_SOCKET; False when there is none or it cannot be reached."""
    env = os.environ if env is None else env
    addr = env.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr[0] == "@":   # abstract namespace socket
        addr = "\0" + addr[1:]
    elif addr[0] != "/":
        return False     # vsock addresses (vsock:CID:PORT) are not used by units on a host
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as e:
        log.debug("sd_notify %r to %s failed: %s", message, env.get("NOTIFY_SOCKET"), e)
        return False


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), 0 when no watchdog is asked for
    (or it is meant for another process: $WATCHDOG_PID)."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return 0.0
    pid = env.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return 0.0
    return usec / 2e6 if usec > 0 else 0.0


class Watchdog:
    """READY=1 at start(), then WATCHDOG=1 every interval while every watched progress keeps moving.

    The agent watches the tier loop (a round dispatched within `stall_s`, twice the period of its
    fastest tier: a loop waiting for its next deadline is not wedged) and delivery (the stream's
    batcher completing its rounds, its sender alive): a wedged loop or a stopped delivery stops the
    pings and systemd (WatchdogSec= in the unit) restarts the agent. A `status()` text (the spool
    cannot write, the collector is away) is sent as STATUS= when it changes. Pings are spaced at
    half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises."""

    def __init__(self, progress: Callable[[], float], stall_s: float = 0.0, env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "tier loop",
                 status: Callable[[], str] | None = None):
        self.env = dict(os.environ if env is None else env)
        # (name, () -> a number that grows while it works, no progress for longer than this: wedged)
        self.watched: list[tuple[str, Callable[[], float], float]] = [(name, progress, stall_s)]
        self.status = status
        self.interval_s = watchdog_interval_s(self.env)
        self.clock = clock
        self.pings = 0
        self.missed = 0
        self._status_sent = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, progress: Callable[[], float], stall_s: float) -> None:
        """Ping only while `progress()` also moves (added before start())."""
        self.watched.append((name, progress, stall_s))

    def start(self) -> None:
        if not self.env.get("NOTIFY_SOCKET"):
            return
        notify(f"READY=1\nSTATUS=measuring\nMAINPID={os.getpid()}", self.env)
        self._status_sent = "measuring"
        if self.interval_s > 0 or self.status is not None:
            self._thread = TASKS.thread("sd-watchdog", self._run, self._stop)
            self._thread.start()

    @staticmethod
    def _read(progress: Callable[[], float]) -> float | None:
        try:
            return progress()
        except Exception:   # a progress that cannot be read is no progress
            return None

    def _run(self) -> None:
        t0 = self.clock()
        last = {name: (self._read(fn), t0) for name, fn, _ in self.watched}
        while not self._stop.wait(self.interval_s or 5.0):
            t = self.clock()
            stalled = []
            for name, fn, stall_s in self.watched:
                now = self._read(fn)
                if now is None:
                    stalled.append(f"{name}: progress cannot be read")
                    continue
                if now != last[name][0]:
                    last[name] = (now, t)
                if t - last[name][1] > max(stall_s, self.interval_s * 1.01):
                    stalled.append(f"{name} made no progress for {t - last[name][1]:.1f} s")
            self._send_status()
            if self.interval_s <= 0:
                continue
            if not stalled:
                if notify("WATCHDOG=1", self.env):
                    self.pings += 1
            else:
                self.missed += 1
                if self.missed == 1 or self.missed % 10 == 0:
                    log.warning("%s: not pinging the systemd watchdog", "; ".join(stalled))

    def _send_status(self) -> None:
        if self.status is None:
            return
        try:
            text = self.status().replace("\n", " ")
        except Exception as e:
            text = f"status unavailable ({e})"
        if text != self._status_sent and notify(f"STATUS={text}", self.env):
            self._status_sent = text

    def stop(self) -> None:
        self._stop.set()
        if self.env.get("NOTIFY_SOCKET"):
            notify("STOPPING=1", self.env)
        if self._thread is not None:
            self._thread.join(timeout=1.0)
