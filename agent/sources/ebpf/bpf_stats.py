"""bpf_stats: the kernel counting run_cnt and run_time_ns of every BPF program, on while the agent runs.

The bpf(BPF_ENABLE_STATS) syscall (Linux 5.8+) turns it on for as long as the returned fd is open,
so a crashed agent leaves nothing switched on. Where that fails, the kernel.bpf_stats_enabled sysctl
is set to 1 and put back to 0 at the end (unless it was 1 already). The figures themselves are read
per program with BPF_OBJ_GET_INFO_BY_FD (bpfmap.ProgStats).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("xpusense.agent.sources.ebpf")

# The bpf syscall's number per machine (no libc wrapper exists for it).
BPF_SYSCALL_NR = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
BPF_ENABLE_STATS, BPF_STATS_RUN_TIME = 32, 0


class BpfStats:
    """Turns bpf_stats on (enable) and back off (disable); `state` says how, or why it is off."""

    def __init__(self, procfs: str = "/proc"):
        self.sysctl = os.path.join(procfs, "sys/kernel/bpf_stats_enabled")
        self.state = "off"
        self._fd: int | None = None
        self._sysctl_restore = False

    @property
    def on(self) -> bool:
        return self.state.startswith("on")

    def enable(self) -> None:
        if self.on:
            return
        nr = BPF_SYSCALL_NR.get(platform.machine())
        if nr is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            attr = ctypes.c_uint32(BPF_STATS_RUN_TIME)
            fd = libc.syscall(ctypes.c_long(nr), ctypes.c_int(BPF_ENABLE_STATS), ctypes.byref(attr),
                              ctypes.c_uint(ctypes.sizeof(attr)))
            if fd >= 0:
                self._fd = fd
                self.state = "on (BPF_ENABLE_STATS, released when the agent stops)"
                return
            why = os.strerror(ctypes.get_errno())
        else:
            why = f"no bpf syscall number known for {platform.machine()}"
        try:
            with open(self.sysctl) as f:
                if f.read().strip() == "1":
                    self.state = "on (kernel.bpf_stats_enabled already 1)"
                    return
            with open(self.sysctl, "w") as f:
                f.write("1")
            self._sysctl_restore = True
            self.state = "on (kernel.bpf_stats_enabled=1 while running)"
        except OSError as e:
            self.state = (f"off: BPF_ENABLE_STATS failed ({why}) and {self.sysctl} is not writable ({e}); "
                          f"probe cost metrics are not reported")
            log.warning("eBPF cost metrics unavailable: %s", self.state)

    def disable(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._sysctl_restore:
            try:
                with open(self.sysctl, "w") as f:
                    f.write("0")
            except OSError:
                pass
            self._sysctl_restore = False
        self.state = "off"
