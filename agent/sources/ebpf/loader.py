"""The one loader all eBPF sources of an agent share: feature tests, one compilation, bpf_stats.

Planning a probe (`EbpfLoader.plan`) picks the first variant of its spec whose tracepoints exist
under tracefs, sets the -D defines of that variant and of its optional tracepoints, and runs the
source's own feature test (a library, interfaces); it compiles nothing and needs no root. Compiling
is bcc's main cost (clang on every load), so on first use the C of every probe that planned is
compiled once, as one translation unit (`render_c`); if that fails, each probe is compiled on its own
so one broken probe cannot take the others down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

from xpusense.probes import specs

from ..base import Unavailable
from .bpf_stats import BpfStats
from .procfs import headers_release, read_cap_eff

log = logging.getLogger("xpusense.agent.sources.ebpf")

CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 12, 21, 38, 39


@dataclasses.dataclass
class Plan:
    """What one probe will be built with on this host: chosen variant, -D flags, attach points."""
    probe: specs.Probe
    variant: specs.Variant
    defines: list[tuple[str, str]]
    tracepoints: list[str]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def cflags(self) -> list[str]:
        return [f"-D{k}={v}" for k, v in self.defines]

    def metrics(self, tier: str | None = None) -> list[specs.Metric]:
        return [m for m in self.probe.metrics
                if (not m.variants or self.variant.name in m.variants) and (tier is None or m.tier == tier)]


@contextlib.contextmanager
def _capture_stderr() -> Iterator[dict[str, str]]:
    """Collect what bcc/clang print on fd 2 (warnings, compile errors) so it can be logged and quoted."""
    buf = {"text": ""}
    try:
        saved = os.dup(2)
    except OSError:
        yield buf
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        try:
            sys.stderr.flush()
            os.dup2(tmp.fileno(), 2)
            yield buf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            buf["text"] = tmp.read().decode(errors="replace")


def _first_errors(text: str, n: int = 3) -> str:
    lines = [line.strip() for line in text.splitlines() if "error" in line.lower()]
    return "; ".join(lines[:n]) or text.strip()[-300:]


def render_c(plans: Iterable[Plan]) -> str:
    """The one translation unit bcc compiles for these plans, with its -D flags in a header comment."""
    plans = list(plans)
    flags = " ".join(f for p in plans for f in p.cflags())
    parts = [f"// xpusense eBPF probes: {', '.join(p.probe.name + '(' + p.variant.name + ')' for p in plans)}\n"
             f"// cflags: {flags or '(none)'}\n"]
    for p in plans:
        parts.append(f'#line 1 "{p.probe.c_file.name}"\n{p.probe.c_text()}')
    return "\n".join(parts)


class EbpfLoader:
    """Shared by all eBPF sources of one agent: environment checks, plans, one compilation, bpf_stats.

    `cfg` is the checked [sources.ebpf] table (family.SCHEMA, as a namespace).
    """

    def __init__(self, cfg: SimpleNamespace):
        self.cfg = cfg
        self._lock = threading.RLock()
        self._planners: dict[str, Callable[[Plan], None]] = {}
        self._plans: dict[str, Plan | Unavailable] = {}
        self._objects: dict[str, Any] = {}          # probe -> bcc BPF object holding its programs
        self._compile_errors: dict[str, str] = {}
        self._compiled = False
        self._users: set[str] = set()
        self._all_objects: list[Any] = []
        self.compile_s: float | None = None
        self.compile_mode = ""
        self.headers = ""
        self.stats = BpfStats(cfg.procfs)
        self._env_error: Unavailable | None = None
        self._env_checked = False
        self.t_created = time.monotonic()

    @property
    def stats_state(self) -> str:
        return self.stats.state

    # -- registration and plans
    def register(self, probe: str, planner: Callable[[Plan], None]) -> None:
        self._planners[probe] = planner

    def tracefs(self) -> str:
        if self.cfg.tracefs:
            return str(self.cfg.tracefs)
        try:
            import bcc
            return str(bcc.TRACEFS)
        except Exception:
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
        for v in candidates:
            missing = [tp for tp in v.tracepoints if not self.tracepoint_exists(tp)]
            if missing:
                missing_by_variant.append(f"{v.name}: no {', '.join(missing)}")
                continue
            defines = list(v.defines)
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
            plan = Plan(spec, v, defines, tps)
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
        where = self.tracefs()
        raise Unavailable(f"{probe}: the kernel lacks the tracepoints it needs ({'; '.join(missing_by_variant)}) "
                          f"under {where}/events; if tracefs is not mounted there, run "
                          f"`mount -t tracefs nodev /sys/kernel/tracing` (scripts/setup-ebpf.sh does it)")

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
        if os.geteuid() != 0:
            caps = read_cap_eff(self.cfg.procfs)
            need = (1 << CAP_BPF) | (1 << CAP_PERFMON)
            if caps & need != need and not caps & (1 << CAP_SYS_ADMIN):
                raise Unavailable(f"eBPF probes need root or CAP_BPF+CAP_PERFMON (and CAP_NET_ADMIN for tc_traffic); "
                                  f"the agent runs as uid {os.geteuid()} without them: run it as root (the "
                                  f"systemd unit does) or set [sources.ebpf] probes = []")
        try:
            import bcc  # noqa: F401  (Debian's python3-bpfcc; the PyPI "bcc" is another project)
            from bcc import BPF  # noqa: F401
        except Exception as e:
            raise Unavailable(f"bcc's Python module is not importable from {sys.executable} ({e}): install "
                              f"python3-bpfcc and link it into the virtualenv (scripts/setup.sh does both)") from e
        release = platform.release()
        build = os.path.join(self.cfg.modules_dir, release, "build")
        if os.path.isdir(build):
            hrel = headers_release(os.path.realpath(build))
            if hrel and hrel != release:
                self.headers = f"generic headers {hrel} for kernel {release} (fallback)"
                log.warning("NO KERNEL HEADERS FOR RUNNING KERNEL %s: bcc compiles against %s (%s). Tracepoint, "
                            "uprobe and tc programs are fine; nothing here reads kernel structs.",
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

    # -- compilation
    def acquire(self, probe: str) -> Any:
        """The bcc BPF object holding `probe`'s programs; compiles every planned probe on first use."""
        with self._lock:
            self.check_environment()
            plan = self.plan(probe)
            if not self._compiled:
                self._compile_all()
            if probe in self._compile_errors:
                raise Unavailable(f"{probe}: bcc could not compile {plan.probe.c_file.name}: "
                                  f"{self._compile_errors[probe]}")
            if probe not in self._objects:
                raise Unavailable(f"{probe}: not compiled (planned after the first compilation; restart the agent)")
            self._users.add(probe)
            if self.cfg.bpf_stats:
                self.stats.enable()
            return self._objects[probe]

    def _planned(self) -> list[Plan]:
        out = []
        for probe in self._planners:
            try:
                out.append(self.plan(probe))
            except Unavailable:
                pass
        return out

    def _bpf_class(self) -> Any:
        from bcc import BPF

        class _BPF(BPF):
            # bcc attaches every tracepoint__* function as soon as it compiles the module, and one
            # failing attach would take the whole object down; attach per probe in the sources instead.
            def _trace_autoload(self):
                pass

        return _BPF

    def _compile(self, plans: list[Plan]) -> Any:
        cls = self._bpf_class()
        text = render_c(plans)
        cflags = [f for p in plans for f in p.cflags()]
        with _capture_stderr() as err:
            try:
                obj = cls(text=text.encode(), cflags=cflags)
            except Exception as e:
                obj = e
        if err["text"].strip():
            log.debug("bcc output compiling %s:\n%s", [p.probe.name for p in plans], err["text"])
        if isinstance(obj, Exception):
            raise RuntimeError(_first_errors(err["text"]) or str(obj))
        return obj

    def _compile_all(self) -> None:
        plans = self._planned()
        self._compiled = True
        if not plans:
            return
        t0 = time.perf_counter()
        if self.cfg.combined_compile and len(plans) > 1:
            try:
                obj = self._compile(plans)
                self._all_objects.append(obj)
                for p in plans:
                    self._objects[p.probe.name] = obj
                self.compile_mode = f"combined ({len(plans)} probes, one clang run)"
            except RuntimeError as e:
                log.warning("compiling all eBPF probes at once failed (%s); compiling each on its own", e)
        if not self._objects:
            self.compile_mode = "per probe"
            for p in plans:
                try:
                    obj = self._compile([p])
                    self._all_objects.append(obj)
                    self._objects[p.probe.name] = obj
                except RuntimeError as e:
                    self._compile_errors[p.probe.name] = str(e)
        self.compile_s = time.perf_counter() - t0
        log.info("compiled eBPF probes %s in %.2f s (%s)", [p.probe.name for p in plans], self.compile_s,
                 self.compile_mode)

    def release(self, probe: str) -> None:
        with self._lock:
            self._users.discard(probe)
            if self._users:
                return
            for obj in self._all_objects:
                try:
                    obj.cleanup()
                except Exception:
                    log.debug("bcc cleanup failed", exc_info=True)
            self._all_objects.clear()
            self._objects.clear()
            self._compiled = False
            self.stats.disable()
