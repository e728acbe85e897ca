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

Static facts npu-smi does not print (cube units, HCCS bandwidth) come from `agent/catalog/huawei.toml`.
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
from typing import Any, Iterable, Mapping

from .base import COUNTER, OFFLINE, REALTIME, Event, Sample, Source, SourceError, Unavailable

log = logging.getLogger("xpusense.agent.sources.npu_smi")

VENDOR = "huawei"
# Where the Ascend driver package installs npu-smi (checked in this order, then PATH).
DEFAULT_SEARCH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/bin")
CATALOG_PATH = Path(__file__).resolve().parent.parent / "catalog" / "huawei.toml"
MIB = 1024 * 1024
MAX_CHIPS_PER_NPU = 64  # a `Chip Count` above this is taken for garbage
SKIPPED_METRIC = "xpusense.npu_smi.rounds.skipped"

_NUMBER = re.compile(r"[-+]?[0-9]+(?:\.[0-9]+)?")
_ID = re.compile(r"[0-9]{1,9}")  # an NPU, chip or process id
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
    if t.lower() in _MISSING or len(t) > 32 or not _NUMBER.fullmatch(t):
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
            if not _ID.fullmatch(value):
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
            if not _ID.fullmatch(value):
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
        if not _ID.fullmatch(npu_s) or not _ID.fullmatch(chip_s):
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
                samples.append(Sample("hw.gpu.memory.usage", float(round(cap * MIB * rate / 100.0)), "By", dict(labels)))
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



@dataclasses.dataclass
class _Column:
    name: str
    norm: str
    offset: int  # from the start of its cell


@dataclasses.dataclass
class _HeaderCell:
    start: int
    columns: list[_Column]


_SEPARATOR = re.compile(r"[+|][-=+|]*")
# A header row names columns; these are the first words of every column npu-smi is known to print.
_HEADER_WORDS = ("npu", "chip", "name", "health", "bus-id", "power", "temp", "aicore", "memory-usage",
                 "hbm-usage", "hugepages", "process", "phy-id", "device")
_INFO_FIELD = {
    "npu": "npu_id", "npuid": "npu_id", "name": "name", "health": "health", "power(w)": "power_w",
    "temp(c)": "temp_c", "chip": "chip_id", "chipid": "chip_id", "phy-id": "phy_id", "device": "logic_id",
    "bus-id": "bus_id", "aicore(%)": "aicore_pct", "npuutil(%)": "npu_util_pct",
    "memory-usage(mb)": "memory", "hbm-usage(mb)": "hbm",
}
_PROC_FIELD = {"npu": "npu_id", "npuid": "npu_id", "chip": "chip_id", "chipid": "chip_id",
               "processid": "pid", "processname": "name", "processmemory(mb)": "memory_mb"}


def _cells(line: str) -> list[tuple[int, str]]:
    """(position, text) of each cell between `|` characters; a row cut short keeps its last piece."""
    bars = [i for i, c in enumerate(line) if c == "|"]
    if not bars:
        return [(0, line)]
    cells = [(a + 1, line[a + 1:b]) for a, b in zip(bars, bars[1:])]
    tail = line[bars[-1] + 1:]
    if tail.strip():
        cells.append((bars[-1] + 1, tail))
    return cells


def _pieces(start: int, text: str) -> list[tuple[int, str]]:
    """Values in a cell at their line positions: runs split by 2+ spaces, `a / b` pairs kept together."""
    merged: list[tuple[int, str]] = []
    for pos, t in _split_columns(text):
        if merged and (t.startswith("/") or merged[-1][1].endswith("/")):
            p0, t0 = merged[-1]
            merged[-1] = (p0, f"{t0} {t}")
        else:
            merged.append((start + pos, t))
    return merged


def _is_header(cells: list[tuple[int, str]]) -> bool:
    pieces = [t for start, text in cells for _, t in _pieces(start, text)]
    if not pieces:
        return False
    for t in pieces:
        if any(_NUMBER.fullmatch(w) for w in t.split()) or ("/" in t and re.search(r"[0-9]", t)):
            return False
    return any(norm_key(t).startswith(_HEADER_WORDS) for t in pieces)


