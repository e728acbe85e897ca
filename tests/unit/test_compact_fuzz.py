"""common/compact.py's decoders fuzzed: any mutation of a valid block or definition table, of its
compressed bytes or of the bytes inside, gives a result within the bounds asked or CompactError,
never another exception; valid encodings come back exactly (NaN, infinities, -0.0, int64 time
extremes, refs near 2**32, histograms)."""

from __future__ import annotations

import random
import struct
import zlib

import pytest
from fuzzing import Mutator
from hypothesis import given, settings
from hypothesis import strategies as st

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

SEED = 20_240_613
MUTATIONS = 4000   # each of compressed and inflated bytes, for columns and for definitions

_doubles = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, float("nan"), float("-inf")]) \
    | st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", b.to_bytes(8, "little"))[0]) \
    | st.builds(lambda m, d: m / 10.0 ** d, st.integers(-2**53 + 1, 2**53 - 1), st.integers(0, 9))   # any NaN payload; digits
_times = st.integers(-2**63, 2**63 - 1) | st.sampled_from([-2**63, 2**63 - 1, 0, -1])
_refs = st.integers(0, 2**32 - 1) | st.integers(2**32 - 64, 2**32 - 1)
_rows = st.lists(st.tuples(_refs, _times, _doubles), max_size=40)


def _bits(v: float) -> bytes:
    return struct.pack("<d", v)


def _rows_key(rows) -> list:
    return [(ref, t, _bits(v)) for ref, t, v in rows]


def _hist_key(histograms) -> dict:
    return {i: ([_bits(b) for b in bounds], list(counts)) for i, (bounds, counts) in histograms.items()}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(rows=_rows, data=st.data(), version=st.sampled_from([1, 2]))
def test_valid_columns_come_back_exactly(rows, data, version):
    histograms = {}
    for i in data.draw(st.sets(st.integers(0, max(0, len(rows) - 1)), max_size=4)) if rows else ():
        bounds = data.draw(st.lists(_doubles, max_size=compact.MAX_BUCKETS))
        counts = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(bounds) + 1, max_size=len(bounds) + 1))
        histograms[i] = (bounds, counts)
    block = compact.encode_columns(rows, histograms, version)
    got = compact.decode_columns(block, len(rows))
    assert compact.version_of(block) == version and compact.decode_columns_python(block, len(rows)).values == got.values
    assert _rows_key(got.rows()) == _rows_key(rows)
    assert list(got.refs) == [r[0] for r in rows] and got.times == [r[1] for r in rows]
    assert got.time == (rows[0][1] if rows and all(r[1] == rows[0][1] for r in rows) else None)
    assert got.rising == all(a[0] < b[0] for a, b in zip(rows, rows[1:]))
    assert _hist_key(got.histograms) == _hist_key(histograms)


@pytest.mark.parametrize("version", [1, 2])
def test_the_extremes_come_back_exactly(version):
    rows = [(2**32 - 1, -2**63, float("nan")), (0, 2**63 - 1, -0.0), (2**32 - 2, -2**63, float("inf")),
            (1, 2**63 - 1, float("-inf")), (2**31, 0, 5e-324), (2**32 - 1, -1, -1.7976931348623157e308)]
    hist = {2: ([float("-inf"), -0.0, float("nan")], [0, 2**63, 2**64 - 1, 2**64 - 1])}
    rows += [(7, 0, v) for v in (2.0**53 - 1, -(2.0**53 - 1), 2.0**53, 0.1, -123.456789012, 1e-9, 1.5e-10, 0.0)]
    ints = [(8, 0, v) for v in (3, -7, 0, 2**53 + 1, -2**62, True)]   # a source's ints: as the floats they make
    got = compact.decode_columns(compact.encode_columns(rows + ints, hist, version), len(rows) + len(ints))
    assert _rows_key(got.rows()) == _rows_key(rows + [(r, t, float(v)) for r, t, v in ints])
    assert _hist_key(got.histograms) == _hist_key(hist)
    assert got.time is None and not got.rising
    one_time = [(r, 2**63 - 1, 1.0) for r in range(2**32 - 3, 2**32)]
    got = compact.decode_columns(compact.encode_columns(one_time, version=version), 3)
    assert got.time == 2**63 - 1 and got.rising and got.refs == (2**32 - 3, 2**32 - 2, 2**32 - 1)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(series=st.lists(st.builds(
    lambda name, unit, kind, labels, ref: pb.Sample(name=name, unit=unit, kind=kind, labels=labels, series_ref=ref),
    st.text(max_size=30), st.sampled_from(["", "1", "By", "Cel"]), st.sampled_from([pb.GAUGE, pb.COUNTER, pb.HISTOGRAM]),
    st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=4), _refs), max_size=20))
