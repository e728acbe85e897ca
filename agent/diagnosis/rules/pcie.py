"""PCIe contention: a GPU whose utilisation swings while its PCIe link runs near its capacity (the
GPU waits on host transfers), or GPUs under one PCIe switch that together move about what one link
carries (they share the switch's uplink). What it reads and when it opens: docs/diagnosis.md
"pcie_contention"."""

from __future__ import annotations

import statistics
from typing import Any

from xpusense.common import metric_names as m
from xpusense.common.config import Key, positive, ratio

from ..base import PCIE_CONTENTION, Context, Evidence, Finding, Rule, RuleFamily
from ..recent import Recent, Series, covers

MIN_POINTS = 3   # a coefficient of variation of fewer utilisation points says nothing


def _gbs(v: float) -> str:
    return f"{v / 1e9:.1f} GB/s"


class PcieContention(Rule):
    name = PCIE_CONTENTION
    reads = (m.GPU_UTILIZATION, m.PCIE_THROUGHPUT, m.PCIE_LINK_CAPACITY, m.NUMA_NODE)

    def __init__(self, window_s: float = 60.0, cv_threshold: float = 0.3, util_floor: float = 0.2,
                 near_capacity: float = 0.8, switch_share_floor: float = 0.1):
        self.window_s, self.cv_threshold, self.util_floor = window_s, cv_threshold, util_floor
        self.near_capacity, self.switch_share_floor = near_capacity, switch_share_floor

    def check(self, recent: Recent, now_ns: int, held: frozenset[tuple[str, str]]) -> list[Finding]:
        links = {s.labels.get("device", ""): s for s in recent.latest(m.PCIE_LINK_CAPACITY)
                 if "mig_instance" not in s.labels}
        flows: dict[str, list[Series]] = {}
        for s in recent.window(m.PCIE_THROUGHPUT, now_ns, self.window_s):
            if "mig_instance" not in s.labels:
                flows.setdefault(s.labels.get("device", ""), []).append(s)
        nodes = {s.labels.get("device", ""): int(s.points[-1].value) for s in recent.latest(m.NUMA_NODE)}
        out = []
        for util in recent.window(m.GPU_UTILIZATION, now_ns, self.window_s):
            device = util.labels.get("device", "")
            if "mig_instance" in util.labels or device not in links or device not in flows:
                continue
            f = self._gpu(util, links[device], flows[device], nodes.get(device), (device, "") in held)
            if f is not None:
                out.append(f)
        return out + self._switches(links, flows, nodes, held)

    def _gpu(self, util: Series, link: Series, flows: list[Series], node: int | None, is_open: bool) -> Finding | None:
        if len(util.points) < MIN_POINTS or (not is_open and not covers(util, self.window_s)):
            return None
        mean = statistics.fmean(util.values)
        if mean < self.util_floor:
            return None
        cv = statistics.pstdev(util.values) / mean
        capacity = link.points[-1].value
        busiest = max(flows, key=lambda s: statistics.fmean(s.values))
        moved = statistics.fmean(busiest.values)
        if cv < self.cv_threshold or capacity <= 0 or moved < self.near_capacity * capacity:
            return None
        device, direction = util.labels.get("device", ""), busiest.labels.get("direction", "?")
        evidence = (
            Evidence.of(util, self.window_s, f"coefficient of variation {cv:.2f} over {util.span_s:.0f} s "
                                             f"(threshold {self.cv_threshold}), mean {mean:.0%}"),
            Evidence.of(busiest, self.window_s, f"{direction} mean {_gbs(moved)} = {moved / capacity:.0%} of the "
                                                f"link's {_gbs(capacity)} (threshold {self.near_capacity:.0%})"),
            Evidence.of(link, 0.0, f"PCIe link capacity {_gbs(capacity)} per direction (generation x width)"),
        )
        return Finding(self.name, device, "GPU utilisation swings",
                       f"PCIe {direction} at {moved / capacity:.0%} of the link ({_gbs(moved)} of {_gbs(capacity)}) "
                       f"while utilisation varies by {cv:.0%} around {mean:.0%}: the GPU waits on host transfers",
                       _remedy(node), evidence, attributes={"pcie.direction": direction})

    def _switches(self, links: dict[str, Series], flows: dict[str, list[Series]], nodes: dict[str, int],
                  held: frozenset[tuple[str, str]]) -> list[Finding]:
        groups: dict[str, list[str]] = {}
        for device, link in links.items():
            if link.labels.get("pcie_switch"):
                groups.setdefault(link.labels["pcie_switch"], []).append(device)
        out = []
        for switch, devices in sorted(groups.items()):
            subject = f"pcie_switch {switch}"
            for direction in ("receive", "transmit"):
                f = self._switch(switch, sorted(devices), direction, links, flows, nodes, ("", subject) in held)
                if f is not None:
                    out.append(f)
                    break   # one finding per switch: the first direction that holds
        return out

    def _switch(self, switch: str, devices: list[str], direction: str, links: dict[str, Series],
                flows: dict[str, list[Series]], nodes: dict[str, int], is_open: bool) -> Finding | None:
        moving = []
        for d in devices:
            s = next((x for x in flows.get(d, []) if x.labels.get("direction") == direction), None)
            capacity = links[d].points[-1].value
            if s is None or capacity <= 0 or (len(s.points) < 2 and not is_open):
                continue
            if statistics.fmean(s.values) >= self.switch_share_floor * capacity:
                moving.append((d, s))
        if len(moving) < 2:
            return None
        uplink = min(links[d].points[-1].value for d in devices)
        total = sum(statistics.fmean(s.values) for _, s in moving)
        if total < self.near_capacity * uplink:
            return None
        names = ",".join(d for d, _ in moving)
        evidence = tuple(Evidence.of(s, self.window_s, f"{d} {direction} mean {_gbs(statistics.fmean(s.values))}")
                         for d, s in moving)
        evidence += (Evidence.of(links[devices[0]], 0.0,
                                 f"together {_gbs(total)} = {total / uplink:.0%} of one link's {_gbs(uplink)} "
                                 f"(threshold {self.near_capacity:.0%}): GPUs {names} share PCIe switch {switch}"),)
        node = next((nodes[d] for d, _ in moving if d in nodes), None)
        return Finding(self.name, "", "GPU utilisation swings",
                       f"GPUs {names} under one PCIe switch move {_gbs(total)} {direction} together, "
                       f"{total / uplink:.0%} of one link ({_gbs(uplink)}): they share the switch's uplink",
                       _remedy(node), evidence, subject=f"pcie_switch {switch}",
                       attributes={"pcie.switch": switch, "pcie.direction": direction, "hw.ids": names})


