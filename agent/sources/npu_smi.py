"""Huawei Ascend NPU utilisation, HBM, power, temperature and health, read from the `npu-smi` tool.

npu-smi is slow and forks a process per call, so this source budgets it: the realtime tier runs
`npu-smi info -t usages -i N` for every NPU at once (a thread pool, one subprocess each, argv
lists, never a shell) under one deadline; calls still running at the deadline are killed, their
NPUs are left out of that round and the round is counted as skipped (never queued behind). The
offline tier reads power, temperatures and health the same way, and turns a chip's change of
health into an Event.

Parsing is separate from reading: `parse_info()` reads the `npu-smi info` table (columns found
from its header rows, never from fixed offsets), `parse_kv()` the `-t TYPE -i N`, `-l` and `-m`
outputs (keys by name), and the `*_samples()` functions turn parsed output into Samples named as in
docs/metrics.md. Text that is not understood raises `ParseError` naming the command and the first
line it could not read, with what could be read in `.partial`.

Static facts npu-smi does not print (cube units, HCCS bandwidth) come from `catalog_npu.toml`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .base import COUNTER, GAUGE, OFFLINE, REALTIME, Event, Sample, Source, SourceError, Unavailable

log = logging.getLogger("xpusense.agent.sources.npu_smi")

VENDOR = "huawei"
# Where the Ascend driver package installs npu-smi (checked in this order, then PATH).
DEFAULT_SEARCH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/bin")
CATALOG_PATH = Path(__file__).resolve().parent.parent / "catalog_npu.toml"
MIB = 1024 * 1024
SKIPPED_METRIC = "xpusense.npu_smi.rounds.skipped"

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_MISSING = frozenset({"", "na", "n/a", "-", "--", "none", "null", "unknown"})


def norm_key(key: str) -> str:
    """Key or column name as compared here: no whitespace, lower case ("HBM Usage Rate(%)" -> "hbmusagerate(%)")."""
    return re.sub(r"\s+", "", key).lower()


def device_id(npu_id: int, chip_id: int) -> str:
    """The `device` label and inventory id of one chip: `npu<NPU ID>-<Chip ID>`."""
    return f"npu{npu_id}-{chip_id}"


def device_labels(npu_id: int, chip_id: int) -> dict[str, str]:
    return {"device": device_id(npu_id, chip_id), "vendor": VENDOR}


def parse_number(text: str | None) -> float | None:
    """A printed number, or None for NA, -, empty and anything that is not a plain decimal."""
    if text is None:
        return None
    t = text.strip()
    if t.lower() in _MISSING or not _NUMBER.fullmatch(t):
        return None
    return float(t)


def is_missing(text: str | None) -> bool:
    return text is None or text.strip().lower() in _MISSING


def parse_pair(text: str | None) -> tuple[float | None, float | None] | None:
    """`used / total` as printed in the info table ("2654 / 32768", "59807/ 65536"); None if not a pair."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([^/]*?)\s*/\s*([^/]*?)\s*", text)
    if not m:
        return None
    return parse_number(m.group(1)), parse_number(m.group(2))


class ParseError(ValueError):
    """npu-smi printed something this parser does not understand.

    `command` is the npu-smi command line, `line_no` (1-based, 0 for the whole output) and `line`
    the first line not understood, `partial` what could be read anyway.
    """

    def __init__(self, command: str, line_no: int, line: str, partial: Any = None,
                 reason: str = "line not understood"):
        self.command = command
        self.line_no = line_no
        self.line = line
        self.partial = partial
        self.reason = reason
        where = f"line {line_no}" if line_no else "its output"
        super().__init__(f"`{command}`: {reason} at {where}: {line.strip()[:160]!r}")


