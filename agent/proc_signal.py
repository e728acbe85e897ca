"""Signal a process named by a vendor's process list only when that is safe: the pid still names
the process that was listed (its start time, field 22 of /proc/PID/stat, is the one recorded when
the list was read), the process catches the signal (its bit in `SigCgt` of /proc/PID/status: one
that does not would be ended by SIGUSR1's default action), and it is neither the agent, one of the
agent's threads, nor the leader of the agent's process group."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal as signal_mod
from collections.abc import Callable, Iterable

# Why a pid was not signalled: the keys of the watch's `not_signalled` counts.
AGENT, THREAD, ENDED, REUSED, NO_HANDLER, UNREADABLE, DENIED = (
    "agent", "thread", "ended", "pid_reused", "no_handler", "unreadable", "permission")
MAX_PROC_FILE = 16 * 1024   # /proc/PID/status is ~1.5 KiB, stat ~300 bytes: a bound, never reached

Refusal = tuple[str, str]   # (reason key, what to log)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_PROC_FILE).decode("utf-8", "replace")
    except OSError:
        return None


def start_time(pid: int, proc: str = "/proc") -> int | None:
    """The process's start time in clock ticks after boot (field 22 of /proc/PID/stat), None when
    it cannot be read (no such process)."""
    text = _read(f"{proc}/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rfind(")") + 2:].split()   # comm (field 2) may hold spaces and parentheses
    try:
        return int(fields[19])                      # fields[0] is field 3 (state)
    except (IndexError, ValueError):
        return None


def status_fields(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    text = _read(f"{proc}/{pid}/status")
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def catches(status: dict[str, str], signum: int) -> bool | None:
    """Whether the process has a handler for `signum` (SigCgt), None when status does not say."""
    try:
        return bool(int(status["SigCgt"], 16) >> (signum - 1) & 1)
    except (KeyError, ValueError):
        return None


def agent_problem(pid: int, proc: str = "/proc", own_pid: int | None = None) -> str | None:
    """Why `pid` is the agent (None when it is not): its own pid, one of its threads (which kill()
    would reach as the whole agent), or the leader of its process group."""
    own = os.getpid() if own_pid is None else own_pid
    if pid == own:
        return f"pid {pid} is the agent itself"
    try:
        tasks = os.listdir(f"{proc}/{own}/task")
    except OSError:
        tasks = []
    if str(pid) in tasks:
        return f"pid {pid} is a thread of the agent (pid {own})"
    if pid == os.getpgrp():
        return f"pid {pid} leads the agent's process group"
    return None


def check(pid: int, signum: int, started: int | None, proc: str = "/proc",
          own_pid: int | None = None) -> Refusal | None:
    """Why `pid` must not get `signum` now (None when it may). `started`: its start time when the
    process list was read. The start time is read last: it vouches for what was read before it."""
    name = signal_mod.Signals(signum).name
    if why := agent_problem(pid, proc, own_pid):
        return AGENT, why
    status = status_fields(pid, proc)
    if status is None:
        return ENDED, f"pid {pid} has ended"
    own = os.getpid() if own_pid is None else own_pid
    tgid = status.get("Tgid", str(pid))
    if tgid == str(own):
        return AGENT, f"pid {pid} is a thread of the agent (pid {own})"
    if tgid != str(pid):
        return THREAD, f"pid {pid} is a thread of process {tgid}, not a process"
    handled = catches(status, signum)
    if handled is None:
        return UNREADABLE, f"pid {pid}: /proc/{pid}/status has no SigCgt"
    now = start_time(pid, proc)
    if started is None or now is None:
        return UNREADABLE, f"pid {pid}: start time unknown (/proc/{pid}/stat)"
    if now != started:
        return REUSED, (f"pid {pid} is another process now (started at tick {now}, the one listed at "
                        f"tick {started})")
    if not handled:
        return NO_HANDLER, (f"pid {pid} has no {name} handler (its default action would end it): "
                            "it gets the request file and event only")
    return None


@dataclasses.dataclass
class Listed:
    """A pid as the process list named it: its start time then, and a pidfd on that process."""
    started: int | None
    fd: int | None = None
    refusal: Refusal | None = None   # what pidfd_open said about it


def _pidfd(pid: int) -> tuple[int | None, Refusal | None]:
    if not hasattr(os, "pidfd_open") or not hasattr(signal_mod, "pidfd_send_signal"):
        return None, None
    try:
        return os.pidfd_open(pid), None
    except ProcessLookupError:
        return None, (ENDED, f"pid {pid} has ended")
    except OSError as e:
        if e.errno == errno.EINVAL:       # pidfd_open takes thread-group leaders only
            return None, (THREAD, f"pid {pid} is a thread, not a process")
        return None, None                 # ENOSYS, or a seccomp filter refusing it: os.kill


def record(pids: Iterable[int], proc: str = "/proc", pidfds: bool = True) -> dict[int, Listed]:
    """What to know of each pid when the process list is read; release() closes the pidfds.
    pidfds: False over a fake /proc (its pids are not this kernel's)."""
    out = {}
    for pid in pids:
        fd, refusal = _pidfd(pid) if pidfds else (None, None)
        out[pid] = Listed(start_time(pid, proc), fd, refusal)   # read after the open: of the same process
    return out


def release(listed: dict[int, Listed]) -> None:
    for ref in listed.values():
        if ref.fd is not None:
            os.close(ref.fd)
            ref.fd = None


def send(pid: int, signum: int, ref: Listed, proc: str = "/proc", own_pid: int | None = None,
         kill: Callable[[int, int], None] | None = None) -> Refusal | None:
    """Signal `pid` if `check` lets it; the refusal when it did not. `ref`: from record(), when the
    list was read. `kill`: replaces os.kill where there is no pidfd (tests over a fake /proc).

    Where the kernel has pidfds, record() opened one for each pid and the signal goes through it,
    after the checks and a null signal that proves the listed process was alive through them: a pid
    reused in between (even within the 10 ms tick of the start time) can never be signalled. Without
    pidfds, os.kill after the same checks: the start time catches a reuse except within one tick,
    and a window of microseconds remains between the check and the kill."""
    if ref.refusal is not None:
        return ref.refusal
    if why := check(pid, signum, ref.started, proc, own_pid):
        return why
    try:
        if ref.fd is not None:
            signal_mod.pidfd_send_signal(ref.fd, 0)        # alive through the checks: they were of it
            signal_mod.pidfd_send_signal(ref.fd, signum)
        else:
            (kill or os.kill)(pid, signum)
    except ProcessLookupError:
        return ENDED, f"pid {pid}: the process listed has ended (the pid may name another one now)"
    except PermissionError as e:
        return DENIED, f"cannot signal pid {pid}: {e} (the agent needs CAP_KILL for other users' jobs)"
    return None
