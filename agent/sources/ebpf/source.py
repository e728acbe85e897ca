"""The Source every eBPF probe is: its plan, what the loader process attached, maps -> samples.

Which maps become which metrics is data in `xpusense.probes.specs`; a map's key decoder turns its
keys into labels (cgroup, process, family, netdev here; disk and iface in the probes that own them).
Counters are read at the realtime tier, histograms at the nearline tier; every probe also reports
its own cost from bpf_stats (run_cnt and run_time_ns of its programs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from xpusense.probes import specs

from ..base import COUNTER, GAUGE, HISTOGRAM, NEARLINE, REALTIME, Sample, Source, SourceError, Unavailable
from .bpfmap import BpfMap, ProgStats
from .loader import EbpfLoader, Plan
from .probe_handle import ProbeHandle
from .procfs import CgroupNames, cgroup2_root

log = logging.getLogger("xpusense.agent.sources.ebpf")

FAMILIES = ("ipv4", "ipv6")
FORGET_EVERY_S = 15.0      # realtime-only maps: how often exited processes / removed cgroups are dropped
RESEND_UNCHANGED_S = 15.0  # an unchanged series is sent again after this long (tiers.ChangeFilter)
REUSE_MAX_S = 15.0         # maps not read again while the programs have not run: at most this long


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
    """Per-CPU values summed field by field, each field when it is first read (a realtime round
    reads counters, not the histogram's slots). Arrays are summed element by element, except
    strings (char arrays: a process's name), where the first CPU's that is set is taken."""

    def __init__(self, per_cpu: list):
        self._cpus = per_cpu

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        vals = [getattr(v, name) for v in self._cpus]
        first = vals[0]
        if isinstance(first, bytes):
            got: Any = next((v for v in vals if v), first)
        elif isinstance(first, ctypes.Array):
            got = [sum(col) for col in zip(*vals)]
        else:
            got = sum(vals)
        self.__dict__[name] = got
        return got


class _SummedScalar:
    def __init__(self, value: int):
        self.value = value


def sum_percpu(value: Any) -> Any:
    """A per-CPU map value (a list of one value per CPU) summed; any other value as it is."""
    if not isinstance(value, list) or not value:
        return value
    if isinstance(value[0], ctypes.Structure):
        return _Summed(value)
    return _SummedScalar(sum(int(v.value if hasattr(v, "value") else v) for v in value))


class EbpfSource(Source):
    """One probe: plan (feature tests), compiled programs from the loader, attach, read maps."""

    probe: ClassVar[str] = ""
    tiers = (REALTIME, NEARLINE)
    # Most of a probe's series stand still between rounds (an idle disk, a process between
    # launches, the probe's own up/errors): the tier loop sends those again only every 15 s.
    resend_unchanged_s = RESEND_UNCHANGED_S
    # A round is a few bpf syscalls that never block: the probes' rounds of a tier run one after the
    # other in one thread of the tier loop (7 probes: 2 threads, not 14 each woken every second).
    worker = "ebpf"

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
        self._forgot: dict[str, float] = {}             # map -> when its dead keys were last dropped
        self._prog_stats = ProgStats()
        self._reads_by_tier: dict[str, list[tuple[str, str, list[tuple[specs.Metric, dict]]]]] = {}
        self._nearline_maps: set[str] | None = None      # maps with metrics of the nearline tier
        # tier -> (run_cnt of the programs, BpfMap.generation, when read, the samples then): see above
        self._last_read: dict[str, tuple[int, int, float, list[Sample]]] = {}
        self.reads_reused = 0
        loader.register(self.probe, self._plan)

    @property
    def planned(self) -> Plan:
        """The plan setup() made (the map readers run only after it)."""
        if self.plan_ is None:
            raise SourceError(f"{self.name} is not set up")
        return self.plan_

    def _plan(self, plan: Plan) -> None:
        """The loader fills every slot queue of this variant (specs.Slots), then the probe's own tests."""
        for sl in self.slots_of(plan):
            plan.attach.setdefault("map_init", {})[sl.free] = {"push": list(range(1, sl.capacity))}
        self.plan_extra(plan)

    def slots_of(self, plan: Plan) -> list[specs.Slots]:
        return [sl for sl in self.spec.slots if not sl.variants or plan.variant.name in sl.variants]

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
        self.loader.prestart()          # it imports bcc while the probes are planned
        self.plan_ = self.loader.plan(self.probe)
        self._reads_by_tier, self._nearline_maps, self._last_read = {}, None, {}
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
        stats = self.program_stats() if self.loader.stats.on else None   # before the maps: see _maps
        out = self._maps(tier, stats)
        if tier == REALTIME:
            out += self.cost_samples(stats)
        return out

    def _maps(self, tier: str, stats: list[dict] | None) -> list[Sample]:
        """read_maps(tier), or the samples of its last read again when nothing can have changed since:
        only its programs write a probe's maps, so while their run_cnt stands still (counted only under
        BPF_ENABLE_STATS, which nothing else can switch off), no map was written from user space and no
        dead keys are due to be dropped, the maps hold what they held (for at most REUSE_MAX_S)."""
        runs = None
        if (stats is not None and len(stats) == len(self.handle.progs if self.handle else ())
                and self.loader.stats.state.startswith("on (BPF_ENABLE_STATS")):
            runs = sum(s["run_cnt"] for s in stats)
        now = time.monotonic()
        last = self._last_read.get(tier)
        if (runs is not None and last is not None and last[0] == runs and last[1] == BpfMap.generation
                and now - last[2] < REUSE_MAX_S and not self._forget_due(tier, now)):
            self.reads_reused += 1
            return [dataclasses.replace(s, labels=dict(s.labels)) for s in last[3]]
        gen = BpfMap.generation
        out = self.read_maps(tier)
        if runs is not None and BpfMap.generation == gen:     # this round wrote nothing either
            self._last_read[tier] = (runs, gen, now, [dataclasses.replace(s, labels=dict(s.labels)) for s in out])
        else:
            self._last_read.pop(tier, None)
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
        if self.handle is not None:
            d["load_attach_s"] = round(self.handle.attach_s, 3)
        d["map_reads_reused"] = self.reads_reused     # rounds whose programs had not run (see _maps)
        return d

    # -- helpers
    def program_stats(self) -> list[dict]:
        """bpf_stats of this probe's programs: [{fn, prog_id, run_cnt, run_time_ns}], one bpf syscall each."""
        out = []
        for fn, fd in self.handle.progs if self.handle else []:
            try:
                prog_id, run_cnt, run_time_ns = self._prog_stats.read(fd)
            except OSError:
                continue
            out.append({"fn": fn, "prog_id": prog_id, "run_cnt": run_cnt, "run_time_ns": run_time_ns})
        return out

    def cost_samples(self, stats: list[dict] | None = None) -> list[Sample]:
        if not self.loader.stats.on:
            return []
        if stats is None:
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
        if decoder == "slots":
            return self.slot_entries(table)
        out = []
        for key, raw in table.items():
            value = sum_percpu(raw)
            labels = self.key_labels(decoder, key, value)
            if labels is not None:
                out.append((key, value, labels))
        return out

    def _slots_spec(self, array: str) -> specs.Slots:
        return next(sl for sl in self.spec.slots if sl.array == array)

    def slot_entries(self, table: Any) -> list[tuple[Any, Any, dict]]:
        """A slots array read through its index: one lookup per key that has a slot, and slot 0
        ("(other)") when keys beyond capacity used it. The entry's key is the index's key (None: 0)."""
        sl = self._slots_spec(table.name)
        found: list[tuple[Any, int, dict]] = []
        for key, val in self.table(sl.index).items():
            slot = int(val.slot if hasattr(val, "slot") else val.value)
            labels = self.key_labels(sl.key, key, val)
            if labels is not None and slot:
                found.append((key, slot, labels))
        other = {"cgroup": "(other)"} if sl.key == "cgroup" else {"pid": "(other)", "process": "(other)"}
        found.append((None, 0, other))
        out = []
        for key, slot, labels in found:
            try:
                value = sum_percpu(table[ctypes.c_uint32(slot)])
            except KeyError:
                continue
            if key is None and not any(isinstance(v := getattr(value, f[0]), int) and v or isinstance(v, list) and any(v)
                                        for f in table.Leaf._fields_):
                continue
            out.append((key, value, labels))
        return out

    def forget_slots(self, table: Any, entries: list[tuple[Any, Any, dict]]) -> None:
        """Keys that are gone (reported once more just now) give their slot back to the programs."""
        sl = self._slots_spec(table.name)
        index, free = self.table(sl.index), self.table(sl.free)
        freed = []
        for key, _value, _labels in entries:
            if key is not None and self.gone(sl.key, key):
                try:
                    val = index[key]
                    del index[key]
                except KeyError:
                    continue
                slot = int(val.slot if hasattr(val, "slot") else val.value)
                if slot:
                    table.zero(ctypes.c_uint32(slot))
                    freed.append(slot)
        if freed:
            for cache in sl.caches:          # no CPU may take a freed slot for the key it last saw
                self.table(cache).zero(ctypes.c_uint32(0))
            for slot in freed:
                free.push(ctypes.c_uint32(slot))

    def _reads(self, tier: str) -> list[tuple[str, str, list[tuple[specs.Metric, dict]]]]:
        """(map, key decoder, [(metric, its own labels)]) of a tier, in the specs' order; worked out
        from the plan once per tier, not every round."""
        got = self._reads_by_tier.get(tier)
        if got is None:
            metrics = self.planned.metrics(tier)
            decoders = dict(self.spec.maps)
            got = [(map_name, decoders[map_name], [(m, dict(m.labels)) for m in metrics if m.map == map_name])
                   for map_name in dict.fromkeys(m.map for m in metrics)]
            self._reads_by_tier[tier] = got
        return got

    def read_maps(self, tier: str) -> list[Sample]:
        out: list[Sample] = []
        for map_name, decoder, mine in self._reads(tier):
            table = self.table(map_name)
            entries = self.entries(decoder, table)
            for _key, value, labels in entries:
                for m, own in mine:
                    lab = {**labels, **own}
                    if m.kind == HISTOGRAM:
                        out.append(hist_sample(m.name, m.unit, lab, getattr(value, m.field),
                                               float(_field(value, m.sum_field)), m.scale))
                    else:
                        out.append(Sample(m.name, float(_field(value, m.field)) * m.scale, m.unit, lab, m.kind))
            if self._forget_now(map_name, tier):
                self.forget_dead(decoder, table, entries)
        return out

    def _forget_due(self, tier: str, now: float) -> bool:
        """Whether a read of `tier` now would drop dead keys of one of its maps (_forget_now, asked
        without marking it done)."""
        if self._nearline_maps is None:
            self._nearline_maps = {m.map for m in self.planned.metrics(NEARLINE)}
        for map_name, _decoder, _mine in self._reads(tier):
            if map_name in self._nearline_maps:
                if tier == NEARLINE:
                    return True
            elif now - self._forgot.get(map_name, -1e9) >= FORGET_EVERY_S:
                return True
        return False

    def _forget_now(self, map_name: str, tier: str) -> bool:
        """Dead keys are dropped in a round that has just reported all of the map's metrics: its
        nearline round when it has nearline ones, else a realtime round at most every FORGET_EVERY_S."""
        if self._nearline_maps is None:
            self._nearline_maps = {m.map for m in self.planned.metrics(NEARLINE)}
        if map_name in self._nearline_maps:
            return tier == NEARLINE
        now = time.monotonic()
        if now - self._forgot.get(map_name, -1e9) < FORGET_EVERY_S:
            return False
        self._forgot[map_name] = now
        return True

    def cgroup_label(self, cgid: int) -> str:
        if self._cgroups is None:
            root = self.cfg.cgroupfs or cgroup2_root(self.cfg.procfs)
            self._cgroups = CgroupNames(root)
        return self._cgroups.label(cgid)

    def gone(self, decoder: str, key: Any) -> bool:
        """The process exited, or the cgroup was removed."""
        if decoder == "process":
            return not os.path.exists(f"{self.cfg.procfs}/{int(key.value)}")
        if decoder == "cgroup" and self._cgroups is not None:
            return self._cgroups.gone(int(key.value))
        return False

    def forget_dead(self, decoder: str, table: Any, entries: list[tuple[Any, Any, dict]]) -> None:
        """After reporting them once more, drop entries of exited processes and removed cgroups."""
        if decoder == "slots":
            self.forget_slots(table, entries)
            return
        for key, _value, _labels in entries:
            if self.gone(decoder, key):
                try:
                    del table[key]
                except KeyError:
                    pass
