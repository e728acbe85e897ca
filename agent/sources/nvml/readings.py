"""The per-device NVML readings as data: which call answers each, its unit, tier and conversion.

dcgm-exporter's rule: the list of fields is data. A `Reading` names a call of `calls(nv)` (made at
most once per device and round, however many readings share it) and how its answer becomes a value.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from xpusense.common import metric_names as m

from ..base import COUNTER, GAUGE, NEARLINE, OFFLINE, REALTIME
from .library import FUNCTION_NOT_FOUND, Unreadable, code

log = logging.getLogger("xpusense.agent.nvml")
ARGUMENT_VERSION_MISMATCH = 25

ALL_LINKS = 0xFFFFFFFF  # field-value scopeId for "summed over all NVLink links" (nvml.h)

THROTTLE_REASONS = {  # nvmlClocksEventReason* bits (the same bits as the older nvmlClocksThrottleReason*)
    0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
}

Call = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Reading:
    name: str
    unit: str
    tier: str
    call: str
    convert: Callable[[Any], float | None]     # None: no value from this answer (no sample)
    kind: str = GAUGE
    labels: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Memory:
    total: int
    used: int
    free: int
    reserved: int | None      # None: the v1 call, which counts reserved memory as used


class MemoryReader:
    """Device memory from nvmlDeviceGetMemoryInfo_v2 where the driver has it (R510 and newer), which
    reports the driver's reserved memory apart from `used` (as DCGM does); else the v1 call, whose
    `used` includes it (an idle H100 then shows ~0.5 GiB used)."""

    def __init__(self, nv: Any):
        self.nv = nv
        self.version = getattr(nv, "nvmlMemory_v2", None)
        self.v2 = self.version is not None

    def read(self, handle: Any) -> Memory:
        nv = self.nv
        if self.v2:
            try:
                m = nv.nvmlDeviceGetMemoryInfo(handle, version=self.version)
                return Memory(m.total, m.used, m.free, m.reserved)
            except nv.NVMLError as e:
                if code(e) not in (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                    raise
                self.v2 = False
                log.info("nvmlDeviceGetMemoryInfo_v2 unavailable (%s): memory from the v1 call, whose used "
                         "includes the driver's reserved memory", e)
        m = nv.nvmlDeviceGetMemoryInfo(handle)
        return Memory(m.total, m.used, m.free, None)

    def describe(self) -> str:
        return "nvmlDeviceGetMemoryInfo_v2 (reserved apart)" if self.v2 else \
            "nvmlDeviceGetMemoryInfo v1 (reserved counted as used)"


class Fallback:
    """The newest of several calls that the driver has, e.g. nvmlDeviceGetTemperatureV (R570 and
    newer) before nvmlDeviceGetTemperature (deprecated, gone in CUDA 14): on FunctionNotFound (or a
    pynvml without the wrapper) the next one, for the rest of the run (one driver per run)."""

    def __init__(self, nv: Any, options: list[tuple[str, Callable[[Any], Any]]]):
        self.nv = nv
        self.options = [(name, fn) for name, fn in options if hasattr(nv, name)] or options[-1:]
        self.i = 0

    @property
    def using(self) -> str:
        return self.options[self.i][0]

    def __call__(self, handle: Any) -> Any:
        while True:
            name, fn = self.options[self.i]
            try:
                return fn(handle)
            except self.nv.NVMLError as e:
                if code(e) != FUNCTION_NOT_FOUND or self.i == len(self.options) - 1:
                    raise
                self.i += 1
                log.info("%s is not in this driver: %s from now on", name, self.using)


def calls(nv: Any, memory: MemoryReader, fallbacks: dict[str, Fallback]) -> dict[str, Call]:
    """Reading call name -> function of a device handle."""
    return {
        "utilization": nv.nvmlDeviceGetUtilizationRates,
        "memory": memory.read,
        "pcie_tx": lambda h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES),
        "pcie_rx": lambda h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES),
        "pcie_link": lambda h: (nv.nvmlDeviceGetCurrPcieLinkGeneration(h), nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
        "clock_sm": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "clock_mem": lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
        "power": nv.nvmlDeviceGetPowerUsage,
        "power_limit": nv.nvmlDeviceGetEnforcedPowerLimit,
        "energy": nv.nvmlDeviceGetTotalEnergyConsumption,
        "temperature": fallbacks["temperature"],
        "ecc_corrected": lambda h: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
        "ecc_uncorrected": lambda h: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
        "remapped_rows": nv.nvmlDeviceGetRemappedRows,
        "throttle": fallbacks["throttle"],
        "hbm_temperature": lambda h: field(nv, h, nv.NVML_FI_DEV_MEMORY_TEMP),
        "encoder": nv.nvmlDeviceGetEncoderUtilization,           # [percent, sampling period us]
        "decoder": nv.nvmlDeviceGetDecoderUtilization,
        **{f"thermal_{name}": threshold(nv, const) for name, const in THRESHOLDS.items()},
        "nvlink": lambda h: fields(nv, h, [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
                                           (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS)]),
    }


def used_share(mem: Memory) -> float | None:
    """used / (total - reserved), as DCGM's FB_USED_PERCENT; used / total from the v1 call."""
    usable = mem.total - (mem.reserved or 0)
    return mem.used / usable if usable > 0 else None


