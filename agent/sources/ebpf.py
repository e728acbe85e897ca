"""Kernel-level measurements from eBPF probes (probes/*.bpf.c), compiled and attached through bcc.

One Source per probe (`ebpf.runqlat`, `ebpf.blkio`, `ebpf.netio`, `ebpf.accel_ioctl`, `ebpf.cuda_uprobe`,
`ebpf.tc_traffic`), all sharing one `EbpfLoader`: compiling is bcc's main cost (clang on every load),
so the C of every probe that passed its feature tests is compiled once, as one translation unit; if
that fails, each probe is compiled on its own so one broken probe cannot take the others down.
Programs are then loaded (verified) and attached per probe; a probe whose load or attach fails
reports Unavailable with the kernel's reason and the others run.

Which maps become which metrics, the tracepoint variants and the attach points are data in
`xpusense.probes.specs`. Counters are read at the realtime tier, histograms (log2 buckets, cumulative
counts) at the nearline tier. Every probe also reports its cost from bpf_stats (enabled for as long
as the agent runs with BPF_ENABLE_STATS, Linux 5.8+, else the kernel.bpf_stats_enabled sysctl):
run_cnt and run_time_ns of its programs, read from /proc/self/fdinfo.

`python -m xpusense.agent.sources.ebpf --print-c` prints the C that will be loaded (and the -D flags).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fnmatch
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, ClassVar, Iterable

from ...probes import specs
from .base import COUNTER, GAUGE, HISTOGRAM, NEARLINE, REALTIME, Sample, Source, SourceError, Unavailable

log = logging.getLogger("xpusense.agent.sources.ebpf")

# [sources.ebpf] keys and their defaults (agent/config.py owns the file; this is what the factory takes).
DEFAULTS: dict[str, Any] = {
    "probes": list(specs.PROBES),          # which probes to run
    "tc_interfaces": [],                   # [] = the namespace's physical interfaces
    "tc_netns": "",                        # network namespace for tc_traffic ("" = the agent's own)
    "cuda_library": "",                    # "" = search the usual places and ldconfig
    "device_globs": list(specs.DEFAULT_DEVICE_GLOBS),
    "bpf_stats": True,                     # turn on bpf_stats while running, report per-probe cost
    "combined_compile": True,              # one clang run for all probes (False: one per probe)
    "variants": {},                        # force a variant per probe, e.g. {"netio": "netdev"}
    "procfs": "/proc",
    "sysfs": "/sys",
    "tracefs": "",                         # "" = the one bcc uses
    "cgroupfs": "",                        # "" = the cgroup2 mount from /proc/self/mountinfo
    "modules_dir": "/lib/modules",         # where kernel headers are looked for (<release>/build)
}

DIRECTIONS_DISK = ("read", "write", "discard", "flush")
DIRECTIONS_TC = ("receive", "transmit")
FAMILIES = ("ipv4", "ipv6")

CAP_NET_ADMIN, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 12, 21, 38, 39

BPF_SYSCALL_NR = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}
BPF_ENABLE_STATS, BPF_STATS_RUN_TIME = 32, 0


# ------------------------------------------------------------------------------------------ pure helpers

def config_with_defaults(cfg: dict | None) -> dict:
    """Merge `cfg` over DEFAULTS; raise ValueError naming the bad key (the CLI exits 2 with it)."""
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - set(DEFAULTS) - {"enabled"})
    if unknown:
        raise ValueError(f"sources.ebpf: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(DEFAULTS))})")
    out = {**DEFAULTS, **cfg}
    bad = [p for p in out["probes"] if p not in specs.PROBES]
    if bad:
        raise ValueError(f"sources.ebpf.probes: unknown probe(s) {', '.join(bad)} (known: {', '.join(specs.PROBES)})")
    for probe, variant in dict(out["variants"]).items():
        names = [v.name for v in specs.PROBES[probe].variants] if probe in specs.PROBES else []
        if variant not in names:
            raise ValueError(f"sources.ebpf.variants.{probe}: {variant!r} is not one of {names or 'the known probes'}")
    for key in ("tc_interfaces", "device_globs", "probes"):
        if isinstance(out[key], str) or not all(isinstance(x, str) for x in out[key]):
            raise ValueError(f"sources.ebpf.{key}: expected a list of strings, got {out[key]!r}")
    try:
        device_prefixes(out["device_globs"])
    except ValueError as e:
        raise ValueError(f"sources.ebpf.device_globs: {e}") from None
    return out


def parse_fdinfo(text: str) -> dict[str, int]:
    """/proc/<pid>/fdinfo/<fd> of a BPF program -> its integer fields (prog_id, run_time_ns, run_cnt...)."""
    out = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        val = val.strip()
        if re.fullmatch(r"-?\d+", val):
            out[key.strip()] = int(val)
    return out


def hist_sample(name: str, unit: str, labels: dict, slots: Iterable[int], sum_raw: float, scale: float) -> Sample:
    """log2 slots from a map -> a histogram Sample: bounds in seconds, counts cumulative over buckets."""
    slots = [int(x) for x in slots]
    counts, total = [], 0
    for c in slots:
        total += c
        counts.append(total)
    return Sample(name, sum_raw * scale, unit, labels, HISTOGRAM,
                  bounds=specs.log2_bounds_s(len(slots)), counts=tuple(counts))


def device_prefixes(globs: Iterable[str]) -> list[str]:
    """Device globs -> the literal prefixes matched in the kernel (the part before the first wildcard)."""
    out = []
    for g in globs:
        prefix = re.split(r"[*?\[]", g, maxsplit=1)[0]
        if not prefix.startswith("/"):
            raise ValueError(f"{g!r} is not an absolute path glob")
        if len(prefix) >= specs.ACCEL_PREFIX_LEN:
            raise ValueError(f"{g!r}: the part before the first wildcard must be under "
                             f"{specs.ACCEL_PREFIX_LEN} characters")
        if prefix not in out:
            out.append(prefix)
    if len(out) > specs.ACCEL_MAX_PREFIXES:
        raise ValueError(f"at most {specs.ACCEL_MAX_PREFIXES} distinct device path prefixes, got {out}")
    return out


def prefix_words(prefix: str) -> tuple[list[int], list[int]]:
    """A path prefix -> (little-endian 8-byte words, byte masks) as accel_ioctl.bpf.c compares them."""
    raw = prefix.encode().ljust(specs.ACCEL_PREFIX_LEN, b"\0")
    mask = (b"\xff" * len(prefix.encode())).ljust(specs.ACCEL_PREFIX_LEN, b"\0")
    n = specs.ACCEL_PREFIX_LEN // 8
    return ([int.from_bytes(raw[8 * i:8 * i + 8], sys.byteorder) for i in range(n)],
            [int.from_bytes(mask[8 * i:8 * i + 8], sys.byteorder) for i in range(n)])


def decode_dev(dev: int) -> tuple[int, int]:
    """A kernel-internal dev_t (as in block tracepoints: major << 20 | minor) -> (major, minor)."""
    return dev >> 20, dev & 0xFFFFF


def cgroup2_mount(mountinfo: str) -> str:
    """The first cgroup2 mount point in /proc/self/mountinfo text ('' if none)."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return left.split(" ")[4].replace("\\040", " ")
    return ""


