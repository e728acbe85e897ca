"""The store's segment files: their names, their header, the records in them and their kinds.

A segment holds checksummed frames (xpusense.common.framing) of the store's own magic, each one
msgpack record; segments of the format before checksums are still read (layout: docs/design.md,
on-disk formats).
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterator

import msgpack

from xpusense.common import framing
from xpusense.common.framing import Span

SEGMENT_MAGIC = b"XPSSEG\x00\x02"
RECORD_MAGIC = b"\xc1XR\x02"   # 0xc1: never a msgpack byte, so a bare-msgpack segment cannot look like frames
MAX_RECORD_BYTES = 2**31          # a length above this is damage, not a record
SEGMENT_NAME = re.compile(r"^(\d{8,})\.log$")
RECORD_KINDS = ("b", "i", "m", "s", "d")   # batch, inventory, mark, seal of the segment before, series defs
# A SeriesTable's definitions inflated (common/compact.decode_defs), at most: far above what a boot's
# bounded definitions take, so only damage passes it.
MAX_DEFS_BYTES = 2**30


class StoreError(Exception):
    pass


class InvalidRecord(ValueError):
    """A frame whose checksum holds but whose record is not one this store writes."""


def frame(record: list) -> bytes:
    return framing.encode(RECORD_MAGIC, msgpack.packb(record, use_bin_type=True))


def segment_id(name: str) -> int | None:
    m = SEGMENT_NAME.match(name)
    return int(m.group(1)) if m else None


def segment_name(seg_id: int) -> str:
    return f"{seg_id:08d}.log"


def segments(directory: str) -> list[tuple[int, str]]:
    """(id, path) of every segment, oldest first; other files are not segments."""
    out = []
    for name in os.listdir(directory):
        sid = segment_id(name)
        if sid is not None:
            out.append((sid, os.path.join(directory, name)))
    return sorted(out)


def scan(buf, start: int, end: int) -> Iterator[Span]:
    """The records and damaged ranges of buf[start:end], in order, covering all of it."""
    return framing.scan(buf, start, end, RECORD_MAGIC, MAX_RECORD_BYTES)


def record_count(buf, start: int, end: int) -> int:
    """How many records a damaged range held, at least: one, or the record magics still in it."""
    return max(1, framing.count(buf, start, end, RECORD_MAGIC))


class Segment:
    """One segment file, mapped read-only (nothing of it is copied until a record is read)."""

    def __init__(self, path: str, end: int | None = None):
        self.path = path
        self._f = open(path, "rb")
        size = os.fstat(self._f.fileno()).st_size
        self.size = size if end is None else min(end, size)
        self.buf: mmap.mmap | bytes = (mmap.mmap(self._f.fileno(), self.size, access=mmap.ACCESS_READ)
                                       if self.size else b"")

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc) -> None:
        if isinstance(self.buf, mmap.mmap):
            self.buf.close()
        self._f.close()

    def format(self) -> str:
        """'framed' (this format; a damaged header too, when any valid frame follows), 'legacy'
        (format 1: bare msgpack records), else 'unknown' (nothing readable)."""
        if self.buf[:len(SEGMENT_MAGIC)] == SEGMENT_MAGIC or any(
                s.payload is not None for s in scan(self.buf, 0, self.size)):
            return "framed"
        return "legacy" if self.size and 0x90 <= self.buf[0] <= 0x9f else "unknown"

    def spans(self, start: int = 0) -> Iterator[Span]:
        if start == 0 and self.buf[:len(SEGMENT_MAGIC)] == SEGMENT_MAGIC:
            start = len(SEGMENT_MAGIC)
        yield from scan(self.buf, start, self.size)

    def legacy_spans(self) -> Iterator[Span]:
        """Format 1: msgpack records back to back, no checksums; the first one that does not decode
        ends what can be read (the rest is one damaged range)."""
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(self.size, 1))
        unpacker.feed(self.buf[:self.size])
        pos = 0
        try:
            for rec in unpacker:
                end = unpacker.tell()
                yield Span(pos, end, msgpack.packb(rec, use_bin_type=True))
                pos = end
        except (ValueError, msgpack.UnpackException):
            pass
        if pos < self.size:
            yield Span(pos, self.size, None)


def parse(payload: bytes) -> list:
    """A record from its payload, checked for shape (InvalidRecord otherwise)."""
    try:
        rec = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise InvalidRecord(f"not msgpack ({e})") from None
    if not isinstance(rec, list) or not rec or rec[0] not in RECORD_KINDS:
        raise InvalidRecord(f"not a store record (kind {rec[0] if isinstance(rec, list) and rec else rec!r:.40})")
    kind = rec[0]
    ok = ((kind == "b" and len(rec) == 2 and isinstance(rec[1], bytes))
          or (kind == "i" and len(rec) == 4 and isinstance(rec[1], str) and isinstance(rec[2], str)
              and isinstance(rec[3], bytes))
          or (kind == "m" and len(rec) == 4 and isinstance(rec[1], str) and isinstance(rec[2], str)
              and isinstance(rec[3], int) and rec[3] >= 0)
          or (kind == "s" and len(rec) == 3 and all(isinstance(x, int) and x >= 0 for x in rec[1:]))
          or (kind == "d" and len(rec) == 3 and isinstance(rec[1], str) and isinstance(rec[2], bytes)))
    if not ok:
        raise InvalidRecord(f"a {kind!r} record with fields of the wrong type or number")
    return rec
