"""HBM bandwidth watch: when an accelerator's HBM bandwidth utilisation stays at or above a
threshold for a window, ask the training jobs on it to checkpoint (signal, request file, event).

It sits between the tier loop and the stream: it sees every realtime sample of
`xpusense.accelerator.hbm.bandwidth.utilization`, keeps one small state machine per accelerator
(Track), and on firing groups the accelerator's processes into jobs so that each job gets one
request, then waits a cooldown per job."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal as signal_mod
import uuid
from collections import Counter
from collections.abc import Callable, Iterable

from . import proc_signal
from .request_dir import prepare_request_dir, write_atomically
from .sources.base import Event, Sample

log = logging.getLogger("xpusense.agent.hbm_watch")

METRIC = "xpusense.accelerator.hbm.bandwidth.utilization"
# Rounds of the 1 s tier are stamped when dispatched, a few ms either side of their deadline: a
# 5 s window is met by the sample 5 periods after the crossing even when it lands 1 ms early.
JITTER_NS = 50_000_000
PID_MAX_LIMIT = 4194304   # the kernel's ceiling for pid_max on 64-bit (include/linux/threads.h)
CONTAINER_HINTS = ("kubepods", "docker", "containerd", "cri-containerd", "crio", "libpod", "lxc", ".service")


@dataclasses.dataclass(frozen=True)
class Rule:
    threshold: float = 0.85
    window_s: float = 5.0
    low_mark: float = 0.75
    cooldown_s: float = 600.0


@dataclasses.dataclass
class Track:
    """One accelerator's state: ARMED -> (value >= threshold continuously for `window_s`) -> FIRED;
    FIRED -> (a value below `low_mark`) -> ARMED. A value below the threshold restarts the window. A
    missing sample neither restarts nor confirms the window, unless the gap is longer than the
    window itself (then the window starts again at the next sample). A value that is not a ratio
    (NaN, infinite, outside 0..1) counts as a missing sample, never as one at or above the
    threshold (`NaN < threshold` is false)."""
    armed: bool = True
    above_since_ns: int | None = None
    last_ns: int | None = None
    last_value: float = 0.0


@dataclasses.dataclass
class Request:
    id: str
    device: str
    vendor: str
    value: float
    rule: Rule
    job: str
    pids: list[int]
    time_ns: int
    crossed_ns: int
    listed: dict[int, proc_signal.Listed] = dataclasses.field(default_factory=dict)   # pid -> as listed
    actions: list[str] = dataclasses.field(default_factory=list)
    file: str = ""

    def as_json(self) -> dict:
        return {
            "id": self.id, "accelerator": self.device, "vendor": self.vendor, "value": round(self.value, 4),
            "threshold": self.rule.threshold, "window_s": self.rule.window_s, "job": self.job,
            "pids": self.pids, "time": self.time_ns / 1e9, "crossed_time": self.crossed_ns / 1e9,
            "reason": (f"HBM bandwidth utilisation of {self.device} at or above {self.rule.threshold:.0%} "
                       f"for {self.rule.window_s:g} s (now {self.value:.0%}): checkpoint now"),
        }


def accelerator(labels: dict[str, str]) -> str:
    """`gpu0`, or `gpu0/gi1` for MIG instance 1 of it (samples labelled `mig_instance`; the NVML
    source lists its processes under that id): each instance has its own window, and a request goes
    to the jobs on that instance only."""
    dev = labels.get("device", "")
    mig = labels.get("mig_instance")
    return f"{dev}/gi{mig}" if mig else dev


def cgroup_of(pid: int, proc: str = "/proc") -> str:
    """The process's cgroup v2 path ('' when unknown)."""
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            for line in f:
                hier, _, path = line.rstrip("\n").split(":", 2)
                if hier == "0":
                    return path
            f.seek(0)
            first = f.readline().rstrip("\n").split(":", 2)
            return first[2] if len(first) == 3 else ""
    except (OSError, ValueError):
        return ""


