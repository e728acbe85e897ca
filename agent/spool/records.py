"""The spool's record format on disk: framing, checksums, and a scan that survives damaged bytes.

One record is a 12-byte header and a payload:

    magic   4 bytes  b"XSR1"
    length  u32 LE   bytes of payload
    crc     u32 LE   CRC-32 of the length field and the payload (zlib.crc32)
    payload          msgpack [boot_id: str, seq: int, samples: int, batch: bytes (a serialised Batch)]

A scan reads a segment record by record (never more than one record, or one search chunk, in
memory). A record whose header, checksum or payload does not check out is damaged: the scan looks
for the next record that checks out (the next magic whose record is whole and whose checksum
matches) and reports the bytes in between as one damaged span, with an estimate of how many
records it held (one, plus any further magics inside it). A span at the end of a segment whose
header says more bytes than the file has is a record cut short (a crash or a full disk mid-write).

Segments written before this format (msgpack records without framing) are recognised by their
first byte and read by `legacy_records`, so an upgrade replays them.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zlib
from collections.abc import Iterator

import msgpack

MAGIC = b"XSR1"
HEADER = struct.Struct("<4sII")
# No batch comes near this (5,000 samples are about 0.5 MB); a length above it is damage.
MAX_RECORD_BYTES = 64 * 2**20
MAX_BOOT_ID = 128
_SEARCH_CHUNK = 1 << 20


class RecordError(ValueError):
    """A record that does not check out; the message says what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class Good:
    boot: str
    seq: int
    samples: int
    offset: int
    length: int          # of the whole record, header included
    batch: bytes = dataclasses.field(default=b"", repr=False)


@dataclasses.dataclass(frozen=True)
class Damaged:
    offset: int
    length: int
    records: int         # how many records the span held, at least 1 (an estimate: magics seen)
    reason: str
    cut_short: bool = False


def encode(boot: str, seq: int, samples: int, batch: bytes) -> bytes:
    payload = msgpack.packb([boot, seq, samples, batch], use_bin_type=True)
    length = struct.pack("<I", len(payload))
    return MAGIC + length + struct.pack("<I", zlib.crc32(payload, zlib.crc32(length))) + payload


def decode_payload(payload: bytes) -> tuple[str, int, int, bytes]:
    try:
        rec = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise RecordError(f"payload is not msgpack ({e})") from None
    return fields(rec)


def fields(rec: object) -> tuple[str, int, int, bytes]:
    """(boot, seq, samples, batch) from a decoded payload, or RecordError."""
    if not (isinstance(rec, list) and len(rec) == 4):
        raise RecordError("payload is not [boot, seq, samples, batch]")
    boot, seq, samples, batch = rec
    if not (isinstance(boot, str) and 0 < len(boot) <= MAX_BOOT_ID and type(seq) is int and seq > 0
            and type(samples) is int and samples >= 0 and isinstance(batch, bytes)):
        raise RecordError("payload fields have the wrong types or ranges")
    return boot, seq, samples, batch


def check(header: bytes, payload: bytes) -> tuple[str, int, int, bytes]:
    """Decode one record from its header and payload bytes, or raise RecordError saying why not."""
    magic, length, crc = HEADER.unpack(header)
    if magic != MAGIC:
        raise RecordError("no record starts here (bad magic)")
    if length != len(payload):
        raise RecordError(f"length {length} does not match the {len(payload)} bytes read")
    if zlib.crc32(payload, zlib.crc32(header[4:8])) != crc:
        raise RecordError("checksum mismatch")
    return decode_payload(payload)


def read_at(fd: int, offset: int, length: int) -> tuple[str, int, int, bytes]:
    """The record of `length` bytes at `offset` of an open segment, checked."""
    if length < HEADER.size or length > HEADER.size + MAX_RECORD_BYTES:
        raise RecordError(f"record length {length} out of range")
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise RecordError(f"only {len(data)} of {length} bytes left in the segment")
    return check(data[:HEADER.size], data[HEADER.size:])


def _try(fd: int, offset: int, size: int) -> tuple[Good | None, str, bool]:
    """The record at `offset` if it checks out; else (None, why, whether it is cut short by the end)."""
    header = os.pread(fd, HEADER.size, offset)
    if len(header) < HEADER.size:
        return None, f"{len(header)} bytes left, less than a record header", True
    magic, length, _ = HEADER.unpack(header)
    if magic != MAGIC:
        return None, "no record starts here (bad magic)", False
    if length > MAX_RECORD_BYTES:
        return None, f"length {length} over the {MAX_RECORD_BYTES}-byte limit", False
    end = offset + HEADER.size + length
    if end > size:
        return None, f"record of {length} bytes cut short by the end of the segment", True
    try:
        boot, seq, samples, batch = check(header, os.pread(fd, length, offset + HEADER.size))
    except RecordError as e:
        return None, str(e), False
    return Good(boot, seq, samples, offset, end - offset, batch), "", False


def _next_good(fd: int, start: int, size: int) -> tuple[int, int, Good | None]:
    """From `start`: (offset of the next record that checks out or `size`, magics passed, that record)."""
    magics, pos = 0, start
    while pos < size:
        chunk = os.pread(fd, min(_SEARCH_CHUNK, size - pos) + len(MAGIC) - 1, pos)
        i = chunk.find(MAGIC)
        while i != -1 and pos + i < size:
            rec, _, _ = _try(fd, pos + i, size)
            if rec is not None:
                return pos + i, magics, rec
            magics += 1
            i = chunk.find(MAGIC, i + 1)
        pos += _SEARCH_CHUNK
    return size, magics, None


def scan(fd: int) -> Iterator[Good | Damaged]:
    """Every record of an open segment in order, damaged spans reported in between."""
    size = os.fstat(fd).st_size
    offset = 0
    while offset < size:
        rec, why, cut = _try(fd, offset, size)
        if rec is not None:
            yield rec
            offset += rec.length
            continue
        nxt, magics, found = _next_good(fd, offset + 1, size)
        yield Damaged(offset, nxt - offset, 1 + magics, why, cut and found is None)
        if found is not None:
            yield found
            nxt += found.length
        offset = nxt


def is_legacy(fd: int) -> bool:
    """A segment of the format before framing: msgpack records, each a fixarray of four."""
    first = os.pread(fd, 1, 0)
    return first == b"\x94"


def legacy_records(fd: int) -> Iterator[Good | Damaged]:
    """The records of a segment written before framing; the rest of it after the first bad one is
    one damaged span (that format could not find its way past a bad byte)."""
    size = os.fstat(fd).st_size
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_RECORD_BYTES + 2 * _SEARCH_CHUNK)
    offset = pos = 0
    while True:
        try:
            rec = unpacker.unpack()
        except msgpack.OutOfData:
            if pos >= size:
                if offset < size:
                    yield Damaged(offset, size - offset, 1, "record cut short (format before framing)", True)
                return
            unpacker.feed(os.pread(fd, _SEARCH_CHUNK, pos))
            pos += _SEARCH_CHUNK
            continue
        except (ValueError, msgpack.UnpackException) as e:
            yield Damaged(offset, size - offset, 1, f"unreadable (format before framing: {e})")
            return
        end = unpacker.tell()
        try:
            boot, seq, samples, batch = fields(rec)
            yield Good(boot, seq, samples, offset, end - offset, batch)
        except RecordError as e:
            yield Damaged(offset, end - offset, 1, f"{e} (format before framing)")
        offset = end
