"""NpuSmiSource: the npu-smi source the agent runs, and its `[sources.npu_smi]` config table.

Setup reads `npu-smi info` once (chips, versions, processes); the realtime tier then runs
`npu-smi info -t usages -i N` for every NPU at once, the nearline tier `-t common` (AI Core clocks)
and `npu-smi info` (each process's memory), the offline tier `-t power|temp|health`, all through
runner.py; a chip's change of health becomes an Event (its error codes also series:
error_codes.py). An NPU whose npu-smi says it does not support `-t common` is not asked again."""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable
from typing import Any

from xpusense.common import catalog as common_catalog
from xpusense.common import metric_names as m
from xpusense.common.config import Key, positive

from ..base import COUNTER, NEARLINE, OFFLINE, REALTIME, Event, Sample, Source, SourceError, SourceFamily, Unavailable
from .catalog import informative, inventory_resources
from .error_codes import ErrorCodes
from .kv import KvOutput, parse_kv
from .readings import (
    HBM_BANDWIDTH,
    HealthReading,
    common_samples,
    health_readings,
    health_samples,
    power_samples,
    severity_of,
    temp_samples,
    usages_samples,
)
from .runner import DEFAULT_MAX_OUTPUT_BYTES, CommandFailed, Job, Runner, TimedOut, command_line
from .table import InfoChip, InfoTable, parse_info
from .values import MIB, VENDOR, FieldError, ParseError, device_id, parse_number

log = logging.getLogger("xpusense.agent.sources.npu_smi")

# Where the Ascend driver package installs npu-smi (checked in this order, then PATH).
DEFAULT_SEARCH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/bin")
MAX_CHIPS_PER_NPU = 64  # a `Chip Count` above this is taken for garbage
SKIPPED_METRIC = "xpusense.npu_smi.rounds.skipped"
OVERSIZED_METRIC = "xpusense.npu_smi.calls.oversized"   # killed for printing more than max_output_bytes
OFFLINE_TYPES = ("power", "temp", "health")
NEARLINE_TYPES = ("common",)
PROCESS_TABLE = "processes"   # the nearline round's `npu-smi info`, for its process table
# How npu-smi says a query does not exist on a model ("This device does not support querying common.")
NOT_SUPPORTED = re.compile(r"(?i)\bnot\s+support")