def test_valid_definitions_come_back_exactly(series):
    data = compact.encode_defs(series)
    got = compact.decode_defs(data, 1 << 20)
    assert [s.SerializeToString(deterministic=True) for s in got] == [s.SerializeToString(deterministic=True) for s in series]


def _columns_corpus() -> list[bytes]:
    rng = random.Random(SEED)
    out = []
    for version in (1, 2):
        out.append(compact.encode_columns([], version=version))
        for n in (1, 3, 40):   # raw doubles, decimals of 0-9 places and integers (version 2's digits)
            values = [rng.random() * 100 if i % 3 == 0 else round(rng.uniform(-1e6, 1e6), i % 10) for i in range(n)]
            rows = [(2**32 - 1 - 3 * i if n == 3 else i + 1, 1_700_000_000_000_000_000 + (i % 2) * (n == 3), values[i])
                    for i in range(n)]
            out.append(compact.encode_columns(rows, version=version))
            out.append(compact.encode_columns(rows, {0: ([0.5, 1.0], [1, 2, 3]), n - 1: ([], [7])}, version))
        out.append(compact.encode_columns([(1, -2**63, float("nan")), (2, 2**63 - 1, -0.0), (3, 0, 2.0**53 - 1)],
                                          version=version))
        full = compact.MAX_BUCKETS   # a histogram of the most buckets read
        out.append(compact.encode_columns([(5, 9, 1.0)], {0: ([float(b) for b in range(full)], list(range(full + 1)))},
                                          version))
    return out


def _layout_values(raw: bytes, n: int) -> tuple[list[float], int]:
    """The values as docs/design.md lays them out for the block's version, and where they end."""
    p = 13 + 12 * n
    if raw[0] == 1:
        return list(struct.unpack_from(f"<{n}d", raw, p)), p + 8 * n
    tags = raw[p:p + n]
    p += n
    k = tags.count(compact.RAW)
    raws = iter(struct.unpack_from(f"<{k}d", raw, p))
    p += 8 * k
    out = []
    for tag in tags:
        if tag == compact.RAW:
            out.append(next(raws))
            continue
        z = shift = 0
        while True:
            z |= (raw[p] & 0x7F) << shift
            shift += 7
            p += 1
            if raw[p - 1] < 0x80:
                break
        out.append((z >> 1 ^ -(z & 1)) / 10.0 ** tag)
    return out, p


def _check_columns(data: bytes, max_samples: int) -> bool:
    """Whether `data` decoded (within the bounds: checked) rather than being refused."""
    try:
        got = compact.decode_columns(data, max_samples)
    except compact.CompactError as e:
        assert str(e)
        return False
    n = len(got)
    assert n <= max_samples
    assert len(got.times) == n and len(got.values) == 8 * n and len(got.rows()) == n
    assert all(0 <= r < 2**32 for r in got.refs) and all(-2**63 <= t < 2**63 for t in got.times)
    assert got.time == (got.times[0] if n and len(set(got.times)) == 1 else None)
    for i, (bounds, counts) in got.histograms.items():
        assert 0 <= i < n and len(bounds) <= compact.MAX_BUCKETS and len(counts) <= compact.MAX_BUCKETS + 1
        assert all(0 <= c < 2**64 for c in counts)
    # what was accepted is read whole, as the layout says (docs/design.md), and nothing after it
    raw = zlib.decompress(data)
    values, end = _layout_values(raw, n)
    assert len(raw) == end + 4 + sum(12 + 8 * (len(b) + len(c)) for b, c in got.histograms.values())
    _, n_head, t0 = struct.unpack_from("<BIq", raw)
    deltas = struct.unpack_from(f"<{n}I", raw, 13)
    assert n_head == n and got.refs == tuple(sum(deltas[:k + 1]) % 2**32 for k in range(n))
    steps = struct.unpack_from(f"<{n}Q", raw, 13 + 4 * n)
    assert got.times == [(t0 + d + 2**63) % 2**64 - 2**63 for d in steps]
    assert _rows_key(got.rows()) == _rows_key(zip(got.refs, got.times, values))
    return True


def _inflated(data: bytes) -> bytes:
    return zlib.decompress(data)


def _header_edits(raw: bytes, rng: random.Random) -> bytes:
    """The block's counts and indices (version, samples, histograms, a histogram's index and sizes)
    set to boundary values: what a bit flip in the compressed bytes seldom reaches past the checksum."""
    b = bytearray(raw)
    at = rng.choice([0, 1, len(b) - 4] + [p for p in range(13, len(b) - 12, 4)][:64])
    width = 1 if at == 0 else 4
    if at + width <= len(b):
        value = rng.choice([0, 1, 2, 255, 256, 257, 2**31, 2**32 - 1, rng.randrange(2**32)])
        b[at:at + width] = (value & (256**width - 1)).to_bytes(width, "little")
    return bytes(b)


