"""The compact batch encoding (`Batch.columns`, negotiated in Hello): a batch's samples as columns
of series references, times and values, zlib-compressed, with each series' name, unit, kind and
labels sent once per stream as a definition (`SeriesTable`) rather than with every sample.
Layout: docs/design.md, "The compact encoding"."""

from __future__ import annotations

import itertools
import operator
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence

from xpusense.v1 import telemetry_pb2 as pb

try:   # decode_columns' reader in C (common/_compact.c), built with the package where a C compiler was at hand
    from . import _compact
except ImportError:
    _compact = None  # type: ignore[assignment]

ENCODING = "columns-zlib-1"   # Hello.batch_encodings / Welcome.batch_encoding
VERSION = 1
LEVEL = 6                     # zlib level: 9 saves <1% of the bytes here for 2x the agent's time
_HEAD = struct.Struct("<BIq")   # version, samples, first time
_HIST = struct.Struct("<III")   # sample index, bounds, counts
MAX_BUCKETS = 256             # bounds of one histogram (counts: one more)
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_SWAP = sys.byteorder == "big"   # arrays are in the machine's order; the encoding is little-endian

Row = tuple[int, int, float]          # series_ref, time_unix_nano, value
Histogram = tuple[Sequence[float], Sequence[int]]   # bounds, counts (sum is the value, count counts[-1])


class CompactError(ValueError):
    """Bytes that are not a compact block this version reads; the message says what is wrong."""


def _le(a: array) -> bytes:
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _from_le(code: str, data: bytes | memoryview) -> array:
    a = array(code)
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a


def encode_columns(rows: Sequence[Row], histograms: dict[int, Histogram] | None = None) -> bytes:
    """`rows` (in the order the reader gets them back; the agent sorts them by reference, which
    compresses best) and the histograms among them by row index, as a compressed block."""
    n = len(rows)
    refs = array("I", bytes(4 * n))
    deltas = array("Q", bytes(8 * n))
    values = array("d", bytes(8 * n))
    t0 = rows[0][1] if n else 0
    last = 0
    for i, (ref, t, v) in enumerate(rows):
        refs[i] = (ref - last) & _U32
        last = ref
        deltas[i] = (t - t0) & _U64
        values[i] = v
    parts = [_HEAD.pack(VERSION, n, t0), _le(refs), _le(deltas), _le(values)]
    hists = sorted((histograms or {}).items())
    parts.append(struct.pack("<I", len(hists)))
    for i, (bounds, counts) in hists:
        parts.append(_HIST.pack(i, len(bounds), len(counts)))
        parts.append(_le(array("d", bounds)))
        parts.append(_le(array("Q", counts)))
    return zlib.compress(b"".join(parts), LEVEL)


class Columns:
    """A decoded block: `refs` (absolute, in order), `time` (the one time of every sample, or
    None), `times` (each sample's), `values` (an array('d')'s bytes, in the machine's order, as
    collector/batch_rows.py takes them), `rising` (references strictly rising), `histograms`
    (row index -> (bounds, counts)) and `ref_deltas` (the references' column as encoded)."""

    __slots__ = ("refs", "time", "times", "values", "rising", "histograms", "ref_deltas")

    def __init__(self, refs: tuple[int, ...], times: list[int], values: bytes, histograms: dict[int, Histogram],
                 rising: bool | None = None, ref_deltas: bytes = b""):
        self.refs, self.times, self.values, self.histograms = refs, times, values, histograms
        self.time = times[0] if times and times.count(times[0]) == len(times) else None
        self.rising = all(map(operator.lt, refs, refs[1:])) if rising is None else rising
        self.ref_deltas = ref_deltas

    def __len__(self) -> int:
        return len(self.refs)

    def rows(self) -> list[Row]:
        return list(zip(self.refs, self.times, array("d", self.values)))


def _refs(deltas: bytes) -> tuple[int, ...]:
    """The references from their deltas' bytes: sums at C speed, reduced to 32 bits where they pass it."""
    refs = tuple(itertools.accumulate(_from_le("I", deltas)))
    if refs and refs[-1] > _U32:   # rising sums: the last is the largest
        refs = tuple(r & _U32 for r in refs)
    return refs


def _times(t0: int, deltas: memoryview, n: int) -> list[int]:
    """The times from t0 and their deltas' bytes, at C speed: one time (all deltas 0, an agent's
    usual round) at once; else each delta's bits read as int64 (the same sum mod 2**64)."""
    if deltas == bytes(8 * n):
        return [t0] * n
    times = list(map(t0.__add__, _from_le("q", deltas)))
    if max(times) >= 1 << 63 or min(times) < -(1 << 63):   # past int64: wrapped as encoded
        times = [(t + (1 << 63) & _U64) - (1 << 63) for t in times]
    return times


def decode_columns(data: bytes, max_samples: int, last: Columns | None = None) -> Columns:
    """A block encode_columns made, of at most `max_samples` samples; CompactError otherwise (the
    decompressed size is bounded by that count before anything is inflated past it). `last`: one
    decoded before; where this block's references are encoded alike (an agent's next round), its
    `refs` are this one's, the same tuple. Read by the C reader where it is built; what it does not
    read (every block refused) is read here, which says why."""
    like = None if last is None else last.ref_deltas
    if _compact is not None and (got := _compact.decode(data, max_samples, like)) is not None:
        c = Columns.__new__(Columns)
        c.refs, c.time, c.times, c.values, c.rising, c.histograms, c.ref_deltas = got
        if c.refs is None:   # encoded as last's
            c.refs, c.rising = last.refs, last.rising
        return c
    return decode_columns_python(data, max_samples, last)


