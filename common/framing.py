"""Checksummed frames on disk, and a scan that finds its way past damaged bytes.

The one record framing of the agent's spool, the collector's store and its snapshot files, each
with a magic of its own (layout: docs/design.md, on-disk formats). A scan holds one frame, or one
search chunk, in memory at a time.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

HEADER = struct.Struct("<4sII")   # magic, payload length, CRC-32 of the length bytes and the payload
_LENGTH = struct.Struct("<I")
_SEARCH_CHUNK = 1 << 20


class FrameError(ValueError):
    """No whole frame with a good checksum here; the message says why."""


class Span(NamedTuple):
    start: int
    end: int
    payload: Any          # None: the damaged bytes [start, end)
    damage: str = ""      # why the bytes at `start` are not a frame


def encode(magic: bytes, payload: bytes) -> bytes:
    n = len(payload)
    return HEADER.pack(magic, n, zlib.crc32(payload, zlib.crc32(_LENGTH.pack(n)))) + payload


def header(magic: bytes, parts: Iterable[Any]) -> bytes:
    """The header of a frame whose payload is `parts` joined (written after it as they are)."""
    parts = tuple(parts)
    n = sum(len(p) for p in parts)
    crc = zlib.crc32(_LENGTH.pack(n))
    for p in parts:
        crc = zlib.crc32(p, crc)
    return HEADER.pack(magic, n, crc)


def payload_at(buf: Any, pos: int, end: int, magic: bytes, max_bytes: int) -> Any:
    """The payload of the frame at buf[pos:] that ends by `end`, checked (a slice of buf: bytes from
    bytes or a map, a view from a memoryview), or FrameError."""
    if pos + HEADER.size > end:
        raise FrameError(f"{end - pos} bytes left, less than a record header")
    head = buf[pos:pos + HEADER.size]
    found, n, crc = HEADER.unpack(head)
    if found != magic:
        raise FrameError("no record starts here (bad magic)")
    if n > max_bytes:
        raise FrameError(f"length {n} over the {max_bytes}-byte limit")
    start = pos + HEADER.size
    if start + n > end:
        raise FrameError(f"record of {n} bytes cut short by the end of the file")
    payload = buf[start:start + n]
    if zlib.crc32(payload, zlib.crc32(head[4:8])) != crc:
        raise FrameError("checksum mismatch")
    return payload


def scan(buf: Any, start: int, end: int, magic: bytes, max_bytes: int) -> Iterator[Span]:
    """The frames and damaged ranges of buf[start:end], in order, covering all of it. A damaged
    range runs to the next magic that starts a frame with a good checksum (or to `end`)."""
    pos = start
    while pos < end:
        try:
            payload = payload_at(buf, pos, end, magic, max_bytes)
        except FrameError as e:
            nxt, found = pos, None
            while (nxt := buf.find(magic, nxt + 1, end)) >= 0:
                try:
                    found = payload_at(buf, nxt, end, magic, max_bytes)
                    break
                except FrameError:
                    pass
            if nxt < 0:
                nxt = end
            yield Span(pos, nxt, None, str(e))
            if found is None:
                return
            pos, payload = nxt, found
        yield Span(pos, pos + HEADER.size + len(payload), payload)
        pos += HEADER.size + len(payload)


def count(buf: Any, start: int, end: int, magic: bytes) -> int:
    """How many magics buf[start:end] holds (records a damaged range held, at least)."""
    n, pos = 0, start
    while (pos := buf.find(magic, pos, end)) >= 0:
        n += 1
        pos += 1
    return n


class FileBytes:
    """An open file read by pread, a slice or a search chunk at a time: what `scan` needs of a
    buffer, for a file that is not mapped."""

    def __init__(self, fd: int):
        self.fd = fd

    def __getitem__(self, s: slice) -> bytes:
        return os.pread(self.fd, s.stop - s.start, s.start)

    def find(self, sub: bytes, start: int, end: int) -> int:
        while start < end:
            i = os.pread(self.fd, min(_SEARCH_CHUNK + len(sub) - 1, end - start), start).find(sub)
            if i >= 0:
                return start + i
            start += _SEARCH_CHUNK
        return -1