def test_mutated_columns_decode_within_bounds_or_are_refused():
    corpus = _columns_corpus()
    rng = random.Random(SEED)
    compressed, inflated = Mutator(corpus, SEED), Mutator([_inflated(c) for c in corpus], SEED + 1)
    decoded = refused = 0
    for k in range(MUTATIONS):
        max_samples = rng.choice([0, 1, 3, 40, 41, 10_000])
        _check_columns(compressed(), max_samples)
        raw = inflated() if k % 2 else _header_edits(rng.choice(inflated.corpus), rng)
        if _check_columns(zlib.compress(raw), max_samples):
            decoded += 1
        else:
            refused += 1
    assert decoded > MUTATIONS // 10 and refused > MUTATIONS // 10   # both sides of the checks past inflation


def test_a_histogram_of_more_buckets_than_read_is_refused():
    full = compact.MAX_BUCKETS
    for bounds, counts in ((full + 1, full + 2), (full, full + 2), (0, full + 2)):
        data = compact.encode_columns([(5, 9, 1.0)], {0: ([0.0] * bounds, [0] * counts)})
        try:
            compact.decode_columns(data, 10)   # room for its bytes: refused for its buckets
        except compact.CompactError as e:
            assert f"{bounds} bounds and {counts} counts" in str(e)
        else:
            raise AssertionError(f"a histogram of {bounds} bounds and {counts} counts was read")


def test_columns_that_inflate_past_their_bound_are_refused_before_inflating_more():
    bomb = zlib.compress(bytes(64 << 20), 9)   # 64 MiB of zeros in 64 kB
    for max_samples in (0, 100, 10_000):
        try:
            compact.decode_columns(bomb, max_samples)
        except compact.CompactError as e:
            assert "inflate past" in str(e)
        else:
            raise AssertionError("a 64 MiB block was decoded")
    try:
        compact.decode_defs(bomb, 1 << 20)
    except compact.CompactError as e:
        assert "inflate past 1048576 bytes" in str(e)
    else:
        raise AssertionError("64 MiB of definitions were decoded")


def test_mutated_definitions_decode_or_are_refused():
    series = [pb.Sample(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, labels={"device": str(i), "型": "ü"},
                        series_ref=i + 1) for i in range(8)]
    series.append(pb.Sample(name="xpusense.network.tcp.rtt", unit="s", kind=pb.HISTOGRAM, series_ref=2**32 - 1))
    corpus = [compact.encode_defs(series), compact.encode_defs(series[:1]), compact.encode_defs([])]
    compressed, inflated = Mutator(corpus, SEED), Mutator([_inflated(c) for c in corpus], SEED + 1)
    decoded = 0
    for _ in range(MUTATIONS):
        for data in (compressed(), zlib.compress(inflated())):
            try:
                got = compact.decode_defs(data, 4096)
            except compact.CompactError as e:
                assert str(e)
                continue
            decoded += 1
            assert all(isinstance(s, pb.Sample) for s in got)
    assert decoded > MUTATIONS // 10   # parsed definitions, not only refusals


def _varint(z: int) -> bytes:
    out = bytearray()
    while z >= 0x80:
        out.append(z & 0x7F | 0x80)
        z >>= 7
    return bytes(out) + bytes([z])


@pytest.mark.parametrize("values, why", [
    (bytes([17]) + bytes(5), "a value's tag 17"),
    (bytes([0]) + b"\x80" * 4, "digits are cut short"),
    (bytes([3]) + b"\xff" * 8 + b"\x01", "digits run past 8 bytes"),
    (bytes([0]) + _varint(2**54) + bytes(4), f"digits {2**53} are past 2\\*\\*53"),
    (bytes([0]) + _varint(2**54 - 1) + bytes(4), f"digits {-2**53} are past 2\\*\\*53"),
    (bytes([compact.RAW]) + bytes(7), "too short for 1 samples"),
])
def test_version_2_values_out_of_their_layout_are_refused(values, why):
    data = zlib.compress(struct.pack("<BIq", 2, 1, 0) + bytes(12) + values)
    with pytest.raises(compact.CompactError, match=why):
        compact.decode_columns(data, 1)   # the C reader gives it to Python's, which says why
    if compact._compact is not None:
        assert compact._compact.decode(data, 1, None) is None


def test_version_2_writes_decimals_as_digits_and_the_rest_whole():
    rows = [(1, 0, 45.3), (2, 0, 3.0), (3, 0, 0.0023909379999622615), (4, 0, -0.0), (5, 0, -7e-9)]
    raw = zlib.decompress(compact.encode_columns(rows))
    tags = raw[13 + 12 * 5:13 + 13 * 5]
    assert list(tags) == [1, 0, compact.RAW, compact.RAW, 9]
    assert raw[13 + 13 * 5 + 16:] == _varint(906) + _varint(6) + _varint(13) + bytes(4)
