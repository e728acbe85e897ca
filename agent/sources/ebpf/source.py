"""The Source every eBPF probe is: plan, what the loader process attached, maps -> samples.

Which maps become which metrics is data in `xpusense.probes.specs`; a map's key decoder turns its
keys into labels (cgroup, process, family, netdev here; disk and iface in the probes that own them).
Counters are read at the realtime tier, histograms (log2 buckets, cumulative counts) at the nearline
tier. Every probe also reports its cost from bpf_stats: run_cnt and run_time_ns of its programs.
The programs are compiled, loaded and attached by the loader process (loadproc.py); a source holds
its probe's fds (handover.ProbeHandle) and reads the maps with the bpf syscall (bpfmap.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from xpusense.probes import specs

from ..base import COUNTER, GAUGE, HISTOGRAM, NEARLINE, REALTIME, Sample, Source, SourceError, Unavailable
from .handover import ProbeHandle
from .loader import EbpfLoader, Plan
from .procfs import CgroupNames, cgroup2_root, parse_fdinfo

log = logging.getLogger("xpusense.agent.sources.ebpf")

FAMILIES = ("ipv4", "ipv6")


def hist_sample(name: str, unit: str, labels: dict, slots: Iterable[int], sum_raw: float, scale: float) -> Sample:
    """log2 slots from a map -> a histogram Sample: bounds in seconds, counts cumulative over buckets."""
    slots = [int(x) for x in slots]
    counts, total = [], 0
    for c in slots:
        total += c
        counts.append(total)
    return Sample(name, sum_raw * scale, unit, labels, HISTOGRAM,
                  bounds=specs.log2_bounds_s(len(slots)), counts=tuple(counts))


def _field(value: Any, name: str) -> Any:
    if name == "value":
        return value.value if hasattr(value, "value") else value
    return getattr(value, name)


class _Summed:
    """Per-CPU values summed field by field (bcc returns one struct per possible CPU)."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


def sum_percpu(value: Any) -> Any:
    """A per-CPU map value (a list of one value per CPU) summed; any other value as it is."""
    if not isinstance(value, list) or not value:
        return value
    first = value[0]
    if isinstance(first, ctypes.Structure):
        fields = {}
        for field in first._fields_:
            name = field[0]
            if isinstance(getattr(first, name), ctypes.Array):
                arrays = [getattr(v, name) for v in value]
                fields[name] = [sum(col) for col in zip(*arrays)]
            else:
                fields[name] = sum(getattr(v, name) for v in value)
        return _Summed(**fields)
    return _Summed(value=sum(int(v.value if hasattr(v, "value") else v) for v in value))