class NpuSmiSource(Source):
    """Ascend NPUs through npu-smi: realtime usages per NPU, nearline AI Core clocks, offline power,
    temperatures and health."""

    name = "npu-smi"
    tiers = (REALTIME, NEARLINE, OFFLINE)

    def __init__(self, path: str = "", timeout_s: float = 0.8, max_workers: int = 8, *,
                 nearline_timeout_s: float = 5.0, offline_timeout_s: float = 10.0, setup_timeout_s: float = 15.0,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES, search_dirs: Iterable[str] = DEFAULT_SEARCH_DIRS,
                 error_codes_per_device: int = 32):
        self.path = path
        self.timeout_s = timeout_s
        self.max_workers = max(1, int(max_workers))
        self.nearline_timeout_s = nearline_timeout_s
        self.offline_timeout_s = offline_timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.search_dirs = tuple(search_dirs)
        self._runner = Runner(self.tiers, self.max_workers, max_output_bytes)
        self._lock = threading.Lock()
        self._table = InfoTable()
        self._chips: dict[int, list[int]] = {}
        self._names: dict[str, str] = {}
        self._health: dict[str, tuple[str, str]] = {}
        self._codes = ErrorCodes(error_codes_per_device)   # counted for the agent's whole run
        self._events: list[Event] = []
        self._pids: dict[int, str] = {}
        self._notes: list[str] = []
        self._hbm_bw: dict[str, bool] = {}   # device -> whether its usages output has HBM bandwidth
        self._unsupported: dict[str, str] = {}   # `npu-smi info -t TYPE -i N` not asked any more -> why

    @property
    def exe(self) -> str:
        """The npu-smi run ("" before setup)."""
        return self._runner.exe

    # -- finding npu-smi and the chips ---------------------------------------------------------

    def find_executable(self) -> str:
        if self.path:
            if not os.path.isfile(self.path):
                raise Unavailable(f"npu-smi not found at {self.path!r} (set by [sources.npu_smi] path or "
                                  f"--npu-smi); point it at the npu-smi of the Ascend driver, usually "
                                  f"/usr/local/sbin/npu-smi")
            if not os.access(self.path, os.X_OK):
                raise Unavailable(f"{self.path!r} is not executable by this user; fix its mode or run the "
                                  f"agent as a user allowed to run npu-smi (root or the HwHiAiUser group)")
            return self.path
        for d in self.search_dirs:
            cand = os.path.join(d, "npu-smi")
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
        found = shutil.which("npu-smi")
        if found:
            return found
        where = ", ".join(self.search_dirs)
        raise Unavailable(f"npu-smi not found in {where} or on PATH: install the Ascend NPU driver (it ships "
                          f"npu-smi) or give its location with [sources.npu_smi] path / --npu-smi PATH")

    def setup(self) -> None:
        self._runner.exe = self.find_executable()
        deadline = time.monotonic() + self.setup_timeout_s
        table = self._read_table(deadline)
        if not table.chips:
            table.chips = self._discover_from_list(deadline)
        if not table.chips:
            why = f" ({self._notes[-1]})" if self._notes else ""
            raise Unavailable(f"`npu-smi info` listed no NPUs{why}; check that the driver sees the cards "
                              f"(`lspci -d 19e5:` lists Huawei devices) and that npu-smi works by hand")
        chips: dict[int, list[int]] = {}
        for c in table.chips:
            chips.setdefault(c.npu_id, []).append(c.chip_id)
        if not all(informative(c.name) for c in table.chips):
            self._names = self._chip_names(deadline)
        common_catalog.load("huawei")   # CatalogError: a broken installation, said at setup
        with self._lock:
            self._table, self._chips, self._pids = table, chips, table.pids()
        self._runner.start()

    def _read_table(self, deadline: float) -> InfoTable:
        """`npu-smi info` at setup, as far as it can be read; Unavailable when it cannot be run."""
        try:
            text = self._runner.run(["info"], deadline)
        except TimedOut:
            raise Unavailable(f"`npu-smi info` ({self.exe}) did not answer within {self.setup_timeout_s:g} s; "
                              f"the NPU driver may be hung (see dmesg) or the host overloaded") from None
        except CommandFailed as e:
            raise Unavailable(f"{e}; check that the Ascend driver is installed and loaded and that this user "
                              f"may use the NPUs (root or the HwHiAiUser group)") from None
        except OSError as e:
            raise Unavailable(f"cannot run {self.exe}: {e}; run the agent as a user allowed to run npu-smi "
                              f"(root or the HwHiAiUser group)") from None
        try:
            return parse_info(text)
        except ParseError as e:
            self._notes.append(str(e))
            log.warning("npu-smi: %s (keeping the %d chips read)", e, len(e.partial.chips))
            return e.partial

    def _read_kv(self, args: list[str], deadline: float) -> KvOutput | None:
        """`npu-smi ARGS` (key-value output) as far as it can be read; None, with a note, when it cannot be run."""
        cmd = command_line(args)
        try:
            return parse_kv(self._runner.run(args, deadline), cmd)
        except ParseError as e:
            return e.partial
        except (TimedOut, CommandFailed, OSError) as e:
            self._notes.append(f"`{cmd}`: {e}")
            return None

    def _discover_from_list(self, deadline: float) -> list[InfoChip]:
        """The NPUs of `npu-smi info -l` when the table could not be read (a layout not seen yet)."""
        out = self._read_kv(["info", "-l"], deadline)
        if out is None:
            return []
        chips = []
        for npu in out.npus:
            if npu.npu_id is None:
                continue
            count = parse_number(npu.fields.get("Chip Count"))
            for c in range(int(count) if count and 0 < count <= MAX_CHIPS_PER_NPU else 1):
                chips.append(InfoChip(npu.npu_id, c))
        return chips

    def _chip_names(self, deadline: float) -> dict[str, str]:
        """Device -> chip name from `npu-smi info -m`, for a table whose Name column says nothing."""
        out = self._read_kv(["info", "-m"], deadline)
        if out is None:
            return {}
        return {device_id(npu.npu_id, rec.chip_id): rec.get("Chip Name") or ""
                for npu in out.npus if npu.npu_id is not None
                for rec in npu.chips if rec.chip_id is not None and rec.get("Chip Name")}

    # -- rounds --------------------------------------------------------------------------------

    def collect(self, tier: str) -> list[Sample]:
        if tier not in self.tiers:
            return []
        with self._lock:
            chips = {n: list(c) for n, c in self._chips.items()}
            unsupported = set(self._unsupported)
        types, budget = {REALTIME: (("usages",), self.timeout_s), NEARLINE: (NEARLINE_TYPES, self.nearline_timeout_s),
                         OFFLINE: (OFFLINE_TYPES, self.offline_timeout_s)}[tier]
        jobs: list[Job] = [((tier, n, t), args) for n in sorted(chips) for t in types
                           if command_line(args := ["info", "-t", t, "-i", str(n)]) not in unsupported]
        if tier == NEARLINE:   # the process table, beside the clocks: each process's memory
            jobs.append(((tier, -1, PROCESS_TABLE), ["info"]))
        finished, _ = self._runner.round(tier, jobs, budget)
        samples: list[Sample] = []
        errors: list[str] = []
        readings: list[HealthReading] = []
        for (_, npu, kind), args, result in finished:
            cmd = command_line(args)
            if kind == PROCESS_TABLE and not isinstance(result, BaseException):
                samples += self._process_memory(result, errors)
                continue
            if kind in NEARLINE_TYPES and self._not_supported(cmd, result):
                continue
            if isinstance(result, BaseException):
                errors.append(str(result) if isinstance(result, CommandFailed) else f"`{cmd}`: {result}")
                continue
            try:
                out = parse_kv(result, cmd)
            except ParseError as e:
                errors.append(str(e))
                out = e.partial
            try:
                samples += self._samples(kind, out, npu, chips.get(npu, []), readings, cmd)
            except FieldError as e:
                errors.append(str(e))
                samples += e.partial
        self._note_health(readings)
        if tier == OFFLINE:
            samples += self._error_codes(readings)
        if tier == REALTIME:
            self._note_hbm_bandwidth(samples)
        samples.append(Sample(SKIPPED_METRIC, float(self._runner.skipped(tier)), "{round}", {"tier": tier}, COUNTER))
        samples.append(Sample(OVERSIZED_METRIC, float(self._runner.oversized), "{call}", {}, COUNTER))
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise SourceError(errors[0] + more, samples)
        return samples

    def _not_supported(self, cmd: str, result: str | BaseException) -> bool:
        """Whether npu-smi answered that it does not support `cmd` on this NPU (failing, or printing
        only that): then it is not asked again, said once in the log and in describe()."""
        if isinstance(result, CommandFailed):
            text = result.text
        elif isinstance(result, str) and not any(":" in ln for ln in result.splitlines()):
            text = result
        else:
            return False
        if not NOT_SUPPORTED.search(text):
            return False
        why = next(ln.strip() for ln in text.splitlines() if NOT_SUPPORTED.search(ln))[:200]
        with self._lock:
            self._unsupported[cmd] = why
        log.warning("npu-smi: `%s` is not supported here (%s): not asked again; the AI Core clocks of "
                    "that NPU are not reported", cmd, why)
        return True

    @staticmethod
    def _samples(kind: str, out: KvOutput, npu: int, known: list[int], readings: list[HealthReading],
                 cmd: str = "") -> list[Sample]:
        """Samples of one `-t KIND -i NPU` output; health readings are also added to `readings`.

        Raises FieldError (with the samples read in `.partial`) for a value that cannot be read."""
        if kind == "usages":
            return usages_samples(out, npu, known)
        if kind == "common":
            return common_samples(out, npu, known, cmd)
        if kind == "power":
            return power_samples(out, npu, known)
        if kind == "temp":
            return temp_samples(out, npu, known)
        found = health_readings(out, npu, known)
        readings += found
        return health_samples(found)

    def _process_memory(self, text: str, errors: list[str]) -> list[Sample]:
        """Each listed process's device memory (npu-smi's table has no per-process utilisation); the
        pids are kept for the HBM watch as processes() keeps them."""
        try:
            table = parse_info(text)
        except ParseError as e:
            errors.append(str(e))
            table = e.partial
        with self._lock:
            self._pids = table.pids()
        return [Sample(m.PROCESS_MEMORY_USAGE, p.memory_mb * MIB, "By",
                       {"device": p.device, "vendor": VENDOR, "pid": str(p.pid)})
                for p in table.processes if p.memory_mb is not None]

    def _note_hbm_bandwidth(self, samples: list[Sample]) -> None:
        """Remember which chips' usages output has HBM bandwidth (for hbm_watch_coverage)."""
        with_bw = {x.labels["device"] for x in samples if x.name == HBM_BANDWIDTH}
        with self._lock:
            for x in samples:
                if x.name == "hw.gpu.utilization":
                    self._hbm_bw[x.labels["device"]] = x.labels["device"] in with_bw

    def _error_codes(self, readings: list[HealthReading]) -> list[Sample]:
        with self._lock:
            self._codes.saw(readings)
            return self._codes.samples(readings)

    def _note_health(self, readings: list[HealthReading]) -> None:
        now = time.time_ns()
        with self._lock:
            for r in readings:
                value = (r.status, r.error_codes)
                prev = self._health.get(r.device)
                self._health[r.device] = value
                if prev == value or (prev is None and r.ok):
                    continue
                before = prev[0] if prev else "unknown"
                codes = f"; error codes {r.error_codes}" if r.error_codes else ""
                self._events.append(Event(
                    "health", f"{r.device} health {before} -> {r.status}{codes}", severity_of(r.status), r.device,
                    {"vendor": VENDOR, "status": r.status, "previous": prev[0] if prev else "",
                     "error_codes": r.error_codes, "error_information": r.error_information}, now))

    # -- Source --------------------------------------------------------------------------------

    def events(self) -> list[Event]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def processes(self) -> dict[int, set[str]]:
        """pid -> devices (`npu<N>-<chip>`) of the processes npu-smi's table lists, read now."""
        try:
            text = self._runner.run(["info"], time.monotonic() + self.offline_timeout_s)
        except TimedOut:
            raise SourceError(f"`npu-smi info` did not answer within {self.offline_timeout_s:g} s") from None
        except (CommandFailed, OSError) as e:
            raise SourceError(str(e)) from None
        try:
            table = parse_info(text)
        except ParseError as e:
            table = e.partial
            log.warning("npu-smi: %s (using the %d processes read)", e, len(table.processes))
        with self._lock:
            self._pids = table.pids()
            return {pid: {dev} for pid, dev in self._pids.items()}

    def hbm_watch_coverage(self) -> dict[str, str]:
        """device -> '' when the HBM watch can follow it, else why not (reads one round if needed)."""
        if not self._hbm_bw:
            try:
                self.collect(REALTIME)
            except SourceError:
                pass  # what could be read was recorded
        with self._lock:
            return {dev: "" if has else "npu-smi prints no `HBM Bandwidth Usage Rate(%)` for this chip "
                                        "(310/310P report DDR bandwidth only)"
                    for dev, has in sorted(self._hbm_bw.items())}

    def inventory(self) -> list[dict]:
        with self._lock:
            table, names = self._table, dict(self._names)
        return inventory_resources(table, names)

    def describe(self) -> dict:
        rounds = self._runner.describe()
        with self._lock:
            return {
                "path": self.exe or self.path,
                "driver_version": self._table.driver_version,
                "npus": sorted(self._chips),
                "devices": [c.device for c in self._table.chips],
                "timeout_s": self.timeout_s,
                "nearline_timeout_s": self.nearline_timeout_s,
                "offline_timeout_s": self.offline_timeout_s,
                "max_workers": self.max_workers,
                **rounds,
                "unsupported_queries": dict(self._unsupported),
                "notes": list(self._notes),
            }

    def close(self) -> None:
        self._runner.close()