def _remedy(node: int | None) -> str:
    bind = f"numactl --cpunodebind={node} --membind={node}" if node is not None else "numactl --cpunodebind=N --membind=N"
    return (f"bind the job to the GPU's NUMA node ({bind}), pin its host buffers, and spread PCIe-heavy jobs "
            f"across PCIe switches (nvidia-smi topo -m)")


def build(section: Any, ctx: Context) -> Rule | None:
    return PcieContention(float(section.window_s), float(section.cv_threshold), float(section.util_floor),
                          float(section.near_capacity), float(section.switch_share_floor))


FAMILY = RuleFamily(PCIE_CONTENTION, {
    "enabled": Key(bool, True),
    "window_s": Key((int, float), 60.0, positive, help="utilisation and PCIe throughput judged over this long"),
    "cv_threshold": Key((int, float), 0.3, positive, help="utilisation's coefficient of variation at or above this..."),
    "util_floor": Key((int, float), 0.2, ratio, help="...with its mean at or above this (an idle GPU does not swing)"),
    "near_capacity": Key((int, float), 0.8, ratio, help="PCIe throughput / link capacity at or above this"),
    "switch_share_floor": Key((int, float), 0.1, ratio,
                              help="a GPU counts towards its switch's load when moving this share of its link"),
}, build)
