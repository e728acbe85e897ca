"""common/compact.py's decoders fuzzed: any mutation of a valid block or definition table, of its
compressed bytes or of the bytes inside, gives a result within the bounds asked or CompactError,
never another exception; valid encodings come back exactly (NaN, infinities, -0.0, int64 time
extremes, refs near 2**32, histograms)."""

from __future__ import annotations

import random
import struct
import zlib

from fuzzing import Mutator
from hypothesis import given, settings
from hypothesis import strategies as st

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

SEED = 20_240_613
MUTATIONS = 4000   # each of compressed and inflated bytes, for columns and for definitions

_doubles = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, float("nan"), float("-inf")]) \
    | st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", b.to_bytes(8, "little"))[0])   # any NaN payload
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
@given(rows=_rows, data=st.data())
def test_valid_columns_come_back_exactly(rows, data):
    histograms = {}
    for i in data.draw(st.sets(st.integers(0, max(0, len(rows) - 1)), max_size=4)) if rows else ():
        bounds = data.draw(st.lists(_doubles, max_size=compact.MAX_BUCKETS))
        counts = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(bounds) + 1, max_size=len(bounds) + 1))
        histograms[i] = (bounds, counts)
    got = compact.decode_columns(compact.encode_columns(rows, histograms), len(rows))
    assert _rows_key(got.rows()) == _rows_key(rows)
    assert list(got.refs) == [r[0] for r in rows] and got.times == [r[1] for r in rows]
    assert got.time == (rows[0][1] if rows and all(r[1] == rows[0][1] for r in rows) else None)
    assert got.rising == all(a[0] < b[0] for a, b in zip(rows, rows[1:]))
    assert _hist_key(got.histograms) == _hist_key(histograms)


def test_the_extremes_come_back_exactly():
    rows = [(2**32 - 1, -2**63, float("nan")), (0, 2**63 - 1, -0.0), (2**32 - 2, -2**63, float("inf")),
            (1, 2**63 - 1, float("-inf")), (2**31, 0, 5e-324), (2**32 - 1, -1, -1.7976931348623157e308)]
    hist = {2: ([float("-inf"), -0.0, float("nan")], [0, 2**63, 2**64 - 1, 2**64 - 1])}
    got = compact.decode_columns(compact.encode_columns(rows, hist), len(rows))
    assert _rows_key(got.rows()) == _rows_key(rows) and _hist_key(got.histograms) == _hist_key(hist)
    assert got.time is None and not got.rising
    one_time = [(r, 2**63 - 1, 1.0) for r in range(2**32 - 3, 2**32)]
    got = compact.decode_columns(compact.encode_columns(one_time), 3)
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
    out = [compact.encode_columns([])]
    for n in (1, 3, 40):
        rows = [(2**32 - 1 - 3 * i if n == 3 else i + 1, 1_700_000_000_000_000_000 + (i % 2) * (n == 3), rng.random() * 100)
                for i in range(n)]
        out.append(compact.encode_columns(rows))
        out.append(compact.encode_columns(rows, {0: ([0.5, 1.0], [1, 2, 3]), n - 1: ([], [7])}))
    out.append(compact.encode_columns([(1, -2**63, float("nan")), (2, 2**63 - 1, -0.0)]))
    full = compact.MAX_BUCKETS   # a histogram of the most buckets read
    out.append(compact.encode_columns([(5, 9, 1.0)], {0: ([float(b) for b in range(full)], list(range(full + 1)))}))
    return out


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
    assert len(raw) == 17 + 20 * n + sum(12 + 8 * (len(b) + len(c)) for b, c in got.histograms.values())
    _, n_head, t0 = struct.unpack_from("<BIq", raw)
    deltas = struct.unpack_from(f"<{n}I", raw, 13)
    assert n_head == n and got.refs == tuple(sum(deltas[:k + 1]) % 2**32 for k in range(n))
    steps = struct.unpack_from(f"<{n}Q", raw, 13 + 4 * n)
    assert got.times == [(t0 + d + 2**63) % 2**64 - 2**63 for d in steps]
    assert _rows_key(got.rows()) == _rows_key(zip(got.refs, got.times, struct.unpack_from(f"<{n}d", raw, 13 + 12 * n)))
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
