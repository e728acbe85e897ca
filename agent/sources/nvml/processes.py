"""The compute processes on a GPU, read right whatever the driver generation (ProcessReader), with
every pid checked (`pid_problem`) before anything uses it."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import struct
from typing import Any

from .library import SUCCESS, has_function

log = logging.getLogger("xpusense.agent.nvml")

INSUFFICIENT_SIZE = 7
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF        # usedGpuMemory when the driver cannot say (WDDM)
NO_INSTANCE = 0xFFFFFFFF                   # gpuInstanceId / computeInstanceId outside MIG
PID_MAX_LIMIT = 4194304                    # the kernel's ceiling for pid_max on 64-bit (include/linux/threads.h)
LAYOUTS = {16: "<I4xQ", 24: "<I4xQII", 32: "<I4xQIIQ"}


@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    used_bytes: int | None
    gpu_instance: int | None = None
    compute_instance: int | None = None


def pid_max(procfs: str = "/proc") -> int:
    try:
        with open(f"{procfs}/sys/kernel/pid_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return PID_MAX_LIMIT


def pid_problem(pid: Any, limit: int = PID_MAX_LIMIT) -> str | None:
    """Why a pid from a vendor library cannot be a process (None when it can)."""
    if not isinstance(pid, int) or isinstance(pid, bool):
        return f"{pid!r} is not an integer"
    if pid <= 0:
        return f"pid {pid}: 0 names the caller's own process group (a misread process list)"
    if pid > limit:
        return f"pid {pid} is above the kernel's pid_max {limit} (a misread process list)"
    return None


class ProcessReader:
    """Lists the compute processes of a device handle (a GPU or a MIG device).

    pynvml reads `nvmlDeviceGetComputeRunningProcesses_v3` as 24-byte entries, but drivers 535.43 to
    535.86 write 32-byte ones (nvml.h 12.2 added usedGpuCcProtectedMemory to nvmlProcessInfo_t) and
    older drivers lack `_v3` (then `_v2`, then the 16-byte v1 call). Read with pynvml, such a driver
    gives pids of 0 or 4294967295 after the first entry (nvitop issues 75 and 88, PR 89): pid 0
    signalled is the signaller's own process group. So the call is made here, into a buffer big
    enough for any entry size, the layout chosen the way nvitop chooses it (`_v3` with
    ConfComputeMemSizeInfo but without RunningProcessDetailList: 32 bytes) and confirmed by the pids
    it yields."""

    def __init__(self, nv: Any, procfs: str = "/proc"):
        self.nv = nv
        self.limit = pid_max(procfs)
        self.function, self.size = self._choose()
        self.dropped = 0

    def _choose(self) -> tuple[str, int]:
        base = "nvmlDeviceGetComputeRunningProcesses"

        def has(name: str) -> bool:
            return has_function(self.nv, name)
        if has(base + "_v3"):
            if has("nvmlDeviceGetConfComputeMemSizeInfo") and not has("nvmlDeviceGetRunningProcessDetailList"):
                return base + "_v3", 32      # R535.43-535.86
            return base + "_v3", 24
        if has(base + "_v2"):
            return base + "_v2", 24
        return base, 16

    def describe(self) -> str:
        return f"{self.function} ({self.size}-byte entries)"

    def read(self, handle: Any) -> list[Proc]:
        """Processes with plausible pids; raises NVMLError when the driver refuses."""
        raw = self._call(handle)
        procs = self._parse(raw, self.size)
        bad = [p for p in procs if pid_problem(p.pid, self.limit)]
        if bad and self.function.endswith("_v3"):
            other = 32 if self.size == 24 else 24
            alt = self._parse(raw, other)
            if not any(pid_problem(p.pid, self.limit) for p in alt):
                log.warning("%s answered %d-byte entries, not %d: reading them so from now on",
                            self.function, other, self.size)
                self.size, procs, bad = other, alt, []
        if bad:
            self.dropped += len(bad)
            log.warning("NVML listed %d process(es) with impossible pids, left out: %s",
                        len(bad), "; ".join(str(pid_problem(p.pid, self.limit)) for p in bad))
        return [p for p in procs if not pid_problem(p.pid, self.limit)]

    def _call(self, handle: Any) -> tuple[bytes, int]:
        nv = self.nv
        fn = nv._nvmlGetFunctionPointer(self.function)   # NVMLError_FunctionNotFound if absent
        count = ctypes.c_uint(0)
        rc = fn(handle, ctypes.byref(count), None)
        if rc == SUCCESS:
            return b"", 0
        if rc != INSUFFICIENT_SIZE:
            raise nv.NVMLError(rc)
        cap = count.value * 2 + 5                         # room for processes started meanwhile
        buf = (ctypes.c_ubyte * (cap * max(LAYOUTS)))()   # room for the largest entry any driver writes
        count = ctypes.c_uint(cap)
        rc = fn(handle, ctypes.byref(count), buf)
        if rc != SUCCESS:
            raise nv.NVMLError(rc)
        return bytes(buf), count.value

    @staticmethod
    def _parse(raw: tuple[bytes, int], size: int) -> list[Proc]:
        buf, n = raw
        out = []
        for i in range(n):
            f = struct.unpack_from(LAYOUTS[size], buf, i * size)
            used = None if f[1] == NOT_AVAILABLE else f[1]
            gi = f[2] if len(f) > 2 and f[2] != NO_INSTANCE else None
            ci = f[3] if len(f) > 3 and f[3] != NO_INSTANCE else None
            out.append(Proc(f[0], used, gi, ci))
        return out

