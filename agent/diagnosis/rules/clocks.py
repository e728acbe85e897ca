"""Clocks held down: an accelerator kept below its clocks for a whole window while it is busy (the
"training suddenly slower" case: clocks locked after a preemption, a power cap, heat). What it
reads and when it opens, for NVIDIA and Ascend: docs/diagnosis.md "clocks_held_down"."""

from __future__ import annotations

from typing import Any

from xpusense.common import metric_names as m
from xpusense.common.config import Key, one_of, positive, ratio

from ..base import CLOCKS_HELD_DOWN, Context, Evidence, Finding, Rule, RuleFamily
from ..recent import Recent, Series, covers

THROTTLE = "xpusense.accelerator.throttle"
AICORE, AICORE_RATED = "aicore", "aicore_rated"

# reason label -> (what it means, what to check)
REASONS: dict[str, tuple[str, str]] = {
    "sw_power_cap": ("the software power cap (power draw at the enforced power limit)",
                     "check the power limit (nvidia-smi -q -d POWER) against the board's default"),
    "hw_power_brake_slowdown": ("the hardware power brake (the system's power supply asked the GPU to slow down)",
                                "check the node's power supplies and the power brake signal"),
    "hw_slowdown": ("hardware slowdown (over temperature or an external power brake)",
                    "check the GPU temperature, cooling and power supply"),
    "sw_thermal_slowdown": ("software thermal slowdown (GPU or HBM temperature above its target)",
                            "check cooling: inlet temperature, airflow, fans, the GPU and HBM temperatures"),
    "hw_thermal_slowdown": ("hardware thermal slowdown (GPU over its slowdown temperature)",
                            "check cooling: inlet temperature, airflow, fans, the GPU and HBM temperatures"),
    "sync_boost": ("sync boost (held to the clocks of another GPU in its sync boost group)",
                   "check the other GPUs of the sync boost group"),
    "applications_clocks_setting": ("the applications clocks setting (clocks locked below boost)",
                                    "reset application clocks (nvidia-smi -rac, nvidia-smi -rgc)"),
}
COMMON_REMEDY = "after a preemption check the job's cgroup QoS and reset application clocks (nvidia-smi -rac)"


def _device(s: Series) -> str:
    return s.labels.get("device", "")