class EbpfSource(Source):
    """One probe: plan (feature tests), compiled programs from the loader, attach, read maps."""

    probe: ClassVar[str] = ""
    tiers = (REALTIME, NEARLINE)

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        cls.name = f"ebpf.{cls.probe}"

    def __init__(self, loader: EbpfLoader):
        self.loader = loader
        self.cfg = loader.cfg
        self.spec = specs.PROBES[self.probe]
        self.handle: ProbeHandle | None = None          # the probe's fds while set up
        self.plan_: Plan | None = None
        self._attached: list[tuple[str, str]] = []     # (kind, target) for describe
        self._prev_stats: tuple[int, int] | None = None
        self.setup_s: float | None = None
        self._cgroups: CgroupNames | None = None
        loader.register(self.probe, self.plan_extra)

    @property
    def planned(self) -> Plan:
        """The plan setup() made (the map readers run only after it)."""
        if self.plan_ is None:
            raise SourceError(f"{self.name} is not set up")
        return self.plan_

    # -- hooks for subclasses
    def plan_extra(self, plan: Plan) -> None:
        """Probe-specific feature tests at plan time (libraries, interfaces) and what the loader process
        attaches or writes first (plan.attach); raise Unavailable."""

    def after_attach(self) -> None:
        """Catch up on state from before the programs ran (e.g. fds already open)."""

    def detach(self) -> None:
        """What closing the probe's fds does not undo (tc filters live in the kernel)."""

    # -- Source interface
    def setup(self) -> None:
        t0 = time.perf_counter()
        self.loader.check_environment()
        self.plan_ = self.loader.plan(self.probe)
        self.handle = self.loader.acquire(self.probe)
        self._attached = list(self.handle.attached)
        try:
            self.after_attach()
        except BaseException as e:
            self.close()
            if isinstance(e, Unavailable):
                raise
            raise Unavailable(f"{self.probe}: setting up after attaching failed: {type(e).__name__}: {e}") from e
        for note in self.plan_.notes:
            log.warning("%s: %s", self.name, note)
        self.setup_s = time.perf_counter() - t0

    def close(self) -> None:
        if self.handle is None:
            return
        try:
            self.detach()
        finally:
            self.handle = None
            self._attached = []
            self.loader.release(self.probe)

    def collect(self, tier: str) -> list[Sample]:
        if self.handle is None:
            raise SourceError(f"{self.name} is not set up")
        out = self.read_maps(tier)
        if tier == REALTIME:
            out += self.cost_samples()
        return out

    def describe(self) -> dict:
        d = {"probe": self.probe, "summary": self.spec.summary, "attach_kind": self.spec.attach_kind}
        d.update(self.loader.describe_plan(self.probe))
        if self._attached:
            d["attached"] = [f"{k} {t}" for k, t in self._attached]
        if self.loader.compile_s is not None:
            d["compile_s"] = round(self.loader.compile_s, 3)
            d["compile"] = self.loader.compile_mode
        if self.loader.loader_info:
            d["loader"] = self.loader.loader_info
        if self.loader.headers:
            d["kernel_headers"] = self.loader.headers
        d["bpf_stats"] = self.loader.stats_state
        if self.setup_s is not None:
            d["setup_s"] = round(self.setup_s, 3)
        return d

    # -- helpers
    def program_stats(self) -> list[dict]:
        """bpf_stats of this probe's programs: [{fn, prog_id, run_cnt, run_time_ns}] from fdinfo."""
        out = []
        for fn, fd in self.handle.progs if self.handle else []:
            try:
                with open(f"{self.cfg.procfs}/self/fdinfo/{fd}") as fh:
                    info = parse_fdinfo(fh.read())
            except OSError:
                continue
            out.append({"fn": fn, "prog_id": info.get("prog_id", 0), "run_cnt": info.get("run_cnt", 0),
                        "run_time_ns": info.get("run_time_ns", 0)})
        return out

    def cost_samples(self) -> list[Sample]:
        if not self.loader.stats.on:
            return []
        stats = self.program_stats()
        cnt = sum(s["run_cnt"] for s in stats)
        ns = sum(s["run_time_ns"] for s in stats)
        labels = {"probe": self.probe}
        out = [Sample("xpusense.ebpf.probe.events", float(cnt), "{event}", labels, COUNTER),
               Sample("xpusense.ebpf.probe.run_time", ns / 1e9, "s", dict(labels), COUNTER)]
        prev_cnt, prev_ns = self._prev_stats or (0, 0)
        if cnt > prev_cnt:
            out.append(Sample("xpusense.ebpf.probe.ns_per_event", (ns - prev_ns) / (cnt - prev_cnt), "ns",
                              dict(labels), GAUGE))
        self._prev_stats = (cnt, ns)
        return out

    def table(self, name: str) -> Any:
        if self.handle is None:
            raise SourceError(f"{self.name} is not set up")
        return self.handle.table(name)

    def key_labels(self, decoder: str, key: Any, value: Any) -> dict[str, str] | None:
        """Map key (and value, for comm) -> labels; None to skip the entry."""
        if decoder == "cgroup":
            return {"cgroup": self.cgroup_label(int(key.value))}
        if decoder == "process":
            comm = bytes(value.comm).split(b"\0", 1)[0].decode(errors="replace") if hasattr(value, "comm") else ""
            return {"pid": str(int(key.value)), "process": comm}
        if decoder == "family":
            idx = int(key.value)
            return {"family": FAMILIES[idx]} if idx < len(FAMILIES) else None
        if decoder == "netdev":
            return {"device": bytes(key.name).split(b"\0", 1)[0].decode(errors="replace")}
        raise ValueError(f"unknown key decoder {decoder!r}")

    def entries(self, decoder: str, table: Any) -> list[tuple[Any, Any, dict]]:
        """(key, value with per-CPU values summed, labels) of every entry of a map worth reporting."""
        out = []
        for key, raw in table.items():
            value = sum_percpu(raw)
            labels = self.key_labels(decoder, key, value)
            if labels is not None:
                out.append((key, value, labels))
        return out

    def read_maps(self, tier: str) -> list[Sample]:
        metrics = self.planned.metrics(tier)
        decoders = dict(self.spec.maps)
        out: list[Sample] = []
        for map_name in dict.fromkeys(m.map for m in metrics):
            mine = [m for m in metrics if m.map == map_name]
            table = self.table(map_name)
            entries = self.entries(decoders[map_name], table)
            for _key, value, labels in entries:
                for m in mine:
                    lab = {**labels, **dict(m.labels)}
                    if m.kind == HISTOGRAM:
                        out.append(hist_sample(m.name, m.unit, lab, getattr(value, m.field),
                                               float(_field(value, m.sum_field)), m.scale))
                    else:
                        out.append(Sample(m.name, float(_field(value, m.field)) * m.scale, m.unit, lab, m.kind))
            if tier == NEARLINE:
                self.forget_dead(decoders[map_name], table, entries)
        return out

    def cgroup_label(self, cgid: int) -> str:
        if self._cgroups is None:
            root = self.cfg.cgroupfs or cgroup2_root(self.cfg.procfs)
            self._cgroups = CgroupNames(root)
        return self._cgroups.label(cgid)

    def forget_dead(self, decoder: str, table: Any, entries: list[tuple[Any, Any, dict]]) -> None:
        """After reporting them once more, drop entries of exited processes and removed cgroups."""
        procfs = self.cfg.procfs
        for key, _value, _labels in entries:
            gone = False
            if decoder == "process":
                gone = not os.path.exists(f"{procfs}/{int(key.value)}")
            elif decoder == "cgroup" and self._cgroups is not None:
                gone = self._cgroups.gone(int(key.value))
            if gone:
                try:
                    del table[key]
                except KeyError:
                    pass
