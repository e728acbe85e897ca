"""One GPU's round: the readings of readings.py plus those that need code (GPM, NVLink counters,
throttle reasons, remapped rows, energy efficiency, MIG instances, processes and their utilisation),
as samples."""

from __future__ import annotations

import functools
import time
from typing import Any

from xpusense.common import metric_names as m

from ..base import COUNTER, NEARLINE, OFFLINE, REALTIME, Sample
from . import gpm, library, readings, topology
from .ask import Asker
from .device import Gpu
from .mig import MigInstance
from .process_util import ENGINES, ProcessUtilReader
from .processes import ProcessReader

UTIL_LEFT_OUT = "xpusense.nvml.process_utilization.left_out"   # processes over [sources.nvml] max_process_samples
GPM_WHAT = {mid: f"gpm_metric_{mid}" for mid in (*gpm.GPM_METRICS, *gpm.GPM_NVLINK)}   # each reading's state name


class GpuRound:
    def __init__(self, nv: Any, ask: Asker, calls: dict[str, readings.Call], memory: readings.MemoryReader,
                 procs: ProcessReader, util: ProcessUtilReader):
        self.nv = nv
        self.util = util
        self.ask = ask
        self.calls = calls
        self.memory = memory
        self.procs = procs
        # Each tier's readings with their extra labels as a dict, built once (not filtered and
        # converted again for every GPU of every round).
        self.by_tier = {t: [(r, dict(r.labels)) for r in readings.READINGS if r.tier == t]
                        for t in (REALTIME, NEARLINE, OFFLINE)}

    def read(self, g: Gpu, call: str) -> Any:
        return self.ask(g, call, lambda: self.calls[call](g.handle))

    def collect(self, g: Gpu, tier: str) -> list[Sample]:
        cache: dict[str, Any] = {}
        out = []
        labels = g.labels
        for r, extra in self.by_tier[tier]:
            if r.call not in cache:
                cache[r.call] = self.read(g, r.call)
            raw = cache[r.call]
            value = None if raw is None else r.convert(raw)
            if value is not None:
                out.append(Sample(r.name, value, r.unit, {**labels, **extra}, r.kind))
        if tier == REALTIME:
            if cache.get("utilization") is not None:
                accumulate_busy(g, cache["utilization"].gpu / 100.0)
            if g.gpm_stream is not None:
                out += self.gpm(g, g.gpm_stream, g.id, g.labels, nvlink_rates=bool(
                    self.ask.states.unsupported(g.id, "nvlink")))
            out += self.nvlink(g)
            out += self.mig(g)
            out += self.process_utilization(g)
        elif tier == OFFLINE:
            out += self.remapped(g)
            out += efficiency(g, cache.get("energy"))
        elif tier == NEARLINE:
            out += self.throttle(g)   # nearline: a rule judges a reason sustained over a minute (diagnosis)
            out += self.processes(g)
            out += self.placement(g)
        return out

    def gpm(self, g: Gpu, stream: gpm.GpmStream, dev: str, labels: dict[str, str], nvlink_rates: bool) -> list[Sample]:
        """GPM metrics of a GPU or GPU instance since its last sample; a failed sample is no data
        for that device this round only."""
        now = time.monotonic()
        results = self.ask(g, "gpm", lambda: stream.read(now), dev)
        out = []
        for mid, rc, value in results or ():
            what = GPM_WHAT.get(mid) or f"gpm_metric_{mid}"
            if rc != library.SUCCESS:
                self.ask.failed(g, what, rc, library.error_text(self.nv, rc), now, dev)
                continue
            self.ask.ok(dev, what)
            if mid in gpm.GPM_METRICS:
                name, scale, unit = gpm.GPM_METRICS[mid]
                out.append(Sample(name, value * scale, unit, dict(labels)))
            elif mid in gpm.GPM_NVLINK and nvlink_rates:
                # Counters from field values are preferred; GPM rates stand in where they fail.
                out.append(Sample("xpusense.accelerator.interconnect.throughput", value * 2**20, "By/s",
                                  {**labels, "link_type": "NVLink", "direction": gpm.GPM_NVLINK[mid]}))
        return out

    def nvlink(self, g: Gpu) -> list[Sample]:
        if g.nvlinks == 0:
            return []
        vals = self.read(g, "nvlink")
        if vals is None:
            return []
        (_, rx_kib), (_, tx_kib) = vals
        return [Sample("xpusense.accelerator.interconnect.io", float(v) * 1024, "By",
                       {**g.labels, "link_type": "NVLink", "direction": d}, COUNTER)
                for d, v in (("receive", rx_kib), ("transmit", tx_kib))]

    def mig(self, g: Gpu) -> list[Sample]:
        """Per GPU instance: memory from its MIG device handle, GPM from nvmlGpmMigSampleGet."""
        if not g.mig:
            return []
        out = []
        for inst in g.migs:
            out += self.mig_instance(g, inst)
        out.append(Sample("xpusense.accelerator.mig.instances", float(len(g.migs)), "{instance}", dict(g.labels)))
        return out

    def mig_instance(self, g: Gpu, inst: MigInstance) -> list[Sample]:
        out = []
        mem = self.ask(g, "memory", lambda: self.memory.read(inst.handles[0]), inst.id)
        if mem is not None:
            out += [Sample("hw.gpu.memory.usage", float(mem.used), "By", inst.labels),
                    Sample("hw.gpu.memory.limit", float(mem.total), "By", inst.labels),
                    Sample("xpusense.accelerator.memory.free", float(mem.free), "By", inst.labels)]
            share = readings.used_share(mem)
            if share is not None:
                out.append(Sample("hw.gpu.memory.utilization", share, "1", inst.labels))
        if inst.gpm is not None:
            out += self.gpm(g, inst.gpm, inst.id, inst.labels, nvlink_rates=False)
        return out

    def throttle(self, g: Gpu) -> list[Sample]:
        mask = self.read(g, "throttle")
        if mask is None:
            return []
        return [Sample("xpusense.accelerator.throttle", 1.0 if mask & bit else 0.0, "1",
                       {**g.labels, "reason": reason}) for bit, reason in readings.THROTTLE_REASONS.items()]

    def remapped(self, g: Gpu) -> list[Sample]:
        r = self.read(g, "remapped_rows")
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

    def placement(self, g: Gpu) -> list[Sample]:
        """The PCIe link's capacity (with the GPU's switch group) and the NUMA node (topology.py)."""
        out = []
        link = self.read(g, "pcie_link")
        capacity = None if link is None else topology.link_capacity(*link)
        if capacity is not None:
            labels = {**g.labels, **({"pcie_switch": g.pcie_switch} if g.pcie_switch else {})}
            out.append(Sample(m.PCIE_LINK_CAPACITY, capacity, "By/s", labels))
        if g.numa_node is not None:
            out.append(Sample(m.NUMA_NODE, float(g.numa_node), "{node}", dict(g.labels)))
        return out

    def process_lists(self, g: Gpu) -> list[tuple[MigInstance | None, Any]]:
        """(instance or None for the whole GPU, processes) per list read this round. With MIG on,
        per instance (their handles answer without the MIG monitor capability)."""
        if g.mig and g.migs:
            lists = []
            for inst in g.migs:
                got = [self.read_processes(g, h, inst.id) for h in inst.handles]
                if any(x is not None for x in got):
                    lists.append((inst, [p for x in got if x for p in x]))
            return lists
        procs = self.read_processes(g, g.handle, g.id)
        return [] if procs is None else [(None, procs)]

    def process_utilization(self, g: Gpu) -> list[Sample]:
        """Each process's share of each engine since the last round: one call per GPU (with MIG on,
        per MIG device handle: nvml.h calls it unsupported on MIG-enabled GPUs, so it is mostly absent)."""
        if g.mig:
            targets = [(inst.id, inst.labels, h) for inst in g.migs for h in inst.handles]
        else:
            targets = [(g.id, g.labels, g.handle)]
        out = []
        for dev, labels, h in targets:
            for p in self.ask(g, "process_utilization", functools.partial(self.util.read, h), dev) or ():
                out += [Sample(m.PROCESS_UTILIZATION, share, "1", {**labels, "pid": str(p.pid), "engine": engine})
                        for engine, share in zip(ENGINES, p.shares)]
            left_out = self.util.left_out.get(library.handle_key(h))
            if left_out:     # from the first time the bound was hit
                out.append(Sample(UTIL_LEFT_OUT, float(left_out), "{process}", dict(labels), COUNTER))
        return out

    def read_processes(self, g: Gpu, handle: Any, dev: str) -> Any:
        return self.ask(g, "processes", lambda: self.procs.read(handle), dev)

    def processes(self, g: Gpu) -> list[Sample]:
        out = []
        lists = self.process_lists(g)
        for inst, procs in lists:
            labels = inst.labels if inst is not None else g.labels
            out += [Sample("xpusense.accelerator.process.memory.usage", float(p.used_bytes), "By",
                           {**labels, "pid": str(p.pid)}) for p in procs if p.used_bytes is not None]
        if lists:
            out.append(Sample("xpusense.accelerator.processes", float(sum(len(p) for _, p in lists)), "{process}",
                              dict(g.labels)))
        return out


def accumulate_busy(g: Gpu, util: float) -> None:
    now = time.monotonic()
    if g.last_util_t is not None:
        dt = now - g.last_util_t
        g.busy_s += util * dt
        g.busy_span_s += dt
    g.last_util_t = now


def efficiency(g: Gpu, energy_mj: Any) -> list[Sample]:
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