class _Problems:
    """Remembers the first line not understood while parsing goes on."""

    def __init__(self) -> None:
        self.first: tuple[int, str, str] | None = None

    def add(self, line_no: int, line: str, reason: str = "line not understood") -> None:
        if self.first is None:
            self.first = (line_no, line, reason)

    def raise_if_any(self, command: str, partial: Any) -> None:
        if self.first is not None:
            line_no, line, reason = self.first
            raise ParseError(command, line_no, line, partial, reason)


# --------------------------------------------------------------------------------------------
# `npu-smi info -t TYPE -i N`, `npu-smi info -l`, `npu-smi info -m`
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KvRecord:
    """The keys of one chip (or of one other part, e.g. the board MCU) in key-value output."""

    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    chip_id: int | None = None
    line_no: int = 0

    def get(self, *names: str) -> str | None:
        """The value of the first of `names` present (names compared as norm_key)."""
        index = {norm_key(k): v for k, v in self.fields.items()}
        for n in names:
            v = index.get(norm_key(n))
            if v is not None:
                return v
        return None

    def number(self, *names: str) -> float | None:
        return parse_number(self.get(*names))


@dataclasses.dataclass
class KvNpu:
    """One `NPU ID` group: its own keys (NPU ID, Chip Count), its chips, and other parts."""

    npu_id: int | None = None
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    chips: list[KvRecord] = dataclasses.field(default_factory=list)
    extra: list[KvRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvOutput:
    command: str
    fields: dict[str, str] = dataclasses.field(default_factory=dict)  # keys before any NPU (Total Count)
    npus: list[KvNpu] = dataclasses.field(default_factory=list)


_KV_LINE = re.compile(r"^\s*([^:]*?)\s*:[ \t]?(.*)$")
_TOP_KEYS = frozenset({"totalcount"})


def _is_mcu(rec: KvRecord) -> bool:
    name = rec.get("Chip Name")
    return name is not None and name.strip().lower() == "mcu"


def parse_kv(text: str, command: str = "npu-smi info -t") -> KvOutput:
    """Key-value output of `npu-smi info -t TYPE -i N`, `-l` (and the column list of `-m`).

    Lines are `<key> : <value>` with a TAB or spaces in front; keys are read by name, so a key that
    a generation or driver does not print is simply absent. `Chip ID` may come after its chip's
    values (usages, power, temp), before them (common, board) or not at all (newer builds): a
    record ends at a blank line, at a `Chip ID` that follows its values, or when a key repeats.
    A line with an empty key continues the previous value (multi-line `Error Information`), kept
    whole with newlines. A record without a Chip ID whose `Chip Name` is `mcu` (the board
    controller) goes to `extra`, not `chips`.
    """
    out = KvOutput(command)
    problems = _Problems()
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise ParseError(command, 0, "", out, "no output")
    if ":" not in first and "npuid" in norm_key(first) and "chipid" in norm_key(first):
        _parse_columns(lines, out, problems)
        problems.raise_if_any(command, out)
        return out

    cur_npu: KvNpu | None = None
    cur: KvRecord | None = None
    last: tuple[dict[str, str], str] | None = None  # where a continuation line goes

    def ensure_npu() -> KvNpu:
        nonlocal cur_npu
        if cur_npu is None:
            cur_npu = KvNpu()
            out.npus.append(cur_npu)
        return cur_npu

    def close() -> None:
        nonlocal cur
        if cur is not None and (cur.fields or cur.chip_id is not None):
            npu = ensure_npu()
            (npu.extra if cur.chip_id is None and _is_mcu(cur) else npu.chips).append(cur)
        cur = None

    for no, raw in enumerate(lines, 1):
        line = raw.rstrip("\r")
        if not line.strip():
            if cur is not None and cur.fields:
                close()
            continue
        m = _KV_LINE.match(line)
        if not m:
            problems.add(no, line)
            continue
        key, value = m.group(1), m.group(2).strip()
        if not key:
            if last is None:
                problems.add(no, line, "continuation line with nothing to continue")
            elif value:
                d, k = last
                d[k] = f"{d[k]}\n{value}" if d[k] else value
            continue
        nk = norm_key(key)
        if nk in _TOP_KEYS:
            close()
            out.fields[key] = value
            last = (out.fields, key)
        elif nk == "npuid":
            close()
            if not re.fullmatch(r"\d+", value):
                problems.add(no, line, "NPU ID is not a number")
                cur_npu = KvNpu()
            else:
                cur_npu = KvNpu(int(value), {key: value})
            out.npus.append(cur_npu)
            last = (cur_npu.fields, key)
        elif nk == "chipcount":
            close()
            npu = ensure_npu()
            npu.fields[key] = value
            last = (npu.fields, key)
        elif nk == "chipid":
            if not re.fullmatch(r"\d+", value):
                problems.add(no, line, "Chip ID is not a number")
                continue
            cid = int(value)
            if cur is None:
                cur = KvRecord(chip_id=cid, line_no=no)          # Chip ID before the values
            elif cur.chip_id is None and cur.fields:
                cur.chip_id = cid                                  # Chip ID after the values
                close()
            elif cur.chip_id is None:
                cur.chip_id = cid
            else:                                                  # the next chip starts
                close()
                cur = KvRecord(chip_id=cid, line_no=no)
            last = None
        else:
            ensure_npu()
            if cur is None:
                cur = KvRecord(line_no=no)
            elif key in cur.fields:                                # a repeated key: a new record
                close()
                cur = KvRecord(line_no=no)
            cur.fields[key] = value
            last = (cur.fields, key)
    close()
    problems.raise_if_any(command, out)
    return out


def _split_columns(line: str) -> list[tuple[int, str]]:
    """(position, text) of each run of text separated by two or more spaces."""
    return [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", line)]


def _nearest(pos: int, starts: list[int]) -> int:
    return min(range(len(starts)), key=lambda i: (abs(starts[i] - pos), i))


def _parse_columns(lines: list[str], out: KvOutput, problems: _Problems) -> None:
    """`npu-smi info -m`: a header row (NPU ID, Chip ID, Chip Logic ID, Chip Name) and one row per chip."""
    header: list[tuple[int, str]] | None = None
    npus: dict[int, KvNpu] = {}
    for no, raw in enumerate(lines, 1):
        line = raw.rstrip("\r").expandtabs(8)
        if not line.strip():
            continue
        cols = _split_columns(line)
        if header is None:
            header = cols
            continue
        names = [n for _, n in header]
        if len(cols) == len(header):
            row = {names[i]: t for i, (_, t) in enumerate(cols)}
        else:
            row = {}
            starts = [p for p, _ in header]
            for p, t in cols:
                name = names[_nearest(p, starts)]
                row.setdefault(name, t)
        by_norm = {norm_key(k): v for k, v in row.items()}
        npu_s, chip_s = by_norm.get("npuid", ""), by_norm.get("chipid", "")
        if not re.fullmatch(r"\d+", npu_s) or not re.fullmatch(r"\d+", chip_s):
            problems.add(no, raw, "row without a numeric NPU ID and Chip ID")
            continue
        npu = npus.get(int(npu_s))
        if npu is None:
            npu = npus[int(npu_s)] = KvNpu(int(npu_s), {"NPU ID": npu_s})
            out.npus.append(npu)
        rec = KvRecord({k: v for k, v in row.items() if norm_key(k) not in ("npuid", "chipid")},
                       int(chip_s), no)
        (npu.extra if _is_mcu(rec) else npu.chips).append(rec)


def chip_records(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[tuple[int, int, KvRecord]]:
    """(NPU ID, Chip ID, record) for every chip record of a per-NPU command's output.

    The NPU ID is the printed one, else `npu_id` (the one asked for). A record without a Chip ID
    gets the next of `known_chips` (or 0, 1, ...) not printed elsewhere in the output.
    """
    result = []
    for group in out.npus:
        npu = group.npu_id if group.npu_id is not None else npu_id
        printed = {r.chip_id for r in group.chips if r.chip_id is not None}
        spare = [c for c in (list(known_chips) or range(len(group.chips))) if c not in printed]
        spare += [c for c in range(len(group.chips) + len(printed) + 1) if c not in printed and c not in spare]
        for rec in group.chips:
            if rec.chip_id is not None:
                cid = rec.chip_id
            else:
                cid = spare.pop(0)
            result.append((npu, cid, rec))
    return result


# Field names per metric, in order of preference (compared as norm_key). Data, not code.
USAGE_RATIOS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hw.gpu.utilization", ("Aicore Usage Rate(%)",)),
    ("xpusense.accelerator.vector.utilization", ("Aivector Usage Rate(%)", "Vector Core Usage Rate(%)")),
    ("xpusense.accelerator.cube.utilization", ("Aicube Usage Rate(%)", "Cube Usage Rate(%)")),
    ("xpusense.accelerator.hbm.bandwidth.utilization", ("HBM Bandwidth Usage Rate(%)",)),
)
POWER_KEYS = ("NPU Real-time Power(W)", "Real-time Power(W)", "Power Dissipation(W)", "Power(W)")
CHIP_TEMP_KEYS = ("NPU Temperature (C)", "Chip Temperature(C)", "Temperature(C)")
HBM_TEMP_KEYS = ("HBM Temperature (C)", "HBM Temperature(C)")
HEALTH_KEYS = ("Health Status", "Health")


def usages_samples(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[Sample]:
    """`npu-smi info -t usages -i N` -> utilisation ratios, HBM bandwidth, HBM used/total/ratio.

    HBM used is `HBM Capacity(MB)` x `HBM Usage Rate(%)` (the output has no used figure, so it is
    as coarse as the integer percentage). A chip without HBM (310, 310P) reports its DDR instead.
    """
    samples = []
    for npu, chip, rec in chip_records(out, npu_id, known_chips):
        labels = device_labels(npu, chip)
        for metric, keys in USAGE_RATIOS:
            v = rec.number(*keys)
            if v is not None:
                samples.append(Sample(metric, v / 100.0, "1", dict(labels)))
        cap, rate = rec.number("HBM Capacity(MB)"), rec.number("HBM Usage Rate(%)")
        if not cap:
            ddr_cap = rec.number("DDR Capacity(MB)")
            if ddr_cap:
                cap, rate = ddr_cap, rec.number("DDR Usage Rate(%)")
        if cap:
            samples.append(Sample("hw.gpu.memory.limit", cap * MIB, "By", dict(labels)))
            if rate is not None:
                samples.append(Sample("hw.gpu.memory.utilization", rate / 100.0, "1", dict(labels)))
                samples.append(Sample("hw.gpu.memory.usage", round(cap * MIB * rate / 100.0), "By", dict(labels)))
    return samples


def power_samples(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[Sample]:
    """`npu-smi info -t power -i N` -> hw.power (W) per chip."""
    samples = []
    for npu, chip, rec in chip_records(out, npu_id, known_chips):
        v = rec.number(*POWER_KEYS)
        if v is not None:
            samples.append(Sample("hw.power", v, "W", device_labels(npu, chip)))
    return samples


def temp_samples(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[Sample]:
    """`npu-smi info -t temp -i N` -> hw.temperature (Cel), sensor chip / hbm (board MCU sensors left out)."""
    samples = []
    for npu, chip, rec in chip_records(out, npu_id, known_chips):
        for sensor, keys in (("chip", CHIP_TEMP_KEYS), ("hbm", HBM_TEMP_KEYS)):
            v = rec.number(*keys)
            if v is not None:
                samples.append(Sample("hw.temperature", v, "Cel", {**device_labels(npu, chip), "sensor": sensor}))
    return samples


@dataclasses.dataclass
class HealthReading:
    npu_id: int
    chip_id: int
    status: str                 # OK, Warning, Alarm, Critical, UNKNOWN (as printed)
    error_codes: str = ""       # "A4025021 8C03A000 8C084E00", "" for NA
    error_information: str = ""  # whole, several lines joined with newlines

    @property
    def device(self) -> str:
        return device_id(self.npu_id, self.chip_id)

    @property
    def ok(self) -> bool:
        return self.status.strip().upper() == "OK"


def health_readings(out: KvOutput, npu_id: int, known_chips: Iterable[int] = ()) -> list[HealthReading]:
    """`npu-smi info -t health -i N` -> one reading per chip.

    The output of one NPU may carry no Chip ID at all; when the NPU has several chips and the output
    one record, that record is the card's health and is given to every chip.
    """
    known = list(known_chips)
    records = chip_records(out, npu_id, known)
    readings = []
    if len(records) == 1 and records[0][2].chip_id is None and len(known) > 1:
        npu, _, rec = records[0]
        records = [(npu, c, rec) for c in known]
    for npu, chip, rec in records:
        status = rec.get(*HEALTH_KEYS)
        if status is None or not status.strip():
            continue
        codes = rec.get("Error Code") or ""
        info = rec.get("Error Information") or ""
        readings.append(HealthReading(npu, chip, status.strip(),
                                      "" if is_missing(codes) else " ".join(codes.split()),
                                      "" if is_missing(info) else info.strip()))
    return readings


def health_samples(readings: Iterable[HealthReading]) -> list[Sample]:
    """xpusense.accelerator.health: 1 when OK, 0 otherwise, with the printed status as label `status`."""
    return [Sample("xpusense.accelerator.health", 1.0 if r.ok else 0.0, "1",
                   {**device_labels(r.npu_id, r.chip_id), "status": r.status}) for r in readings]


def severity_of(status: str) -> str:
    s = status.strip().upper()
    if s == "OK":
        return "info"
    if s == "WARNING":
        return "warning"
    return "critical"  # Alarm, Critical, UNKNOWN, anything else


# --------------------------------------------------------------------------------------------
# `npu-smi info`: the table
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class InfoChip:
    """One chip row of the `npu-smi info` table, with the NPU row it belongs to.

    `power_w` is the NPU row's power and is given to the first chip row after that NPU row only (a
    310P card prints one NPU row for several chips; an A3 card one per chip, the second with `-`).
    """

    npu_id: int
    chip_id: int
    name: str = ""
    health: str = ""
    power_w: float | None = None
    temp_c: float | None = None
    bus_id: str = ""
    phy_id: str = ""
    logic_id: str = ""
    aicore_pct: float | None = None
    npu_util_pct: float | None = None
    hbm_used_mb: float | None = None
    hbm_total_mb: float | None = None
    memory_used_mb: float | None = None
    memory_total_mb: float | None = None
    line_no: int = 0
    fields: dict[str, str] = dataclasses.field(default_factory=dict)  # column -> text as printed

    @property
    def device(self) -> str:
        return device_id(self.npu_id, self.chip_id)


@dataclasses.dataclass
class InfoProcess:
    npu_id: int
    chip_id: int
    pid: int
    name: str = ""
    memory_mb: float | None = None

    @property
    def device(self) -> str:
        return device_id(self.npu_id, self.chip_id)


@dataclasses.dataclass
class InfoTable:
    command: str = "npu-smi info"
    tool_version: str = ""     # "npu-smi 24.1.RC2"
    driver_version: str = ""   # "Version: 24.1.RC2"
    chips: list[InfoChip] = dataclasses.field(default_factory=list)
    processes: list[InfoProcess] = dataclasses.field(default_factory=list)
    idle_npus: list[int] = dataclasses.field(default_factory=list)  # "No running processes found in NPU n"

    def pids(self) -> dict[int, str]:
        """pid -> device (the first chip listed for a pid that uses several)."""
        result: dict[int, str] = {}
        for p in self.processes:
            result.setdefault(p.pid, p.device)
        return result


