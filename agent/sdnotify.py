"""systemd readiness and watchdog notifications (sd_notify(3)) over $NOTIFY_SOCKET, standard library
only.

The agent says READY=1 once its sources are set up and the tier loop runs, then WATCHDOG=1 from
the tier loop's progress: a ping goes out only while the loop has dispatched a round within
`stall_s` (twice the period of its fastest tier: a loop waiting for its next deadline is not
wedged), so a wedged loop stops the pings and systemd (WatchdogSec= in the unit) restarts the
agent. Pings are spaced at half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises. Outside
systemd ($NOTIFY_SOCKET unset) everything here does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

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
    """READY=1 at start(), then WATCHDOG=1 every interval while `progress()` keeps moving."""

    def __init__(self, progress: Callable[[], float], stall_s: float = 0.0, env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.env = dict(os.environ if env is None else env)
        self.progress = progress          # () -> a number that grows while the tier loop works
        self.stall_s = stall_s            # no progress for longer than this: wedged (0: one interval)
        self.interval_s = watchdog_interval_s(self.env)
        self.clock = clock
        self.pings = 0
        self.missed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.env.get("NOTIFY_SOCKET"):
            return
        notify(f"READY=1\nSTATUS=measuring\nMAINPID={os.getpid()}", self.env)
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="sd-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        last, moved_at = self.progress(), self.clock()
        while not self._stop.wait(self.interval_s):
            now, t = self.progress(), self.clock()
            if now != last:
                last, moved_at = now, t
            if t - moved_at <= max(self.stall_s, self.interval_s * 1.01):
                if notify("WATCHDOG=1", self.env):
                    self.pings += 1
            else:
                self.missed += 1
                if self.missed == 1 or self.missed % 10 == 0:
                    log.warning("tier loop made no progress for %.1f s: not pinging the systemd watchdog",
                                t - moved_at)

    def stop(self) -> None:
        self._stop.set()
        if self.env.get("NOTIFY_SOCKET"):
            notify("STOPPING=1", self.env)
        if self._thread is not None:
            self._thread.join(timeout=1.0)
