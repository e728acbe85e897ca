"""The NVML source: every NVIDIA GPU of the host at three tiers, its events and its inventory.

Failure rules: no library or driver -> Unavailable with the reason. Every reading of every GPU
stands alone: an error is judged by its code (library.classify) and kept in that reading's state
(states.py), so one failing call costs that reading on that GPU for that round and nothing else;
transient errors are asked again with back-off, never taken for "not supported". A GPU that answers
RESET_REQUIRED gets a critical health event and keeps being asked; a GPU lost (GPU_IS_LOST) gets one
and is left out; a GPU that cannot be opened for another reason is tried again later (health.py).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from xpusense.common import catalog
from xpusense.common.config import Key, positive

from ..base import COUNTER, NEARLINE, OFFLINE, REALTIME, Event, Sample, Source, SourceFamily, Unavailable
from . import gpm, inventory, library, readings
from .checks import Gate
from .device import Gpu
from .events import EventWatcher
from .health import Health
from .processes import ProcessReader
from .states import ReadingStates

log = logging.getLogger("xpusense.agent.nvml")

SCHEMA = {
    "enabled": Key(bool, True),
    "gpm": Key(bool, True, help="GPM metrics (HBM bandwidth, SM, tensor) on Hopper and newer"),
    "events": Key(bool, True, help="watch XID and ECC events"),
    "event_wait_ms": Key(int, 500, positive),
}


class GpuLost(Exception):
    """A call answered GPU_IS_LOST: the GPU's round ends here."""


