"""The NVML source: every NVIDIA GPU of the host at three tiers, its events and its inventory
(NvmlSource, with its failure rules). Nothing leaves the source without passing checks.py."""

from __future__ import annotations

import logging
import queue
from typing import Any

from xpusense.common import catalog
from xpusense.common import metric_names as m
from xpusense.common.config import Key, positive

from ..base import NEARLINE, OFFLINE, REALTIME, Event, Sample, Source, SourceFamily, Unavailable
from ..code_counts import CodeCounts
from . import gpm, inventory, library, mig, readings, topology
from .ask import Asker, GpuLost
from .checks import Gate
from .collect import GpuRound
from .device import Gpu
from .events import EventWatcher
from .health import Health
from .process_util import ProcessUtilReader
from .processes import ProcessReader
from .states import ReadingStates

log = logging.getLogger("xpusense.agent.nvml")

SCHEMA = {
    "enabled": Key(bool, True),
    "gpm": Key(bool, True, help="GPM metrics (HBM bandwidth, SM, tensor, graphics engine) on Hopper and newer"),
    "events": Key(bool, True, help="watch XID and ECC events"),
    # How long one nvmlEventSetWait blocks: an event ends the wait at once, so this bounds only how soon
    # the thread sees stop() (close waits for it); each timeout is a wake-up of the agent (~0.15 ms).
    "event_wait_ms": Key(int, 1000, positive,
                         help="longest nvmlEventSetWait; events come at once whatever it is, stop waits up to it"),
    "xid_codes_per_device": Key(int, 32, positive,
                                help="XID codes counted apart per GPU; further codes count as xid `other` "
                                     "(xpusense.accelerator.error_codes.over_limit)"),
    "sysfs": Key(str, "/sys", help="where each GPU's NUMA node is read (bus/pci/devices/ADDRESS/numa_node)"),
    "max_process_samples": Key(int, 64, positive,
                               help="processes whose utilisation is kept per GPU (or MIG device) and round; the "
                                    "busiest kept, the rest counted (xpusense.nvml.process_utilization.left_out)"),
}