def _inflate(data: bytes, limit: int, what: str, why: str = "") -> bytes:
    """`data` inflated, never past `limit` bytes; CompactError naming `what` otherwise."""
    d = zlib.decompressobj()
    try:
        raw = d.decompress(data, limit)
    except zlib.error as e:
        raise CompactError(f"{what} do not inflate ({e})") from None
    if d.unconsumed_tail:
        raise CompactError(f"{what} inflate past {limit} bytes{why}")
    if not d.eof or d.unused_data:
        raise CompactError(f"{what} are cut short" if not d.eof else f"bytes after the {what}' end")
    return raw


def decode_columns_python(data: bytes, max_samples: int, last: Columns | None = None) -> Columns:
    """decode_columns read in Python: the same result, or CompactError saying what is wrong."""
    limit = _HEAD.size + 20 * max_samples + 4 + max_samples * (_HIST.size + 16 * MAX_BUCKETS + 8)
    raw = _inflate(data, limit, "columns", f", more than {max_samples} samples take")
    if len(raw) < _HEAD.size:
        raise CompactError(f"columns of {len(raw)} bytes, shorter than their header")
    version, n, t0 = _HEAD.unpack_from(raw)
    if version != VERSION:
        raise CompactError(f"columns of version {version}; this collector reads version {VERSION}")
    if n > max_samples:
        raise CompactError(f"{n} samples in one batch, more than {max_samples}")
    end = _HEAD.size + 20 * n + 4
    if len(raw) < end:
        raise CompactError(f"columns of {len(raw)} bytes, too short for {n} samples")
    view = memoryview(raw)
    p = _HEAD.size
    ref_deltas = bytes(view[p:p + 4 * n])
    refs, rising = (last.refs, last.rising) if last is not None and last.ref_deltas == ref_deltas \
        else (_refs(ref_deltas), None)
    p += 4 * n
    times = _times(t0, view[p:p + 8 * n], n)
    p += 8 * n
    values = _from_le("d", view[p:p + 8 * n]).tobytes()
    p += 8 * n
    (nh,) = struct.unpack_from("<I", raw, p)
    p += 4
    histograms: dict[int, Histogram] = {}
    for _ in range(nh):
        if p + _HIST.size > len(raw):
            raise CompactError("columns end inside a histogram")
        i, nb, nc = _HIST.unpack_from(raw, p)
        p += _HIST.size
        if nb > MAX_BUCKETS or nc > MAX_BUCKETS + 1:
            raise CompactError(f"a histogram of {nb} bounds and {nc} counts, more than {MAX_BUCKETS} buckets")
        if i >= n or i in histograms:
            raise CompactError(f"a histogram for sample {i} of {n}" + (" twice" if i < n else ""))
        if p + 8 * (nb + nc) > len(raw):
            raise CompactError("columns end inside a histogram")
        bounds = _from_le("d", view[p:p + 8 * nb]).tolist()
        p += 8 * nb
        counts = _from_le("Q", view[p:p + 8 * nc]).tolist()
        p += 8 * nc
        histograms[i] = (bounds, counts)
    if p != len(raw):
        raise CompactError(f"{len(raw) - p} bytes after the columns' histograms")
    return Columns(refs, times, values, histograms, rising, ref_deltas)


def encode_defs(series: Iterable[pb.Sample]) -> bytes:
    """Series definitions (name, unit, kind, labels and series_ref of each) as SeriesTable.defs."""
    return zlib.compress(pb.SeriesDefs(series=series).SerializeToString(), LEVEL)


def decode_defs(data: bytes, max_bytes: int) -> list[pb.Sample]:
    """SeriesTable.defs, inflated to at most `max_bytes`; CompactError otherwise."""
    raw = _inflate(data, max_bytes, "series definitions")
    try:
        defs = pb.SeriesDefs.FromString(raw)
    except Exception as e:   # protobuf's DecodeError
        raise CompactError(f"series definitions do not parse ({e})") from None
    return list(defs.series)


def sample(definition: pb.Sample, row: Row, histogram: Histogram | None = None) -> pb.Sample:
    """The Sample the full encoding would have carried for one row of a series so defined."""
    m = pb.Sample()
    m.CopyFrom(definition)
    m.time_unix_nano, m.value = row[1], row[2]
    if histogram is not None:
        bounds, counts = histogram
        h = m.histogram
        h.bounds.extend(bounds)
        h.counts.extend(counts)
        h.sum, h.count = row[2], (counts[-1] if counts else 0)
    return m


def expand(batch: pb.Batch, columns: Columns, definitions: Mapping[int, pb.Sample]) -> pb.Batch:
    """A compact batch as the Sample encoding would have carried it: its columns' rows as samples
    (`definitions`: one for each of their refs; KeyError for a ref without one), then the samples it
    carries whole; its ids, sequence number, sent time and events as they are."""
    out = pb.Batch()
    out.CopyFrom(batch)
    out.ClearField("columns")
    del out.samples[:]
    hists = columns.histograms
    out.samples.extend(sample(definitions[row[0]], row, hists.get(i)) for i, row in enumerate(columns.rows()))
    out.samples.extend(batch.samples)
    return out