class ClocksHeldDown(Rule):
    name = CLOCKS_HELD_DOWN
    reads = (THROTTLE, m.GPU_UTILIZATION, m.CLOCK_FREQUENCY)

    def __init__(self, window_s: float = 60.0, busy_above: float = 0.5, min_clock_ratio: float = 0.95,
                 reasons: tuple[str, ...] = tuple(REASONS)):
        self.window_s, self.busy_above, self.min_clock_ratio = window_s, busy_above, min_clock_ratio
        self.reasons = frozenset(reasons)

    def _busy(self, recent: Recent, now_ns: int, device: str) -> Series | None:
        for s in recent.window(m.GPU_UTILIZATION, now_ns, self.window_s, device=device):
            if "mig_instance" not in s.labels and sum(s.values) / len(s.values) >= self.busy_above:
                return s
        return None

    def check(self, recent: Recent, now_ns: int, held: frozenset[tuple[str, str]]) -> list[Finding]:
        held_down: dict[str, list[Series]] = {}
        for s in recent.window(THROTTLE, now_ns, self.window_s):
            if s.labels.get("reason") not in self.reasons or "mig_instance" in s.labels:
                continue
            is_open = (_device(s), "") in held
            if (s.values[-1] >= 1 and is_open) or (covers(s, self.window_s) and min(s.values) >= 1):
                held_down.setdefault(_device(s), []).append(s)
        out = []
        for device, reasons in sorted(held_down.items()):
            if (busy := self._busy(recent, now_ns, device)) is not None:
                out.append(self._nvidia(recent, now_ns, device, reasons, busy))
        rated = {_device(s): s for s in recent.window(m.CLOCK_FREQUENCY, now_ns, self.window_s, clock=AICORE_RATED)}
        for cur in recent.window(m.CLOCK_FREQUENCY, now_ns, self.window_s, clock=AICORE):
            device = _device(cur)
            r = rated.get(device)
            if r is None or r.values[-1] <= 0:
                continue
            bar = self.min_clock_ratio * r.values[-1]
            is_open = (device, "") in held
            if not ((is_open and cur.values[-1] < bar) or (covers(cur, self.window_s) and max(cur.values) < bar)):
                continue
            if (busy := self._busy(recent, now_ns, device)) is not None:
                out.append(self._ascend(device, cur, r, busy))
        return out

    def _busy_evidence(self, busy: Series) -> Evidence:
        mean = sum(busy.values) / len(busy.values)
        return Evidence.of(busy, self.window_s, f"utilisation {mean:.0%} on average (busy above {self.busy_above:.0%})")

    def _nvidia(self, recent: Recent, now_ns: int, device: str, reasons: list[Series], busy: Series) -> Finding:
        names = sorted(s.labels["reason"] for s in reasons)
        evidence = [Evidence.of(s, self.window_s, f"{s.labels['reason']} active at every reading for {s.span_s:.0f} s")
                    for s in sorted(reasons, key=lambda x: x.labels["reason"])]
        evidence.append(self._busy_evidence(busy))
        sm = [s for s in recent.window(m.CLOCK_FREQUENCY, now_ns, self.window_s, device=device, clock="sm")
              if "mig_instance" not in s.labels]
        clock = ""
        if sm:
            evidence.append(Evidence.of(sm[0], self.window_s, f"SM clock {sm[0].values[-1] / 1e6:.0f} MHz"))
            clock = f"; SM clock {sm[0].values[-1] / 1e6:.0f} MHz"
        remedies = list(dict.fromkeys(REASONS[n][1] for n in names))
        return Finding(self.name, device, "training slower: clocks held down",
                       "clocks held down by " + ", ".join(f"{n} ({REASONS[n][0]})" for n in names) + clock,
                       "; ".join([*remedies, COMMON_REMEDY]), tuple(evidence),
                       attributes={"throttle.reasons": ",".join(names)})

    def _ascend(self, device: str, cur: Series, rated: Series, busy: Series) -> Finding:
        now_mhz, rated_mhz = cur.values[-1] / 1e6, rated.values[-1] / 1e6
        evidence = (Evidence.of(cur, self.window_s, f"AI Core at most {max(cur.values) / 1e6:.0f} MHz for "
                                                    f"{cur.span_s:.0f} s (below {self.min_clock_ratio:.0%} of rated)"),
                    Evidence.of(rated, self.window_s, f"AI Core rated {rated_mhz:.0f} MHz"),
                    self._busy_evidence(busy))
        return Finding(self.name, device, "training slower: clocks held down",
                       f"AI Core at {now_mhz:.0f} MHz, {now_mhz / rated_mhz:.0%} of its rated {rated_mhz:.0f} MHz "
                       f"while busy (power or thermal limit, or clocks set after a preemption)",
                       "check the NPU's power and temperature (npu-smi info -t power / -t temp) and cooling; "
                       "after a preemption check the job's cgroup QoS and the NPU's clock settings",
                       evidence)


def build(section: Any, ctx: Context) -> Rule | None:
    return ClocksHeldDown(float(section.window_s), float(section.busy_above), float(section.min_clock_ratio),
                          tuple(section.reasons))


FAMILY = RuleFamily(CLOCKS_HELD_DOWN, {
    "enabled": Key(bool, True),
    "window_s": Key((int, float), 60.0, positive, help="a throttle reason (or a low AI Core clock) this long..."),
    "busy_above": Key((int, float), 0.5, ratio, help="...while utilisation averages at least this opens it"),
    "reasons": Key(list, list(REASONS), one_of(*REASONS), help="the NVIDIA clocks-event reasons that count"),
    "min_clock_ratio": Key((int, float), 0.95, ratio,
                           help="Ascend: AI Core current / rated frequency below this is held down"),
}, build)