def pid_max(proc: str = "/proc") -> int:
    try:
        with open(f"{proc}/sys/kernel/pid_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return PID_MAX_LIMIT


def pid_refusal(pid: object, proc: str = "/proc", own_pid: int | None = None) -> proc_signal.Refusal | None:
    """(reason key, why) a request must not name this pid, None when it may: not an integer, 0
    (kill(0, sig) signals the caller's own process group), 1 (init), above pid_max (a misread
    list), the agent (its pid, a thread of it, its process group's leader), or no such process."""
    if not isinstance(pid, int) or isinstance(pid, bool):
        return "invalid", f"{pid!r} is not a pid"
    if pid <= 1:
        return "invalid", f"pid {pid} is {'init' if pid == 1 else 'not a process (0 signals our own process group)'}"
    limit = pid_max(proc)
    if pid > limit:
        return "invalid", f"pid {pid} is above pid_max {limit} (a misread process list)"
    if why := proc_signal.agent_problem(pid, proc, own_pid):
        return proc_signal.AGENT, why
    if not os.path.isdir(f"{proc}/{pid}"):
        return proc_signal.ENDED, f"pid {pid}: no such process"
    return None


def job_key(pid: int, group_by: str = "auto", proc: str = "/proc") -> str:
    """Which job a process belongs to: its container/service cgroup, else its process group."""
    if group_by == "pid":
        return f"pid:{pid}"
    cg = cgroup_of(pid, proc) if group_by in ("auto", "cgroup") else ""
    if group_by == "cgroup" and cg:
        return f"cgroup:{cg}"
    if group_by == "auto" and cg and any(h in cg for h in CONTAINER_HINTS):
        return f"cgroup:{cg}"
    try:
        return f"pgid:{os.getpgid(pid)}"
    except (OSError, OverflowError):
        return f"pid:{pid}"


def group_jobs(pids: Iterable[int], group_by: str = "auto", proc: str = "/proc") -> dict[str, list[int]]:
    jobs: dict[str, list[int]] = {}
    for pid in sorted(set(pids)):
        jobs.setdefault(job_key(pid, group_by, proc), []).append(pid)
    return jobs


class HbmWatch:
    def __init__(self, rules: dict[str, Rule], processes: Callable[[], dict[int, set[str]]],
                 actions: Iterable[str] = ("signal", "file", "event"), signal_name: str = "SIGUSR1",
                 request_dir: str = "/run/xpusense/checkpoint", group_by: str = "auto", proc: str = "/proc",
                 kill: Callable[[int, int], None] | None = None, own_pid: int | None = None):
        """Every pid is checked before a request names it (pid_refusal: pids come from vendor
        libraries, and a misread NVML process list gives 0 or 4294967295); the signal goes only to a
        process that catches it and is still the one listed (proc_signal.py), so a process without
        a handler gets the request file and event only. Every pid not signalled is logged with why
        and counted by reason (`status()["not_signalled"]`).

        rules: vendor -> Rule ('default' for any vendor without its own). kill: None sends through
        a pidfd (os.kill where there is none); tests over a fake /proc give their own. Raises
        RequestDirError when the "file" action's request_dir is unsafe (request_dir.py)."""
        self.rules = rules
        self.processes = processes
        self.actions = list(actions)
        self.signum = int(getattr(signal_mod, signal_name))
        self.request_dir = request_dir
        self.group_by = group_by
        self.proc = proc
        self.kill = kill
        self.own_pid = own_pid
        self.bad_pids = 0                       # pids refused by pid_refusal
        self.not_signalled: Counter[str] = Counter()   # reason -> pids not signalled (left out or refused)
        self.tracks: dict[tuple[str, str], Track] = {}
        self.last_fired: dict[str, int] = {}   # job -> time_ns of its last request
        self.sent: list[Request] = []           # what was sent, for status and tests
        self.fired = 0
        self.suppressed = 0
        self.ignored = 0                        # values that were not ratios (NaN...)
        if "file" in self.actions and (why := prepare_request_dir(request_dir)):
            log.warning("hbm_watch.request_dir: %s: checkpoint requests go out without their file until it "
                        "exists (mode 1777, docs/security.md)", why)

    def rule(self, vendor: str) -> Rule:
        return self.rules.get(vendor) or self.rules["default"]

    def observe(self, samples: list[Sample]) -> list[Event]:
        events: list[Event] = []
        for s in samples:
            if s.name != METRIC:
                continue
            dev, vendor = accelerator(s.labels), s.labels.get("vendor", "")
            if not (math.isfinite(s.value) and 0.0 <= s.value <= 1.0):
                self.ignored += 1
                if self.ignored == 1:
                    log.warning("HBM bandwidth of %s reads %r, not a ratio: treated as a missing sample "
                                "(said once)", dev, s.value)
                continue
            tr = self.tracks.setdefault((vendor, dev), Track())
            fire = self._step(tr, self.rule(vendor), s.value, s.time_ns)
            if fire is not None:
                events += self._fire(dev, vendor, s.value, fire, s.time_ns)
        return events

    def _step(self, tr: Track, rule: Rule, value: float, t_ns: int) -> int | None:
        """Advance one accelerator's state; returns the time the threshold was crossed when firing."""
        gap_ns = None if tr.last_ns is None else t_ns - tr.last_ns
        tr.last_ns, tr.last_value = t_ns, value
        if not tr.armed:
            if value < rule.low_mark:
                tr.armed = True
                tr.above_since_ns = None
            return None
        if value < rule.threshold:
            tr.above_since_ns = None
            return None
        if tr.above_since_ns is None or (gap_ns is not None and gap_ns > rule.window_s * 1e9):
            tr.above_since_ns = t_ns
        if t_ns - tr.above_since_ns >= rule.window_s * 1e9 - JITTER_NS:
            tr.armed = False
            return tr.above_since_ns
        return None

    def _fire(self, dev: str, vendor: str, value: float, crossed_ns: int, now_ns: int) -> list[Event]:
        rule = self.rule(vendor)
        pids = self._checked([pid for pid, devs in self.processes().items() if dev in devs], dev)
        if not pids:
            log.info("HBM bandwidth of %s at %.0f%% for %g s, but no process uses it: nothing to ask",
                     dev, value * 100, rule.window_s)
            return []
        # Right after the list is read: each pid's start time, and a pidfd on it (closed below).
        listed = proc_signal.record(pids, self.proc, pidfds=self.kill is None and "signal" in self.actions)
        try:
            return self._requests(dev, vendor, value, crossed_ns, now_ns, pids, listed)
        finally:
            proc_signal.release(listed)

    def _requests(self, dev: str, vendor: str, value: float, crossed_ns: int, now_ns: int, pids: list[int],
                  listed: dict[int, proc_signal.Listed]) -> list[Event]:
        rule = self.rule(vendor)
        events = []
        for job, job_pids in group_jobs(pids, self.group_by, self.proc).items():
            last = self.last_fired.get(job)
            if last is not None and now_ns - last < rule.cooldown_s * 1e9:
                self.suppressed += 1
                log.info("HBM bandwidth of %s high again, job %s asked %.0f s ago: in cooldown (%g s)",
                         dev, job, (now_ns - last) / 1e9, rule.cooldown_s)
                continue
            self.last_fired[job] = now_ns
            req = Request(uuid.uuid4().hex[:16], dev, vendor, value, rule, job, job_pids, now_ns, crossed_ns,
                          {pid: listed[pid] for pid in job_pids})
            events += self._act(req)
        return events

    def _checked(self, pids: list[int], dev: str) -> list[int]:
        ok = []
        for pid in pids:
            refusal = pid_refusal(pid, self.proc, self.own_pid)
            if refusal is None:
                ok.append(pid)
                continue
            reason, why = refusal
            self.bad_pids += 1
            self.not_signalled[reason] += 1
            log.warning("HBM watch on %s: process list names %s: left out of the request", dev, why)
        return ok

    def _act(self, req: Request) -> list[Event]:
        done = []
        if "file" in self.actions:
            try:
                # "signal": the job's helper pairs this file with the signal that follows it.
                sig = signal_mod.Signals(self.signum).name if "signal" in self.actions else ""
                req.file = write_atomically(self.request_dir, f"{req.id}.json", {**req.as_json(), "signal": sig})
                done.append(f"file {req.file}")
            except OSError as e:
                log.error("checkpoint request %s: cannot write to %s: %s", req.id, self.request_dir, e)
        if "signal" in self.actions:
            sent, refused = [], []
            for pid in req.pids:
                refusal = proc_signal.send(pid, self.signum, req.listed[pid], self.proc, self.own_pid, self.kill)
                if refusal is None:
                    sent.append(pid)
                    continue
                reason, why = refusal
                self.not_signalled[reason] += 1
                refused.append(f"{pid} ({reason})")
                quiet = reason in (proc_signal.NO_HANDLER, proc_signal.ENDED)   # expected: said at info
                log.log(logging.INFO if quiet else logging.WARNING, "checkpoint request %s: not signalled: %s",
                        req.id, why)
            if sent:
                done.append(f"{signal_mod.Signals(self.signum).name} to pids {sent}")
            if refused:
                done.append(f"not signalled: {', '.join(refused)}")
        req.actions = done
        self.sent.append(req)
        self.fired += 1
        log.info("checkpoint request %s for job %s on %s (HBM bandwidth %.0f%% >= %.0f%% for %g s): %s",
                 req.id, req.job, req.device, req.value * 100, req.rule.threshold * 100, req.rule.window_s,
                 "; ".join(done) or "event only")
        if "event" not in self.actions:
            return []
        attrs = {"request_id": req.id, "vendor": req.vendor, "job": req.job,
                 "pids": ",".join(map(str, req.pids)), "value": f"{req.value:.4f}",
                 "threshold": f"{req.rule.threshold:g}", "window_s": f"{req.rule.window_s:g}",
                 "actions": "; ".join(done) or "event only"}
        return [Event("checkpoint_request", req.as_json()["reason"], "warning", req.device, attrs,
                      req.time_ns, req.id)]

    def status(self) -> dict:
        return {"fired": self.fired, "suppressed_by_cooldown": self.suppressed, "refused_pids": self.bad_pids,
                "not_signalled": dict(self.not_signalled),
                "armed": {f"{v}/{d}": t.armed for (v, d), t in self.tracks.items()}}

