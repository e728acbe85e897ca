"""The `npu-smi info` table: chips (NPU row + chip row merged), the process table, versions.

Columns are found from the header rows of each section, never from fixed offsets. `parse_info()`
is the entry point; `InfoTableParser` holds the state of one pass over the lines.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from .cells import Cells, HeaderRow, assign, cells, header_row, is_header
from .values import ID, ParseError, Problems, device_id, is_missing, norm_key, parse_number, parse_pair


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


# --------------------------------------------------------------------------------------------
# What the columns mean
# --------------------------------------------------------------------------------------------

_SEPARATOR = re.compile(r"[+|][-=+|]*")
_INFO_FIELD = {
    "npu": "npu_id", "npuid": "npu_id", "name": "name", "health": "health", "power(w)": "power_w",
    "temp(c)": "temp_c", "chip": "chip_id", "chipid": "chip_id", "phy-id": "phy_id", "device": "logic_id",
    "bus-id": "bus_id", "aicore(%)": "aicore_pct", "npuutil(%)": "npu_util_pct",
    "memory-usage(mb)": "memory", "hbm-usage(mb)": "hbm",
}
_PROC_FIELD = {"npu": "npu_id", "npuid": "npu_id", "chip": "chip_id", "chipid": "chip_id",
               "processid": "pid", "processname": "name", "processmemory(mb)": "memory_mb"}
_NUMBER_FIELDS = ("power_w", "temp_c", "aicore_pct", "npu_util_pct")
_PAIR_FIELDS = ("memory", "hbm")


def _section_kind(rows: list[HeaderRow]) -> str:
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


def _bad_value(f: Mapping[str, str]) -> str | None:
    """Why a row's number or `used / total` field cannot be read, or None when they all can."""
    for k in _NUMBER_FIELDS:
        if k in f and not is_missing(f[k]) and parse_number(f[k]) is None:
            return f"{k} is not a number"
    for k in _PAIR_FIELDS:
        if k in f and not is_missing(f[k]):
            pair = parse_pair(f[k])
            if pair is None or (pair[0] is None and pair[1] is None):
                return f"{k} is not 'used / total'"
    return None


def _text(value: str | None) -> str:
    return "" if is_missing(value) else (value or "").strip()


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _NpuRow:
    """The first data row of a device block: the NPU's (or, with a one-row header, the whole chip's)."""

    line_no: int
    raw: dict[str, str]      # column -> text as printed
    fields: dict[str, str]   # canonical field -> text


def parse_info(text: str, command: str = "npu-smi info") -> InfoTable:
    """The `npu-smi info` table -> chips (NPU row + chip row merged) and the process table.

    Column names and positions come from the header rows of each section; the first data row of a
    block (between separator lines) matches the first header row (NPU, Name, Health, Power...), the
    following rows the last (Chip, Bus-Id, AICore, HBM...). This reads the 310, 310P (one NPU row,
    several chip rows), 910A, 910B, A3 (one block per chip) and 950 (no Chip column) layouts.

    Text not understood raises ParseError naming the first such line, the table read anyway in
    `.partial`.
    """
    return InfoTableParser(command).parse(text)