class NvmlSource(Source):
    name = "nvml"
    tiers = (REALTIME, NEARLINE, OFFLINE)

    def __init__(self, events: bool = True, event_wait_ms: int = 500, gpm: bool = True):
        self.want_events = events
        self.event_wait_ms = event_wait_ms
        self.want_gpm = gpm
        self.nv: Any = None
        self.gpus: list[Gpu] = []
        self.states = ReadingStates()
        self.gate = Gate()
        self.driver = ""
        self.nvml_version = ""
        self._calls: dict[str, readings.Call] = {}
        self._events: queue.Queue[Event] = queue.Queue()
        self.health = Health(self._events)
        self._watcher: EventWatcher | None = None
        self.procs: ProcessReader | None = None
        self.memory: readings.MemoryReader | None = None

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        nv = library.load()
        try:
            catalog.load("nvidia")
        except catalog.CatalogError as e:
            nv.nvmlShutdown()
            raise Unavailable(str(e)) from None
        self.nv = nv
        self.memory = readings.MemoryReader(nv)
        self._calls = readings.calls(nv, self.memory)
        self.procs = ProcessReader(nv)
        try:
            self.driver = library.text(nv.nvmlSystemGetDriverVersion())
            self.nvml_version = library.text(nv.nvmlSystemGetNVMLVersion())
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as e:
            nv.nvmlShutdown()
            raise Unavailable(f"NVML answered nvmlInit but not the device count: {e}") from None
        if count == 0:
            nv.nvmlShutdown()
            raise Unavailable("NVML found no NVIDIA GPU on this host")
        for i in range(count):
            gpu = Gpu(i, None)
            self.gpus.append(gpu)
            self._open(gpu)
        if self.want_events:
            self._watcher = EventWatcher(nv, self.gpus, self._events, self.event_wait_ms, self._unsupported_for)
            self._watcher.start()

    def _open(self, g: Gpu) -> None:
        """Handle and discovery; on failure g stays unopened and is tried again later (unless lost)."""
        try:
            self._try(g, "open", lambda: self._discover(g))
        except GpuLost as e:
            g.lost = True
            log.warning("%s: cannot be opened: %s", g.id, e)
            self.health.cannot_open(g, str(e))

    def _discover(self, g: Gpu) -> None:
        nv = self.nv
        h = g.handle = nv.nvmlDeviceGetHandleByIndex(g.index)
        inventory.identify(nv, g, self.driver)
        cc = self._try(g, "compute_capability", lambda: nv.nvmlDeviceGetCudaComputeCapability(h))
        g.info["compute_capability"] = f"{cc[0]}.{cc[1]}" if cc else ""
        g.arch = self._try(g, "architecture", lambda: nv.nvmlDeviceGetArchitecture(h))
        mig = self._try(g, "mig_mode", lambda: nv.nvmlDeviceGetMigMode(h))
        g.mig = bool(mig and mig[0] == nv.NVML_DEVICE_MIG_ENABLE)
        g.info["mig_mode"] = "enabled" if g.mig else ("disabled" if mig is not None else "unsupported")
        g.nvlinks = inventory.count_nvlinks(nv, g)
        g.info["nvlink_count"] = str(g.nvlinks)
        inventory.catalog_facts(g)
        self._setup_gpm(g)
        g.opened = True

    def _setup_gpm(self, g: Gpu) -> None:
        nv = self.nv
        if not self.want_gpm:
            g.gpm_reason = "GPM switched off in config ([sources.nvml] gpm = false)"
        else:
            ok = self._try(g, "gpm", lambda: gpm.supported(nv, g.handle))
            if ok:
                ids = list(gpm.GPM_METRICS) + (list(gpm.GPM_NVLINK) if g.nvlinks else [])
                g.gpm_stream = gpm.GpmStream(nv, lambda s: nv.nvmlGpmSampleGet(g.handle, s), ids)
            elif ok is not None:
                g.gpm_reason = (f"GPM is not supported on {g.name} (Hopper or newer needed); the "
                                f"memory-controller busy share is reported instead under "
                                f"xpusense.accelerator.memory_controller.utilization")
            else:
                g.gpm_reason = f"GPM query failed: {self.states.unsupported(g.id, 'gpm') or 'see the log'}"
        if g.gpm_stream is None:
            self.states.mark_unsupported(g.id, "hbm_bandwidth", g.gpm_reason)

    def _try(self, g: Gpu, what: str, fn: Callable[[], Any]) -> Any:
        """fn() when the reading is due on g, else None; an NVML error is judged (library.classify)
        and kept in the reading's state; GPU_IS_LOST raises GpuLost to end g's round."""
        now = time.monotonic()
        if not self.states.due(g.id, what, now):
            return None
        try:
            v = fn()
        except self.nv.NVMLError as e:
            self._failed(g, what, library.code(e), str(e), now)
            return None
        self.states.succeeded(g.id, what)
        self.health.answered(g, what)
        return v

    def _failed(self, g: Gpu, what: str, rc: int | None, why: str, now: float) -> None:
        kind = library.classify(rc)
        if kind == library.LOST:
            raise GpuLost(why)
        if kind == library.RESET:
            self.health.reset_required(g, what, why)
        self.states.failed(g.id, what, library.UNSUPPORTED if kind == library.UNSUPPORTED else library.TRANSIENT,
                           why, now)

    def _unsupported_for(self, g: Gpu | None, what: str, why: str) -> None:
        self.states.mark_unsupported("*" if g is None else g.id, what, why)

    # -- rounds --------------------------------------------------------------------------------------
    def collect(self, tier: str) -> list[Sample]:
        out: list[Sample] = []
        for g in self.gpus:
            if g.lost:
                continue
            try:
                if not g.opened:
                    self._open(g)
                    if not g.opened:
                        continue
                    self._reopened(g)
                out += self._collect_gpu(g, tier)
            except GpuLost as e:
                self._lose(g, str(e))
        if tier == OFFLINE:
            out += self.health.samples([g for g in self.gpus if g.opened or g.lost])
        return self.gate.admit(out)

    def _lose(self, g: Gpu, why: str) -> None:
        if self.health.lost(g, why) and g.gpm_stream is not None:
            g.gpm_stream.reset()

    def _reopened(self, g: Gpu) -> None:
        log.info("%s (%s) opened after failing at start", g.id, g.name)
        if self._watcher is not None:
            self._watcher.add(g)

    def _read(self, g: Gpu, call: str) -> Any:
        return self._try(g, call, lambda: self._calls[call](g.handle))

    def _collect_gpu(self, g: Gpu, tier: str) -> list[Sample]:
        cache: dict[str, Any] = {}
        out = []
        for r in readings.READINGS:
            if r.tier != tier:
                continue
            if r.call not in cache:
                cache[r.call] = self._read(g, r.call)
            raw = cache[r.call]
            value = None if raw is None else r.convert(raw)
            if value is not None:
                out.append(Sample(r.name, value, r.unit, {**g.labels, **dict(r.labels)}, r.kind))
        if tier == REALTIME:
            if cache.get("utilization") is not None:
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
        """GPM metrics of g since its last sample; a failed sample is no data for g this round only."""
        stream = g.gpm_stream
        now = time.monotonic()
        if stream is None:
            return []
        results = self._try(g, "gpm", lambda: stream.read(now))
        out = []
        nvlink_rates = self.states.unsupported(g.id, "nvlink") is not None
        for mid, rc, value in results or ():
            what = f"gpm_metric_{mid}"
            if rc != library.SUCCESS:
                self._failed(g, what, rc, library.error_text(self.nv, rc), now)
                continue
            self.states.succeeded(g.id, what)
            if mid in gpm.GPM_METRICS:
                name, scale, unit = gpm.GPM_METRICS[mid]
                out.append(Sample(name, value * scale, unit, dict(g.labels)))
            elif mid in gpm.GPM_NVLINK and nvlink_rates:
                # Counters from field values are preferred; GPM rates stand in where they fail.
                out.append(Sample("xpusense.accelerator.interconnect.throughput", value * 2**20, "By/s",
                                  {**g.labels, "link_type": "NVLink", "direction": gpm.GPM_NVLINK[mid]}))
        return out

    def _nvlink(self, g: Gpu) -> list[Sample]:
        if g.nvlinks == 0:
            return []
        vals = self._read(g, "nvlink")
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
            out += self._mig_instance(g, mh, i)
        out.append(Sample("xpusense.accelerator.mig.instances", float(len(out) // 2), "{instance}", dict(g.labels)))
        return out

    def _mig_instance(self, g: Gpu, mh: Any, slot: int) -> list[Sample]:
        nv = self.nv
        gi = self._try(g, "mig_instance_id", lambda: nv.nvmlDeviceGetGpuInstanceId(mh))
        mem = self._try(g, "mig_memory", lambda: nv.nvmlDeviceGetMemoryInfo(mh))
        if mem is None:
            return []
        labels = {**g.labels, "mig_instance": str(gi if gi is not None else slot)}
        return [Sample("hw.gpu.memory.usage", float(mem.used), "By", labels),
                Sample("hw.gpu.memory.limit", float(mem.total), "By", dict(labels))]

    def _throttle(self, g: Gpu) -> list[Sample]:
        mask = self._read(g, "throttle")
        if mask is None:
            return []
        return [Sample("xpusense.accelerator.throttle", 1.0 if mask & bit else 0.0, "1",
                       {**g.labels, "reason": reason}) for bit, reason in readings.THROTTLE_REASONS.items()]

    def _remapped(self, g: Gpu) -> list[Sample]:
        r = self._read(g, "remapped_rows")
        if r is None:
            return []
        corr, unc, pending, failure = r
        name = "xpusense.accelerator.memory.remapped_rows"
        return [
            Sample(name, float(corr), "{row}", {**g.labels, "type": "correctable"}),
            Sample(name, float(unc), "{row}", {**g.labels, "type": "uncorrectable"}),
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

    def _efficiency(self, g: Gpu, energy_mj: Any) -> list[Sample]:
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
        reader = self.procs
        procs = self._try(g, "processes", lambda: reader.read(g.handle)) if reader is not None else None
        if procs is None:
            return []
        out = [Sample("xpusense.accelerator.process.memory.usage", float(p.used_bytes), "By",
                      {**g.labels, "pid": str(p.pid)}) for p in procs if p.used_bytes is not None]
        out.append(Sample("xpusense.accelerator.processes", float(len(procs)), "{process}", dict(g.labels)))
        return out

    def processes(self) -> dict[int, set[str]]:
        """pid -> ids of the GPUs it uses, read now (the checkpoint watch asks when it fires); only
        pids that can be processes (processes.pid_problem)."""
        pids: dict[int, set[str]] = {}
        if self.procs is None:
            return pids
        for g in self.gpus:
            if g.lost or self.states.unsupported(g.id, "processes"):
                continue
            try:
                for p in self.procs.read(g.handle):
                    pids.setdefault(p.pid, set()).add(g.id)
            except self.nv.NVMLError as e:
                log.warning("%s: cannot list its processes: %s", g.id, e)
        return pids

    # -- events, inventory and status ----------------------------------------------------------------
    def events(self) -> list[Event]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def inventory(self) -> list[dict]:
        return [inventory.entry(g) for g in self.gpus if g.opened]

    def hbm_watch_coverage(self) -> dict[str, str]:
        """device -> '' when the HBM watch can follow it, else why not."""
        out = {}
        for g in self.gpus:
            why = "GPU lost" if g.lost else (self.states.unsupported(g.id, "hbm_bandwidth")
                                             or self.states.unsupported(g.id, "gpm")
                                             or self.states.unsupported(g.id, f"gpm_metric_{gpm.DRAM_BW_UTIL}"))
            out[g.id] = why or ""
        return out

    def describe(self) -> dict:
        unsupported, retrying = self.states.describe()
        return {
            "devices": [f"{g.id}: {g.name or '(not opened)'}" + (f" ({Health.status(g)})" if Health.status(g) != "ok"
                                                                else "") for g in self.gpus],
            "driver": self.driver,
            "unavailable_readings": unsupported,
            "retrying_readings": retrying,
            "dropped_values": self.gate.describe(),
            "memory_call": self.memory.describe() if self.memory is not None else "",
            "process_list": (f"{self.procs.describe()}, {self.procs.dropped} impossible pid(s) left out"
                             if self.procs is not None else ""),
            "gpm_rounds_too_soon": {g.id: g.gpm_stream.too_soon for g in self.gpus
                                    if g.gpm_stream is not None and g.gpm_stream.too_soon},
        }

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        nv = self.nv
        if nv is None:
            return
        for g in self.gpus:
            if g.gpm_stream is not None:
                g.gpm_stream.reset()
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        self.nv = None


def build(table: Any) -> list[Source]:
    return [NvmlSource(events=table.events, event_wait_ms=table.event_wait_ms, gpm=table.gpm)]


FAMILY = SourceFamily("nvml", SCHEMA, build)
