"""The key-value outputs of npu-smi: `npu-smi info -t TYPE -i N`, `npu-smi info -l`, `npu-smi info -m`.

`parse_kv()` reads them into `KvOutput` (keys by name, grouped by NPU and chip) and
`chip_records()` gives each chip record its NPU and chip id; readings.py turns them into Samples.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from .values import ID, ParseError, Problems, nearest, norm_key, parse_number, split_columns


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


def is_mcu(rec: KvRecord) -> bool:
    """Whether a record is the board controller's (`Chip Name : mcu`), not a chip's."""
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
    problems = Problems()
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise ParseError(command, 0, "", out, "no output")
    if ":" not in first and "npuid" in norm_key(first) and "chipid" in norm_key(first):
        _parse_columns(lines, out, problems)
    else:
        _KvParser(out, problems).parse(lines)
    problems.raise_if_any(command, out)
    return out


class _KvParser:
    """`<key> : <value>` lines -> the NPU groups and chip records of a KvOutput (see parse_kv)."""

    def __init__(self, out: KvOutput, problems: Problems) -> None:
        self.out = out
        self.problems = problems
        self.npu: KvNpu | None = None      # the NPU group being read
        self.rec: KvRecord | None = None   # the record being read
        self.last: tuple[dict[str, str], str] | None = None  # where a continuation line goes

    def parse(self, lines: list[str]) -> None:
        for no, raw in enumerate(lines, 1):
            self.line(no, raw.rstrip("\r"))
        self.close()

    def line(self, no: int, line: str) -> None:
        if not line.strip():
            if self.rec is not None and self.rec.fields:
                self.close()
            return
        m = _KV_LINE.match(line)
        if not m:
            self.problems.add(no, line)
            return
        key, value = m.group(1), m.group(2).strip()
        if not key:
            self.continuation(no, line, value)
            return
        nk = norm_key(key)
        if nk in _TOP_KEYS:
            self.close()
            self.out.fields[key] = value
            self.last = (self.out.fields, key)
        elif nk == "npuid":
            self.npu_id(no, line, key, value)
        elif nk == "chipcount":
            self.close()
            npu = self.ensure_npu()
            npu.fields[key] = value
            self.last = (npu.fields, key)
        elif nk == "chipid":
            self.chip_id(no, line, value)
        else:
            self.value(no, key, value)

    def continuation(self, no: int, line: str, value: str) -> None:
        if self.last is None:
            self.problems.add(no, line, "continuation line with nothing to continue")
        elif value:
            d, k = self.last
            d[k] = f"{d[k]}\n{value}" if d[k] else value

    def npu_id(self, no: int, line: str, key: str, value: str) -> None:
        self.close()
        if not ID.fullmatch(value):
            self.problems.add(no, line, "NPU ID is not a number")
            self.npu = KvNpu()
            self.last = None   # a continuation line of a bad id is not kept either
        else:
            self.npu = KvNpu(int(value), {key: value})
            self.last = (self.npu.fields, key)
        self.out.npus.append(self.npu)

    def chip_id(self, no: int, line: str, value: str) -> None:
        if not ID.fullmatch(value):
            self.problems.add(no, line, "Chip ID is not a number")
            return
        cid = int(value)
        if self.rec is None:
            self.rec = KvRecord(chip_id=cid, line_no=no)          # Chip ID before the values
        elif self.rec.chip_id is None and self.rec.fields:
            self.rec.chip_id = cid                                 # Chip ID after the values
            self.close()
        elif self.rec.chip_id is None:
            self.rec.chip_id = cid
        else:                                                      # the next chip starts
            self.close()
            self.rec = KvRecord(chip_id=cid, line_no=no)
        self.last = None

    def value(self, no: int, key: str, value: str) -> None:
        self.ensure_npu()
        if self.rec is None:
            self.rec = KvRecord(line_no=no)
        elif key in self.rec.fields:                               # a repeated key: a new record
            self.close()
            self.rec = KvRecord(line_no=no)
        self.rec.fields[key] = value
        self.last = (self.rec.fields, key)

    def ensure_npu(self) -> KvNpu:
        if self.npu is None:
            self.npu = KvNpu()
            self.out.npus.append(self.npu)
        return self.npu

    def close(self) -> None:
        """End the record being read: a chip's, or the MCU's (`extra`)."""
        rec = self.rec
        if rec is not None and (rec.fields or rec.chip_id is not None):
            npu = self.ensure_npu()
            (npu.extra if rec.chip_id is None and is_mcu(rec) else npu.chips).append(rec)
        self.rec = None


def _parse_columns(lines: list[str], out: KvOutput, problems: Problems) -> None:
    """`npu-smi info -m`: a header row (NPU ID, Chip ID, Chip Logic ID, Chip Name) and one row per chip."""
    header: list[tuple[int, str]] | None = None
    npus: dict[int, KvNpu] = {}
    for no, raw in enumerate(lines, 1):
        line = raw.rstrip("\r").expandtabs(8)
        if not line.strip():
            continue
        cols = split_columns(line)
        if header is None:
            header = cols
            continue
        row = _column_row(header, cols)
        by_norm = {norm_key(k): v for k, v in row.items()}
        npu_s, chip_s = by_norm.get("npuid", ""), by_norm.get("chipid", "")
        if not ID.fullmatch(npu_s) or not ID.fullmatch(chip_s):
            problems.add(no, raw, "row without a numeric NPU ID and Chip ID")
            continue
        npu = npus.get(int(npu_s))
        if npu is None:
            npu = npus[int(npu_s)] = KvNpu(int(npu_s), {"NPU ID": npu_s})
            out.npus.append(npu)
        rec = KvRecord({k: v for k, v in row.items() if norm_key(k) not in ("npuid", "chipid")},
                       int(chip_s), no)
        (npu.extra if is_mcu(rec) else npu.chips).append(rec)


def _column_row(header: list[tuple[int, str]], cols: list[tuple[int, str]]) -> dict[str, str]:
    """A row's values by header name: in order when the counts agree, else by the nearest header start."""
    names = [n for _, n in header]
    if len(cols) == len(header):
        return {names[i]: t for i, (_, t) in enumerate(cols)}
    row: dict[str, str] = {}
    starts = [p for p, _ in header]
    for p, t in cols:
        row.setdefault(names[nearest(p, starts)], t)
    return row


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
            cid = rec.chip_id if rec.chip_id is not None else spare.pop(0)
            result.append((npu, cid, rec))
    return result
