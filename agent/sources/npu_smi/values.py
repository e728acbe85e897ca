"""Small shared pieces of the npu-smi parsers: key and id spelling, printed numbers, ParseError.

Everything here is plain text handling; it knows no npu-smi command and no Sample.
"""

from __future__ import annotations

import re
from typing import Any

VENDOR = "huawei"
MIB = 1024 * 1024

NUMBER = re.compile(r"[-+]?[0-9]+(?:\.[0-9]+)?")
ID = re.compile(r"[0-9]{1,9}")  # an NPU, chip or process id
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
    if t.lower() in _MISSING or len(t) > 32 or not NUMBER.fullmatch(t):
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


def split_columns(line: str) -> list[tuple[int, str]]:
    """(position, text) of each run of text separated by two or more spaces."""
    return [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", line)]


def nearest(pos: int, starts: list[int]) -> int:
    """Index of the start nearest to `pos` (the first of two equally near)."""
    return min(range(len(starts)), key=lambda i: (abs(starts[i] - pos), i))


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


class FieldError(ParseError):
    """A field npu-smi printed whose value cannot be what it names (not a number, out of range).

    `field` is the key as printed, `line` its value; `partial` what could be read anyway.
    """

    def __init__(self, command: str, field: str, value: str, partial: Any = None, reason: str = "not a number"):
        super().__init__(command, 0, value, partial, reason)
        self.field = field
        ValueError.__init__(self, f"`{command}`: `{field}` {reason}: {value.strip()[:80]!r}")


class Problems:
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
