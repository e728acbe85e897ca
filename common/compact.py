"""The compact batch encoding (`Batch.columns`, negotiated in Hello): a batch's samples as columns
of series references, times and values, zlib-compressed, with each series' name, unit, kind and
labels sent once per stream as a definition (`SeriesTable`) rather than with every sample. Version 2
writes a value that is a decimal of at most 9 places as its digits (a varint) instead of 8 bytes;
version 1 is still read and written for a peer that knows no other; on the wire, blocks may be
chained (compact_chain.py). Layout: docs/design.md, "The compact encoding"."""

from __future__ import annotations

import itertools
import math
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

# Hello.batch_encodings / Welcome.batch_encoding: what this version writes by default. CHAINED is
# version 2's blocks, each deflated on the stream's block before it (compact_chain.py), the wire's
# form only: an agent offers it where configured to, since it costs the collector a deflate a batch.
CHAINED = "columns-zlib-2-chained"
ENCODING = "columns-zlib-2"
# every encoding read, newest first, and its block's version
VERSIONS = {CHAINED: 2, "columns-zlib-2": 2, "columns-zlib-1": 1}
ENCODINGS = tuple(VERSIONS)
VERSION = VERSIONS[ENCODING]
LEVEL = 6                     # zlib level: 9 saves <1% of the bytes here for 2x the agent's time
_HEAD = struct.Struct("<BIq")   # version, samples, first time
_HIST = struct.Struct("<III")   # sample index, bounds, counts
_PER_SAMPLE = 21              # the most bytes a sample takes, histogram aside: ref, time, tag, value
RAW = 255                     # version 2's tag of a value sent as its 8 bytes; 0-9: its decimal places
_P10 = tuple(10.0 ** d for d in range(10))   # exact doubles
_EXACT = float(1 << 53)       # a value's digits below this in magnitude are exact as a double
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


def offered(encoding: str) -> list[str]:
    """What an agent that builds batches in `encoding` offers in Hello: it and the older compact
    encodings (its columns are written again in the one a collector chooses); [] for ""."""
    return list(ENCODINGS[ENCODINGS.index(encoding):]) if encoding in VERSIONS else []


def _digits(v: float) -> tuple[int, int] | None:
    """(places, digits) where `v` is digits / 10**places exactly (-0.0, NaN and infinities are not):
    the places are those of its shortest repr, which gives it back. An int is taken as the float
    it makes, as version 1 takes it."""
    v = float(v)
    if not -_EXACT < v < _EXACT:
        return None
    if v.is_integer():
        return (0, int(v)) if v or math.copysign(1.0, v) > 0 else None
    r = repr(v)
    mantissa, _, exponent = r.partition("e")
    d = (len(mantissa) - mantissa.find(".") - 1 if "." in mantissa else 0) - int(exponent or 0)
    if d > 9:
        return None
    m = round(v * _P10[d])
    return (d, m) if m / _P10[d] == v and -_EXACT < m < _EXACT else None


def _values_v2(values: Iterable[float]) -> bytes:
    """Version 2's values: a tag a value, then the raw ones' 8 bytes, then the others' digits as
    zigzag varints."""
    tags, digits, raw = bytearray(), bytearray(), array("d")
    for v in values:
        got = _digits(v)
        if got is None:
            tags.append(RAW)
            raw.append(v)
            continue
        tags.append(got[0])
        z = got[1] << 1 ^ got[1] >> 63
        while z >= 0x80:
            digits.append(z & 0x7F | 0x80)
            z >>= 7
        digits.append(z)
    return bytes(tags) + _le(raw) + bytes(digits)


def encode_columns(rows: Sequence[Row], histograms: dict[int, Histogram] | None = None,
                   version: int = VERSION) -> bytes:
    """`rows` (in the order the reader gets them back; the agent sorts them by reference, which
    compresses best) and the histograms among them by row index, as a compressed block of `version`."""
    n = len(rows)
    refs = array("I", bytes(4 * n))
    deltas = array("Q", bytes(8 * n))
    t0 = rows[0][1] if n else 0
    last = 0
    for i, (ref, t, _) in enumerate(rows):
        refs[i] = (ref - last) & _U32
        last = ref
        deltas[i] = (t - t0) & _U64
    values = (r[2] for r in rows)
    parts = [_HEAD.pack(version, n, t0), _le(refs), _le(deltas),
             _values_v2(values) if version == 2 else _le(array("d", values))]
    hists = sorted((histograms or {}).items())
    parts.append(struct.pack("<I", len(hists)))
    for i, (bounds, counts) in hists:
        parts.append(_HIST.pack(i, len(bounds), len(counts)))
        parts.append(_le(array("d", bounds)))
        parts.append(_le(array("Q", counts)))
    return deflate(b"".join(parts))


