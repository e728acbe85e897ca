"""NVIDIA GPUs through NVML (nvidia-ml-py): utilisation, HBM bandwidth (GPM), memory, NVLink,
PCIe, clocks, processes, power, energy, temperatures, throttling, ECC, XID events, inventory.

pynvml finds `libnvidia-ml.so.1` through the dynamic loader, so a test puts a fake one on
LD_LIBRARY_PATH and pynvml's real ctypes code runs. The simple per-device readings are data
(`FIELDS`: metric, unit, tier, NVML call, conversion); GPM, NVLink counters, throttle reasons,
remapped rows, MIG, processes and events need code of their own below.

Failure rules: no library or driver -> Unavailable with the reason; a reading NotSupported on a
GPU -> that reading is absent there, said once (log and `describe()`); a GPU lost mid-run
(GPU_IS_LOST) -> one critical health event, that GPU is left out, the others go on.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import tomllib
from importlib import resources
from typing import Any, Callable

from .base import COUNTER, GAUGE, NEARLINE, OFFLINE, REALTIME, Event, Sample, Source, Unavailable

log = logging.getLogger("xpusense.agent.nvml")

VENDOR = "nvidia"
ALL_LINKS = 0xFFFFFFFF  # scopeId for "summed over all NVLink links" (nvml.h)

# GPM metric ids (pynvml NVML_GPM_METRIC_*): id -> (metric name, scale to the reported unit, unit)
GPM_METRICS = {
    10: ("xpusense.accelerator.hbm.bandwidth.utilization", 0.01, "1"),   # DRAM_BW_UTIL, percent
    2: ("xpusense.accelerator.sm.utilization", 0.01, "1"),               # SM_UTIL, percent
    5: ("xpusense.accelerator.cube.utilization", 0.01, "1"),             # ANY_TENSOR_UTIL, percent
}
GPM_NVLINK = {60: "receive", 61: "transmit"}  # NVLINK_TOTAL_RX/TX_PER_SEC, MiB/s

THROTTLE_REASONS = {  # nvmlClocksEventReason* bits
    0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
}

XID_EVENT, DBE_EVENT, SBE_EVENT = 0x8, 0x2, 0x1
GPU_UNAVAILABLE_EVENT, GPU_RECOVERY_EVENT = 0x4000, 0x8000
WATCHED_EVENTS = XID_EVENT | DBE_EVENT | GPU_UNAVAILABLE_EVENT | GPU_RECOVERY_EVENT


@dataclasses.dataclass(frozen=True)
class Field:
    """One reading: `call` names an NVML call in CALLS (made once per device and round)."""
    name: str
    unit: str
    tier: str
    call: str
    convert: Callable[[Any], float]
    kind: str = GAUGE
    labels: tuple[tuple[str, str], ...] = ()


def _calls(nv) -> dict[str, Callable]:
    return {
        "utilization": nv.nvmlDeviceGetUtilizationRates,
        "memory": nv.nvmlDeviceGetMemoryInfo,
        "pcie_tx": lambda h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES),
        "pcie_rx": lambda h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES),
        "clock_sm": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "clock_mem": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
        "power": nv.nvmlDeviceGetPowerUsage,
        "power_limit": nv.nvmlDeviceGetEnforcedPowerLimit,
        "energy": nv.nvmlDeviceGetTotalEnergyConsumption,
        "temperature": lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "ecc_corrected": lambda h: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
        "ecc_uncorrected": lambda h: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
        "remapped_rows": nv.nvmlDeviceGetRemappedRows,
        "throttle": nv.nvmlDeviceGetCurrentClocksEventReasons,
        "hbm_temperature": lambda h: _field(nv, h, nv.NVML_FI_DEV_MEMORY_TEMP),
        "nvlink": lambda h: _fields(nv, h, [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
                                           (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS)]),
        "processes": nv.nvmlDeviceGetComputeRunningProcesses,
    }


FIELDS = [
    Field("hw.gpu.utilization", "1", REALTIME, "utilization", lambda u: u.gpu / 100.0),
    # Memory-controller busy time: NOT bandwidth (shared/reference/nvml.md section 5).
    Field("xpusense.accelerator.memory_controller.utilization", "1", REALTIME, "utilization",
          lambda u: u.memory / 100.0),
    Field("hw.gpu.memory.usage", "By", REALTIME, "memory", lambda m: float(m.used)),
    Field("hw.gpu.memory.limit", "By", REALTIME, "memory", lambda m: float(m.total)),
    Field("xpusense.accelerator.memory.free", "By", REALTIME, "memory", lambda m: float(m.free)),
    Field("hw.gpu.memory.utilization", "1", REALTIME, "memory", lambda m: m.used / m.total if m.total else 0.0),
    Field("xpusense.accelerator.pcie.throughput", "By/s", NEARLINE, "pcie_tx", lambda kb: kb * 1000.0,
          labels=(("direction", "transmit"),)),
    Field("xpusense.accelerator.pcie.throughput", "By/s", NEARLINE, "pcie_rx", lambda kb: kb * 1000.0,
          labels=(("direction", "receive"),)),
    Field("xpusense.accelerator.clock.frequency", "Hz", NEARLINE, "clock_sm", lambda mhz: mhz * 1e6,
          labels=(("clock", "sm"),)),
    Field("xpusense.accelerator.clock.frequency", "Hz", NEARLINE, "clock_mem", lambda mhz: mhz * 1e6,
          labels=(("clock", "memory"),)),
    Field("hw.power", "W", OFFLINE, "power", lambda mw: mw / 1000.0),
    Field("xpusense.accelerator.power.limit", "W", OFFLINE, "power_limit", lambda mw: mw / 1000.0),
    Field("hw.energy", "J", OFFLINE, "energy", lambda mj: mj / 1000.0, COUNTER),
    Field("hw.temperature", "Cel", OFFLINE, "temperature", float, labels=(("sensor", "chip"),)),
    Field("hw.temperature", "Cel", OFFLINE, "hbm_temperature", float, labels=(("sensor", "hbm"),)),
    Field("xpusense.accelerator.ecc.errors", "{error}", OFFLINE, "ecc_corrected", float, COUNTER,
          (("type", "corrected"),)),
    Field("xpusense.accelerator.ecc.errors", "{error}", OFFLINE, "ecc_uncorrected", float, COUNTER,
          (("type", "uncorrected"),)),
]


def _fields(nv, handle, ids):
    vals = nv.nvmlDeviceGetFieldValues(handle, ids)
    out = []
    for v in vals:
        if v.nvmlReturn != nv.NVML_SUCCESS:
            raise nv.NVMLError(v.nvmlReturn)
        out.append((v.timestamp, _field_value(nv, v)))
    return out


def _field(nv, handle, fid):
    return _fields(nv, handle, [fid])[0][1]


def _field_value(nv, v):
    t = v.valueType
    if t == nv.NVML_VALUE_TYPE_DOUBLE:
        return v.value.dVal
    if t == nv.NVML_VALUE_TYPE_UNSIGNED_INT:
        return v.value.uiVal
    if t == nv.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return v.value.ulVal
    if t == nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return v.value.sllVal
    if t == getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", -1):
        return v.value.siVal
    return v.value.ullVal


def load_catalog() -> dict:
    with resources.files("xpusense.agent").joinpath("catalog/nvidia.toml").open("rb") as f:
        return tomllib.load(f)


def catalog_entry(catalog: dict, name: str) -> dict:
    for entry in catalog.get("gpu", []):
        if entry["match"] in name:
            return entry
    return {}


def nvlink_bandwidth(catalog: dict, arch: int | None, links: int) -> str:
    gen = catalog.get("nvlink", {}).get("generation", {}).get(str(arch))
    if not gen or not links:
        return ""
    return f"{links * gen['per_link_gbs']}GB/s"


def model_name(nvml_name: str) -> str:
    """'NVIDIA A100-SXM4-40GB' -> 'A100-SXM4-40GB' (the inventory schema's style)."""
    name = nvml_name.removeprefix("NVIDIA ").strip()
    return "-".join(name.split())


class Gpu:
    """What the source keeps per GPU between rounds."""

    def __init__(self, index: int, handle):
        self.index = index
        self.handle = handle
        self.id = f"gpu{index}"
        self.labels = {"device": self.id, "vendor": VENDOR}
        self.name = ""
        self.arch: int | None = None
        self.lost = False
        self.gpm = False
        self.gpm_reason = ""
        self.gpm_prev = None          # the previous GPM sample
        self.info: dict[str, str] = {}
        self.nvlinks = 0
        self.mig = False
        self.busy_s = 0.0             # utilisation x seconds since the last offline round
        self.busy_span_s = 0.0
        self.last_util_t: float | None = None
        self.energy_prev: tuple[float, float] | None = None  # (monotonic s, J)
        self.peak_tflops = 0.0


class NvmlSource(Source):
    name = "nvml"
    tiers = (REALTIME, NEARLINE, OFFLINE)

    def __init__(self, events: bool = True, event_wait_ms: int = 500, gpm: bool = True):
        self.want_events = events
        self.event_wait_ms = event_wait_ms
        self.want_gpm = gpm
        self.nv = None
        self.gpus: list[Gpu] = []
        self.unsupported: dict[tuple[str, str], str] = {}   # (device, reading) -> why
        self.driver = ""
        self.nvml_version = ""
        self.catalog: dict = {}
        self._calls: dict[str, Callable] = {}
        self._events: "queue.Queue[Event]" = queue.Queue()
        self._event_set = None
        self._event_thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        try:
            import pynvml as nv
        except ImportError as e:
            raise Unavailable(f"nvidia-ml-py is not installed ({e}); pip install nvidia-ml-py") from e
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            code = getattr(e, "value", None)
            if code == nv.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise Unavailable("libnvidia-ml.so.1 not found: no NVIDIA driver on this host "
                                  "(install the driver, or put the library on LD_LIBRARY_PATH)") from None
            if code == nv.NVML_ERROR_DRIVER_NOT_LOADED:
                raise Unavailable("the NVIDIA kernel driver is not loaded (modprobe nvidia; check dmesg)") from None
            if code == nv.NVML_ERROR_NO_PERMISSION:
                raise Unavailable("no permission to open the NVIDIA devices (/dev/nvidia*)") from None
            raise Unavailable(f"nvmlInit failed: {e}") from None
        self.nv = nv
        self._calls = _calls(nv)
        self.catalog = load_catalog()
        try:
            self.driver = _text(nv.nvmlSystemGetDriverVersion())
            self.nvml_version = _text(nv.nvmlSystemGetNVMLVersion())
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as e:
            nv.nvmlShutdown()
            raise Unavailable(f"NVML answered nvmlInit but not the device count: {e}") from None
        if count == 0:
            nv.nvmlShutdown()
            raise Unavailable("NVML found no NVIDIA GPU on this host")
        for i in range(count):
            try:
                gpu = Gpu(i, nv.nvmlDeviceGetHandleByIndex(i))
                self._discover(gpu)
            except nv.NVMLError as e:
                gpu = Gpu(i, None)
                gpu.lost = True
                log.warning("GPU %d: cannot be opened: %s", i, e)
                self._events.put(self._health_event(gpu, f"GPU {i} cannot be opened at start: {e}"))
            self.gpus.append(gpu)
        if self.want_events:
            self._start_events()

    def _discover(self, g: Gpu) -> None:
        nv, h = self.nv, g.handle
        g.name = _text(nv.nvmlDeviceGetName(h))
        g.info["uuid"] = _text(nv.nvmlDeviceGetUUID(h))
        g.info["pci_bus_id"] = _text(nv.nvmlDeviceGetPciInfo(h).busId)
        g.info["driver"] = self.driver
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        g.info["memory"] = f"{round(mem.total / 2**30)}GB"
        g.info["compute_capability"] = self._try(g, "compute_capability",
                                                 lambda: "%d.%d" % nv.nvmlDeviceGetCudaComputeCapability(h)) or ""
        g.arch = self._try(g, "architecture", lambda: nv.nvmlDeviceGetArchitecture(h))
        mig = self._try(g, "mig_mode", lambda: nv.nvmlDeviceGetMigMode(h))
        g.mig = bool(mig and mig[0] == nv.NVML_DEVICE_MIG_ENABLE)
        g.info["mig_mode"] = "enabled" if g.mig else ("disabled" if mig is not None else "unsupported")
        g.nvlinks = self._count_nvlinks(g)
        g.info["nvlink_count"] = str(g.nvlinks)
        entry = catalog_entry(self.catalog, g.name)
        g.peak_tflops = float(entry.get("peak_tflops", 0.0))
        if entry.get("architecture"):
            g.info["architecture"] = entry["architecture"]
        if self.want_gpm:
            self._check_gpm(g)
        else:
            g.gpm_reason = "GPM switched off in config ([sources.nvml] gpm = false)"
        if not g.gpm:
            self.unsupported[(g.id, "hbm_bandwidth")] = g.gpm_reason
            log.info("%s (%s): no HBM bandwidth utilisation: %s", g.id, g.name, g.gpm_reason)

    def _check_gpm(self, g: Gpu) -> None:
        nv = self.nv
        try:
            support = nv.nvmlGpmQueryDeviceSupport(g.handle)
            g.gpm = bool(support.isSupportedDevice)
            if not g.gpm:
                g.gpm_reason = (f"GPM is not supported on {g.name} (Hopper or newer needed); "
                                f"the memory-controller busy share is reported instead under "
                                f"xpusense.accelerator.memory_controller.utilization")
        except nv.NVMLError as e:
            g.gpm_reason = f"GPM query failed: {e}"

    def _count_nvlinks(self, g: Gpu) -> int:
        nv = self.nv
        active = 0
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(g.handle, link) == nv.NVML_FEATURE_ENABLED:
                    active += 1
            except nv.NVMLError:
                break  # NotSupported / InvalidArgument past the last link
        return active

    def _try(self, g: Gpu, what: str, fn: Callable[[], Any]):
        nv = self.nv
        try:
            return fn()
        except nv.NVMLError as e:
            if getattr(e, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                raise
            self._note_unsupported(g, what, e)
            return None

    def _note_unsupported(self, g: Gpu, what: str, e: Exception) -> None:
        key = (g.id, what)
        if key not in self.unsupported:
            self.unsupported[key] = str(e)
            log.info("%s (%s): %s unavailable: %s", g.id, g.name, what, e)

    # -- rounds --------------------------------------------------------------------------------------
    def collect(self, tier: str) -> list[Sample]:
        out: list[Sample] = []
        for g in self.gpus:
            if g.lost:
                continue
            try:
                out += self._collect_gpu(g, tier)
            except self.nv.NVMLError as e:
                if getattr(e, "value", None) == self.nv.NVML_ERROR_GPU_IS_LOST:
                    self._lose(g, str(e))
                else:
                    raise
        if tier == OFFLINE:
            out += [Sample("xpusense.accelerator.health", 0.0 if g.lost else 1.0, "1",
                           {**g.labels, "status": "lost" if g.lost else "ok"}) for g in self.gpus]
        return out

    def _lose(self, g: Gpu, why: str) -> None:
        g.lost = True
        log.error("%s (%s) is lost: %s; the other GPUs go on", g.id, g.name, why)
        self._events.put(self._health_event(g, f"{g.id} ({g.name}, {g.info.get('pci_bus_id', '?')}) "
                                               f"is lost (GPU_IS_LOST: fell off the bus or the driver "
                                               f"gave up on it): {why}"))

    def _health_event(self, g: Gpu, message: str) -> Event:
        return Event("health", message, "critical", g.id,
                     {"vendor": VENDOR, "status": "lost", "uuid": g.info.get("uuid", ""),
                      "pci_bus_id": g.info.get("pci_bus_id", "")}, time.time_ns())

    def _collect_gpu(self, g: Gpu, tier: str) -> list[Sample]:
        cache: dict[str, Any] = {}
        out = []
        for f in FIELDS:
            if f.tier != tier or (g.id, f.call) in self.unsupported:
                continue
            if f.call not in cache:
                cache[f.call] = self._try(g, f.call, lambda c=f.call: self._calls[c](g.handle))
            raw = cache[f.call]
            if raw is None:
                continue
            out.append(Sample(f.name, f.convert(raw), f.unit, {**g.labels, **dict(f.labels)}, f.kind))
        if tier == REALTIME:
            if "utilization" in cache and cache["utilization"] is not None:
                self._accumulate_busy(g, cache["utilization"].gpu / 100.0)
            out += self._gpm(g)
            out += self._nvlink(g)
            if g.mig:
                out += self._mig(g)
        elif tier == OFFLINE:
            out += self._throttle(g)
            out += self._remapped(g)
            out += self._efficiency(g, cache.get("energy"))
        elif tier == NEARLINE:
            out += self._process_samples(g)
        return out

    def _gpm(self, g: Gpu) -> list[Sample]:
        if not g.gpm:
            return []
        nv = self.nv
        sample = nv.nvmlGpmSampleAlloc()
        try:
            nv.nvmlGpmSampleGet(g.handle, sample)
        except nv.NVMLError:
            nv.nvmlGpmSampleFree(sample)
            raise
        prev, g.gpm_prev = g.gpm_prev, sample
        if prev is None:
            return []  # GPM metrics need two samples: from the next round on
        try:
            mg = nv.c_nvmlGpmMetricsGet_t()
            mg.version = nv.NVML_GPM_METRICS_GET_VERSION
            mg.sample1, mg.sample2 = prev, sample
            ids = list(GPM_METRICS) + ([] if g.nvlinks == 0 else list(GPM_NVLINK))
            mg.numMetrics = len(ids)
            for i, mid in enumerate(ids):
                mg.metrics[i].metricId = mid
            nv.nvmlGpmMetricsGet(mg)
        finally:
            nv.nvmlGpmSampleFree(prev)
        out = []
        for i in range(len(ids)):
            m = mg.metrics[i]
            if m.nvmlReturn != nv.NVML_SUCCESS:
                self._note_unsupported(g, f"gpm_metric_{m.metricId}", nv.NVMLError(m.nvmlReturn))
                continue
            if m.metricId in GPM_METRICS:
                name, scale, unit = GPM_METRICS[m.metricId]
                out.append(Sample(name, m.value * scale, unit, dict(g.labels)))
            elif m.metricId in GPM_NVLINK and (g.id, "nvlink") in self.unsupported:
                # Counters from field values are preferred; GPM rates stand in where they fail.
                out.append(Sample("xpusense.accelerator.interconnect.throughput", m.value * 2**20, "By/s",
                                  {**g.labels, "link_type": "NVLink", "direction": GPM_NVLINK[m.metricId]}))
        return out

    def _nvlink(self, g: Gpu) -> list[Sample]:
        if g.nvlinks == 0 or (g.id, "nvlink") in self.unsupported:
            return []
        vals = self._try(g, "nvlink", lambda: self._calls["nvlink"](g.handle))
        if vals is None:
            return []
        (_, rx_kib), (_, tx_kib) = vals
        return [Sample("xpusense.accelerator.interconnect.io", float(v) * 1024, "By",
                       {**g.labels, "link_type": "NVLink", "direction": d}, COUNTER)
                for d, v in (("receive", rx_kib), ("transmit", tx_kib))]

    def _mig(self, g: Gpu) -> list[Sample]:
        nv = self.nv
        out = []
        count = self._try(g, "mig_devices", lambda: nv.nvmlDeviceGetMaxMigDeviceCount(g.handle)) or 0
        for i in range(count):
            try:
                mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(g.handle, i)
            except nv.NVMLError:
                continue  # an empty slot
            gi = self._try(g, "mig_instance_id", lambda: nv.nvmlDeviceGetGpuInstanceId(mh))
            mem = self._try(g, "mig_memory", lambda: nv.nvmlDeviceGetMemoryInfo(mh))
            if mem is None:
                continue
            labels = {**g.labels, "mig_instance": str(gi if gi is not None else i)}
            out.append(Sample("hw.gpu.memory.usage", float(mem.used), "By", labels))
            out.append(Sample("hw.gpu.memory.limit", float(mem.total), "By", dict(labels)))
        out.append(Sample("xpusense.accelerator.mig.instances", float(len(out) // 2), "{instance}", dict(g.labels)))
        return out

    def _throttle(self, g: Gpu) -> list[Sample]:
        mask = self._try(g, "throttle", lambda: self._calls["throttle"](g.handle)) \
            if (g.id, "throttle") not in self.unsupported else None
        if mask is None:
            return []
        return [Sample("xpusense.accelerator.throttle", 1.0 if mask & bit else 0.0, "1",
                       {**g.labels, "reason": reason}) for bit, reason in THROTTLE_REASONS.items()]

    def _remapped(self, g: Gpu) -> list[Sample]:
        if (g.id, "remapped_rows") in self.unsupported:
            return []
        r = self._try(g, "remapped_rows", lambda: self._calls["remapped_rows"](g.handle))
        if r is None:
            return []
        corr, unc, pending, failure = r
        return [
            Sample("xpusense.accelerator.memory.remapped_rows", float(corr), "{row}", {**g.labels, "type": "correctable"}),
            Sample("xpusense.accelerator.memory.remapped_rows", float(unc), "{row}", {**g.labels, "type": "uncorrectable"}),
            Sample("xpusense.accelerator.memory.remap_pending", float(bool(pending)), "1", dict(g.labels)),
            Sample("xpusense.accelerator.memory.remap_failed", float(bool(failure)), "1", dict(g.labels)),
        ]

    def _accumulate_busy(self, g: Gpu, util: float) -> None:
        now = time.monotonic()
        if g.last_util_t is not None:
            dt = now - g.last_util_t
            g.busy_s += util * dt
            g.busy_span_s += dt
        g.last_util_t = now

    def _efficiency(self, g: Gpu, energy_mj) -> list[Sample]:
        """Estimated tensor TFLOP per joule over the last offline interval (docs/metrics.md)."""
        if energy_mj is None:
            return []
        now, joules = time.monotonic(), energy_mj / 1000.0
        prev, g.energy_prev = g.energy_prev, (now, joules)
        busy, span = g.busy_s, g.busy_span_s
        g.busy_s = g.busy_span_s = 0.0
        if prev is None or not g.peak_tflops or span <= 0:
            return []
        dt, de = now - prev[0], joules - prev[1]
        if dt <= 0 or de <= 0:
            return []
        watts = de / dt
        return [Sample("xpusense.accelerator.energy.efficiency", (busy / span) * g.peak_tflops / watts,
                       "TFLOP/J", dict(g.labels))]

    # -- processes -----------------------------------------------------------------------------------
    def _process_samples(self, g: Gpu) -> list[Sample]:
        procs = self._try(g, "processes", lambda: self._calls["processes"](g.handle))
        if procs is None:
            return []
        out = []
        for p in procs:
            out.append(Sample("xpusense.accelerator.process.memory.usage", float(p.usedGpuMemory or 0), "By",
                              {**g.labels, "pid": str(p.pid)}))
        out.append(Sample("xpusense.accelerator.processes", float(len(procs)), "{process}", dict(g.labels)))
        return out

    def processes(self) -> dict[int, set[str]]:
        """pid -> ids of the GPUs it uses, read now (the checkpoint watch asks when it fires)."""
        pids: dict[int, set[str]] = {}
        for g in self.gpus:
            if g.lost or (g.id, "processes") in self.unsupported:
                continue
            try:
                for p in self._calls["processes"](g.handle):
                    pids.setdefault(p.pid, set()).add(g.id)
            except self.nv.NVMLError as e:
                log.warning("%s: cannot list its processes: %s", g.id, e)
        return pids

    # -- events --------------------------------------------------------------------------------------
    def _start_events(self) -> None:
        nv = self.nv
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            self.unsupported[("*", "events")] = str(e)
            return
        registered = 0
        for g in self.gpus:
            if g.lost:
                continue
            try:
                mask = nv.nvmlDeviceGetSupportedEventTypes(g.handle) & WATCHED_EVENTS
                if mask:
                    nv.nvmlDeviceRegisterEvents(g.handle, mask, self._event_set)
                    registered += 1
                else:
                    self._note_unsupported(g, "events", Exception("no XID/ECC events supported"))
            except nv.NVMLError as e:
                self._note_unsupported(g, "events", e)
        if registered:
            self._event_thread = threading.Thread(target=self._event_loop, name="nvml-events", daemon=True)
            self._event_thread.start()

    def _event_loop(self) -> None:
        nv = self.nv
        by_handle = {}
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait(self._event_set, self.event_wait_ms)
            except nv.NVMLError as e:
                if getattr(e, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    continue
                if self._stop.is_set():
                    return
                log.warning("NVML event wait failed: %s", e)
                self._stop.wait(1.0)
                continue
            g = self._gpu_for(data.device, by_handle)
            self._events.put(self._event_from(g, data))

    def _gpu_for(self, handle, cache: dict) -> Gpu | None:
        key = _handle_key(handle)
        if key not in cache:
            idx = None
            try:
                idx = self.nv.nvmlDeviceGetIndex(handle)
            except self.nv.NVMLError:
                pass
            cache[key] = next((g for g in self.gpus if g.index == idx), None)
        return cache[key]

    def _event_from(self, g: Gpu | None, data) -> Event:
        dev = g.id if g else "gpu?"
        name = g.name if g else ""
        attrs = {"vendor": VENDOR, "event_type": hex(data.eventType)}
        if g:
            attrs["uuid"] = g.info.get("uuid", "")
        if data.eventType == XID_EVENT:
            attrs["xid"] = str(data.eventData)
            return Event("xid", f"{dev} ({name}): XID {data.eventData}", "critical", dev, attrs, time.time_ns())
        if data.eventType == DBE_EVENT:
            return Event("ecc", f"{dev} ({name}): double-bit ECC error", "critical", dev, attrs, time.time_ns())
        if data.eventType == GPU_UNAVAILABLE_EVENT:
            return Event("health", f"{dev} ({name}): GPU unavailable", "critical", dev, attrs, time.time_ns())
        if data.eventType == GPU_RECOVERY_EVENT:
            attrs["recovery_action"] = str(data.eventData)
            return Event("health", f"{dev} ({name}): recovery action {data.eventData} requested", "warning",
                         dev, attrs, time.time_ns())
        return Event("nvml_event", f"{dev} ({name}): event {hex(data.eventType)} data {data.eventData}",
                     "warning", dev, attrs, time.time_ns())

    def events(self) -> list[Event]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    # -- inventory and status ------------------------------------------------------------------------
    def inventory(self) -> list[dict]:
        res = []
        for g in self.gpus:
            if not g.name:
                continue
            attrs = {k: v for k, v in g.info.items() if v}
            bw = nvlink_bandwidth(self.catalog, g.arch, g.nvlinks)
            res.append({"type": "GPU", "vendor": VENDOR, "model": model_name(g.name), "id": g.id,
                        "attributes": attrs,
                        "interconnects": [{"type": "NVLink", "bandwidth": bw}] if bw else []})
        return res

    def hbm_watch_coverage(self) -> dict[str, str]:
        """device -> '' when the HBM watch can follow it, else why not."""
        return {g.id: "" if g.gpm and not g.lost else (g.gpm_reason or "GPU lost") for g in self.gpus}

    def describe(self) -> dict:
        return {
            "devices": [f"{g.id}: {g.name}" + (" (lost)" if g.lost else "") for g in self.gpus],
            "driver": self.driver,
            "unavailable_readings": {f"{d}/{what}": why for (d, what), why in sorted(self.unsupported.items())},
        }

    def close(self) -> None:
        self._stop.set()
        if self._event_thread:
            self._event_thread.join(timeout=self.event_wait_ms / 1000 + 2)
        nv = self.nv
        if nv is None:
            return
        for g in self.gpus:
            if g.gpm_prev is not None:
                try:
                    nv.nvmlGpmSampleFree(g.gpm_prev)
                except nv.NVMLError:
                    pass
                g.gpm_prev = None
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except nv.NVMLError:
                pass
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        self.nv = None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _handle_key(handle) -> int:
    import ctypes
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    except Exception:
        return id(handle)
