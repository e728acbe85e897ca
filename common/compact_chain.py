"""The compact encoding's chained form ("columns-zlib-2-chained"), the wire's only: each batch's
block deflated with the stream's block before it as zlib's preset dictionary, so that what repeats
from one round to the next (references, times, tags, values that did not change) costs a few bytes.
The agent chains its blocks as it sends them; the collector or gateway deflates each alone again as
it reads it, so spools, stores and JetStream keep version 2's blocks, each readable alone.
"""

from __future__ import annotations

from . import compact

COLUMNS_KEY = 0x3A   # Batch.columns: field 7, length-delimited
_FDICT = 0x20        # a zlib stream's header flag: deflated on a preset dictionary


def _on_dictionary(block: bytes) -> bool:
    """Whether `block` starts as a zlib stream deflated on a preset dictionary (RFC 1950's header)."""
    return len(block) >= 6 and block[0] & 0x0F == 8 and (block[0] << 8 | block[1]) % 31 == 0 and bool(block[1] & _FDICT)


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise compact.CompactError("a Batch's bytes end inside a varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return value, i
        shift += 7


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def columns_span(batch: bytes, block: bytes = b"") -> tuple[int, int, int] | None:
    """Where a Batch's bytes hold its columns: (the field's key, its value's first byte, the byte
    after it), of the last such field as protobuf reads it; None for a Batch without one. A field
    it cannot walk over: CompactError. `block`: the columns, where known; found at once where they
    end the bytes (as protobuf writes them, field 7 last)."""
    if block and batch.endswith(block):
        head = bytes((COLUMNS_KEY,)) + varint(len(block))
        start = len(batch) - len(block) - len(head)
        if start >= 0 and batch[start:start + len(head)] == head:
            return start, start + len(head), len(batch)
    span, i = None, 0
    while i < len(batch):
        start = i
        key, i = _varint(batch, i)
        kind = key & 7
        if kind == 0:
            _, i = _varint(batch, i)
        elif kind == 2:
            n, i = _varint(batch, i)
            if i + n > len(batch):
                raise compact.CompactError("a Batch's field runs past its end")
            if key == COLUMNS_KEY:
                span = (start, i, i + n)
            i += n
        elif kind in (1, 5):
            i += 8 if kind == 1 else 4
        else:
            raise compact.CompactError(f"a Batch's field of wire type {kind}")
    if i != len(batch):
        raise compact.CompactError("a Batch's last field runs past its end")
    return span


def with_columns(batch: bytes, columns: bytes, span: tuple[int, int, int] | None = None, old: bytes = b"") -> bytes:
    """A Batch's bytes with its columns (which it has: `old`, where known; `span`: where, as
    columns_span says) replaced by `columns`, in the same place."""
    span = span or columns_span(batch, old)
    if span is None:
        raise compact.CompactError("a Batch without columns")
    start, _, end = span
    return b"".join((batch[:start], bytes((COLUMNS_KEY,)), varint(len(columns)), columns, batch[end:]))


class Chain:
    """One stream's end of the chain: the block before, inflated (b"": none yet, the next one goes
    alone). `max_samples` bounds what a block may inflate to."""

    __slots__ = ("last", "limit")

    def __init__(self, max_samples: int):
        self.last = b""
        self.limit = compact.inflated_limit(max_samples)

    def send(self, block: bytes) -> bytes:
        """The agent's side: `block` (deflated alone) deflated on the block before; CompactError
        where it does not inflate (the chain is left as it was)."""
        raw = compact.inflate(block, self.limit, "columns")
        chained = compact.deflate(raw, self.last) if self.last else block
        self.last = raw
        return chained

    def receive(self, block: bytes) -> bytes:
        """The reader's side: `block` as the agent built it, deflated alone (one sent alone is
        returned as it is, and a broken one left to the reader of blocks to refuse). CompactError
        where a block deflated on the one before does not inflate on it."""
        if not _on_dictionary(block):
            try:
                self.last = compact.inflate(block, self.limit, "columns")
            except compact.CompactError:
                self.last = b""
            return block
        if not self.last:
            raise compact.CompactError("columns deflated on a block before them, with none before them on this stream")
        raw = compact.inflate(block, self.limit, "columns", zdict=self.last)
        self.last = raw
        return compact.deflate(raw)
