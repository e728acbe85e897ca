"""NUMA misplacement: a GPU's process running on CPUs outside the GPU's NUMA node, so its host
buffers and PCIe transfers cross the socket interconnect. What it reads and when it opens:
docs/diagnosis.md "numa_misplacement"."""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from xpusense.common import metric_names as m
from xpusense.common.config import Key

from ..base import NUMA_MISPLACEMENT, Context, Evidence, Finding, Rule, RuleFamily
from ..recent import Recent

STAT_PROCESSOR = 39   # proc(5): "processor %d: CPU number last executed on"


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' (the kernel's list format) -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_stat_cpu(text: str) -> int:
    """/proc/PID/stat -> field 39, counting after the command (which may hold spaces and ')')."""
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[STAT_PROCESSOR - 3])


def parse_allowed(status: str) -> str:
    """/proc/PID/status -> its Cpus_allowed_list ('' when absent)."""
    found = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
    return found.group(1) if found else ""


def node_cpus(sysfs: str) -> dict[int, str]:
    """NUMA node -> its cpulist as the kernel writes it (nodes without CPUs left out)."""
    out = {}
    for path in glob.glob(os.path.join(sysfs, "devices/system/node/node*/cpulist")):
        node = os.path.basename(os.path.dirname(path))[4:]
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if node.isdigit() and text:
            out[int(node)] = text
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


class NumaMisplacement(Rule):
    name = NUMA_MISPLACEMENT
    reads = (m.NUMA_NODE,)

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def check(self, recent: Recent, now_ns: int, held: frozenset[tuple[str, str]]) -> list[Finding]:
        gpu_nodes = {s.labels.get("device", ""): s for s in recent.latest(m.NUMA_NODE) if "mig_instance" not in s.labels}
        if not gpu_nodes:
            return []
        lists = node_cpus(self.ctx.sysfs)
        if len(lists) < 2:
            return []
        cpus = {n: parse_cpulist(t) for n, t in lists.items()}
        where = {cpu: n for n, cs in cpus.items() for cpu in cs}
        out = []
        for pid, devices in sorted(self.ctx.processes().items()):
            for device in sorted({d.split("/")[0] for d in devices}):
                s = gpu_nodes.get(device)
                if s is None or (node := int(s.points[-1].value)) not in cpus:
                    continue
                try:
                    base = os.path.join(self.ctx.procfs, str(pid))
                    last = parse_stat_cpu(_read(os.path.join(base, "stat")))
                    allowed_text = parse_allowed(_read(os.path.join(base, "status")))
                    comm = _read(os.path.join(base, "comm")).strip()
                except (OSError, ValueError, IndexError):
                    continue   # the process ended, or is not ours to read
                allowed = parse_cpulist(allowed_text) if allowed_text else set()
                if last in cpus[node] or (allowed and allowed <= cpus[node]):
                    continue
                allowed_nodes = sorted({where[c] for c in allowed if c in where})
                evidence = (
                    Evidence.of(s, 0.0, f"{device} is on NUMA node {node} (CPUs {lists[node]})"),
                    Evidence(f"/proc/{pid}/stat processor", {"pid": str(pid)}, (float(last),), 0.0,
                             f"pid {pid} ({comm}) last ran on CPU {last} (NUMA node {where.get(last, '?')}); "
                             f"allowed CPUs {allowed_text or '?'} (nodes {','.join(map(str, allowed_nodes)) or '?'})"),
                )
                out.append(Finding(
                    self.name, device, "host-side work far from the GPU",
                    f"pid {pid} ({comm}) uses {device} on NUMA node {node} but runs on CPU {last} of node "
                    f"{where.get(last, '?')} (allowed CPUs {allowed_text or '?'}): its transfers cross the sockets",
                    f"bind it to NUMA node {node}: numactl --cpunodebind={node} --membind={node} <command>, "
                    f"or taskset -acp {lists[node]} {pid}",
                    evidence, subject=f"pid {pid}",
                    attributes={"process.pid": str(pid), "process.executable.name": comm}))
        return out


def build(section: Any, ctx: Context) -> Rule | None:
    return NumaMisplacement(ctx)


FAMILY = RuleFamily(NUMA_MISPLACEMENT, {"enabled": Key(bool, True)}, build)
