"""Snapshot files: their names, their checksummed frames, writing one atomically, reading one back.

A snapshot is the fleet state at a position of the store's log (fleet_image.py), in frames of the
store's record magic (xpusense.common.framing); written to a temporary name, fsync'ed and renamed,
so it is there whole or not at all; from version 4 each frame's payload is zstd-compressed (the
values of one series contiguous, so unchanged values cost almost nothing); read back mapped (a
compressed frame decompressed), every checksum checked, else Damaged (layout: docs/design.md).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
from collections.abc import Iterator
from typing import NamedTuple

import msgpack
import zstandard

from xpusense.common import framing
from xpusense.common.fsync import fsync_dir

from .segment_file import MAX_RECORD_BYTES, RECORD_MAGIC

MAGIC = b"XPSSNP\x00"
VERSIONS = (1, 2, 3, 4)
VERSION = 4
RAW, ZSTD = 0, 1   # a version 4 frame's first byte: how the rest of its payload is written
NAME = re.compile(r"^snapshot-(\d{8,})-(\d{12,})(?:-on-(\d{8,})-(\d{12,}))?\.snap$")
TMP_PREFIX = ".tmp-"
U32 = struct.Struct("<I")

Pos = tuple[int, int]


class Damaged(Exception):
    pass


class Entry(NamedTuple):
    pos: Pos             # what it covers
    path: str
    base: Pos | None     # a diff: the position of the full snapshot it is written on


def snapshot_name(pos: Pos, base: Pos | None = None) -> str:
    on = f"-on-{base[0]:08d}-{base[1]:012d}" if base is not None else ""
    return f"snapshot-{pos[0]:08d}-{pos[1]:012d}{on}.snap"


def entries(directory: str) -> list[Entry]:
    """Every snapshot file, newest (highest position) first; at one position a diff before its base."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = NAME.match(name)
        if m:
            base = (int(m.group(3)), int(m.group(4))) if m.group(3) else None
            out.append(Entry((int(m.group(1)), int(m.group(2))), os.path.join(directory, name), base))
    return sorted(out, key=lambda e: (e.pos, e.base is not None), reverse=True)


class SnapshotFile:
    """One snapshot being written (in a worker thread, never on the event loop). `base`: (position,
    id) of the full snapshot a diff is written on; None for a full one. `level`: zstd's level for
    every frame after the header (0: written raw)."""

    def __init__(self, directory: str, pos: Pos, fsync: bool = True, base: tuple[Pos, int] | None = None,
                 level: int = 1):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.dir, self.pos, self.fsync, self.base, self.level = directory, pos, fsync, base, level
        self.version = VERSION   # (tests write an older version's layout by setting VERSION)
        self.zstd = zstandard.ZstdCompressor(level=level) if level else None
        self.id = int.from_bytes(os.urandom(8), "little") >> 1
        name = snapshot_name(pos, base[0] if base is not None else None)
        self.path = os.path.join(directory, name)
        self.tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{os.getpid()}")
        self.f = open(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb")
        self.frames = self.nodes = self.bytes = self.raw_bytes = 0
        try:
            self.f.write(MAGIC + bytes([self.version]))
            self.bytes = self.raw_bytes = len(MAGIC) + 1
            bpos, bid = base if base is not None else ((-1, -1), -1)
            self.add(["h", self.version, pos[0], pos[1], time.time_ns(), self.id, bpos[0], bpos[1], bid])
        except BaseException:
            self.abort()
            raise

    def add(self, record: list, parts: list[bytes] | tuple = ()) -> None:
        """One frame: the record, then `parts` as its blob (written as they are, not joined)."""
        meta = msgpack.packb(record, use_bin_type=True)
        size = (self.version >= 4) + U32.size + len(meta) + sum(len(p) for p in parts)
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"a snapshot frame of {size} bytes (at most {MAX_RECORD_BYTES})")
        head = U32.pack(len(meta)) + meta
        if self.version < 4:
            parts = [head, *parts]
        elif self.zstd is not None and self.frames:   # (the header stays raw: read before the version is known)
            z = self.zstd.compressobj(size=size - 1)
            parts = [bytes([ZSTD]), z.compress(head), *[z.compress(p) for p in parts], z.flush()]
        else:
            parts = [bytes([RAW]), head, *parts]
        self.f.write(framing.header(RECORD_MAGIC, parts))
        self.f.writelines(parts)
        self.frames += 1
        self.raw_bytes += framing.HEADER.size + size
        self.bytes += framing.HEADER.size + sum(len(p) for p in parts)
        if record[0] == "n":
            self.nodes += len(record[1])

    def finish(self) -> str:
        self.add(["e", self.nodes, self.frames])
        self.f.flush()
        if self.fsync:
            os.fsync(self.f.fileno())
        self.f.close()
        if self.base is None:   # diffs on a full snapshot this one replaces (same position) are not its
            for e in entries(self.dir):
                if e.base == self.pos:
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass
        os.replace(self.tmp, self.path)
        if self.fsync:
            fsync_dir(self.dir)
        return self.path

    def abort(self) -> None:
        """Give this snapshot up: its temporary file is closed and removed (never renamed into place,
        so never read as a snapshot). It runs where a write already failed: the close's flush of what
        is still buffered fails the same way (ENOSPC, EIO), and that is ignored, never raised."""
        try:
            self.f.close()   # the raw file is closed even when the flush before it fails
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


