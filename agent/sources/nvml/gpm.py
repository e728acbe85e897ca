"""HBM (DRAM) bandwidth, SM, tensor and graphics engine utilisation from NVML GPM (GPU Performance
Monitoring), Hopper and newer only (nvmlGpmQueryDeviceSupport). A GPM metric is computed from two
samples: every realtime round takes one per GPU (or per MIG GPU instance) and asks for the metrics
over the interval since the previous one (GpmStream)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MIN_INTERVAL_S = 0.1

GRAPHICS_UTIL, DRAM_BW_UTIL, SM_UTIL, ANY_TENSOR_UTIL = 1, 10, 2, 5
NVLINK_TOTAL_RX, NVLINK_TOTAL_TX = 60, 61
# GPM metric id (pynvml NVML_GPM_METRIC_*) -> (metric name, scale to the reported unit, unit)
GPM_METRICS = {
    DRAM_BW_UTIL: ("xpusense.accelerator.hbm.bandwidth.utilization", 0.01, "1"),   # percent
    SM_UTIL: ("xpusense.accelerator.sm.utilization", 0.01, "1"),                   # percent
    ANY_TENSOR_UTIL: ("xpusense.accelerator.cube.utilization", 0.01, "1"),         # percent
    GRAPHICS_UTIL: ("xpusense.accelerator.graphics.utilization", 0.01, "1"),       # percent
}
GPM_NVLINK = {NVLINK_TOTAL_RX: "receive", NVLINK_TOTAL_TX: "transmit"}  # MiB/s


def supported(nv: Any, handle: Any) -> bool:
    """nvmlGpmQueryDeviceSupport; raises NVMLError when the query itself fails."""
    return bool(nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)


class GpmStream:
    """Consecutive GPM samples of one device (a GPU, or one GPU instance of a MIG GPU).

    What real drivers do, and what is done about it: samples under 100 ms apart give metrics that
    are invalid without any error (nvml.h: "should be greater than 100ms due to the internal sample
    refresh rate"; DCGM issue 310: "a hard limit"): a round that comes sooner takes no sample and
    reports nothing, the older sample waits for the next. Any failed sample or metrics call
    (Unknown, ResetRequired, NotSupported on a vGPU profile...) is no data for that device and round
    only, as in DCGM's GPM manager; both samples are dropped so the next pair starts afresh. A
    metric can come back NaN with a success code: the caller's range check drops it.

    `take(sample)` fills an allocated sample (nvmlGpmSampleGet or nvmlGpmMigSampleGet). Two samples
    are allocated once and take turns (the newer one is kept, the older one is filled next), and the
    metrics request is built once: a round makes two NVML calls per device, not four.
    """

    def __init__(self, nv: Any, take: Callable[[Any], Any], ids: list[int]):
        self.nv = nv
        self.take = take
        self.ids = ids
        self.prev: Any = None
        self.spare: Any = None   # the other allocated sample, filled next
        self.prev_t = 0.0
        self.too_soon = 0      # rounds that came under MIN_INTERVAL_S after the last sample
        self._mg: Any = None     # the nvmlGpmMetricsGet_t request, metric ids set once

    def read(self, now: float) -> list[tuple[int, int, float]] | None:
        """(metric id, NVML return code, value) per metric since the previous sample; None when there
        is nothing to report this round (the first sample, or too soon after the last one). Raises
        NVMLError when the sample or the metrics call fails (the stream then starts afresh)."""
        nv = self.nv
        if self.prev is not None and now - self.prev_t < MIN_INTERVAL_S:
            self.too_soon += 1
            return None
        sample, self.spare = self.spare, None
        if sample is None:
            sample = nv.nvmlGpmSampleAlloc()
        try:
            self.take(sample)
        except nv.NVMLError:
            nv.nvmlGpmSampleFree(sample)
            self.reset()
            raise
        prev, self.prev, self.prev_t = self.prev, sample, now
        if prev is None:
            return None
        self.spare = prev        # the older sample is filled again next round
        try:
            mg = self._request()
            mg.sample1, mg.sample2 = prev, sample
            nv.nvmlGpmMetricsGet(mg)
        except nv.NVMLError:
            self.reset()
            raise
        # pynvml's structures answer every attribute through a Python __getattribute__ (a bytes to
        # str conversion): the array is looked up once, and its numbers read with the plain one
        get = object.__getattribute__
        return [(get(m, "metricId"), get(m, "nvmlReturn"), get(m, "value")) for m in mg.metrics[:len(self.ids)]]

    def _request(self) -> Any:
        if self._mg is None:
            nv = self.nv
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = nv.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(self.ids)
            for i, mid in enumerate(self.ids):
                mg.metrics[i].metricId = mid
            self._mg = mg
        return self._mg

    def reset(self) -> None:
        """Both samples freed: the next pair starts afresh (after a failed call, or on close)."""
        for name in ("prev", "spare"):
            got = getattr(self, name)
            setattr(self, name, None)
            if got is not None:
                try:
                    self.nv.nvmlGpmSampleFree(got)
                except self.nv.NVMLError:
                    pass
