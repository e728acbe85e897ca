"""The geometry of the `npu-smi info` table: `|`-separated cells, header rows, values matched to columns.

A header row names the columns of each cell; a data row's values are matched to them by count, or
else by the nearest column start. Nothing here knows which column means what (table.py does).
"""

from __future__ import annotations

import dataclasses
import re

from .values import NUMBER, nearest, norm_key, split_columns

Cells = list[tuple[int, str]]  # (position in the line, text) of each cell

# A header row names columns; these are the first words of every column npu-smi is known to print.
_HEADER_WORDS = ("npu", "chip", "name", "health", "bus-id", "power", "temp", "aicore", "memory-usage",
                 "hbm-usage", "hugepages", "process", "phy-id", "device")


@dataclasses.dataclass
class Column:
    name: str
    norm: str
    offset: int  # from the start of its cell


@dataclasses.dataclass
class HeaderCell:
    start: int
    columns: list[Column]


HeaderRow = list[HeaderCell]


def cells(line: str) -> Cells:
    """(position, text) of each cell between `|` characters; a row cut short keeps its last piece."""
    bars = [i for i, c in enumerate(line) if c == "|"]
    if not bars:
        return [(0, line)]
    out = [(a + 1, line[a + 1:b]) for a, b in zip(bars, bars[1:], strict=False)]
    tail = line[bars[-1] + 1:]
    if tail.strip():
        out.append((bars[-1] + 1, tail))
    return out


def _pieces(start: int, text: str) -> list[tuple[int, str]]:
    """Values in a cell at their line positions: runs split by 2+ spaces, `a / b` pairs kept together."""
    merged: list[tuple[int, str]] = []
    for pos, t in split_columns(text):
        if merged and (t.startswith("/") or merged[-1][1].endswith("/")):
            p0, t0 = merged[-1]
            merged[-1] = (p0, f"{t0} {t}")
        else:
            merged.append((start + pos, t))
    return merged


def is_header(row: Cells) -> bool:
    """Whether a row names columns (no numbers, no `a / b` values, a known first word)."""
    pieces = [t for start, text in row for _, t in _pieces(start, text)]
    if not pieces:
        return False
    for t in pieces:
        if any(NUMBER.fullmatch(w) for w in t.split()) or ("/" in t and re.search(r"[0-9]", t)):
            return False
    return any(norm_key(t).startswith(_HEADER_WORDS) for t in pieces)


def header_row(row: Cells) -> HeaderRow:
    return [HeaderCell(start, [Column(t, norm_key(t), p - start) for p, t in _pieces(start, text)])
            for start, text in row]


def _assign_cell(out: dict[str, str], start: int, text: str, cols: list[Column]) -> None:
    """Values of one cell by column name, into `out`."""
    if not cols:
        return
    if len(cols) == 1:  # one column: the whole cell (a process name may hold spaces)
        t = text.strip()
        if t:
            out[cols[0].name] = " ".join(t.split()) if "/" in t else t
        return
    vals = _pieces(start, text)
    if len(vals) == len(cols):
        for c, (_, v) in zip(cols, vals, strict=True):
            out[c.name] = v
    else:  # a value missing or overflowing: the column whose start is nearest
        offsets = [c.offset for c in cols]
        for p, v in vals:
            out.setdefault(cols[nearest(p - start, offsets)].name, v)


def assign(row: Cells, header: HeaderRow) -> dict[str, str]:
    """Values of one data row by column name, matched to a header row's columns by position."""
    out: dict[str, str] = {}
    if len(row) == len(header):
        for (start, text), hc in zip(row, header, strict=True):
            _assign_cell(out, start, text, hc.columns)
        return out
    flat = [(hc.start + c.offset, c) for hc in header for c in hc.columns]
    if flat:
        starts = [p for p, _ in flat]
        for start, text in row:
            for p, v in _pieces(start, text):
                out.setdefault(flat[nearest(p, starts)][1].name, v)
    return out