# nvmlTemperatureThresholds_t read per GPU -> the pynvml constant. Named `thermal_*` (not
# temperature) so a GPU without them shows `thermal_*` in `sources`, apart from the temperatures.
THRESHOLDS = {"shutdown": "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", "slowdown": "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",
              "gpu_max": "NVML_TEMPERATURE_THRESHOLD_GPU_MAX", "mem_max": "NVML_TEMPERATURE_THRESHOLD_MEM_MAX"}


def threshold(nv: Any, const: str) -> Call:
    kind = getattr(nv, const, None)
    return lambda h: nv.nvmlDeviceGetTemperatureThreshold(h, kind)


def codec_share(answer: Any) -> float | None:
    """nvmlDeviceGet{En,De}coderUtilization -> [percent, sampling period us]: the busy share."""
    return answer[0] / 100.0


READINGS = [
    Reading("hw.gpu.utilization", "1", REALTIME, "utilization", lambda u: u.gpu / 100.0),
    # Memory-controller busy time: NOT bandwidth (shared/reference/nvml.md section 5).
    Reading("xpusense.accelerator.memory_controller.utilization", "1", REALTIME, "utilization",
            lambda u: u.memory / 100.0),
    Reading("hw.gpu.memory.usage", "By", REALTIME, "memory", lambda m: float(m.used)),
    Reading("hw.gpu.memory.limit", "By", REALTIME, "memory", lambda m: float(m.total)),
    Reading("xpusense.accelerator.memory.free", "By", REALTIME, "memory", lambda m: float(m.free)),
    Reading("xpusense.accelerator.memory.reserved", "By", REALTIME, "memory",
            lambda m: None if m.reserved is None else float(m.reserved)),
    Reading("hw.gpu.memory.utilization", "1", REALTIME, "memory", used_share),
    # nvml.h: "KB/s", a byte counter over a 20 ms window (a snapshot, not the tier's average); read
    # as KiB/s like nvitop and GPM's PCIE_*_PER_SEC (MiB/s) of the same counter.
    Reading("xpusense.accelerator.pcie.throughput", "By/s", NEARLINE, "pcie_tx", lambda kb: kb * 1024.0,
            labels=(("direction", "transmit"),)),
    Reading("xpusense.accelerator.pcie.throughput", "By/s", NEARLINE, "pcie_rx", lambda kb: kb * 1024.0,
            labels=(("direction", "receive"),)),
    Reading("xpusense.accelerator.clock.frequency", "Hz", NEARLINE, "clock_sm", lambda mhz: mhz * 1e6,
            labels=(("clock", "sm"),)),
    Reading("xpusense.accelerator.clock.frequency", "Hz", NEARLINE, "clock_mem", lambda mhz: mhz * 1e6,
            labels=(("clock", "memory"),)),
    Reading("hw.power", "W", OFFLINE, "power", lambda mw: mw / 1000.0),
    Reading("xpusense.accelerator.power.limit", "W", OFFLINE, "power_limit", lambda mw: mw / 1000.0),
    Reading("hw.energy", "J", OFFLINE, "energy", lambda mj: mj / 1000.0, COUNTER),
    Reading("hw.temperature", "Cel", OFFLINE, "temperature", float, labels=(("sensor", "chip"),)),
    Reading("hw.temperature", "Cel", OFFLINE, "hbm_temperature", float, labels=(("sensor", "hbm"),)),
    # The limits of the same sensors (nvmlDeviceGetTemperatureThreshold): OTLP hw.temperature.limit
    # with hw.limit_type high.critical / throttled / max (common/semconv.py).
    *(Reading(m.TEMPERATURE_LIMIT, "Cel", OFFLINE, f"thermal_{kind}", float, labels=(("sensor", sensor), ("limit", limit)))
      for kind, sensor, limit in (("shutdown", "chip", "shutdown"), ("slowdown", "chip", "slowdown"),
                                  ("gpu_max", "chip", "max"), ("mem_max", "hbm", "max"))),
    # NVENC / NVDEC: OTLP hw.gpu.utilization with hw.gpu.task encoder / decoder.
    Reading(m.ENCODER_UTILIZATION, "1", NEARLINE, "encoder", codec_share),
    Reading(m.DECODER_UTILIZATION, "1", NEARLINE, "decoder", codec_share),
    Reading("xpusense.accelerator.ecc.errors", "{error}", OFFLINE, "ecc_corrected", float, COUNTER,
            (("type", "corrected"),)),
    Reading("xpusense.accelerator.ecc.errors", "{error}", OFFLINE, "ecc_uncorrected", float, COUNTER,
            (("type", "uncorrected"),)),
]