class NvmlSource(Source):
    """Failure rules: no library or driver -> Unavailable with the reason. Every reading of every GPU
    (and of every MIG instance) stands alone: an error is judged by its code (library.classify) and
    kept in that reading's state (states.py), so one failing call costs that reading on that device
    for that round and nothing else; transient errors are asked again with back-off, never taken
    for "not supported". A GPU that answers RESET_REQUIRED gets a critical health event and keeps
    being asked; a GPU lost (GPU_IS_LOST) gets one and is left out; a GPU that cannot be opened for
    another reason is tried again later (health.py). MIG mode and layout are read again every
    nearline round and when a MIG config change event arrives."""

    name = "nvml"
    tiers = (REALTIME, NEARLINE, OFFLINE)

    def __init__(self, events: bool = True, event_wait_ms: int = 1000, gpm: bool = True, sysfs: str = "/sys",
                 xid_codes_per_device: int = 32, max_process_samples: int = 64):
        self.sysfs = sysfs
        self.max_process_samples = max_process_samples
        self.xids = CodeCounts(m.XID_ERRORS, "xid", xid_codes_per_device)   # kept for the agent's whole run
        self.topology_reason = ""
        self.want_events = events
        self.event_wait_ms = event_wait_ms
        self.want_gpm = gpm
        self.nv: Any = None
        self.gpus: list[Gpu] = []
        self.states = ReadingStates()
        self.gate = Gate()
        self.driver = ""
        self.nvml_version = ""
        self._events: queue.Queue[Event] = queue.Queue()
        self.health = Health(self._events)
        self._watcher: EventWatcher | None = None
        self.memory: readings.MemoryReader | None = None
        self.procs: ProcessReader | None = None
        self.util: ProcessUtilReader | None = None
        self.ask: Asker | None = None
        self.round: GpuRound | None = None
        self.fallbacks: dict[str, readings.Fallback] = {}

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
        self.procs = ProcessReader(nv)
        self.util = ProcessUtilReader(nv, self.max_process_samples)
        self.ask = Asker(nv, self.states, self.health)
        self.fallbacks = readings.fallbacks(nv)
        self.round = GpuRound(nv, self.ask, readings.calls(nv, self.memory, self.fallbacks), self.memory, self.procs,
                              self.util)
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
        self._place()
        if self.want_events:
            self._watcher = EventWatcher(nv, self.gpus, self._events, self.event_wait_ms, self.states, self.health,
                                         self.xids)
            self._watcher.start()

    def _ask(self) -> Asker:
        assert self.ask is not None, "setup() first"
        return self.ask

    def _open(self, g: Gpu) -> None:
        """Handle and discovery; on failure g stays unopened and is tried again later (unless lost)."""
        try:
            self._ask()(g, "open", lambda: self._discover(g))
        except GpuLost as e:
            g.lost = True
            log.warning("%s: cannot be opened: %s", g.id, e)
            self.health.cannot_open(g, str(e))

    def _discover(self, g: Gpu) -> None:
        nv, ask = self.nv, self._ask()
        h = g.handle = nv.nvmlDeviceGetHandleByIndex(g.index)
        inventory.identify(nv, g, self.driver)
        mode = ask(g, "mig_mode", lambda: nv.nvmlDeviceGetMigMode(h))   # first: errors below depend on it
        g.mig = bool(mode and mode[0] == nv.NVML_DEVICE_MIG_ENABLE)
        mem = ask(g, "memory", lambda: self._memory().read(h))
        if mem is not None:
            g.info["memory"] = f"{round(mem.total / 2**30)}GB"
            g.info["memory_mib"] = str(mem.total // 2**20)   # as GPU feature discovery labels it
        cc = ask(g, "compute_capability", lambda: nv.nvmlDeviceGetCudaComputeCapability(h))
        g.info["compute_capability"] = f"{cc[0]}.{cc[1]}" if cc else ""
        g.arch = ask(g, "architecture", lambda: nv.nvmlDeviceGetArchitecture(h))
        g.nvlinks = inventory.count_nvlinks(nv, g)
        g.info["nvlink_count"] = str(g.nvlinks)
        inventory.catalog_facts(g)
        self._setup_gpm(g)
        self._read_mig(g)
        g.opened = True

    def _place(self) -> None:
        """NUMA node and PCIe switch group of every opened GPU (again when one opens late)."""
        opened = [g for g in self.gpus if g.opened and not g.lost]
        groups, self.topology_reason = topology.switch_groups(self.nv, opened)
        for g in opened:
            g.numa_node = topology.numa_node(self.sysfs, g.info.get("pci_bus_id", ""))
            g.info["numa_node"] = "" if g.numa_node is None else str(g.numa_node)
            g.pcie_switch = groups.get(g.id, "")
            g.info["pcie_switch"] = g.pcie_switch

    def _memory(self) -> readings.MemoryReader:
        assert self.memory is not None, "setup() first"
        return self.memory

    def _setup_gpm(self, g: Gpu) -> None:
        nv = self.nv
        if not self.want_gpm:
            g.gpm_reason = "GPM switched off in config ([sources.nvml] gpm = false)"
        else:
            ok = self._ask()(g, "gpm", lambda: gpm.supported(nv, g.handle))
            if ok:
                g.gpm_supported = True
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

    def _read_mig(self, g: Gpu) -> None:
        """MIG mode now, and the GPU instances when it is on; when either changed, every reading of g
        gets a new chance (utilisation comes back when MIG goes off, and so on)."""
        nv = self.nv
        mode = self._ask()(g, "mig_mode", lambda: nv.nvmlDeviceGetMigMode(g.handle))
        on = bool(mode and mode[0] == nv.NVML_DEVICE_MIG_ENABLE)
        if g.opened and on == g.mig and not g.mig_changed:
            return
        was, g.mig, g.mig_changed = g.mig, on, False
        mig.release(g.migs)
        g.migs = []
        if g.opened:
            self.states.forget(g.id)
            if g.gpm_stream is not None:
                g.gpm_stream.reset()
            else:
                self.states.mark_unsupported(g.id, "hbm_bandwidth", g.gpm_reason)
        if on:
            found = self._ask()(g, "mig_instances", lambda: mig.discover(nv, g, g.gpm_supported))
            g.migs = found or []
        g.info["mig_mode"] = "enabled" if on else ("disabled" if mode is not None else "unsupported")
        g.info["mig_instances"] = str(len(g.migs)) if on else ""
        if g.opened:
            log.info("%s (%s): MIG mode %s (was %s), %d GPU instance(s)", g.id, g.name,
                     "on" if on else "off", "on" if was else "off", len(g.migs))
            self._events.put(Event("mig_config", f"{g.id} ({g.name}): MIG {'enabled' if on else 'disabled'}, "
                                   f"{len(g.migs)} GPU instance(s)", "info", g.id,
                                   {"vendor": "nvidia", "mig_mode": g.info["mig_mode"],
                                    "instances": ",".join(str(i.gi) for i in g.migs)}))

    # -- rounds --------------------------------------------------------------------------------------
    def collect(self, tier: str) -> list[Sample]:
        assert self.round is not None, "setup() first"
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
                if g.mig_changed or tier == NEARLINE:
                    self._read_mig(g)
                out += self.round.collect(g, tier)
            except GpuLost as e:
                self._lose(g, str(e))
        if tier == OFFLINE:
            out += self.health.samples([g for g in self.gpus if g.opened or g.lost])
        elif tier == REALTIME:
            out += self.xid_samples()
        return self.gate.admit(out)

    def xid_samples(self) -> list[Sample]:
        """XIDs counted per GPU and code since the agent started, and the last XID of every GPU whose
        events are watched (0: none yet); nothing for a GPU whose events are not."""
        watched = self._watcher.registered if self._watcher is not None else []
        last = [Sample(m.LAST_XID, float(self.xids.last(g.id) or 0), "{xid}", dict(g.labels))
                for g in watched if not g.lost]
        return self.xids.samples() + last

    def _lose(self, g: Gpu, why: str) -> None:
        if self.health.lost(g, why):
            if g.gpm_stream is not None:
                g.gpm_stream.reset()
            mig.release(g.migs)

    def _reopened(self, g: Gpu) -> None:
        log.info("%s (%s) opened after failing at start", g.id, g.name)
        self._place()
        if self._watcher is not None:
            self._watcher.add(g)

    def processes(self) -> dict[int, set[str]]:
        """pid -> ids of the accelerators it uses (`gpu0`, and `gpu0/gi1` for a MIG instance), read
        now (the HBM watch asks when it fires); only pids that can be processes."""
        pids: dict[int, set[str]] = {}
        if self.round is None:
            return pids
        for g in self.gpus:
            if g.lost or not g.opened:
                continue
            try:
                lists = self.round.process_lists(g)
            except GpuLost as e:
                self._lose(g, str(e))
                continue
            for inst, procs in lists:
                for p in procs:
                    pids.setdefault(p.pid, set()).update([g.id] + ([inst.id] if inst is not None else []))
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
        """accelerator -> '' when the HBM watch can follow it, else why not (MIG instances apart)."""
        def why(dev: str, stream: gpm.GpmStream | None, reason: str) -> str:
            if stream is None:
                return reason or "no GPM"
            return (self.states.unsupported(dev, "gpm")
                    or self.states.unsupported(dev, f"gpm_metric_{gpm.DRAM_BW_UTIL}") or "")
        out = {}
        for g in self.gpus:
            out[g.id] = "GPU lost" if g.lost else why(g.id, g.gpm_stream, g.gpm_reason)
            for inst in g.migs:
                out[inst.id] = why(inst.id, inst.gpm, g.gpm_reason)
        return out

    def describe(self) -> dict:
        unsupported, retrying = self.states.describe()
        return {
            "devices": [f"{g.id}: {g.name or '(not opened)'}"
                        + (f" ({Health.status(g)})" if Health.status(g) != "ok" else "")
                        + (f" MIG {', '.join(f'gi{i.gi} {i.name}' for i in g.migs)}" if g.migs else "")
                        for g in self.gpus],
            "driver": self.driver,
            "topology": self.topology_reason or "ok",
            "unavailable_readings": unsupported,
            "retrying_readings": retrying,
            "dropped_values": self.gate.describe(),
            "memory_call": self.memory.describe() if self.memory is not None else "",
            "calls": {k: f.using for k, f in sorted(self.fallbacks.items())},
            "process_list": (f"{self.procs.describe()}, {self.procs.dropped} impossible pid(s) left out"
                             if self.procs is not None else ""),
            "process_utilization": self.util.describe() if self.util is not None else "",
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
            mig.release(g.migs)
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        self.nv = None


def build(table: Any) -> list[Source]:
    return [NvmlSource(events=table.events, event_wait_ms=table.event_wait_ms, gpm=table.gpm, sysfs=table.sysfs,
                       xid_codes_per_device=table.xid_codes_per_device, max_process_samples=table.max_process_samples)]


FAMILY = SourceFamily("nvml", SCHEMA, build)
