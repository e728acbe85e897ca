"""Per-process utilisation from NVML's per-process samples (ProcessUtilReader): each process's SM,
memory, encoder and decoder share since the last read of a device handle, the newest sample per pid,
at most `max_samples` processes per handle (the rest left out and counted)."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from typing import Any

from .library import SUCCESS, Unreadable, code, handle_key, has_function
from .processes import INSUFFICIENT_SIZE, pid_max, pid_problem

log = logging.getLogger("xpusense.agent.nvml")

NEWER = "nvmlDeviceGetProcessesUtilizationInfo"   # R550 and newer: a versioned struct, also JPEG and OFA
OLDER = "nvmlDeviceGetProcessUtilization"
ENGINES = ("sm", "memory", "encoder", "decoder")
NOT_FOUND, NOT_SUPPORTED = 6, 3
ROOM_TIMES = 16               # the handshake reads at most max_samples x this (a driver answering more is refused)
FIRST_WINDOW_US = 1_000_000   # a handle's first read asks for the last second (0 would be the driver's whole buffer)


class _Sample(ctypes.Structure):          # nvmlProcessUtilizationSample_t
    _fields_ = [("pid", ctypes.c_uint), ("timeStamp", ctypes.c_ulonglong), ("smUtil", ctypes.c_uint),
                ("memUtil", ctypes.c_uint), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint)]


class _Info(ctypes.Structure):            # nvmlProcessUtilizationInfo_v1_t
    _fields_ = [("timeStamp", ctypes.c_ulonglong), ("pid", ctypes.c_uint), ("smUtil", ctypes.c_uint),
                ("memUtil", ctypes.c_uint), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint),
                ("jpgUtil", ctypes.c_uint), ("ofaUtil", ctypes.c_uint)]


class _Infos(ctypes.Structure):           # nvmlProcessesUtilizationInfo_v1_t
    _fields_ = [("version", ctypes.c_uint), ("processSamplesCount", ctypes.c_uint),
                ("lastSeenTimeStamp", ctypes.c_ulonglong), ("procUtilArray", ctypes.POINTER(_Info))]


INFOS_V1 = ctypes.sizeof(_Infos) | (1 << 24)   # 0x1000018, as nvml.h's NVML_STRUCT_VERSION


@dataclasses.dataclass(frozen=True)
class ProcUtil:
    pid: int
    timestamp_us: int
    shares: tuple[float, float, float, float]   # ENGINES, 0..1 (NVML's percent / 100)


def share(percent: int) -> float:
    """NVML's percent as a ratio, at most 1."""
    return min(1.0, percent / 100.0)


class ProcessUtilReader:
    """One call per handle and round: into a buffer of `max_samples` entries made once, with the
    timestamp of the newest sample read before, so the driver answers only newer samples (NOT_FOUND:
    none, no value this round). A driver holding more takes the INSUFFICIENT_SIZE handshake: it says
    how many, they are read (up to ROOM_TIMES x `max_samples`), and the `max_samples` busiest kept. The newer call is
    preferred; the older where the driver lacks it or refuses it on a handle."""

    def __init__(self, nv: Any, max_samples: int, procfs: str = "/proc"):
        self.nv = nv
        self.max_samples = max_samples
        self.limit = pid_max(procfs)
        self.functions = [f for f in (NEWER, OLDER) if has_function(self.nv, f)]
        self.last_seen: dict[int, int] = {}    # handle -> timestamp (us) of the newest sample read from it
        self.older_only: set[int] = set()      # handles that refused the newer call
        self.over_bound = 0                    # reads that found more processes than max_samples
        self.left_out: dict[int, int] = {}     # handle -> processes left out for it, since the start
        self._infos = (_Info * max_samples)()
        self._samples = (_Sample * max_samples)()

    def describe(self) -> str:
        using = self.functions[0] if self.functions else "neither per-process utilisation call"
        return (f"{using}, {self.over_bound} read(s) over max_process_samples = {self.max_samples}, "
                f"{sum(self.left_out.values())} process(es) left out")

    def read(self, handle: Any) -> list[ProcUtil]:
        """The processes with a sample newer than the last read of `handle` (newest each); raises
        NVMLError when the driver refuses, Unreadable when it has neither call."""
        key = handle_key(handle)
        usable = [f for f in self.functions if not (f == NEWER and key in self.older_only)]
        if not usable:
            raise Unreadable(f"the driver has neither {NEWER} nor {OLDER}")
        since = self.last_seen.get(key) or time.time_ns() // 1000 - FIRST_WINDOW_US
        try:
            rows = self._call(usable[0], handle, since)
        except self.nv.NVMLError as e:
            if usable[0] != NEWER or len(usable) < 2 or code(e) != NOT_SUPPORTED:
                raise
            self.older_only.add(key)
            log.info("%s is not supported on a device: %s from now on", NEWER, OLDER)
            rows = self._call(OLDER, handle, since)
        if rows:
            self.last_seen[key] = max(ts for _, ts, _ in rows)
        newest: dict[int, ProcUtil] = {}
        for pid, ts, (sm, mem, enc, dec) in rows:
            if pid_problem(pid, self.limit) is None and (pid not in newest or ts > newest[pid].timestamp_us):
                newest[pid] = ProcUtil(pid, ts, (share(sm), share(mem), share(enc), share(dec)))
        out = list(newest.values())
        if len(out) > self.max_samples:
            self.over_bound += 1
            self.left_out[key] = self.left_out.get(key, 0) + len(out) - self.max_samples
            out.sort(key=lambda p: (-(p.shares[0] + p.shares[1]), p.pid))
            out = out[:self.max_samples]
        return sorted(out, key=lambda p: p.pid)

    def _call(self, function: str, handle: Any, since: int) -> list[tuple[int, int, tuple[int, int, int, int]]]:
        fn = self.nv._nvmlGetFunctionPointer(function)
        rc, n, buf = self._ask(function, fn, handle, since, self.max_samples)
        if rc == INSUFFICIENT_SIZE:          # more samples than the buffer: the size handshake
            if n <= self.max_samples or n > self.max_samples * ROOM_TIMES:   # not an answer to read
                log.warning("%s asked for room for %d samples (at most %d read): no samples this round",
                            function, n, self.max_samples * ROOM_TIMES)
                raise self.nv.NVMLError(rc)
            rc, n, buf = self._ask(function, fn, handle, since, n)
        if rc == NOT_FOUND:                  # no sample since `since`
            return []
        if rc != SUCCESS:
            raise self.nv.NVMLError(rc)
        return [(r.pid, r.timeStamp, (r.smUtil, r.memUtil, r.encUtil, r.decUtil)) for r in buf[:min(n, len(buf))]]

    def _ask(self, function: str, fn: Any, handle: Any, since: int, cap: int) -> tuple[int, int, Any]:
        """One call with room for `cap` samples: (return code, the count it answered, the buffer)."""
        if function == NEWER:
            buf: Any = self._infos if cap <= self.max_samples else (_Info * cap)()
            infos = _Infos(INFOS_V1, cap, since, ctypes.cast(buf, ctypes.POINTER(_Info)))
            rc = fn(handle, ctypes.byref(infos))
            return rc, infos.processSamplesCount, buf
        buf = self._samples if cap <= self.max_samples else (_Sample * cap)()
        count = ctypes.c_uint(cap)
        rc = fn(handle, buf, ctypes.byref(count), ctypes.c_ulonglong(since))
        return rc, count.value, buf