def fallbacks(nv: Any) -> dict[str, Fallback]:
    gpu = getattr(nv, "NVML_TEMPERATURE_GPU", 0)
    return {
        "temperature": Fallback(nv, [("nvmlDeviceGetTemperatureV", lambda h: nv.nvmlDeviceGetTemperatureV(h, gpu)),
                                     ("nvmlDeviceGetTemperature", lambda h: nv.nvmlDeviceGetTemperature(h, gpu))]),
        # NVML 12.2 renamed throttle reasons to clock event reasons; R525/R530 have only the old call.
        "throttle": Fallback(nv, [("nvmlDeviceGetCurrentClocksEventReasons", nv.nvmlDeviceGetCurrentClocksEventReasons),
                                  ("nvmlDeviceGetCurrentClocksThrottleReasons",
                                   nv.nvmlDeviceGetCurrentClocksThrottleReasons)]),
    }


def fields(nv: Any, handle: Any, ids: list) -> list[tuple[int, float]]:
    """(timestamp us, value) per field id; a per-field error raises it as an NVMLError."""
    out = []
    get = object.__getattribute__    # numbers only: pynvml's own __getattribute__ adds a Python call each
    for v in nv.nvmlDeviceGetFieldValues(handle, ids):
        rc = get(v, "nvmlReturn")
        if rc != nv.NVML_SUCCESS:
            raise nv.NVMLError(rc)
        out.append((get(v, "timestamp"), field_value(nv, v)))
    return out


def field(nv: Any, handle: Any, fid: int) -> float:
    return fields(nv, handle, [fid])[0][1]


# nvmlValueType_t -> the nvmlValue_t union member it fills (nvml.h; SIGNED_INT since 12.2, UNSIGNED_SHORT
# since 12.6). Drivers change a field's type between releases, so a field is read by its valueType.
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def field_value(nv: Any, v: Any) -> float:
    """The value of a c_nvmlFieldValue_t by its valueType (the union member NVML filled); a type this
    agent does not know raises Unreadable rather than guessing a member."""
    get = object.__getattribute__
    member = VALUE_MEMBERS.get(get(v, "valueType"))
    value = get(v, "value")
    if member is None or not hasattr(value, member):
        raise Unreadable(f"field {v.fieldId} has value type {v.valueType}, newer than this agent knows")
    return float(getattr(value, member))