def physical_links(links: Iterable[dict]) -> list[str]:
    """Links as {"ifname", "kind", "loopback"} -> names of physical ones (no link kind, not loopback)."""
    return [l["ifname"] for l in links if not l.get("kind") and not l.get("loopback")]


def read_cap_eff(procfs: str = "/proc") -> int:
    try:
        with open(f"{procfs}/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def headers_release(build_dir: str) -> str:
    try:
        with open(os.path.join(build_dir, "include/generated/utsrelease.h")) as f:
            m = re.search(r'UTS_RELEASE "([^"]+)"', f.read())
            return m.group(1) if m else ""
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------ resolvers

class CgroupNames:
    """cgroup v2 id (kernfs inode number) -> path below the cgroup2 mount, '/' for the root.

    An unknown id triggers a rescan (at most one per `min_rescan_s`); ids still unknown after a scan
    (removed cgroups) are remembered, so they do not cause a rescan every round.
    """

    def __init__(self, root: str, min_rescan_s: float = 1.0):
        self.root = root
        self.min_rescan_s = min_rescan_s
        self._names: dict[int, str] = {}
        self._missing: set[int] = set()
        self._last_scan = -1e9

    def scan(self) -> None:
        names = {}
        for dirpath, _dirnames, _ in os.walk(self.root):
            try:
                ino = os.stat(dirpath).st_ino
            except OSError:
                continue
            rel = os.path.relpath(dirpath, self.root)
            names[ino] = "/" if rel == "." else "/" + rel
        self._names = names
        self._missing.clear()
        self._last_scan = time.monotonic()

    def name(self, cgid: int) -> str | None:
        if cgid not in self._names and cgid not in self._missing and self.root:
            if time.monotonic() - self._last_scan >= self.min_rescan_s:
                self.scan()
            if cgid not in self._names:
                self._missing.add(cgid)
        return self._names.get(cgid)

    def gone(self, cgid: int) -> bool:
        """True when the cgroup no longer exists (checked against a fresh scan)."""
        if cgid in self._names:
            return False
        if time.monotonic() - self._last_scan >= self.min_rescan_s:
            self.scan()
        return cgid not in self._names

    def label(self, cgid: int) -> str:
        return self.name(cgid) or f"id:{cgid}"


class DiskNames:
    """dev_t -> disk name from <sysfs>/dev/block/MAJ:MIN/uevent (DEVNAME)."""

    def __init__(self, sysfs: str = "/sys"):
        self.sysfs = sysfs
        self._names: dict[int, str] = {}

    def name(self, dev: int) -> str:
        if dev not in self._names:
            major, minor = decode_dev(dev)
            name = f"{major}:{minor}"
            try:
                with open(f"{self.sysfs}/dev/block/{major}:{minor}/uevent") as f:
                    for line in f:
                        if line.startswith("DEVNAME="):
                            name = line.strip().split("=", 1)[1]
            except OSError:
                return name     # not cached: the disk may appear later
            self._names[dev] = name
        return self._names[dev]


# ------------------------------------------------------------------------------------------ the loader

@dataclasses.dataclass
class Plan:
    """What one probe will be built with on this host: chosen variant, -D flags, attach points."""
    probe: specs.Probe
    variant: specs.Variant
    defines: list[tuple[str, str]]
    tracepoints: list[str]
    extra: dict = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def cflags(self) -> list[str]:
        return [f"-D{k}={v}" for k, v in self.defines]

    def metrics(self, tier: str | None = None) -> list[specs.Metric]:
        return [m for m in self.probe.metrics
                if (not m.variants or self.variant.name in m.variants) and (tier is None or m.tier == tier)]


@contextlib.contextmanager
def _capture_stderr():
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
    lines = [l.strip() for l in text.splitlines() if "error" in l.lower()]
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
    """Shared by all eBPF sources of one agent: environment checks, plans, one compilation, bpf_stats."""

    def __init__(self, cfg: dict):
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
        self.stats_state = "off"
        self._stats_fd: int | None = None
        self._stats_sysctl_restore = False
        self._env_error: Unavailable | None = None
        self._env_checked = False
        self.t_created = time.monotonic()

    # -- registration and plans
    def register(self, probe: str, planner: Callable[[Plan], None]) -> None:
        self._planners[probe] = planner

    def tracefs(self) -> str:
        if self.cfg.get("tracefs"):
            return self.cfg["tracefs"]
        try:
            import bcc
            return bcc.TRACEFS
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
        forced = self.cfg.get("variants", {}).get(probe)
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
        procfs = self.cfg.get("procfs", "/proc")
        if os.geteuid() != 0:
            caps = read_cap_eff(procfs)
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
                              f"python3-bpfcc and link it into the virtualenv (scripts/setup.sh does both)")
        release = platform.release()
        build = os.path.join(self.cfg.get("modules_dir", "/lib/modules"), release, "build")
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
    def acquire(self, probe: str):
        """The bcc BPF object holding `probe`'s programs; compiles every planned probe on first use."""
        with self._lock:
            self.check_environment()
            plan = self.plan(probe)
            if not self._compiled:
                self._compile_all()
            if probe in self._compile_errors:
                raise Unavailable(f"{probe}: bcc could not compile {plan.probe.c_file.name}: {self._compile_errors[probe]}")
            if probe not in self._objects:
                raise Unavailable(f"{probe}: not compiled (planned after the first compilation; restart the agent)")
            self._users.add(probe)
            self._enable_stats()
            return self._objects[probe]

    def _planned(self) -> list[Plan]:
        out = []
        for probe in self._planners:
            try:
                out.append(self.plan(probe))
            except Unavailable:
                pass
        return out

    def _bpf_class(self):
        from bcc import BPF

        class _BPF(BPF):
            # bcc attaches every tracepoint__* function as soon as it compiles the module, and one
            # failing attach would take the whole object down; attach per probe in the sources instead.
            def _trace_autoload(self):
                pass

        return _BPF

    def _compile(self, plans: list[Plan]):
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
        if self.cfg.get("combined_compile", True) and len(plans) > 1:
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
            self._disable_stats()

    # -- bpf_stats
    def _enable_stats(self) -> None:
        if not self.cfg.get("bpf_stats", True) or self.stats_state.startswith("on"):
            return
        nr = BPF_SYSCALL_NR.get(platform.machine())
        if nr is not None:
            libc = ctypes.CDLL(None, use_errno=True)
            attr = ctypes.c_uint32(BPF_STATS_RUN_TIME)
            fd = libc.syscall(ctypes.c_long(nr), ctypes.c_int(BPF_ENABLE_STATS), ctypes.byref(attr),
                              ctypes.c_uint(ctypes.sizeof(attr)))
            if fd >= 0:
                self._stats_fd = fd
                self.stats_state = "on (BPF_ENABLE_STATS, released when the agent stops)"
                return
            why = os.strerror(ctypes.get_errno())
        else:
            why = f"no bpf syscall number known for {platform.machine()}"
        path = os.path.join(self.cfg.get("procfs", "/proc"), "sys/kernel/bpf_stats_enabled")
        try:
            with open(path) as f:
                if f.read().strip() == "1":
                    self.stats_state = "on (kernel.bpf_stats_enabled already 1)"
                    return
            with open(path, "w") as f:
                f.write("1")
            self._stats_sysctl_restore = True
            self.stats_state = "on (kernel.bpf_stats_enabled=1 while running)"
        except OSError as e:
            self.stats_state = (f"off: BPF_ENABLE_STATS failed ({why}) and {path} is not writable ({e}); "
                                f"probe cost metrics are not reported")
            log.warning("eBPF cost metrics unavailable: %s", self.stats_state)

    def _disable_stats(self) -> None:
        if self._stats_fd is not None:
            os.close(self._stats_fd)
            self._stats_fd = None
        if self._stats_sysctl_restore:
            try:
                with open(os.path.join(self.cfg.get("procfs", "/proc"), "sys/kernel/bpf_stats_enabled"), "w") as f:
                    f.write("0")
            except OSError:
                pass
            self._stats_sysctl_restore = False
        self.stats_state = "off"


