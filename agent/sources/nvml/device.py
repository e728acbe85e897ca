"""What the NVML source keeps per GPU between rounds (handle, identity, abilities, last samples)."""

from __future__ import annotations

from typing import Any

from .gpm import GpmStream

VENDOR = "nvidia"


class Gpu:
    def __init__(self, index: int, handle: Any):
        self.index = index
        self.handle = handle
        self.id = f"gpu{index}"
        self.labels = {"device": self.id, "vendor": VENDOR}
        self.name = ""
        self.arch: int | None = None
        self.opened = False                      # handle and identity read
        self.lost = False
        self.reset_required: set[str] = set()   # readings that answered RESET_REQUIRED since
        self.gpm = False
        self.gpm_reason = ""
        self.gpm_supported = False                # nvmlGpmQueryDeviceSupport said so
        self.gpm_stream: GpmStream | None = None
        self.info: dict[str, str] = {}
        self.nvlinks = 0
        self.mig = False
        self.migs: list[Any] = []                # mig.MigInstance, when MIG mode is on
        self.mig_changed = False                 # a MIG config change event arrived
        self.busy_s = 0.0              # utilisation x seconds since the last offline round
        self.busy_span_s = 0.0
        self.last_util_t: float | None = None
        self.energy_prev: tuple[float, float] | None = None  # (monotonic s, J)
        self.peak_tflops = 0.0
        self.numa_node: int | None = None        # topology.py: from sysfs
        self.pcie_switch = ""                   # topology.py: its PCIe switch group, '' unknown