class InfoTableParser:
    """One pass over the lines of an `npu-smi info` table (use parse_info()).

    A table is sections (a header of one or more rows, then blocks of data rows, blocks ending at a
    separator line); a device block is one NPU row then its chip rows.
    """

    def __init__(self, command: str = "npu-smi info") -> None:
        self.table = InfoTable(command)
        self.problems = Problems()
        self.header: list[HeaderRow] = []   # the header rows of the current section
        self.pending: list[HeaderRow] = []  # header rows read, their section not started yet
        self.kind = ""                              # the current section: device, process or unknown
        self.block = 0                              # data rows read in the current block
        self.npu_row: _NpuRow | None = None         # the current device block's NPU row
        self.chips_in_block = 0
        self.seen: set[tuple[int, int]] = set()     # (NPU, chip) already in table.chips

    def parse(self, text: str) -> InfoTable:
        lines = text.splitlines()
        if not any(ln.strip() for ln in lines):
            raise ParseError(self.table.command, 0, "", self.table, "no output")
        for no, raw in enumerate(lines, 1):
            self.line(no, raw)
        self.end_block()
        self.problems.raise_if_any(self.table.command, self.table)
        return self.table

    def line(self, no: int, raw: str) -> None:
        line = raw.rstrip("\r").expandtabs(8)
        s = line.strip()
        if not s:
            return
        if _SEPARATOR.fullmatch(s) and ("-" in s or "=" in s):
            self.separator()
        elif not s.startswith("|"):
            self.problems.add(no, raw)
        elif not self.banner(s.strip("|").strip()):
            row = cells(line)
            if is_header(row):
                self.header_line(row)
            else:
                self.data_line(no, raw, row)

    # -- kinds of line -------------------------------------------------------------------------

    def separator(self) -> None:
        self.end_block()
        self.block = 0
        if self.pending:
            self.start_section()

    def banner(self, inner: str) -> bool:
        """The version line or a process section's "No running processes" line; False for others."""
        m = re.match(r"npu-smi\s+(\S+)", inner)
        if m:
            self.table.tool_version = m.group(1)
            v = re.search(r"Version:\s*(\S+)", inner)
            if v:
                self.table.driver_version = v.group(1)
            return True
        m = re.fullmatch(r"No running processes found in NPU\s+([0-9]{1,9})", inner)
        if m:
            self.table.idle_npus.append(int(m.group(1)))
            return True
        return False

    def header_line(self, row: Cells) -> None:
        if not self.pending:
            self.end_block()
        self.pending.append(header_row(row))

    def data_line(self, no: int, raw: str, row: Cells) -> None:
        if self.pending:
            self.start_section()
        if not self.header:
            self.problems.add(no, raw, "data row before any header row")
            return
        values = assign(row, self.header[min(self.block, len(self.header) - 1)])
        self.block += 1
        if self.kind == "device":
            self.device_row(no, raw, values)
        elif self.kind == "process":
            self.process_row(no, raw, values)
        # rows of a section this parser does not know are skipped: nothing in them is claimed

    # -- sections and blocks -------------------------------------------------------------------

    def start_section(self) -> None:
        self.header, self.pending, self.kind, self.block = self.pending, [], _section_kind(self.pending), 0

    def end_block(self) -> None:
        if self.npu_row is not None and self.chips_in_block == 0:
            self.add_chip(0, 0, {}, {})  # an NPU row whose chip row is missing (cut short): keep what it says
        self.npu_row, self.chips_in_block = None, 0

    # -- rows of the device section ------------------------------------------------------------

    def device_row(self, no: int, raw: str, row: dict[str, str]) -> None:
        f = _canon(row, _INFO_FIELD)
        why = _bad_value(f)
        if why:
            self.problems.add(no, raw, why)
        elif self.block == 1:
            self.npu_line(no, raw, row, f)
        else:
            self.chip_line(no, raw, row, f)

    def npu_line(self, no: int, raw: str, row: dict[str, str], f: dict[str, str]) -> None:
        """The NPU row (or, with a one-row header, the whole chip)."""
        self.end_block()
        if not ID.fullmatch(f.get("npu_id", "")):
            self.problems.add(no, raw, "NPU row without a numeric NPU id")
            return
        self.npu_row = _NpuRow(no, row, f)
        if len(self.header) == 1:
            chip_s = f.get("chip_id", "0")
            self.add_chip(int(chip_s) if ID.fullmatch(chip_s) else 0, no, {}, {})

    def chip_line(self, no: int, raw: str, row: dict[str, str], f: dict[str, str]) -> None:
        if self.npu_row is None:
            self.problems.add(no, raw, "chip row without its NPU row")
            return
        chip_s = f.pop("chip_id", "").strip()
        if not chip_s:
            chip_id = self.chips_in_block
        elif ID.fullmatch(chip_s):
            chip_id = int(chip_s)
        else:
            self.problems.add(no, raw, "chip row without a numeric chip id")
            return
        f.pop("npu_id", None)
        self.add_chip(chip_id, no, row, f)

    def add_chip(self, chip_id: int, chip_no: int, chip_raw: dict[str, str], chip_f: dict[str, str]) -> None:
        """One chip: the block's NPU row merged with its chip row (empty when there is none)."""
        npu = self.npu_row
        assert npu is not None
        f = npu.fields
        merged = {**f, **chip_f}
        key = (int(f["npu_id"]), chip_id)
        first_in_block = self.chips_in_block == 0
        self.chips_in_block += 1
        if key in self.seen:
            return
        self.seen.add(key)
        hbm = parse_pair(merged.get("hbm")) or (None, None)
        mem = parse_pair(merged.get("memory")) or (None, None)
        self.table.chips.append(InfoChip(
            npu_id=key[0], chip_id=chip_id, name=merged.get("name", "").strip(),
            health=merged.get("health", "").strip(),
            power_w=parse_number(f.get("power_w")) if first_in_block else None,
            temp_c=parse_number(merged.get("temp_c")),
            bus_id=_text(merged.get("bus_id")), phy_id=_text(merged.get("phy_id")),
            logic_id=_text(merged.get("logic_id")),
            aicore_pct=parse_number(merged.get("aicore_pct")),
            npu_util_pct=parse_number(merged.get("npu_util_pct")),
            hbm_used_mb=hbm[0], hbm_total_mb=hbm[1], memory_used_mb=mem[0], memory_total_mb=mem[1],
            line_no=chip_no or npu.line_no, fields={**npu.raw, **chip_raw}))

    # -- rows of the process section -----------------------------------------------------------

    def process_row(self, no: int, raw: str, row: dict[str, str]) -> None:
        f = _canon(row, _PROC_FIELD)
        npu_s, chip_s, pid_s = f.get("npu_id", ""), f.get("chip_id", "0"), f.get("pid", "")
        if not (ID.fullmatch(npu_s) and ID.fullmatch(chip_s) and ID.fullmatch(pid_s)):
            self.problems.add(no, raw, "process row without numeric NPU, chip and process id")
            return
        self.table.processes.append(InfoProcess(int(npu_s), int(chip_s), int(pid_s), f.get("name", "").strip(),
                                                parse_number(f.get("memory_mb"))))
