"""The one loader all eBPF sources of an agent share (EbpfLoader): feature tests that plan each probe
(variant, -D flags, attach points; no compiling, no root), one loader process for every planned
probe (loader_process.py), what it hands over held per probe (probe_handle.py), and bpf_stats.
A loader that fails, is killed or hangs makes every probe Unavailable with the reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from xpusense.probes import specs

from ..base import Unavailable
from .bpf_stats import BpfStats
from .bpfmap import BpfMap, possible_cpus
from .btf import FUNC, TYPEDEF, Btf, BtfError
from .caps import bpf_capable
from .loader_process import LoaderProcess, loader_argv, take_early
from .probe_handle import ProbeHandle, close_fd
from .procfs import headers_release, sched_info_off

log = logging.getLogger("xpusense.agent.sources.ebpf")

# Host checks a variant can name in specs.Variant.needs: cfg -> why not ("" when fine).
HOST_CHECKS: dict[str, Callable[[SimpleNamespace], str]] = {
    "sched_info": lambda cfg: sched_info_off(cfg.procfs),
}
LOADER_TIMEOUT_S = 120.0     # compile + load + attach; a loader taking longer is killed
LOADER_PROCESSES = 1         # loader processes compiling in parallel, each its share (at most one per CPU);
# 2 gained nothing measurable on a 2-core VM also starting the rest of the agent, for twice the memory


@dataclasses.dataclass
class Plan:
    """What one probe will be built with on this host: chosen variant, -D flags, attach points."""
    probe: specs.Probe
    variant: specs.Variant
    defines: list[tuple[str, str]]
    tracepoints: list[str]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    # what the loader process attaches and writes (loader_main.Builder.attach_probe): tracepoints,
    # raw_tracepoints {name: fn}, uprobes {library, symbols}, tc {...}, map_init {map: [[key, fields]]}
    attach: dict[str, Any] = dataclasses.field(default_factory=dict)

    def cflags(self) -> list[str]:
        return [f"-D{k}={v}" for k, v in self.defines]

    def metrics(self, tier: str | None = None) -> list[specs.Metric]:
        return [m for m in self.probe.metrics
                if (not m.variants or self.variant.name in m.variants) and (tier is None or m.tier == tier)]


def render_c(plans: Iterable[Plan]) -> str:
    """The one translation unit bcc compiles for these plans, with its -D flags in a header comment."""
    plans = list(plans)
    flags = " ".join(f for p in plans for f in p.cflags())
    parts = [f"// xpusense eBPF probes: {', '.join(p.probe.name + '(' + p.variant.name + ')' for p in plans)}\n"
             f"// cflags: {flags or '(none)'}\n"]
    for p in plans:
        parts.append(f'#line 1 "{p.probe.c_file.name}"\n{p.probe.c_text()}')
    return "\n".join(parts)


def attach_points(v: specs.Variant, tps: list[str]) -> dict[str, Any]:
    """What the loader process attaches for these tracepoints: classic ones, and raw ones by event."""
    attach: dict[str, Any] = {}
    if classic := [tp for tp in tps if tp not in v.raw_tracepoints]:
        attach["tracepoints"] = classic
    if v.raw_tracepoints:
        events = [tp.partition(":")[2] for tp in v.raw_tracepoints]
        attach["raw_tracepoints"] = {ev: f"raw_tracepoint__{ev}" for ev in events}
    return attach


class EbpfLoader:
    """Shared by all eBPF sources of one agent: environment checks, plans, one compilation, bpf_stats.

    `cfg` is the checked [sources.ebpf] table (family.SCHEMA, as a namespace).
    """

    def __init__(self, cfg: SimpleNamespace):
        self.cfg = cfg
        self._lock = threading.RLock()
        self._planners: dict[str, Callable[[Plan], None]] = {}
        self._plans: dict[str, Plan | Unavailable] = {}
        self._handles: dict[str, ProbeHandle] = {}     # probe -> what the loader process handed over
        self._errors: dict[str, str] = {}              # probe -> why the loader could not build it
        self._maps: dict[str, BpfMap] = {}
        self._load_error: Unavailable | None = None
        self._loaded = False
        self._users: set[str] = set()
        self.compile_s: float | None = None
        self.compile_mode = ""
        self.loader_info: dict[str, Any] = {}
        self.headers = ""
        self.stats = BpfStats(cfg.procfs)
        self._env_error: Unavailable | None = None
        self._env_checked = False
        self.t_created = time.monotonic()
        self._btf: Btf | None = None
        self._procs: list[LoaderProcess] = []           # started early, asked once planning is done

    @property
    def stats_state(self) -> str:
        return self.stats.state

    # -- registration and plans
    def register(self, probe: str, planner: Callable[[Plan], None]) -> None:
        self._planners[probe] = planner

    def tracefs(self) -> str:
        """The configured tracefs, else the first mounted of bcc's two places (bcc itself is not imported)."""
        if self.cfg.tracefs:
            return str(self.cfg.tracefs)
        for path in ("/sys/kernel/debug/tracing", "/sys/kernel/tracing"):
            if os.path.isdir(os.path.join(path, "events")):
                return path
        return "/sys/kernel/tracing"

    def tracepoint_exists(self, tp: str) -> bool:
        cat, _, ev = tp.partition(":")
        return os.path.isdir(os.path.join(self.tracefs(), "events", cat, ev))

    def plan(self, probe: str) -> Plan:
        """Feature-test `probe` (no compiling, no root needed); raise Unavailable with the reason."""
        with self._lock:
            if probe not in self._plans:
                try:
                    self._plans[probe] = self._make_plan(probe)
                except Unavailable as e:
                    self._plans[probe] = e
            got = self._plans[probe]
            if isinstance(got, Unavailable):
                raise got
            return got

    def _make_plan(self, probe: str) -> Plan:
        spec = specs.PROBES[probe]
        forced = getattr(self.cfg.variants, probe, "")
        candidates = [v for v in spec.variants if not forced or v.name == forced]
        missing_by_variant = []
        tracepoints_missing = False
        for v in candidates:
            missing = [tp for tp in v.tracepoints if not self.tracepoint_exists(tp)]
            if missing:
                tracepoints_missing = True
                missing_by_variant.append(f"{v.name}: no {', '.join(missing)}")
                continue
            kernel_defines, lacks = self._kernel_features(v)
            if lacks:
                missing_by_variant.append(f"{v.name}: {'; '.join(lacks)}")
                continue
            defines, tps = self._optional(v, list(v.defines) + kernel_defines)
            plan = Plan(spec, v, defines, tps, attach=attach_points(v, tps))
            if v is not spec.variants[0] and not forced:
                plan.notes.append(f"fallback variant {v.name} ({v.note}); preferred one unavailable: "
                                  + "; ".join(missing_by_variant))
            planner = self._planners.get(probe)
            if planner:
                try:
                    planner(plan)
                except Unavailable:
                    raise
                except Exception as e:   # a host detail we did not foresee: say it, run the others
                    raise Unavailable(f"{probe}: feature test failed: {type(e).__name__}: {e}") from e
            return plan
        if not tracepoints_missing:
            raise Unavailable(f"{probe}: this kernel offers none of its variants ({'; '.join(missing_by_variant)})")
        where = self.tracefs()
        raise Unavailable(f"{probe}: the kernel lacks the tracepoints it needs ({'; '.join(missing_by_variant)}) "
                          f"under {where}/events; if tracefs is not mounted there, run "
                          f"`mount -t tracefs nodev /sys/kernel/tracing` (scripts/setup-ebpf.sh does it)")

    def _optional(self, v: specs.Variant, defines: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[str]]:
        """The variant's optional tracepoints: their defines 1 (and attached) when present, else 0."""
        tps = list(v.tracepoints)
        for tp, define in v.optional:
            have = self.tracepoint_exists(tp)
            if define not in dict(defines):
                defines.append((define, "1" if have else "0"))
            elif not have:
                defines = [(k, "0" if k == define else val) for k, val in defines]
        for tp, define in v.optional:
            if dict(defines)[define] == "1":
                tps.append(tp)
        return defines, tps

    def _kernel_features(self, v: specs.Variant) -> tuple[list[tuple[str, str]], list[str]]:
        """What a variant needs beyond tracepoints, asked of the kernel's BTF and of /proc:
        (-D defines with struct offsets, what is missing)."""
        lacks = [why for name in v.needs if (why := HOST_CHECKS[name](self.cfg))]
        if not (v.raw_tracepoints or v.btf_offsets or v.btf_functions):
            return [], lacks
        try:
            b = self.btf()
        except BtfError as e:
            return [], [*lacks, str(e)]
        defines = []
        for tp in v.raw_tracepoints:
            event = tp.partition(":")[2]
            if not b.has(TYPEDEF, f"btf_trace_{event}"):
                lacks.append(f"no raw tracepoint {event} (no btf_trace_{event} in the kernel's BTF)")
        for fn in v.btf_functions:
            if not b.has(FUNC, fn):
                lacks.append(f"no BPF helper {fn} (not in the kernel's BTF)")
        for define, struct_name, path in v.btf_offsets:
            try:
                defines.append((define, str(b.member_offset(struct_name, path))))
            except BtfError as e:
                lacks.append(str(e))
        return defines, lacks

    def btf(self) -> Btf:
        """The kernel's BTF (<sysfs>/kernel/btf/vmlinux), read once while planning, let go after loading."""
        if self._btf is None:
            self._btf = Btf(os.path.join(self.cfg.sysfs, "kernel/btf/vmlinux"))
        return self._btf

    def describe_plan(self, probe: str) -> dict:
        got = self._plans.get(probe)
        if got is None:
            try:
                got = self.plan(probe)
            except Unavailable:
                got = self._plans.get(probe)
        if isinstance(got, Plan):
            return {"variant": got.variant.name, "tracepoints": got.tracepoints, "notes": got.notes}
        return {}

    # -- environment
    def check_environment(self) -> None:
        """Raise Unavailable when no probe can run here: privileges, bcc, kernel headers, tracefs."""
        with self._lock:
            if not self._env_checked:
                self._env_checked = True
                try:
                    self._check_environment()
                except Unavailable as e:
                    self._env_error = e
            if self._env_error:
                raise self._env_error

    def _check_environment(self) -> None:
        if not bpf_capable(self.cfg.procfs):
            raise Unavailable(f"eBPF probes need root or CAP_BPF+CAP_PERFMON (and CAP_NET_ADMIN for tc_traffic); "
                              f"the agent runs as uid {os.geteuid()} without them: run it as root (the "
                              f"systemd unit does) or set [sources.ebpf] probes = []")
        # Only found here, never imported: bcc (and the LLVM libbcc maps) lives in the loader process.
        try:
            found = importlib.util.find_spec("bcc") is not None   # Debian's python3-bpfcc, not PyPI's "bcc"
        except (ImportError, ValueError) as e:
            found, why = False, str(e)
        else:
            why = "no module named bcc"
        if not found:
            raise Unavailable(f"bcc's Python module is not importable from {sys.executable} ({why}): install "
                              f"python3-bpfcc and link it into the virtualenv (scripts/setup.sh does both)")
        release = platform.release()
        build = os.path.join(self.cfg.modules_dir, release, "build")
        if os.path.isdir(build):
            hrel = headers_release(os.path.realpath(build))
            if hrel and hrel != release:
                self.headers = f"generic headers {hrel} for kernel {release} (fallback)"
                log.warning("NO KERNEL HEADERS FOR RUNNING KERNEL %s: bcc compiles against %s (%s). Tracepoint, "
                            "uprobe and tc programs are fine; struct offsets come from the kernel's BTF, not headers.",
                            release, hrel, os.path.realpath(build))
            else:
                self.headers = f"{hrel or release} ({os.path.realpath(build)})"
        elif os.environ.get("BCC_KERNEL_SOURCE"):
            self.headers = f"BCC_KERNEL_SOURCE={os.environ['BCC_KERNEL_SOURCE']}"
        elif os.path.exists("/sys/kernel/kheaders.tar.xz"):
            self.headers = "kheaders (CONFIG_IKHEADERS)"
        else:
            raise Unavailable(f"no kernel headers at {build} (bcc compiles the probes at load time): run "
                              f"scripts/setup-ebpf.sh, which installs linux-headers-{release} or links generic "
                              f"headers for kernels without a package")
        if not os.path.isdir(os.path.join(self.tracefs(), "events")):
            raise Unavailable(f"tracefs is not mounted at {self.tracefs()}: run `mount -t tracefs nodev "
                              f"/sys/kernel/tracing` (scripts/setup-ebpf.sh does it)")

    # -- the loader process
    def acquire(self, probe: str) -> ProbeHandle:
        """What the loader process built for `probe`; runs the loader (all planned probes) on first use."""
        with self._lock:
            self.check_environment()
            plan = self.plan(probe)
            if not self._loaded:
                self._load_all()
            if self._load_error is not None:
                raise self._load_error
            if probe in self._errors:
                raise Unavailable(self._errors[probe])
            handle = self._handles.get(probe)
            if handle is None or handle.closed:
                raise Unavailable(f"{probe}: not built (planned after the loader ran; restart the agent)")
            self._users.add(probe)
            if self.cfg.bpf_stats:
                self.stats.enable()
            log.debug("%s: %s", probe, plan.variant.name)
            return handle

    def planned(self) -> list[Plan]:
        """The plans of every registered probe that can run here, in registration (the specs') order."""
        out = []
        for probe in self._planners:
            try:
                out.append(self.plan(probe))
            except Unavailable:
                pass
        return out

    def request(self, plans: list[Plan]) -> dict:
        """What the loader process is asked to build (see loader_main.Builder)."""
        return {"combined": bool(self.cfg.combined_compile), "combined_text": render_c(plans),
                "probes": [{"name": p.probe.name, "text": render_c([p]), "cflags": p.cflags(), "attach": p.attach}
                           for p in plans]}

    def loader_argv(self, fd: int) -> list[str]:
        return loader_argv(fd)

    def prestart(self) -> None:
        """Start the loader processes now, so that they import bcc while the probes are planned here; the
        one `xpusense-agent run` started before its imports (loader_process.start_early) is taken first."""
        with self._lock:
            if not self._procs and not self._loaded:
                early = take_early()
                if early is not None:
                    self._procs.append(early)
                for _ in range(max(1, min(LOADER_PROCESSES, os.cpu_count() or 1)) - len(self._procs)):
                    try:
                        self._procs.append(LoaderProcess(self.loader_argv))
                    except Unavailable as e:
                        self._load_error = e
                        break

    def _load_all(self) -> None:
        t0 = time.perf_counter()
        self.prestart()
        plans = self.planned()
        self._loaded = True
        procs, self._procs = self._procs, []
        if self._btf is not None:      # planning is over: a few MB the agent does not keep
            self._btf.close()
            self._btf = None
        # The probes in the specs' order, dealt to the loader processes in turn: each compiles its
        # share in one clang run (clang's fixed cost is about half of a run of all six here).
        if self._load_error is not None:
            for proc in procs:
                proc.close()
            return
        pairs = [(proc, plans[i::len(procs)]) for i, proc in enumerate(procs)]
        for proc, group in pairs:
            if group:
                proc.send(self.request(group))
        for proc, group in pairs:
            if not group:
                proc.close()
        deadline = time.monotonic() + LOADER_TIMEOUT_S
        manifests = []
        for proc, group in [(p, g) for p, g in pairs if g]:
            try:
                manifest, fds = proc.receive(max(0.0, deadline - time.monotonic()), LOADER_TIMEOUT_S)
            except Unavailable as e:
                self._group_failed(group, str(e))
                continue
            try:
                self._take(manifest, fds, group)
                manifests.append(manifest)
            except Unavailable as e:    # the loader could not run bcc at all
                self._group_failed(group, str(e))
            except Exception as e:      # a manifest we cannot read: nothing of it is used
                for fd in fds:
                    close_fd(fd)
                self._group_failed(group, f"the eBPF loader's answer could not be used: {type(e).__name__}: {e}")
        if manifests:
            self._summarise(manifests, time.perf_counter() - t0)

    def _group_failed(self, group: list[Plan], reason: str) -> None:
        log.warning("eBPF probes %s unavailable: %s", [p.probe.name for p in group], reason)
        for p in group:
            self._errors[p.probe.name] = reason

    def _summarise(self, manifests: list[dict], total_s: float) -> None:
        self.compile_s = max(float(m.get("compile_s", 0.0)) for m in manifests)
        modes = sorted({str(m.get("compile_mode", "")) for m in manifests})
        self.compile_mode = (f"{len(manifests)} loader processes in parallel: " if len(manifests) > 1 else "") + \
            "; ".join(modes)
        worst = max(manifests, key=lambda m: float(m.get("done_after_s") or 0.0))
        self.loader_info = {"processes": len(manifests), "pids": [m.get("pid") for m in manifests],
                            "peak_rss_mb": [round(m.get("vm_hwm_kb", 0) / 1024, 1) for m in manifests],
                            "compile_s": round(self.compile_s, 3),
                            "attach_s": round(max(float(m.get("attach_s", 0.0)) for m in manifests), 3),
                            "total_s": round(total_s, 3), "request_after_s": worst.get("request_after_s"),
                            "done_after_s": worst.get("done_after_s"),
                            "compiled_ahead": any(m.get("compiled_ahead") for m in manifests),
                            "kallsyms": "; ".join(sorted({str(m.get("kallsyms", "")) for m in manifests})),
                            "ahead": "; ".join(str(m["ahead"]) for m in manifests if m.get("ahead")) or "not asked"}
        for m in manifests:
            if m.get("combined_error"):
                log.warning("compiling eBPF probes at once failed (%s); compiled each on its own", m["combined_error"])
            if m.get("bcc_output"):
                log.debug("bcc output:\n%s", m["bcc_output"])
        log.info("eBPF loader processes built %s in %.2f s (compile %.2f s, %s; compiling ahead: %s), peak RSS %.0f MB; "
                 "the agent holds the fds; from the loader's start: request %.2f s, done %.2f s", sorted(self._handles),
                 total_s, self.compile_s, self.compile_mode, self.loader_info["ahead"], max(self.loader_info["peak_rss_mb"]),
                 float(worst.get("request_after_s") or 0.0), float(worst.get("done_after_s") or 0.0))

    def _take(self, manifest: dict, fds: list[int], plans: list[Plan]) -> None:
        """The manifest and its fds -> maps, one handle per probe built, reasons for the others."""
        if not manifest.get("ok"):
            for fd in fds:
                close_fd(fd)
            if manifest.get("traceback"):
                log.debug("eBPF loader traceback:\n%s", manifest["traceback"])
            raise Unavailable(str(manifest.get("reason", "the eBPF loader failed")))
        ncpus = possible_cpus(self.cfg.sysfs)
        used = set()
        for m in manifest["maps"]:
            self._maps[m["name"]] = BpfMap.from_manifest(fds[m["fd"]], m, ncpus)
            used.add(m["fd"])
        by_name = {p.probe.name: p for p in plans}
        for probe, why in manifest.get("compile_errors", {}).items():
            self._errors[probe] = f"{probe}: bcc could not compile {by_name[probe].probe.c_file.name}: {why}"
        for probe, got in manifest["probes"].items():
            if not got.get("ok"):
                self._errors[probe] = str(got.get("reason"))
                continue
            progs = [(p["fn"], fds[p["fd"]]) for p in got["progs"]]
            links = [{**link, "fd": None if link["fd"] is None else fds[link["fd"]]} for link in got["links"]]
            used.update(p["fd"] for p in got["progs"])
            used.update(link["fd"] for link in got["links"] if link["fd"] is not None)
            self._handles[probe] = ProbeHandle(probe, self._maps, progs, links, got.get("extra", {}), self.tracefs(),
                                               float(got.get("attach_s", 0.0)))
        for i, fd in enumerate(fds):
            if i not in used:
                close_fd(fd)
        for p in plans:
            if p.probe.name not in self._handles and p.probe.name not in self._errors:
                self._errors[p.probe.name] = f"{p.probe.name}: the eBPF loader did not build it"

    def release(self, probe: str) -> None:
        with self._lock:
            handle = self._handles.get(probe)
            if handle is not None:
                handle.close()
            self._users.discard(probe)
            if self._users:
                return
            for h in self._handles.values():
                h.close()
            for m in self._maps.values():
                m.close()
            self._handles.clear()
            self._maps.clear()
            self._errors.clear()
            self._load_error = None
            self._loaded = False
            self.stats.disable()