class Reader:
    """One snapshot file, mapped read-only. `header`: its first record (read at open)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            if self.size < len(MAGIC) + 1 + framing.HEADER.size:
                raise Damaged(f"{self.size} bytes, too short for a snapshot")
            self.mm = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_READ)
        head = self.mm[:len(MAGIC) + 1]
        if head[:len(MAGIC)] != MAGIC or head[-1] not in VERSIONS:
            self.close()
            raise Damaged("not a snapshot (magic)")
        self.version = head[-1]
        self._frames = self.frames()
        try:
            self.header = next(self._frames)[0]
        except (Damaged, StopIteration) as e:
            self.close()
            raise Damaged(str(e) or "no header") from None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pos(self) -> Pos:
        return int(self.header[2]), int(self.header[3])

    @property
    def id(self) -> int:
        return int(self.header[5]) if self.version >= 2 else -1

    @property
    def base(self) -> tuple[Pos, int] | None:
        if self.version < 2 or self.header[8] < 0:
            return None
        return (int(self.header[6]), int(self.header[7])), int(self.header[8])

    def records(self) -> Iterator[tuple[list, memoryview]]:
        """The records after the header, each with its blob (a view on the mapped file)."""
        return self._frames

    def frames(self) -> Iterator[tuple[list, memoryview]]:
        mv, size = memoryview(self.mm), self.size
        pos, frames, nodes = len(MAGIC) + 1, 0, 0
        while pos < size:
            try:
                payload = framing.payload_at(mv, pos, size, RECORD_MAGIC, MAX_RECORD_BYTES)
            except framing.FrameError as e:
                raise Damaged(f"the frame at byte {pos}: {e}") from None
            end = pos + framing.HEADER.size + len(payload)
            try:
                if self.version >= 4:
                    payload = _decompressed(payload)
                if self.version >= 2:
                    mlen = U32.unpack_from(payload)[0]
                    if U32.size + mlen > len(payload):
                        raise ValueError("record longer than its frame")
                    rec = msgpack.unpackb(payload[U32.size:U32.size + mlen], raw=False)
                    blob = payload[U32.size + mlen:]
                else:
                    rec, blob = msgpack.unpackb(payload, raw=False), payload[len(payload):]
            except (ValueError, struct.error, msgpack.UnpackException, zstandard.ZstdError) as e:
                raise Damaged(f"the frame at byte {pos} is not a snapshot record ({e})") from None
            if not isinstance(rec, list) or not rec:
                raise Damaged(f"the frame at byte {pos} is not a snapshot record")
            pos = end
            if rec[0] == "e":
                if rec[1:] != [nodes, frames] or pos != size:
                    raise Damaged(f"the end record says {rec[1:]} nodes and frames, read {[nodes, frames]}"
                                  f"{'' if pos == size else f', and {size - pos} bytes follow it'}")
                return
            if frames == 0 and (rec[0] != "h" or rec[1] != self.version or len(rec) < (9 if self.version >= 2 else 4)):
                raise Damaged(f"first record {rec[:2]!r}, not a version {self.version} header")
            frames += 1
            nodes += len(rec[1]) if rec[0] == "n" else 0
            yield rec, blob
        raise Damaged("cut short: no end record")

    def close(self) -> None:
        frames = getattr(self, "_frames", None)
        if frames is not None:
            frames.close()   # lets go of its view on the map
        try:
            self.mm.close()
        except BufferError:   # a view is still held somewhere (a traceback): closed when it goes
            pass


def _decompressed(payload: memoryview) -> memoryview:
    """A version 4 frame's record and blob: after its first byte, as written (RAW) or decompressed
    (ZSTD, at most MAX_RECORD_BYTES); ValueError (or ZstdError) when it is neither or does not fit."""
    if not len(payload) or payload[0] not in (RAW, ZSTD):
        raise ValueError(f"codec {payload[0] if len(payload) else None!r} (0: raw, 1: zstd)")
    if payload[0] == RAW:
        return payload[1:]
    data = payload[1:]
    size = zstandard.frame_content_size(data)
    if not 0 <= size <= MAX_RECORD_BYTES:
        raise ValueError(f"its zstd frame says {size} bytes (at most {MAX_RECORD_BYTES}; -1: not said)")
    z = zstandard.ZstdDecompressor().decompressobj()
    out = z.decompress(data)
    if not z.eof or len(out) != size:
        raise ValueError(f"its zstd frame is cut short ({len(out)} of {size} bytes)")
    if z.unused_data:
        raise ValueError(f"{len(z.unused_data)} bytes after its zstd frame")
    return memoryview(out)
