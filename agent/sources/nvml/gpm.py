"""HBM (DRAM) bandwidth, SM and tensor utilisation from NVML GPM (GPU Performance Monitoring).

GPM metrics come from two samples: each round takes one and computes the metrics over the interval
since the previous one. Hopper and newer only (nvmlGpmQueryDeviceSupport).
"""

from __future__ import annotations

from typing import Any

from ..base import Sample
from .device import Gpu

# GPM metric id (pynvml NVML_GPM_METRIC_*) -> (metric name, scale to the reported unit, unit)
GPM_METRICS = {
    10: ("xpusense.accelerator.hbm.bandwidth.utilization", 0.01, "1"),   # DRAM_BW_UTIL, percent
    2: ("xpusense.accelerator.sm.utilization", 0.01, "1"),               # SM_UTIL, percent
    5: ("xpusense.accelerator.cube.utilization", 0.01, "1"),             # ANY_TENSOR_UTIL, percent
}
GPM_NVLINK = {60: "receive", 61: "transmit"}  # NVLINK_TOTAL_RX/TX_PER_SEC, MiB/s


def check_support(nv: Any, g: Gpu) -> None:
    """Set g.gpm, and g.gpm_reason when GPM cannot be used."""
    try:
        g.gpm = bool(nv.nvmlGpmQueryDeviceSupport(g.handle).isSupportedDevice)
        if not g.gpm:
            g.gpm_reason = (f"GPM is not supported on {g.name} (Hopper or newer needed); "
                            f"the memory-controller busy share is reported instead under "
                            f"xpusense.accelerator.memory_controller.utilization")
    except nv.NVMLError as e:
        g.gpm_reason = f"GPM query failed: {e}"


def metrics(nv: Any, g: Gpu, nvlink_rates: bool) -> tuple[list[Sample], dict[int, int]]:
    """Take this round's sample and return the metrics since the previous one, and per-metric
    errors (metric id -> NVML return code). Raises NVMLError when the sample cannot be taken."""
    sample = nv.nvmlGpmSampleAlloc()
    try:
        nv.nvmlGpmSampleGet(g.handle, sample)
    except nv.NVMLError:
        nv.nvmlGpmSampleFree(sample)
        raise
    prev, g.gpm_prev = g.gpm_prev, sample
    if prev is None:
        return [], {}  # GPM metrics need two samples: from the next round on
    ids = list(GPM_METRICS) + ([] if g.nvlinks == 0 else list(GPM_NVLINK))
    try:
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.sample1, mg.sample2 = prev, sample
        mg.numMetrics = len(ids)
        for i, mid in enumerate(ids):
            mg.metrics[i].metricId = mid
        nv.nvmlGpmMetricsGet(mg)
    finally:
        nv.nvmlGpmSampleFree(prev)
    out, errors = [], {}
    for i in range(len(ids)):
        m = mg.metrics[i]
        if m.nvmlReturn != nv.NVML_SUCCESS:
            errors[m.metricId] = m.nvmlReturn
            continue
        if m.metricId in GPM_METRICS:
            name, scale, unit = GPM_METRICS[m.metricId]
            out.append(Sample(name, m.value * scale, unit, dict(g.labels)))
        elif m.metricId in GPM_NVLINK and nvlink_rates:
            # Counters from field values are preferred; GPM rates stand in where they fail.
            out.append(Sample("xpusense.accelerator.interconnect.throughput", m.value * 2**20, "By/s",
                              {**g.labels, "link_type": "NVLink", "direction": GPM_NVLINK[m.metricId]}))
    return out, errors


def free(nv: Any, g: Gpu) -> None:
    if g.gpm_prev is not None:
        try:
            nv.nvmlGpmSampleFree(g.gpm_prev)
        except nv.NVMLError:
            pass
        g.gpm_prev = None