def _header_cells(cells: list[tuple[int, str]]) -> list[_HeaderCell]:
    return [_HeaderCell(start, [_Column(t, norm_key(t), p - start) for p, t in _pieces(start, text)])
            for start, text in cells]


def _assign(cells: list[tuple[int, str]], header: list[_HeaderCell]) -> dict[str, str]:
    """Values of one data row by column name, matched to a header row's columns by position."""
    row: dict[str, str] = {}
    if len(cells) == len(header):
        for (start, text), hc in zip(cells, header):
            cols = hc.columns
            if not cols:
                continue
            if len(cols) == 1:  # one column: the whole cell (a process name may hold spaces)
                t = text.strip()
                if t:
                    row[cols[0].name] = " ".join(t.split()) if "/" in t else t
                continue
            vals = _pieces(start, text)
            if len(vals) == len(cols):
                for c, (_, v) in zip(cols, vals):
                    row[c.name] = v
            else:  # a value missing or overflowing: the column whose start is nearest
                offsets = [c.offset for c in cols]
                for p, v in vals:
                    row.setdefault(cols[_nearest(p - start, offsets)].name, v)
        return row
    flat = [(hc.start + c.offset, c) for hc in header for c in hc.columns]
    if flat:
        starts = [p for p, _ in flat]
        for start, text in cells:
            for p, v in _pieces(start, text):
                row.setdefault(flat[_nearest(p, starts)][1].name, v)
    return row


def _section_kind(rows: list[list[_HeaderCell]]) -> str:
    norms = {c.norm for row in rows for hc in row for c in hc.columns}
    if any(n.startswith("processid") for n in norms):
        return "process"
    if norms & {"health", "bus-id", "name", "aicore(%)", "hbm-usage(mb)", "memory-usage(mb)", "npu", "npuid"}:
        return "device"
    return "unknown"