# ------------------------------------------------------------------------------------------ sources

class EbpfSource(Source):
    """One probe: plan (feature tests), compiled programs from the loader, attach, read maps."""

    probe: ClassVar[str] = ""
    tiers = (REALTIME, NEARLINE)

    def __init__(self, loader: EbpfLoader):
        self.loader = loader
        self.cfg = loader.cfg
        self.spec = specs.PROBES[self.probe]
        self.name = f"ebpf.{self.probe}"
        self.bpf = None
        self.plan_: Plan | None = None
        self._attached: list[tuple[str, str]] = []     # (kind, target) for describe and detach
        self._fns: list[str] = []
        self._prev_stats: tuple[int, int] | None = None
        self.setup_s: float | None = None
        self._cgroups: CgroupNames | None = None
        loader.register(self.probe, self.plan_extra)

    # -- hooks for subclasses
    def plan_extra(self, plan: Plan) -> None:
        """Probe-specific feature tests at plan time (libraries, interfaces); raise Unavailable."""

    def before_attach(self) -> None:
        """Fill maps the programs read (after compiling, before attaching)."""

    def attach(self) -> None:
        for tp in self.plan_.tracepoints:
            cat, _, ev = tp.partition(":")
            fn = f"tracepoint__{cat}__{ev}"
            self._load(fn, "TRACEPOINT")
            try:
                self.bpf.attach_tracepoint(tp=tp.encode(), fn_name=fn.encode())
            except Exception as e:
                raise Unavailable(f"{self.probe}: could not attach to tracepoint {tp}: {e}") from e
            self._attached.append(("tracepoint", tp))

    def after_attach(self) -> None:
        """Catch up on state from before the programs ran (e.g. fds already open)."""

    def detach(self) -> None:
        for kind, target in reversed(self._attached):
            try:
                if kind == "tracepoint":
                    self.bpf.detach_tracepoint(target.encode())
            except Exception:
                log.debug("%s: detaching %s %s failed", self.name, kind, target, exc_info=True)
        self._attached.clear()

    # -- Source interface
    def setup(self) -> None:
        t0 = time.perf_counter()
        self.loader.check_environment()
        self.plan_ = self.loader.plan(self.probe)
        self.bpf = self.loader.acquire(self.probe)
        try:
            self.before_attach()
            self.attach()
            self.after_attach()
        except BaseException as e:
            self.detach()
            self.loader.release(self.probe)
            self.bpf = None
            if isinstance(e, Unavailable):
                raise
            raise Unavailable(f"{self.probe}: attaching failed: {type(e).__name__}: {e}") from e
        for note in self.plan_.notes:
            log.warning("%s: %s", self.name, note)
        self.setup_s = time.perf_counter() - t0

    def close(self) -> None:
        if self.bpf is None:
            return
        self.detach()
        self.bpf = None
        self.loader.release(self.probe)

    def collect(self, tier: str) -> list[Sample]:
        if self.bpf is None:
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
        if self.loader.headers:
            d["kernel_headers"] = self.loader.headers
        d["bpf_stats"] = self.loader.stats_state
        if self.setup_s is not None:
            d["setup_s"] = round(self.setup_s, 3)
        return d

    # -- helpers
    def _load(self, fn: str, prog_type: str):
        from bcc import BPF
        try:
            f = self.bpf.load_func(fn.encode(), getattr(BPF, prog_type))
        except Exception as e:
            raise Unavailable(f"{self.probe}: the kernel refused program {fn} ({e}); run with "
                              f"`python -m xpusense.agent.sources.ebpf --print-c` to see the C") from e
        if fn not in self._fns:
            self._fns.append(fn)
        return f

    def program_stats(self) -> list[dict]:
        """bpf_stats of this probe's programs: [{fn, prog_id, run_cnt, run_time_ns}] from fdinfo."""
        out = []
        procfs = self.cfg.get("procfs", "/proc")
        for fn in self._fns:
            f = self.bpf.funcs.get(fn.encode())
            if f is None:
                continue
            try:
                with open(f"{procfs}/self/fdinfo/{f.fd}") as fh:
                    info = parse_fdinfo(fh.read())
            except OSError:
                continue
            out.append({"fn": fn, "prog_id": info.get("prog_id", 0), "run_cnt": info.get("run_cnt", 0),
                        "run_time_ns": info.get("run_time_ns", 0)})
        return out

    def cost_samples(self) -> list[Sample]:
        if not self.loader.stats_state.startswith("on"):
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

    def table(self, name: str):
        return self.bpf.get_table(name.encode())

    def key_labels(self, decoder: str, key, value) -> dict[str, str] | None:
        """Map key (and value, for comm) -> labels; None to skip the entry."""
        if decoder == "cgroup":
            if self._cgroups is None:
                root = self.cfg.get("cgroupfs") or _cgroup2_root(self.cfg.get("procfs", "/proc"))
                self._cgroups = CgroupNames(root)
            return {"cgroup": self._cgroups.label(int(key.value))}
        if decoder == "process":
            comm = bytes(value.comm).split(b"\0", 1)[0].decode(errors="replace") if hasattr(value, "comm") else ""
            return {"pid": str(int(key.value)), "process": comm}
        if decoder == "family":
            idx = int(key.value)
            return {"family": FAMILIES[idx]} if idx < len(FAMILIES) else None
        if decoder == "netdev":
            return {"device": bytes(key.name).split(b"\0", 1)[0].decode(errors="replace")}
        raise ValueError(f"unknown key decoder {decoder!r}")

    def read_maps(self, tier: str) -> list[Sample]:
        metrics = self.plan_.metrics(tier)
        decoders = dict(self.spec.maps)
        out: list[Sample] = []
        for map_name in dict.fromkeys(m.map for m in metrics):
            mine = [m for m in metrics if m.map == map_name]
            table = self.table(map_name)
            entries = []
            for key, value in table.items():
                value = _sum_percpu(value)
                labels = self.key_labels(decoders[map_name], key, value)
                if labels is None:
                    continue
                entries.append((key, value, labels))
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

    def forget_dead(self, decoder: str, table, entries) -> None:
        """After reporting them once more, drop entries of exited processes and removed cgroups."""
        procfs = self.cfg.get("procfs", "/proc")
        for key, _value, labels in entries:
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


