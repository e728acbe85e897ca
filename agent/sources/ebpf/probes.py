"""The tracepoint and uprobe probes: runqlat, blkio, netio, accel_ioctl, cuda_uprobe.

runqlat and netio are their specs and nothing more; blkio names disks; accel_ioctl fills the device
path prefixes its programs match and adds device files opened before it attached; cuda_uprobe finds
libcuda and attaches one uprobe per exported driver-API symbol. (tc_traffic is in tc.py.)
"""

from __future__ import annotations

import ctypes
import fnmatch
import logging
import os
import subprocess
from typing import Any

from xpusense.probes import specs

from ..base import NEARLINE, Sample, Unavailable
from .loader import EbpfLoader, Plan
from .procfs import DiskNames, device_prefixes, prefix_words
from .source import EbpfSource

log = logging.getLogger("xpusense.agent.sources.ebpf")

DIRECTIONS_DISK = ("read", "write", "discard", "flush")


class RunqlatSource(EbpfSource):
    probe = "runqlat"


class BlkioSource(EbpfSource):
    probe = "blkio"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.disks = DiskNames(self.cfg.sysfs)

    def key_labels(self, decoder: str, key: Any, value: Any) -> dict[str, str] | None:
        if decoder == "disk":
            d = int(key.dir)
            return {"device": self.disks.name(int(key.dev)),
                    "direction": DIRECTIONS_DISK[d] if d < len(DIRECTIONS_DISK) else str(d)}
        return super().key_labels(decoder, key, value)


class NetioSource(EbpfSource):
    probe = "netio"


class AccelIoctlSource(EbpfSource):
    probe = "accel_ioctl"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.globs = list(self.cfg.device_globs or specs.DEFAULT_DEVICE_GLOBS)
        self.prefixes = device_prefixes(self.globs)
        self._scanned: set[int] = set()
        self.fds_from_scan = 0

    def before_attach(self) -> None:
        t = self.table("accel_prefixes")
        for i in range(specs.ACCEL_MAX_PREFIXES):
            v = t.Leaf()
            if i < len(self.prefixes):
                words, masks = prefix_words(self.prefixes[i])
                v.used = 1
                for w in range(len(words)):
                    v.word[w], v.mask[w] = words[w], masks[w]
            t[ctypes.c_int(i)] = v

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
        if tier == NEARLINE and self.bpf is not None:
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

    def attach(self) -> None:
        from bcc import BPF
        lib = self.planned.extra["library"]
        try:
            found = BPF.get_user_functions_and_addresses(lib.encode(), b"^cu")
        except Exception as e:
            raise Unavailable(f"cuda_uprobe: cannot read the symbols of {lib}: {e}") from e
        addr_of: dict[str, int] = {}
        for name, addr in found:
            name = name.decode() if isinstance(name, bytes) else name
            addr_of.setdefault(name, addr)
        seen_addr = set()
        for sym, fn in specs.CUDA_SYMBOLS.items():
            addr = addr_of.get(sym)
            if addr is None or addr in seen_addr:    # absent, or an alias of one already probed
                continue
            self._load(fn, "KPROBE")
            try:
                self.bpf.attach_uprobe(name=lib.encode(), sym=sym.encode(), fn_name=fn.encode())
            except Exception as e:
                raise Unavailable(f"cuda_uprobe: could not attach a uprobe to {sym} in {lib}: {e}") from e
            seen_addr.add(addr)
            self._attached.append(("uprobe", sym))
        if not self._attached:
            raise Unavailable(f"cuda_uprobe: {lib} exports none of {', '.join(list(specs.CUDA_SYMBOLS)[:4])}...: "
                              f"is it libcuda (the driver library)? set [sources.ebpf] cuda_library")

    def detach(self) -> None:
        lib = self.plan_.extra.get("library") if self.plan_ else None
        for kind, target in reversed(self._attached):
            try:
                if kind == "uprobe" and lib:
                    self.bpf.detach_uprobe(name=lib.encode(), sym=target.encode())
            except Exception:
                log.debug("%s: detaching uprobe %s failed", self.name, target, exc_info=True)
        self._attached.clear()

    def describe(self) -> dict:
        d = super().describe()
        if self.plan_:
            d["library"] = self.plan_.extra.get("library")
        return d
