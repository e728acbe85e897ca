"""The store's on-disk format: segment files of length-prefixed, checksummed records.

A segment `NNNNNNNN.log` starts with SEGMENT_MAGIC (8 bytes, the format version in its last byte),
then frames:

    RECORD_MAGIC (4 bytes) | length (u32 LE) | crc32 (u32 LE, over the length bytes and the payload) | payload

The payload is one msgpack record (see RECORD_KINDS). A reader checks every frame's magic, length
and checksum; bytes that are not a whole valid frame (flipped bits, a zeroed or cut tail, stray
data) form a damaged range, and reading goes on at the next valid frame (found by its magic and
checked by its checksum). So damage costs the records it touches, never the ones after it.
Format 1 (before checksums) was bare msgpack records; such segments are still read (`legacy`).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple

import msgpack

SEGMENT_MAGIC = b"XPSSEG\x00\x02"
RECORD_MAGIC = b"\xc1XR\x02"   # 0xc1 is never used by msgpack, so a bare-msgpack segment cannot look like frames
HEADER = struct.Struct("<4sII")   # magic, length, crc32
HEADER_BYTES = HEADER.size
MAX_RECORD_BYTES = 2**31          # a length above this is damage, not a record
SEGMENT_NAME = re.compile(r"^(\d{8,})\.log$")

# ["b", batch_bytes]                        a stored Batch, whole
# ["i", node_id, boot_id, inventory_bytes]  a node's inventory (Hello, change, checkpoint)
# ["m", node_id, boot_id, seq]              a (node, boot) mark (checkpoint)
# ["s", segment_id, size]                   the previous segment ended there (first record of a segment):
#                                           a segment cut or deleted later is found, not silently shorter
RECORD_KINDS = ("b", "i", "m", "s")


class StoreError(Exception):
    pass


class InvalidRecord(ValueError):
    """A frame whose checksum holds but whose record is not one this store writes."""


def frame(record: list) -> bytes:
    payload = msgpack.packb(record, use_bin_type=True)
    n = struct.pack("<I", len(payload))
    return HEADER.pack(RECORD_MAGIC, len(payload), zlib.crc32(payload, zlib.crc32(n))) + payload


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


class Span(NamedTuple):
    start: int
    end: int
    payload: bytes | None   # None: a damaged range [start, end)


def frame_at(buf, pos: int, end: int) -> bytes | None:
    """The payload of the valid frame at `pos`, or None when there is none."""
    if pos + HEADER_BYTES > end or buf[pos:pos + 4] != RECORD_MAGIC:
        return None
    _, n, crc = HEADER.unpack(buf[pos:pos + HEADER_BYTES])
    if n > MAX_RECORD_BYTES or pos + HEADER_BYTES + n > end:
        return None
    payload = bytes(buf[pos + HEADER_BYTES:pos + HEADER_BYTES + n])
    if zlib.crc32(payload, zlib.crc32(buf[pos + 4:pos + 8])) != crc:
        return None
    return payload


def scan(buf, start: int, end: int) -> Iterator[Span]:
    """The valid frames and damaged ranges of buf[start:end], in order, covering all of it."""
    pos = start
    while pos < end:
        payload = frame_at(buf, pos, end)
        if payload is not None:
            yield Span(pos, pos + HEADER_BYTES + len(payload), payload)
            pos += HEADER_BYTES + len(payload)
            continue
        nxt = pos
        while True:
            nxt = buf.find(RECORD_MAGIC, nxt + 1, end)
            if nxt < 0:
                nxt = end
                break
            if frame_at(buf, nxt, end) is not None:
                break
        yield Span(pos, nxt, None)
        pos = nxt


def record_count(buf, start: int, end: int) -> int:
    """How many records a damaged range held, at least: one, or the record magics still in it."""
    n, pos = 0, start
    while (pos := buf.find(RECORD_MAGIC, pos, end)) >= 0:
        n += 1
        pos += 1
    return max(1, n)


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
          or (kind == "s" and len(rec) == 3 and all(isinstance(x, int) and x >= 0 for x in rec[1:])))
    if not ok:
        raise InvalidRecord(f"a {kind!r} record with fields of the wrong type or number")
    return rec