# --------------------------------------------------------------------------------------------
# [sources.npu_smi]
# --------------------------------------------------------------------------------------------

SCHEMA = {
    "enabled": Key(bool, True),
    "path": Key(str, "", help="npu-smi executable (default: the driver's install dirs, then PATH)"),
    "timeout_s": Key((int, float), 0.6, positive, help="budget of one realtime round of calls"),
    "nearline_timeout_s": Key((int, float), 5.0, positive, help="budget of one nearline round (-t common)"),
    "offline_timeout_s": Key((int, float), 10.0, positive),
    "setup_timeout_s": Key((int, float), 15.0, positive),
    "max_workers": Key(int, 8, positive, help="npu-smi calls run at once"),
    "max_output_bytes": Key(int, DEFAULT_MAX_OUTPUT_BYTES, positive,
                            help="a call printing more is killed and counted (xpusense.npu_smi.calls.oversized)"),
    "error_codes_per_device": Key(int, 32, positive,
                                  help="error codes counted apart per chip; further codes count as code `other` "
                                       "(xpusense.accelerator.error_codes.over_limit)"),
}


def build(table: Any) -> list[Source]:
    """The source of a checked `[sources.npu_smi]` table."""
    return [NpuSmiSource(path=table.path, timeout_s=table.timeout_s, max_workers=table.max_workers,
                         nearline_timeout_s=table.nearline_timeout_s, offline_timeout_s=table.offline_timeout_s,
                         setup_timeout_s=table.setup_timeout_s, max_output_bytes=table.max_output_bytes,
                         error_codes_per_device=table.error_codes_per_device)]


FAMILY = SourceFamily("npu_smi", SCHEMA, build)
