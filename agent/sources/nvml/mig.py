"""MIG: the GPU instances of a MIG-enabled GPU, found through their MIG device handles (discover).
Instances are found again when MIG mode or the MIG layout changes."""

from __future__ import annotations

import dataclasses
from typing import Any

from .device import Gpu
from .gpm import GPM_METRICS, GpmStream
from .library import code

NOT_FOUND = 6


@dataclasses.dataclass
class MigInstance:
    """One GPU instance: its MIG device handles (one per compute instance) and its GPM stream."""
    gpu: Gpu
    gi: int
    handles: list[Any]
    name: str = ""
    gpm: GpmStream | None = None

    @property
    def id(self) -> str:
        """The accelerator id the HBM watch and process lists use: `gpu0/gi1`."""
        return f"{self.gpu.id}/gi{self.gi}"

    @property
    def labels(self) -> dict[str, str]:
        return {**self.gpu.labels, "mig_instance": str(self.gi)}


def discover(nv: Any, g: Gpu, with_gpm: bool) -> list[MigInstance]:
    """The GPU instances with compute instances, by GI id. Raises NVMLError when the GPU refuses.

    With MIG enabled, the whole-GPU handle answers aggregate calls (memory, processes, GPM) only to
    a caller with the MIG monitor capability (a container needs NVIDIA_MIG_MONITOR_DEVICES=all and
    CAP_SYS_ADMIN), and NO_PERMISSION otherwise, while each MIG device handle still answers for its
    own instance. So every instance is read through its own handle: memory and processes from the
    MIG device handle, GPM from nvmlGpmMigSampleGet(GPU, GI id), which works only for GPU instances
    that have a compute instance (the ones that have MIG device handles at all)."""
    found: dict[int, MigInstance] = {}
    for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(g.handle)):
        try:
            mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(g.handle, slot)
        except nv.NVMLError as e:
            if code(e) == NOT_FOUND:
                continue          # an empty slot
            raise
        gi = int(nv.nvmlDeviceGetGpuInstanceId(mh))
        if gi in found:
            found[gi].handles.append(mh)
            continue
        inst = found[gi] = MigInstance(g, gi, [mh])
        try:
            inst.name = nv.nvmlDeviceGetName(mh)
            inst.name = inst.name.decode() if isinstance(inst.name, bytes) else str(inst.name)
        except nv.NVMLError:
            pass
        if with_gpm:
            inst.gpm = GpmStream(nv, _mig_sampler(nv, g.handle, gi), list(GPM_METRICS))
    return [found[k] for k in sorted(found)]


def _mig_sampler(nv: Any, handle: Any, gi: int) -> Any:
    return lambda sample: nv.nvmlGpmMigSampleGet(handle, gi, sample)


def release(instances: list[MigInstance]) -> None:
    for inst in instances:
        if inst.gpm is not None:
            inst.gpm.reset()
