"""Where each GPU sits on the host: its PCIe link's capacity, its NUMA node and the PCIe switch it
shares with other GPUs (what the pcie_contention and numa_misplacement diagnosis rules read)."""

from __future__ import annotations

import logging
import os
from typing import Any

from .device import Gpu

log = logging.getLogger("xpusense.agent.nvml")

GT_PER_LANE = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
TOPOLOGY_MULTIPLE = 20   # NVML_TOPOLOGY_INTERNAL 0, SINGLE 10, MULTIPLE 20: at or below a PCIe switch


def link_capacity(gen: int, width: int) -> float | None:
    """Bytes/s one direction of a PCIe link carries at most (None for a generation not known): per
    lane 2.5 / 5 / 8 / 16 / 32 / 64 GT/s for generations 1-6, 8b/10b encoding for 1-2 and 128b/130b
    from 3 on (generation 6's FLIT overhead is not taken off). The caller passes the current
    generation and width, not the maximum: a link trained down (a riser, a slot) is what the traffic
    gets; an idle GPU may drop to a lower generation to save power, so its capacity reads low."""
    rate = GT_PER_LANE.get(int(gen))
    if rate is None or width <= 0:
        return None
    encoding = 8 / 10 if gen <= 2 else 128 / 130
    return rate * 1e9 * encoding / 8 * int(width)


def sysfs_pci_address(bus_id: str) -> str:
    """NVML's busId ('00000000:18:00.0', 8-digit domain) -> the sysfs name ('0000:18:00.0')."""
    domain, bus, rest = bus_id.strip().lower().split(":", 2)
    return f"{int(domain, 16):04x}:{bus}:{rest}"


def numa_node(sysfs: str, bus_id: str) -> int | None:
    """The GPU's NUMA node from sysfs, None where unknown (-1, no file, a bus id not understood)."""
    try:
        path = os.path.join(sysfs, "bus/pci/devices", sysfs_pci_address(bus_id), "numa_node")
        with open(path, encoding="ascii") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def switch_groups(nv: Any, gpus: list[Gpu]) -> tuple[dict[str, str], str]:
    """GPU id -> its PCIe switch group ('0', '1', ...), for the GPUs NVML placed; and why some were
    not ('' when all were). A GPU under no shared switch is a group of its own. Per pair,
    nvmlDeviceGetTopologyCommonAncestor: one switch (SINGLE) or several (MULTIPLE) below the root
    complex share a switch uplink; groups are transitive, numbered in the order of their first GPU."""
    parent = {g.id: g.id for g in gpus}

    def root(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    placed: set[str] = set()
    why = ""
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            try:
                level = nv.nvmlDeviceGetTopologyCommonAncestor(a.handle, b.handle)
            except nv.NVMLError as e:
                why = why or f"nvmlDeviceGetTopologyCommonAncestor({a.id}, {b.id}): {e}"
                continue
            placed.update((a.id, b.id))
            if level <= TOPOLOGY_MULTIPLE:
                parent[root(b.id)] = root(a.id)
    if len(gpus) == 1:
        placed.add(gpus[0].id)
    numbers: dict[str, str] = {}
    out = {}
    for g in gpus:
        if g.id in placed:
            out[g.id] = numbers.setdefault(root(g.id), str(len(numbers)))
    return out, why
