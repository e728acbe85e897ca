"""This process's capabilities (CapEff in /proc/self/status) and whether it may load eBPF programs.

Imports nothing but os: `xpusense-agent run` asks it before its own imports (loader_process.start_early).
"""

from __future__ import annotations

import os


def read_cap_eff(procfs: str = "/proc") -> int:
    """This process's effective capability bits (CapEff in <procfs>/self/status; 0 if unreadable)."""
    try:
        with open(f"{procfs}/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 12, 21, 38, 39


def bpf_capable(procfs: str = "/proc") -> bool:
    """Whether this process may load eBPF programs: root, CAP_SYS_ADMIN, or CAP_BPF and CAP_PERFMON."""
    if os.geteuid() == 0:
        return True
    caps = read_cap_eff(procfs)
    need = (1 << CAP_BPF) | (1 << CAP_PERFMON)
    return caps & need == need or bool(caps & (1 << CAP_SYS_ADMIN))
