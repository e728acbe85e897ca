"""The tracepoint and uprobe probes: runqlat, blkio, netio, accel_ioctl, cuda_uprobe.

runqlat and netio are their specs and nothing more; blkio names disks; accel_ioctl has the loader
fill the device path prefixes its programs match and adds device files opened before it attached;
cuda_uprobe finds libcuda, and the loader attaches one uprobe per exported driver-API symbol.
(tc_traffic is in tc.py.)
"""

from __future__ import annotations

import ctypes
import fnmatch
import logging
import os
import subprocess
import time
from typing import Any

from xpusense.probes import specs

from ..base import NEARLINE, Sample, Unavailable
from .loader import EbpfLoader, Plan
from .procfs import DiskNames, device_prefixes, prefix_words
from .source import FAMILIES, EbpfSource

log = logging.getLogger("xpusense.agent.sources.ebpf")

DIRECTIONS_DISK = ("read", "write", "discard", "flush")
STALE_INFLIGHT_S = 60.0     # blkio: an in-flight request this old lost its completion


class RunqlatSource(EbpfSource):
    probe = "runqlat"


class BlkioSource(EbpfSource):
    probe = "blkio"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.disks = DiskNames(self.cfg.sysfs)
        self.stale_dropped = 0

    def collect(self, tier: str) -> list[Sample]:
        if tier == NEARLINE and self.handle is not None and self.planned.variant.name != "raw_done":
            self.drop_stale()       # raw_done keeps no in-flight map
        return super().collect(tier)

    def drop_stale(self, now_ns: int | None = None) -> int:
        """In-flight requests older than STALE_INFLIGHT_S whose completion the probe never saw (a
        plain hash keeps them otherwise): dropped, and counted in describe()."""
        table = self.table("blkio_start")
        cutoff = (time.monotonic_ns() if now_ns is None else now_ns) - int(STALE_INFLIGHT_S * 1e9)
        stale = [k for k, v in table.items(batch=False) if v.ts_ns < cutoff]
        for k in stale:
            try:
                del table[k]
            except KeyError:
                pass
        self.stale_dropped += len(stale)
        return len(stale)

    def describe(self) -> dict:
        return {**super().describe(), "stale_inflight_dropped": self.stale_dropped}

    def key_labels(self, decoder: str, key: Any, value: Any) -> dict[str, str] | None:
        if decoder == "disk":
            d = int(key.dir)
            return {"device": self.disks.name(int(key.dev)),
                    "direction": DIRECTIONS_DISK[d] if d < len(DIRECTIONS_DISK) else str(d)}
        return super().key_labels(decoder, key, value)


class NetioSource(EbpfSource):
    probe = "netio"

    def key_labels(self, decoder: str, key: Any, value: Any) -> dict[str, str] | None:
        if decoder == "cgroup_family":     # retransmits per socket cgroup (variant sock_cgroup)
            fam = int(key.family)
            return {"cgroup": self.cgroup_label(int(key.cgid)),
                    "family": FAMILIES[fam] if fam < len(FAMILIES) else str(fam)}
        return super().key_labels(decoder, key, value)

    def gone(self, decoder: str, key: Any) -> bool:
        if decoder == "cgroup_family" and self._cgroups is not None:
            return self._cgroups.gone(int(key.cgid))
        return super().gone(decoder, key)


class AccelIoctlSource(EbpfSource):
    probe = "accel_ioctl"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.globs = list(self.cfg.device_globs or specs.DEFAULT_DEVICE_GLOBS)
        self.prefixes = device_prefixes(self.globs)
        self._scanned: set[int] = set()
        self.fds_from_scan = 0

    def plan_extra(self, plan: Plan) -> None:
        """The loader writes the prefixes into accel_prefixes before it attaches the programs."""
        entries = []
        for i in range(specs.ACCEL_MAX_PREFIXES):
            if i < len(self.prefixes):
                words, masks = prefix_words(self.prefixes[i])
                entries.append([i, {"used": 1, "word": words, "mask": masks}])
            else:
                entries.append([i, {"used": 0}])
        plan.attach["map_init"] = {"accel_prefixes": entries}

    def after_attach(self) -> None:
        self.scan(only_new=False)

    def scan(self, only_new: bool) -> int:
        """Add (tgid, fd) of device files already open to accel_fds from <procfs>/<pid>/fd."""
        procfs = self.cfg.procfs
        table = self.table("accel_fds")
        added = 0
        try:
            pids = {int(p) for p in os.listdir(procfs) if p.isdigit()}
        except OSError:
            return 0
        for pid in (pids - self._scanned) if only_new else pids:
            fd_dir = f"{procfs}/{pid}/fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                if target.startswith("/") and any(fnmatch.fnmatchcase(target, g) for g in self.globs):
                    k = table.Key(pid, int(fd))
                    table[k] = ctypes.c_uint8(1)
                    added += 1
        self._scanned = pids
        self.fds_from_scan += added
        return added

    def collect(self, tier: str) -> list[Sample]:
        if tier == NEARLINE and self.handle is not None:
            self.scan(only_new=True)
        return super().collect(tier)

    def describe(self) -> dict:
        return {**super().describe(), "device_globs": self.globs, "kernel_prefixes": self.prefixes,
                "fds_found_in_proc": self.fds_from_scan}


def find_cuda_library(configured: str = "") -> str:
    """The configured libcuda if it exists, else the first of the usual paths, else ldconfig's ('' if none)."""
    if configured:
        return configured if os.path.exists(configured) else ""
    for path in specs.CUDA_LIBRARY_CANDIDATES:
        if os.path.exists(path):
            return path
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        if line.strip().startswith("libcuda.so.1 ") and "=>" in line:
            path = line.split("=>", 1)[1].strip()
            if os.path.exists(path):
                return path
    return ""


class CudaUprobeSource(EbpfSource):
    probe = "cuda_uprobe"

    def plan_extra(self, plan: Plan) -> None:
        lib = find_cuda_library(self.cfg.cuda_library)
        if not lib:
            where = self.cfg.cuda_library or ", ".join(specs.CUDA_LIBRARY_CANDIDATES[:2]) + ", ldconfig"
            raise Unavailable(f"cuda_uprobe: libcuda.so.1 not found ({where}): no NVIDIA driver on this host, "
                              f"or set [sources.ebpf] cuda_library to its path")
        plan.extra["library"] = lib
        plan.attach["uprobes"] = {"library": lib, "symbols": dict(specs.CUDA_SYMBOLS)}

    def describe(self) -> dict:
        d = super().describe()
        if self.plan_:
            d["library"] = self.plan_.extra.get("library")
        return d
