"""The spool's records: a batch with its boot, sequence number and sample count, or the
acknowledged marks of boots (`Acks`), each in a checksummed frame (xpusense.common.framing) of the
spool's own magic; a scan that survives damaged bytes, and the reader of segments written before
framing (layout: docs/design.md, on-disk formats).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import msgpack

from xpusense.common import framing
from xpusense.v1 import telemetry_pb2 as pb

MAGIC = b"XSR1"
HEADER = framing.HEADER
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
class Acks:
    """The highest acknowledged seq of some boots, as the agent knew them when it wrote the record."""
    marks: dict[str, int]
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class Damaged:
    offset: int
    length: int
    records: int         # how many records the span held, at least 1 (an estimate: magics seen)
    reason: str


def batch_ids(node_id: str, boot: str) -> bytes:
    """A serialized Batch's first bytes where it carries `node_id` and `boot` (fields 1 and 2, which
    protobuf writes first): what a batch may leave out, on a version-2 stream and in the spool."""
    return pb.Batch(node_id=node_id, boot_id=boot).SerializeToString()


def without_ids(batch: bytes, ids: bytes) -> bytes:
    """`batch` less its first bytes where they are `ids` (batch_ids); as it is otherwise."""
    return batch[len(ids):] if ids and batch.startswith(ids) else batch


def encode(boot: str, seq: int, samples: int, batch: bytes) -> bytes:
    return framing.encode(MAGIC, msgpack.packb([boot, seq, samples, batch], use_bin_type=True))


def encode_acks(marks: dict[str, int]) -> bytes:
    return framing.encode(MAGIC, msgpack.packb({"acked": marks}, use_bin_type=True))


def _unpack(payload: bytes) -> object:
    try:
        return msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise RecordError(f"payload is not msgpack ({e})") from None


def decode_payload(payload: bytes) -> tuple[str, int, int, bytes]:
    return fields(_unpack(payload))


def marks(rec: dict) -> dict[str, int]:
    """The marks of a decoded acknowledgement record, or RecordError."""
    got = rec.get("acked")
    if not (len(rec) == 1 and isinstance(got, dict)
            and all(isinstance(b, str) and 0 < len(b) <= MAX_BOOT_ID and type(s) is int and s > 0
                    for b, s in got.items())):
        raise RecordError("payload is not {acked: {boot: seq}}")
    return got


def fields(rec: object) -> tuple[str, int, int, bytes]:
    """(boot, seq, samples, batch) from a decoded payload, or RecordError."""
    if not (isinstance(rec, list) and len(rec) == 4):
        raise RecordError("payload is not [boot, seq, samples, batch]")
    boot, seq, samples, batch = rec
    if not (isinstance(boot, str) and 0 < len(boot) <= MAX_BOOT_ID and type(seq) is int and seq > 0
            and type(samples) is int and samples >= 0 and isinstance(batch, bytes)):
        raise RecordError("payload fields have the wrong types or ranges")
    return boot, seq, samples, batch


def read_at(fd: int, offset: int, length: int) -> tuple[str, int, int, bytes]:
    """The record of `length` bytes at `offset` of an open segment, checked."""
    if length < HEADER.size or length > HEADER.size + MAX_RECORD_BYTES:
        raise RecordError(f"record length {length} out of range")
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise RecordError(f"only {len(data)} of {length} bytes left in the segment")
    try:
        payload = framing.payload_at(data, 0, length, MAGIC, MAX_RECORD_BYTES)
    except framing.FrameError as e:
        raise RecordError(str(e)) from None
    if HEADER.size + len(payload) != length:
        raise RecordError(f"length {len(payload)} does not match the {length - HEADER.size} bytes read")
    return decode_payload(payload)


def scan(fd: int) -> Iterator[Good | Acks | Damaged]:
    """Every record of an open segment in order, damaged spans reported in between."""
    buf = framing.FileBytes(fd)
    for span in framing.scan(buf, 0, os.fstat(fd).st_size, MAGIC, MAX_RECORD_BYTES):
        length = span.end - span.start
        if span.payload is None:
            held = 1 + framing.count(buf, span.start + 1, span.end, MAGIC)
            yield Damaged(span.start, length, held, span.damage)
            continue
        try:
            rec = _unpack(span.payload)
            if isinstance(rec, dict):
                yield Acks(marks(rec), span.start, length)
                continue
            boot, seq, samples, batch = fields(rec)
        except RecordError as e:
            yield Damaged(span.start, length, 1, str(e))
            continue
        yield Good(boot, seq, samples, span.start, length, batch)


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
                    yield Damaged(offset, size - offset, 1, "record cut short (format before framing)")
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