def _field(value, name: str):
    if name == "value":
        return value.value if hasattr(value, "value") else value
    return getattr(value, name)


class _Summed:
    """Per-CPU values summed field by field (bcc returns one struct per possible CPU)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _sum_percpu(value):
    if not isinstance(value, ctypes.Array) or isinstance(value, (bytes, str)):
        return value
    if len(value) == 0:
        return value
    first = value[0]
    if isinstance(first, ctypes.Structure):
        fields = {}
        for name, _t in first._fields_:
            fields[name] = sum(getattr(v, name) for v in value)
        return _Summed(**fields)
    return _Summed(value=sum(int(v) for v in value))


def _cgroup2_root(procfs: str) -> str:
    try:
        with open(f"{procfs}/self/mountinfo") as f:
            return cgroup2_mount(f.read())
    except OSError:
        return ""


class RunqlatSource(EbpfSource):
    probe = "runqlat"


class BlkioSource(EbpfSource):
    probe = "blkio"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.disks = DiskNames(self.cfg.get("sysfs", "/sys"))

    def key_labels(self, decoder, key, value):
        if decoder == "disk":
            d = int(key.dir)
            return {"device": self.disks.name(int(key.dev)),
                    "direction": DIRECTIONS_DISK[d] if d < len(DIRECTIONS_DISK) else str(d)}
        return super().key_labels(decoder, key, value)


class NetioSource(EbpfSource):
    probe = "netio"


class AccelIoctlSource(EbpfSource):
    probe = "accel_ioctl"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.globs = list(self.cfg.get("device_globs") or specs.DEFAULT_DEVICE_GLOBS)
        self.prefixes = device_prefixes(self.globs)
        self._scanned: set[int] = set()
        self.fds_from_scan = 0

    def before_attach(self) -> None:
        t = self.table("accel_prefixes")
        for i in range(specs.ACCEL_MAX_PREFIXES):
            v = t.Leaf()
            if i < len(self.prefixes):
                words, masks = prefix_words(self.prefixes[i])
                v.used = 1
                for w in range(len(words)):
                    v.word[w], v.mask[w] = words[w], masks[w]
            t[ctypes.c_int(i)] = v

    def after_attach(self) -> None:
        self.scan(only_new=False)

    def scan(self, only_new: bool) -> int:
        """Add (tgid, fd) of device files already open to accel_fds from <procfs>/<pid>/fd."""
        procfs = self.cfg.get("procfs", "/proc")
        table = self.table("accel_fds")
        added = 0
        try:
            pids = {int(p) for p in os.listdir(procfs) if p.isdigit()}
        except OSError:
            return 0
        for pid in (pids - self._scanned) if only_new else pids:
            fd_dir = f"{procfs}/{pid}/fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                except OSError:
                    continue
                if target.startswith("/") and any(fnmatch.fnmatchcase(target, g) for g in self.globs):
                    k = table.Key(pid, int(fd))
                    table[k] = ctypes.c_uint8(1)
                    added += 1
        self._scanned = pids
        self.fds_from_scan += added
        return added

    def collect(self, tier: str) -> list[Sample]:
        if tier == NEARLINE and self.bpf is not None:
            self.scan(only_new=True)
        return super().collect(tier)

    def describe(self) -> dict:
        return {**super().describe(), "device_globs": self.globs, "kernel_prefixes": self.prefixes,
                "fds_found_in_proc": self.fds_from_scan}


class CudaUprobeSource(EbpfSource):
    probe = "cuda_uprobe"

    def plan_extra(self, plan: Plan) -> None:
        lib = find_cuda_library(self.cfg.get("cuda_library", ""))
        if not lib:
            where = self.cfg.get("cuda_library") or ", ".join(specs.CUDA_LIBRARY_CANDIDATES[:2]) + ", ldconfig"
            raise Unavailable(f"cuda_uprobe: libcuda.so.1 not found ({where}): no NVIDIA driver on this host, "
                              f"or set [sources.ebpf] cuda_library to its path")
        plan.extra["library"] = lib

    def attach(self) -> None:
        from bcc import BPF
        lib = self.plan_.extra["library"]
        try:
            found = BPF.get_user_functions_and_addresses(lib.encode(), b"^cu")
        except Exception as e:
            raise Unavailable(f"cuda_uprobe: cannot read the symbols of {lib}: {e}") from e
        addr_of = {}
        for name, addr in found:
            name = name.decode() if isinstance(name, bytes) else name
            addr_of.setdefault(name, addr)
        seen_addr = set()
        for sym, fn in specs.CUDA_SYMBOLS.items():
            addr = addr_of.get(sym)
            if addr is None or addr in seen_addr:    # absent, or an alias of one already probed
                continue
            self._load(fn, "KPROBE")
            try:
                self.bpf.attach_uprobe(name=lib.encode(), sym=sym.encode(), fn_name=fn.encode())
            except Exception as e:
                raise Unavailable(f"cuda_uprobe: could not attach a uprobe to {sym} in {lib}: {e}") from e
            seen_addr.add(addr)
            self._attached.append(("uprobe", sym))
        if not self._attached:
            raise Unavailable(f"cuda_uprobe: {lib} exports none of {', '.join(list(specs.CUDA_SYMBOLS)[:4])}...: "
                              f"is it libcuda (the driver library)? set [sources.ebpf] cuda_library")

    def detach(self) -> None:
        lib = self.plan_.extra.get("library") if self.plan_ else None
        for kind, target in reversed(self._attached):
            try:
                if kind == "uprobe":
                    self.bpf.detach_uprobe(name=lib.encode(), sym=target.encode())
            except Exception:
                log.debug("%s: detaching uprobe %s failed", self.name, target, exc_info=True)
        self._attached.clear()

    def describe(self) -> dict:
        d = super().describe()
        if self.plan_:
            d["library"] = self.plan_.extra.get("library")
        return d


def find_cuda_library(configured: str = "") -> str:
    if configured:
        return configured if os.path.exists(configured) else ""
    for path in specs.CUDA_LIBRARY_CANDIDATES:
        if os.path.exists(path):
            return path
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        if line.strip().startswith("libcuda.so.1 ") and "=>" in line:
            path = line.split("=>", 1)[1].strip()
            if os.path.exists(path):
                return path
    return ""


TC_PARENTS = {"ingress": 0xFFFFFFF2, "egress": 0xFFFFFFF3}   # clsact's ingress and egress hooks


def ours(filter_msg) -> bool:
    """A tc filter message that one of our runs added (by name or by our priority)."""
    if filter_msg.get_attr("TCA_KIND") != "bpf":
        return False
    opts = filter_msg.get_attr("TCA_OPTIONS")
    name = opts.get_attr("TCA_BPF_NAME") if opts is not None else None
    prio = (filter_msg["info"] >> 16) & 0xFFFF
    return (name or "").startswith(specs.TC_FILTER_NAME) or prio == specs.TC_FILTER_PRIO


class TcTrafficSource(EbpfSource):
    probe = "tc_traffic"

    def __init__(self, loader: EbpfLoader):
        super().__init__(loader)
        self.netns = self.cfg.get("tc_netns", "")
        self.ifaces: dict[int, str] = {}
        self._created_clsact: set[int] = set()
        self.stale_removed = 0

    def _ipr(self):
        from pyroute2 import IPRoute
        if self.netns:
            path = self.netns if "/" in self.netns else os.path.join("/run/netns", self.netns)
            if not os.path.exists(path):   # pyroute2 would create it
                raise Unavailable(f"tc_traffic: network namespace {self.netns!r} does not exist (no {path}); "
                                  f"fix [sources.ebpf] tc_netns")
            return IPRoute(netns=self.netns)
        return IPRoute()

    def plan_extra(self, plan: Plan) -> None:
        try:
            ipr = self._ipr()
        except Unavailable:
            raise
        except Exception as e:
            raise Unavailable(f"tc_traffic: cannot open rtnetlink: {e}") from e
        try:
            links = []
            for m in ipr.get_links():
                info = m.get_attr("IFLA_LINKINFO")
                links.append({"ifname": m.get_attr("IFLA_IFNAME"), "index": m["index"],
                              "kind": info.get_attr("IFLA_INFO_KIND") if info is not None else None,
                              "loopback": bool(m["flags"] & 0x8)})   # IFF_LOOPBACK
        finally:
            ipr.close()
        by_name = {l["ifname"]: l["index"] for l in links}
        wanted = list(self.cfg.get("tc_interfaces") or [])
        where = f"network namespace {self.netns!r}" if self.netns else "this host"
        if wanted:
            missing = [n for n in wanted if n not in by_name]
            if missing:
                raise Unavailable(f"tc_traffic: no interface {', '.join(missing)} in {where} "
                                  f"(have {', '.join(sorted(by_name))}); fix [sources.ebpf] tc_interfaces")
        else:
            wanted = physical_links(links)
            if not wanted:
                raise Unavailable(f"tc_traffic: no physical interfaces in {where}; list the ones to count in "
                                  f"[sources.ebpf] tc_interfaces")
        plan.extra["interfaces"] = {by_name[n]: n for n in wanted}
        plan.extra["all_ifindexes"] = sorted(by_name.values())

    def attach(self) -> None:
        from pyroute2.netlink.exceptions import NetlinkError
        fns = {d: self._load(fn, "SCHED_CLS") for d, fn in
               (("ingress", specs.TC_INGRESS_FN), ("egress", specs.TC_EGRESS_FN))}
        self.ifaces = dict(self.plan_.extra["interfaces"])
        ipr = self._ipr()
        try:
            # Filters a crashed run left behind, on any interface of the namespace (the configured
            # list may have changed since): found by our name/priority, removed before adding ours.
            for idx in self.plan_.extra.get("all_ifindexes", self.ifaces):
                self.stale_removed += self._remove_ours(ipr, idx)
            for idx, ifname in self.ifaces.items():
                try:
                    ipr.tc("add", "clsact", idx)
                    self._created_clsact.add(idx)
                except NetlinkError as e:
                    if e.code != 17:   # EEXIST: someone (maybe we, before a crash) added it already
                        raise Unavailable(f"tc_traffic: cannot add a clsact qdisc to {ifname}: {e}") from e
                for direction, fn in fns.items():
                    try:
                        ipr.tc("add-filter", "bpf", idx, specs.TC_FILTER_HANDLE, fd=fn.fd,
                               name=f"{specs.TC_FILTER_NAME}", parent=TC_PARENTS[direction], classid=1,
                               direct_action=True, prio=specs.TC_FILTER_PRIO)
                    except NetlinkError as e:
                        raise Unavailable(f"tc_traffic: cannot attach the {direction} filter to {ifname}: {e}") from e
                    self._attached.append(("tc", f"{ifname} {direction}"))
        finally:
            ipr.close()
        if self.stale_removed:
            log.warning("tc_traffic: removed %d stale filter(s) left by an earlier run", self.stale_removed)

    @staticmethod
    def _remove_ours(ipr, idx: int) -> int:
        removed = 0
        for parent in TC_PARENTS.values():
            try:
                msgs = list(ipr.get_filters(index=idx, parent=parent))
            except Exception:
                continue
            prios = {(m["info"] >> 16) & 0xFFFF for m in msgs if ours(m) and m["handle"]}
            for prio in prios:
                try:
                    ipr.tc("del-filter", "bpf", idx, 0, parent=parent, prio=prio)
                    removed += 1
                except Exception:
                    log.debug("tc_traffic: deleting filter prio %d on ifindex %d failed", prio, idx, exc_info=True)
        return removed

    def detach(self) -> None:
        if not self._attached and not self._created_clsact:
            return
        try:
            ipr = self._ipr()
        except Exception:
            log.warning("tc_traffic: cannot open rtnetlink to detach; the next start removes the filters")
            return
        try:
            for idx in self.ifaces:
                self._remove_ours(ipr, idx)
                if idx in self._created_clsact:
                    others = [m for p in TC_PARENTS.values() for m in ipr.get_filters(index=idx, parent=p)]
                    if not others:
                        try:
                            ipr.tc("del", "clsact", idx)
                        except Exception:
                            pass
        finally:
            ipr.close()
        self._attached.clear()
        self._created_clsact.clear()

    def key_labels(self, decoder, key, value):
        if decoder == "iface":
            d = int(key.dir)
            return {"device": self.ifaces.get(int(key.ifindex), str(int(key.ifindex))),
                    "direction": DIRECTIONS_TC[d] if d < 2 else str(d)}
        return super().key_labels(decoder, key, value)

    def describe(self) -> dict:
        d = super().describe()
        d["netns"] = self.netns or "(agent's)"
        if self.ifaces:
            d["interfaces"] = sorted(self.ifaces.values())
        d["filter"] = {"name": specs.TC_FILTER_NAME, "prio": specs.TC_FILTER_PRIO, "handle": hex(specs.TC_FILTER_HANDLE)}
        if self.stale_removed:
            d["stale_filters_removed"] = self.stale_removed
        return d


SOURCE_CLASSES: dict[str, type[EbpfSource]] = {
    c.probe: c for c in (RunqlatSource, BlkioSource, NetioSource, AccelIoctlSource, CudaUprobeSource, TcTrafficSource)
}


def build_ebpf_sources(cfg: dict | None = None) -> list[Source]:
    """One Source per enabled probe, sharing one loader (one compilation). Raises ValueError on bad config."""
    cfg = config_with_defaults(cfg)
    if cfg.get("enabled") is False:
        return []
    loader = EbpfLoader(cfg)
    return [SOURCE_CLASSES[p](loader) for p in specs.PROBES if p in cfg["probes"]]


def plans_for(cfg: dict | None = None) -> tuple[list[Plan], dict[str, str]]:
    """Plans of the enabled probes on this host and, for the others, why not (no compiling)."""
    sources = build_ebpf_sources(cfg)
    plans, why = [], {}
    for s in sources:
        try:
            plans.append(s.loader.plan(s.probe))
        except Unavailable as e:
            why[s.probe] = str(e)
    return plans, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xpusense.agent.sources.ebpf",
                                 description="Show the eBPF C the agent would load here, or try loading it.")
    ap.add_argument("--print-c", action="store_true", help="print the C that will be compiled (with -D flags)")
    ap.add_argument("--probes", default="", help="comma-separated probes (default: all)")
    ap.add_argument("--config-json", default="", help="[sources.ebpf] keys as a JSON object")
    ap.add_argument("--load", action="store_true", help="compile, attach, print describe() of each probe, detach")
    args = ap.parse_args(argv)
    cfg = json.loads(args.config_json) if args.config_json else {}
    if args.probes:
        cfg["probes"] = [p for p in args.probes.split(",") if p]
    try:
        plans, why = plans_for(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for probe, reason in why.items():
        print(f"// {probe}: not built here: {reason}", file=sys.stderr)
    if args.print_c or not args.load:
        print(render_c(plans))
    if args.load:
        sources = build_ebpf_sources(cfg)
        for s in sources:
            try:
                s.setup()
                print(json.dumps({"source": s.name, "state": "running", **s.describe()}))
            except Unavailable as e:
                print(json.dumps({"source": s.name, "state": "unavailable", "reason": str(e)}))
        for s in sources:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
