"""CPU starvation of an accelerator job: the job's cgroup waits on the CPU run queue too long, so the
host side (data loading, kernel launches, collectives' progress threads) holds the device back.
What it reads and when it opens: docs/diagnosis.md "cpu_starvation"."""

from __future__ import annotations

from typing import Any

from xpusense.common.config import Key, positive

from ..base import CPU_STARVATION, Context, Evidence, Finding, Rule, RuleFamily
from ..jobs import job_cgroups
from ..recent import Recent, Series, covers, histogram_quantile

RUNQUEUE_LATENCY = "xpusense.sched.runqueue.latency"


class CpuStarvation(Rule):
    name = CPU_STARVATION
    reads = (RUNQUEUE_LATENCY,)

    def __init__(self, ctx: Context, p99_above_ms: float = 5.0, clear_below_ms: float = 2.5, window_s: float = 60.0,
                 min_waits: int = 50):
        self.ctx = ctx
        self.p99_above_s, self.clear_below_s = p99_above_ms / 1e3, clear_below_ms / 1e3
        self.window_s, self.min_waits = window_s, min_waits

    def check(self, recent: Recent, now_ns: int, held: frozenset[tuple[str, str]]) -> list[Finding]:
        jobs = job_cgroups(self.ctx.processes(), self.ctx.procfs)
        out = []
        for (device, cgroup), pids in sorted(jobs.items()):
            is_open = (device, cgroup) in held
            for s in recent.window(RUNQUEUE_LATENCY, now_ns, self.window_s, cgroup=cgroup):
                if not is_open and not covers(s, self.window_s):
                    continue
                got = histogram_quantile(s, 0.99)
                if got is None:
                    continue
                p99, n = got
                if n < self.min_waits or p99 <= (self.clear_below_s if is_open else self.p99_above_s):
                    continue
                out.append(self._finding(device, cgroup, sorted(pids), s, p99, n))
        return out

    def _finding(self, device: str, cgroup: str, pids: list[int], s: Series, p99: float, n: int) -> Finding:
        shown = f"{p99 * 1e3:.1f} ms"
        who = ", ".join(str(p) for p in pids[:5])
        evidence = (Evidence.of(s, self.window_s, f"run-queue latency p99 {shown} over {n} waits in {s.span_s:.0f} s "
                                                  f"(threshold {self.p99_above_s * 1e3:g} ms)"),)
        return Finding(self.name, device, "accelerator job starved of CPU",
                       f"processes {who} on {device or 'the device'} wait on the CPU run queue: p99 {shown} in "
                       f"cgroup {cgroup}",
                       "give the job CPU: a CPU quota / cpuset (or a higher cpu.weight) for its cgroup, "
                       "or move the noisy neighbours sharing its CPUs elsewhere",
                       evidence, subject=cgroup, attributes={"cgroup": cgroup, "process.pid": str(pids[0])})


def build(section: Any, ctx: Context) -> Rule | None:
    return CpuStarvation(ctx, float(section.p99_above_ms), float(section.clear_below_ms), float(section.window_s),
                         int(section.min_waits))


FAMILY = RuleFamily(CPU_STARVATION, {
    "enabled": Key(bool, True),
    "p99_above_ms": Key((int, float), 5.0, positive, help="run-queue latency p99 of a job's cgroup above this..."),
    "window_s": Key((int, float), 60.0, positive, help="...over this long opens the diagnosis"),
    "clear_below_ms": Key((int, float), 2.5, positive, help="an open diagnosis closes once the p99 is at or below this"),
    "min_waits": Key(int, 50, positive, help="run-queue waits a window needs before its p99 counts"),
}, build)
