"""Every family of sources the agent can run, in the order they are set up (host first).

A source module declares its `[sources.NAME]` keys and how it is built as `FAMILY` (a
`SourceFamily`, base.py); adding a source means writing that module and adding it here. The
agent's config schema (agent/config.py) and the daemon (agent/daemon.py) loop over this list.
"""

from __future__ import annotations

from .base import SourceFamily
from .ebpf.family import FAMILY as EBPF
from .host import FAMILY as HOST
from .npu_smi.source import FAMILY as NPU_SMI
from .nvml.source import FAMILY as NVML

FAMILIES: tuple[SourceFamily, ...] = (HOST, NVML, EBPF, NPU_SMI)
