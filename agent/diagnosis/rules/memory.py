"""Device memory pressure: an accelerator's memory used near its total for a whole window, named
with the processes holding the most of it (the cause an operator checks next: one process growing,
or fragmentation; the remedy: a pooling allocator, a smaller batch, or the job moved).

Reads hw.gpu.memory.utilization (used / usable, NVML and npu-smi alike) and
xpusense.accelerator.process.memory.usage (per pid, NVML). Opens at `threshold` held for the whole
`window_s`; an open diagnosis stays while the utilisation is at or above `clear_below`.
"""

from __future__ import annotations

from typing import Any

from xpusense.common import metric_names as m
from xpusense.common.config import Key, positive, ratio

from ..base import DEVICE_MEMORY_PRESSURE, Context, Evidence, Finding, Rule, RuleFamily
from ..recent import Recent, covers

PROCESS_MEMORY = "xpusense.accelerator.process.memory.usage"
TOP_PROCESSES = 3


class MemoryPressure(Rule):
    name = DEVICE_MEMORY_PRESSURE
    reads = (m.GPU_MEMORY_UTILIZATION, PROCESS_MEMORY)

    def __init__(self, threshold: float = 0.95, clear_below: float = 0.90, window_s: float = 60.0):
        self.threshold, self.clear_below, self.window_s = threshold, clear_below, window_s

    def check(self, recent: Recent, now_ns: int, held: frozenset[tuple[str, str]]) -> list[Finding]:
        out = []
        for s in recent.window(m.GPU_MEMORY_UTILIZATION, now_ns, self.window_s):
            if "mig_instance" in s.labels:
                continue   # a MIG instance's memory is its own partition: judged per device here
            device = s.labels.get("device", "")
            is_open = (device, "") in held
            bar = self.clear_below if is_open else self.threshold
            # The whole window must be covered (not one high point after a gap) unless already open.
            if not is_open and not covers(s, self.window_s):
                continue
            if min(s.values) < bar:
                continue
            out.append(self._finding(recent, now_ns, device, s))
        return out

    def _finding(self, recent: Recent, now_ns: int, device: str, s) -> Finding:
        holders = sorted(recent.latest(PROCESS_MEMORY, device=device),
                         key=lambda p: -p.points[-1].value)[:TOP_PROCESSES]   # the largest first
        who = ", ".join(f"pid {p.labels.get('pid', '?')} {p.points[-1].value / 2**30:.1f} GiB" for p in holders)
        evidence = [Evidence.of(s, self.window_s, f"used/usable at least {min(s.values):.1%} for {s.span_s:.0f} s "
                                                  f"(threshold {self.threshold:.0%})")]
        evidence += [Evidence.of(p, 0.0, f"pid {p.labels.get('pid', '?')} holds {p.points[-1].value / 2**30:.2f} GiB")
                     for p in holders]
        attrs = {"process.pid": holders[0].labels.get("pid", "?")} if holders else {}
        return Finding(self.name, device, "out of device memory ahead",
                       f"device memory at {s.values[-1]:.0%} of usable for {s.span_s:.0f} s; "
                       f"held by {who or 'no process listed'}",
                       "a pooling allocator (fragmentation), a smaller batch, or move a job off this device",
                       tuple(evidence), attributes=attrs)


def build(section: Any, ctx: Context) -> Rule | None:
    return MemoryPressure(float(section.threshold), float(section.clear_below), float(section.window_s))


FAMILY = RuleFamily(DEVICE_MEMORY_PRESSURE, {
    "enabled": Key(bool, True),
    "threshold": Key((int, float), 0.95, ratio, help="memory used / usable at or above this..."),
    "window_s": Key((int, float), 60.0, positive, help="...for this long opens the diagnosis"),
    "clear_below": Key((int, float), 0.90, ratio, help="an open diagnosis closes once below this"),
}, build)
