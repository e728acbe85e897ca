"""Snapshot files: their names, their checksummed frames, writing one atomically, reading one back.

In `data_dir/snapshots/`:

    snapshot-SSSSSSSS-OOOOOOOOOOOO.snap                            full: the store up to segment S, byte O
    snapshot-SSSSSSSS-OOOOOOOOOOOO-on-SSSSSSSS-OOOOOOOOOOOO.snap   a diff: the same, on the full one named after -on-

A file is SNAPSHOT_MAGIC (the version in its last byte), then frames in the store's own format
(frames.py: RECORD_MAGIC, length, crc32 over the length bytes and the payload). In version 2 a
payload (version 2 and on) is a u32 length, that many bytes of msgpack (the record), then a blob
of raw bytes the record describes (image.py: history arrays; version 3 adds a node's frames, 2 is
still read):

    ["h", 2, seg, off, created_unix_ns, id, base_seg, base_off, base_id]   first (base_*: -1 in a full one)
    ["f", fleet]                                                          known marks, counters (image.fleet)
    ["n", [node, ...]] + blob                                             nodes, a chunk at a time (image.capture)
    ["e", nodes, frames]                                                  last: how many nodes and frames came before it

Version 1 (written before; still read) has no blobs: every payload is one msgpack record, the
header ["h", 1, seg, off, created_unix_ns], nodes as image.restore_node_v1 reads them.

A file is written to a temporary name in the same directory, fsync'ed, renamed into place and the
directory fsync'ed, so it is there whole or not at all. Reading maps the file and checks every
frame's checksum over the mapped bytes (no copy); a file that does not read back whole (a bad
checksum, a cut file, no end record, counts that differ, a header of another version) is Damaged.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
import zlib
from collections.abc import Iterator
from typing import NamedTuple

import msgpack

from xpusense.common.fsync import fsync_dir

from .frames import HEADER, HEADER_BYTES, MAX_RECORD_BYTES, RECORD_MAGIC

MAGIC = b"XPSSNP\x00"
VERSIONS = (1, 2, 3)
VERSION = 3
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
    id) of the full snapshot a diff is written on; None for a full one."""

    def __init__(self, directory: str, pos: Pos, fsync: bool = True, base: tuple[Pos, int] | None = None):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.dir, self.pos, self.fsync, self.base = directory, pos, fsync, base
        self.id = int.from_bytes(os.urandom(8), "little") >> 1
        name = snapshot_name(pos, base[0] if base is not None else None)
        self.path = os.path.join(directory, name)
        self.tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{os.getpid()}")
        self.f = open(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb")
        self.frames = self.nodes = self.bytes = 0
        try:
            self.f.write(MAGIC + bytes([VERSION]))
            bpos, bid = base if base is not None else ((-1, -1), -1)
            self.add(["h", VERSION, pos[0], pos[1], time.time_ns(), self.id, bpos[0], bpos[1], bid])
        except BaseException:
            self.abort()
            raise

    def add(self, record: list, parts: list[bytes] | tuple = ()) -> None:
        """One frame: the record, then `parts` as its blob (written as they are, not joined)."""
        meta = msgpack.packb(record, use_bin_type=True)
        size = U32.size + len(meta) + sum(len(p) for p in parts)
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"a snapshot frame of {size} bytes (at most {MAX_RECORD_BYTES})")
        mlen = U32.pack(len(meta))
        crc = zlib.crc32(meta, zlib.crc32(mlen, zlib.crc32(U32.pack(size))))
        for p in parts:
            crc = zlib.crc32(p, crc)
        self.f.write(HEADER.pack(RECORD_MAGIC, size, crc) + mlen + meta)
        self.f.writelines(parts)
        self.frames += 1
        self.bytes += HEADER_BYTES + size
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
            if self.size < len(MAGIC) + 1 + HEADER_BYTES:
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
        mm, size = self.mm, self.size
        mv = memoryview(mm)
        pos, frames, nodes = len(MAGIC) + 1, 0, 0
        while pos < size:
            if pos + HEADER_BYTES > size or mm[pos:pos + 4] != RECORD_MAGIC:
                raise Damaged(f"no frame at byte {pos}")
            _, n, crc = HEADER.unpack_from(mm, pos)
            start, end = pos + HEADER_BYTES, pos + HEADER_BYTES + n
            if end > size or zlib.crc32(mv[start:end], zlib.crc32(mv[pos + 4:pos + 8])) != crc:
                raise Damaged(f"the frame at byte {pos} is not whole or its checksum fails")
            try:
                if self.version >= 2:
                    mlen = U32.unpack_from(mm, start)[0]
                    if U32.size + mlen > n:
                        raise ValueError("record longer than its frame")
                    rec = msgpack.unpackb(mv[start + U32.size:start + U32.size + mlen], raw=False)
                    blob = mv[start + U32.size + mlen:end]
                else:
                    rec, blob = msgpack.unpackb(mv[start:end], raw=False), mv[end:end]
            except (ValueError, struct.error, msgpack.UnpackException) as e:
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