def _canon(row: Mapping[str, str], mapping: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in row.items():
        f = mapping.get(norm_key(k))
        if f and f not in out:
            out[f] = v
    return out


def parse_info(text: str, command: str = "npu-smi info") -> InfoTable:
    """The `npu-smi info` table -> chips (NPU row + chip row merged) and the process table.

    Column names and positions come from the header rows of each section; the first data row of a
    block (between separator lines) matches the first header row (NPU, Name, Health, Power...), the
    following rows the last (Chip, Bus-Id, AICore, HBM...). This reads the 310, 310P (one NPU row,
    several chip rows), 910A, 910B, A3 (one block per chip) and 950 (no Chip column) layouts.
    """
    table = InfoTable(command)
    problems = _Problems()
    lines = text.splitlines()
    if not any(ln.strip() for ln in lines):
        raise ParseError(command, 0, "", table, "no output")
    header: list[list[_HeaderCell]] = []
    pending: list[list[_HeaderCell]] = []
    kind = ""
    block = 0
    npu_row: tuple[int, dict[str, str], dict[str, str]] | None = None  # (line, raw row, canonical)
    chips_in_block = 0
    seen: set[tuple[int, int]] = set()

    def bad_value(no: int, raw: str, f: Mapping[str, str]) -> bool:
        for k in ("power_w", "temp_c", "aicore_pct", "npu_util_pct"):
            if k in f and not is_missing(f[k]) and parse_number(f[k]) is None:
                problems.add(no, raw, f"{k} is not a number")
                return True
        for k in ("memory", "hbm"):
            if k in f and not is_missing(f[k]):
                pair = parse_pair(f[k])
                if pair is None or (pair[0] is None and pair[1] is None):
                    problems.add(no, raw, f"{k} is not 'used / total'")
                    return True
        return False

    def add_chip(chip_id: int, chip_no: int, chip_raw: dict[str, str], chip_f: dict[str, str]) -> None:
        nonlocal chips_in_block
        assert npu_row is not None
        no, raw, f = npu_row
        merged = {**f, **chip_f}
        key = (int(f["npu_id"]), chip_id)
        first_in_block = chips_in_block == 0
        chips_in_block += 1
        if key in seen:
            return
        seen.add(key)
        hbm = parse_pair(merged.get("hbm")) or (None, None)
        mem = parse_pair(merged.get("memory")) or (None, None)
        table.chips.append(InfoChip(
            npu_id=key[0], chip_id=chip_id, name=merged.get("name", "").strip(),
            health=merged.get("health", "").strip(),
            power_w=parse_number(f.get("power_w")) if first_in_block else None,
            temp_c=parse_number(merged.get("temp_c")),
            bus_id="" if is_missing(merged.get("bus_id")) else merged["bus_id"].strip(),
            phy_id="" if is_missing(merged.get("phy_id")) else merged["phy_id"].strip(),
            logic_id="" if is_missing(merged.get("logic_id")) else merged["logic_id"].strip(),
            aicore_pct=parse_number(merged.get("aicore_pct")),
            npu_util_pct=parse_number(merged.get("npu_util_pct")),
            hbm_used_mb=hbm[0], hbm_total_mb=hbm[1], memory_used_mb=mem[0], memory_total_mb=mem[1],
            line_no=chip_no or no, fields={**raw, **chip_raw}))

    def end_block() -> None:
        nonlocal npu_row, chips_in_block
        if npu_row is not None and chips_in_block == 0:
            add_chip(0, 0, {}, {})  # an NPU row whose chip row is missing (cut short): keep what it says
        npu_row, chips_in_block = None, 0

    def start_section() -> None:
        nonlocal header, pending, kind, block
        header, pending, kind, block = pending, [], _section_kind(pending), 0

    for no, raw in enumerate(lines, 1):
        line = raw.rstrip("\r").expandtabs(8)
        s = line.strip()
        if not s:
            continue
        if _SEPARATOR.fullmatch(s) and ("-" in s or "=" in s):
            end_block()
            block = 0
            if pending:
                start_section()
            continue
        if not s.startswith("|"):
            problems.add(no, raw)
            continue
        inner = s.strip("|").strip()
        m = re.match(r"npu-smi\s+(\S+)", inner)
        if m:
            table.tool_version = m.group(1)
            v = re.search(r"Version:\s*(\S+)", inner)
            if v:
                table.driver_version = v.group(1)
            continue
        m = re.fullmatch(r"No running processes found in NPU\s+([0-9]{1,9})", inner)
        if m:
            table.idle_npus.append(int(m.group(1)))
            continue
        cells = _cells(line)
        if _is_header(cells):
            if not pending:
                end_block()
            pending.append(_header_cells(cells))
            continue
        if pending:
            start_section()
        if not header:
            problems.add(no, raw, "data row before any header row")
            continue
        row = _assign(cells, header[min(block, len(header) - 1)])
        block += 1
        if kind == "device":
            f = _canon(row, _INFO_FIELD)
            if bad_value(no, raw, f):
                continue
            if block == 1:  # the NPU row (or, with a one-row header, the whole chip)
                end_block()
                npu_s = f.get("npu_id", "")
                if not _ID.fullmatch(npu_s):
                    problems.add(no, raw, "NPU row without a numeric NPU id")
                    continue
                npu_row = (no, row, f)
                if len(header) == 1:
                    chip_s = f.get("chip_id", "0")
                    add_chip(int(chip_s) if _ID.fullmatch(chip_s) else 0, no, {}, {})
                continue
            if npu_row is None:
                problems.add(no, raw, "chip row without its NPU row")
                continue
            chip_s = f.pop("chip_id", "").strip()
            if not chip_s:
                chip_id = chips_in_block
            elif _ID.fullmatch(chip_s):
                chip_id = int(chip_s)
            else:
                problems.add(no, raw, "chip row without a numeric chip id")
                continue
            f.pop("npu_id", None)
            add_chip(chip_id, no, row, f)
        elif kind == "process":
            f = _canon(row, _PROC_FIELD)
            npu_s, chip_s, pid_s = f.get("npu_id", ""), f.get("chip_id", "0"), f.get("pid", "")
            if not (_ID.fullmatch(npu_s) and _ID.fullmatch(chip_s) and _ID.fullmatch(pid_s)):
                problems.add(no, raw, "process row without numeric NPU, chip and process id")
                continue
            table.processes.append(InfoProcess(int(npu_s), int(chip_s), int(pid_s), f.get("name", "").strip(),
                                               parse_number(f.get("memory_mb"))))
        # rows of a section this parser does not know are skipped: nothing in them is claimed
    end_block()
    problems.raise_if_any(command, table)
    return table


def info_samples(table: InfoTable) -> list[Sample]:
    """The `npu-smi info` table -> AI Core utilisation, HBM used/total (exact MB), power, chip temperature, health.

    A chip without HBM (310, 310P) reports its device memory. Where the table has no AICore column
    (950) its `NPU Util(%)` is used.
    """
    samples = []
    for c in table.chips:
        labels = device_labels(c.npu_id, c.chip_id)
        util = c.aicore_pct if c.aicore_pct is not None else c.npu_util_pct
        if util is not None:
            samples.append(Sample("hw.gpu.utilization", util / 100.0, "1", dict(labels)))
        used, total = (c.hbm_used_mb, c.hbm_total_mb) if c.hbm_total_mb else (c.memory_used_mb, c.memory_total_mb)
        if total:
            samples.append(Sample("hw.gpu.memory.limit", total * MIB, "By", dict(labels)))
            if used is not None:
                samples.append(Sample("hw.gpu.memory.usage", used * MIB, "By", dict(labels)))
                samples.append(Sample("hw.gpu.memory.utilization", used / total, "1", dict(labels)))
        if c.power_w is not None:
            samples.append(Sample("hw.power", c.power_w, "W", dict(labels)))
        if c.temp_c is not None:
            samples.append(Sample("hw.temperature", c.temp_c, "Cel", {**labels, "sensor": "chip"}))
        if c.health:
            samples.append(Sample("xpusense.accelerator.health", 1.0 if c.health.upper() == "OK" else 0.0, "1",
                                  {**labels, "status": c.health}))
    return samples


# --------------------------------------------------------------------------------------------
# Inventory
# --------------------------------------------------------------------------------------------

def load_catalog(path: str | Path = CATALOG_PATH) -> dict[str, dict]:
    """`[models."Ascend-910B4"]` tables of the catalog file, keyed by norm_key(model); {} if unreadable."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        log.warning("NPU catalog %s unreadable (%s); inventory will lack matrix units and HCCS bandwidth", path, e)
        return {}
    models = data.get("models") if isinstance(data.get("models"), dict) else {}
    return {norm_key(k): v for k, v in models.items() if isinstance(v, dict)}


def normalize_model(name: str) -> str:
    """Chip name as npu-smi prints it -> inventory model: "910B4" / "Ascend 910A" / "Ascend910" -> "Ascend-910B4"..."""
    n = re.sub(r"(?i)^ascend[\s_-]*", "", name.strip())
    n = re.sub(r"\s+", "", n)
    return f"Ascend-{n}" if n else "Ascend"


def informative(name: str | None) -> bool:
    """A chip name that says which chip it is (has a digit; public captures often redact it to "xxx")."""
    return bool(name) and bool(re.search(r"[0-9]", name or ""))


def catalog_entry(catalog: Mapping[str, dict], model: str) -> dict:
    key = norm_key(model)
    if key in catalog:
        return catalog[key]
    return catalog.get(re.sub(r"-[0-9]+$", "", key), {})  # "Ascend-910B4-1" (a board variant) -> "Ascend-910B4"


def memory_text(mb: float) -> str:
    gb = mb / 1024.0
    return f"{round(gb)}GB" if abs(gb - round(gb)) < 0.05 else f"{gb:.1f}GB"


def inventory_resources(table: InfoTable, catalog: Mapping[str, dict],
                        names: Mapping[str, str] | None = None) -> list[dict]:
    """One NPU resource per chip in DESIGN.md's inventory schema.

    `names` (device -> chip name, e.g. from `npu-smi info -m`) is used where the table's Name says
    nothing (redacted or blank). Catalog fields a model does not have are left out.
    """
    names = names or {}
    per_card: dict[int, int] = {}
    for c in table.chips:
        per_card[c.npu_id] = per_card.get(c.npu_id, 0) + 1
    resources = []
    for c in table.chips:
        name = c.name if informative(c.name) else (names.get(c.device) or c.name)
        model = normalize_model(name)
        entry = catalog_entry(catalog, model)
        attrs: dict[str, str] = {}
        total = c.hbm_total_mb or c.memory_total_mb
        if total:
            attrs["memory"] = memory_text(total)
        attrs["chips_per_card"] = str(per_card[c.npu_id])
        if c.bus_id:
            attrs["pci_bus_id"] = c.bus_id
        if table.driver_version:
            attrs["driver_version"] = table.driver_version
        for k in ("matrix_units", "matrix_unit_shape", "vector_units"):
            if k in entry:
                attrs[k] = str(entry[k])
        interconnects = []
        for ic in entry.get("interconnects", []):
            if isinstance(ic, dict) and "type" in ic:
                interconnects.append({"type": str(ic["type"]),
                                      **({"bandwidth": str(ic["bandwidth"])} if "bandwidth" in ic else {})})
        resources.append({"type": "NPU", "vendor": VENDOR, "model": model, "id": c.device,
                          "attributes": attrs, "interconnects": interconnects})
    return resources


# --------------------------------------------------------------------------------------------
# The source
# --------------------------------------------------------------------------------------------

class _TimedOut(Exception):
    pass


class _CommandFailed(Exception):
    def __init__(self, command: str, returncode: int, text: str):
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "(no output)")
        super().__init__(f"`{command}` exited with {returncode}: {first[:200]}")
        self.command, self.returncode, self.text = command, returncode, text


KILL_GRACE_S = 1.0  # how long a round waits, past its deadline, for killed calls to be reaped


def _command(args: list[str]) -> str:
    return " ".join(["npu-smi", *args])


class NpuSmiSource(Source):
    """Ascend NPUs through npu-smi: realtime usages per NPU, offline power, temperatures and health."""

    name = "npu-smi"
    tiers = (REALTIME, OFFLINE)

    def __init__(self, path: str = "", timeout_s: float = 0.8, max_workers: int = 8, *,
                 offline_timeout_s: float = 10.0, setup_timeout_s: float = 15.0,
                 search_dirs: Iterable[str] = DEFAULT_SEARCH_DIRS, catalog_path: str | Path = CATALOG_PATH):
        self.path = path
        self.timeout_s = timeout_s
        self.max_workers = max(1, int(max_workers))
        self.offline_timeout_s = offline_timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.search_dirs = tuple(search_dirs)
        self.catalog_path = catalog_path
        self.exe = ""
        self._lock = threading.Lock()
        self._table = InfoTable()
        self._chips: dict[int, list[int]] = {}
        self._names: dict[str, str] = {}
        self._catalog: dict[str, dict] = {}
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._inflight: dict[tuple, concurrent.futures.Future] = {}
        self._stragglers: list[subprocess.Popen] = []
        self._skipped = {t: 0 for t in self.tiers}
        self._last_round_s: dict[str, float] = {}
        self._late: dict[str, list[str]] = {}
        self._health: dict[str, tuple[str, str]] = {}
        self._events: list[Event] = []
        self._pids: dict[int, str] = {}
        self._notes: list[str] = []
        self._hbm_bw: dict[str, bool] = {}   # device -> whether its usages output has HBM bandwidth

    # -- finding and running npu-smi ---------------------------------------------------------

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

    def _run(self, args: list[str], deadline: float) -> str:
        """Run `npu-smi ARGS` (argv list, own process group) until `deadline`; kill it when late."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _TimedOut(_command(args))
        proc = subprocess.Popen([self.exe, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise _TimedOut(_command(args)) from None
        text = out.decode("utf-8", "replace")
        if proc.returncode != 0:
            raise _CommandFailed(_command(args), proc.returncode, err.decode("utf-8", "replace") + "\n" + text)
        return text

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        try:
            proc.communicate(timeout=KILL_GRACE_S / 2)
        except subprocess.TimeoutExpired:  # stuck in the kernel (D state): reap it in a later round
            with self._lock:
                self._stragglers.append(proc)

    def _reap(self) -> None:
        with self._lock:
            self._stragglers = [p for p in self._stragglers if p.poll() is None]

    # -- Source ------------------------------------------------------------------------------

    def setup(self) -> None:
        self.exe = self.find_executable()
        deadline = time.monotonic() + self.setup_timeout_s
        try:
            text = self._run(["info"], deadline)
        except _TimedOut:
            raise Unavailable(f"`npu-smi info` ({self.exe}) did not answer within {self.setup_timeout_s:g} s; "
                              f"the NPU driver may be hung (see dmesg) or the host overloaded") from None
        except _CommandFailed as e:
            raise Unavailable(f"{e}; check that the Ascend driver is installed and loaded and that this user "
                              f"may use the NPUs (root or the HwHiAiUser group)") from None
        except OSError as e:
            raise Unavailable(f"cannot run {self.exe}: {e}; run the agent as a user allowed to run npu-smi "
                              f"(root or the HwHiAiUser group)") from None
        try:
            table = parse_info(text)
        except ParseError as e:
            table = e.partial
            self._notes.append(str(e))
            log.warning("npu-smi: %s (keeping the %d chips read)", e, len(table.chips))
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
        self._catalog = load_catalog(self.catalog_path)
        with self._lock:
            self._table, self._chips, self._pids = table, chips, table.pids()
        self._pools = {t: concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix=f"npu-smi-{t}")
                       for t in self.tiers}

    def _discover_from_list(self, deadline: float) -> list[InfoChip]:
        """The NPUs of `npu-smi info -l` when the table could not be read (a layout not seen yet)."""
        try:
            out = parse_kv(self._run(["info", "-l"], deadline), "npu-smi info -l")
        except ParseError as e:
            out = e.partial
        except (_TimedOut, _CommandFailed, OSError) as e:
            self._notes.append(f"`npu-smi info -l`: {e}")
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
        try:
            out = parse_kv(self._run(["info", "-m"], deadline), "npu-smi info -m")
        except ParseError as e:
            out = e.partial
        except (_TimedOut, _CommandFailed, OSError) as e:
            self._notes.append(f"`npu-smi info -m`: {e}")
            return {}
        return {device_id(npu.npu_id, rec.chip_id): rec.get("Chip Name") or ""
                for npu in out.npus if npu.npu_id is not None
                for rec in npu.chips if rec.chip_id is not None and rec.get("Chip Name")}

    def _round(self, tier: str, jobs: list[tuple[tuple, list[str]]], budget_s: float):
        """Run every job at once under one deadline: (finished (key, args, text or error), keys that were late)."""
        self._reap()
        t0 = time.monotonic()
        deadline = t0 + budget_s
        pool = self._pools.get(tier)
        if pool is None:
            raise SourceError("the npu-smi source is not set up (setup() failed or close() was called)")
        futures: dict[concurrent.futures.Future, tuple[tuple, list[str]]] = {}
        late: list[tuple] = []
        for key, args in jobs:
            with self._lock:
                prev = self._inflight.get(key)
                if prev is not None and not prev.done():  # last round's call still being killed
                    late.append(key)
                    continue
                try:
                    fut = pool.submit(self._run, args, deadline)
                except RuntimeError:  # close() shut the pool down under us
                    raise SourceError("the npu-smi source was closed during a round") from None
                self._inflight[key] = fut
            futures[fut] = (key, args)
        _, not_done = concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()) + KILL_GRACE_S)
        finished = []
        for fut, (key, args) in futures.items():
            if fut in not_done:
                late.append(key)
                continue
            exc = fut.exception()
            if isinstance(exc, _TimedOut):
                late.append(key)
            else:
                finished.append((key, args, exc if exc is not None else fut.result()))
        with self._lock:
            self._last_round_s[tier] = time.monotonic() - t0
            self._late[tier] = [_command(a) for k, a in jobs if k in late]
            if late:
                self._skipped[tier] += 1
        return finished, late

    def collect(self, tier: str) -> list[Sample]:
        if tier not in self.tiers:
            return []
        with self._lock:
            chips = {n: list(c) for n, c in self._chips.items()}
        if tier == REALTIME:
            jobs = [((tier, n, "usages"), ["info", "-t", "usages", "-i", str(n)]) for n in sorted(chips)]
            budget = self.timeout_s
        else:
            jobs = [((tier, n, t), ["info", "-t", t, "-i", str(n)]) for n in sorted(chips)
                    for t in ("power", "temp", "health")]
            budget = self.offline_timeout_s
        finished, late = self._round(tier, jobs, budget)
        samples: list[Sample] = []
        errors: list[str] = []
        readings: list[HealthReading] = []
        for (_, npu, kind), args, result in finished:
            cmd = _command(args)
            if isinstance(result, BaseException):
                errors.append(str(result) if isinstance(result, _CommandFailed) else f"`{cmd}`: {result}")
                continue
            try:
                out = parse_kv(result, cmd)
            except ParseError as e:
                errors.append(str(e))
                out = e.partial
            known = chips.get(npu, [])
            if kind == "usages":
                samples += usages_samples(out, npu, known)
            elif kind == "power":
                samples += power_samples(out, npu, known)
            elif kind == "temp":
                samples += temp_samples(out, npu, known)
            else:
                found = health_readings(out, npu, known)
                readings += found
                samples += health_samples(found)
        self._note_health(readings)
        if tier == REALTIME:
            with_bw = {x.labels["device"] for x in samples if x.name == "xpusense.accelerator.hbm.bandwidth.utilization"}
            with self._lock:
                for x in samples:
                    if x.name == "hw.gpu.utilization":
                        self._hbm_bw[x.labels["device"]] = x.labels["device"] in with_bw
        with self._lock:
            skipped = self._skipped[tier]
        samples.append(Sample(SKIPPED_METRIC, float(skipped), "{round}", {"tier": tier}, COUNTER))
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise SourceError(errors[0] + more, samples)
        return samples

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

    def events(self) -> list[Event]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def processes(self) -> dict[int, set[str]]:
        """pid -> devices (`npu<N>-<chip>`) of the processes npu-smi's table lists, read now."""
        try:
            text = self._run(["info"], time.monotonic() + self.offline_timeout_s)
        except _TimedOut:
            raise SourceError(f"`npu-smi info` did not answer within {self.offline_timeout_s:g} s") from None
        except (_CommandFailed, OSError) as e:
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
            table, names, catalog = self._table, dict(self._names), self._catalog
        return inventory_resources(table, catalog, names)

    def describe(self) -> dict:
        with self._lock:
            return {
                "path": self.exe or self.path,
                "driver_version": self._table.driver_version,
                "npus": sorted(self._chips),
                "devices": [c.device for c in self._table.chips],
                "timeout_s": self.timeout_s,
                "offline_timeout_s": self.offline_timeout_s,
                "max_workers": self.max_workers,
                "rounds_skipped": dict(self._skipped),
                "last_round_s": {t: round(v, 6) for t, v in self._last_round_s.items()},
                "last_late_commands": {t: list(v) for t, v in self._late.items() if v},
                "notes": list(self._notes),
            }

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools = {}
        self._reap()