def deflate(raw: bytes, zdict: bytes = b"") -> bytes:
    """zlib.compress(raw, LEVEL)'s bytes; with `zdict`, a compressobj's with it as the preset
    dictionary. In C where it is built (one deflate state kept, not made anew for each block)."""
    if _compact is not None:
        return _compact.deflate(raw, LEVEL, zdict)
    if not zdict:
        return zlib.compress(raw, LEVEL)
    z = zlib.compressobj(LEVEL, zlib.DEFLATED, zlib.MAX_WBITS, 8, zlib.Z_DEFAULT_STRATEGY, zdict)
    return z.compress(raw) + z.flush()


def inflated_limit(max_samples: int) -> int:
    """The most bytes a block of at most `max_samples` samples inflates to."""
    return _HEAD.size + 4 + max_samples * (_PER_SAMPLE + _HIST.size + 16 * MAX_BUCKETS + 8)


def version_of(data: bytes) -> int:
    """The version a block says it is (its first byte inflated), or -1 for one that does not inflate."""
    try:
        head = zlib.decompressobj().decompress(data, 1)
    except zlib.error:
        return -1
    return head[0] if head else -1


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


def inflate(data: bytes, limit: int, what: str, why: str = "", zdict: bytes = b"") -> bytes:
    """`data` inflated (with `zdict` as the preset dictionary it may ask for), never past `limit`
    bytes; CompactError naming `what` otherwise."""
    d = zlib.decompressobj(zdict=zdict) if zdict else zlib.decompressobj()
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
    limit = inflated_limit(max_samples)
    raw = inflate(data, limit, "columns", f", more than {max_samples} samples take")
    if len(raw) < _HEAD.size:
        raise CompactError(f"columns of {len(raw)} bytes, shorter than their header")
    version, n, t0 = _HEAD.unpack_from(raw)
    if version not in (1, 2):
        raise CompactError(f"columns of version {version}; this version reads versions 1 and 2")
    if n > max_samples:
        raise CompactError(f"{n} samples in one batch, more than {max_samples}")
    end = _HEAD.size + (20 if version == 1 else 13) * n + 4
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
    if version == 1:
        values = _from_le("d", view[p:p + 8 * n]).tobytes()
        p += 8 * n
    else:
        values, p = _read_values_v2(raw, p, n)
    if p + 4 > len(raw):
        raise CompactError(f"columns of {len(raw)} bytes, too short for {n} samples")
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


def _read_values_v2(raw: bytes, p: int, n: int) -> tuple[bytes, int]:
    """Version 2's `n` values from raw[p:] (see _values_v2), as array('d')'s bytes, and where they end."""
    tags = raw[p:p + n]
    if bad := next((t for t in tags if t > 9 and t != RAW), None):
        raise CompactError(f"a value's tag {bad}: neither decimal places (0-9) nor {RAW} (raw)")
    p += n
    k = tags.count(RAW)
    if p + 8 * k > len(raw):
        raise CompactError(f"columns of {len(raw)} bytes, too short for {n} samples")
    raw_values = iter(_from_le("d", raw[p:p + 8 * k]))
    p += 8 * k
    out = array("d", bytes(8 * n))
    for i, d in enumerate(tags):
        if d == RAW:
            out[i] = next(raw_values)
            continue
        z = shift = 0
        while True:
            if p >= len(raw) or shift > 49:
                raise CompactError("a value's digits are cut short" if p >= len(raw)
                                   else "a value's digits run past 8 bytes")
            b = raw[p]
            p += 1
            z |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        m = z >> 1 ^ -(z & 1)
        if not -_EXACT < m < _EXACT:
            raise CompactError(f"a value's digits {m} are past 2**53")
        out[i] = m / _P10[d]
    return out.tobytes(), p


def encode_defs(series: Iterable[pb.Sample]) -> bytes:
    """Series definitions (name, unit, kind, labels and series_ref of each) as SeriesTable.defs."""
    return deflate(pb.SeriesDefs(series=series).SerializeToString())


def decode_defs(data: bytes, max_bytes: int) -> list[pb.Sample]:
    """SeriesTable.defs, inflated to at most `max_bytes`; CompactError otherwise."""
    raw = inflate(data, max_bytes, "series definitions")
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
