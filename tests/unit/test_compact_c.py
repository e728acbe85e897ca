"""The compact encoding's C reader (common/_compact.c) against decode_columns read in Python: for
valid blocks and for mutations of them (compressed bytes, inflated bytes recompressed, header
counts at their bounds, zlib bombs), the same blocks accepted, to the same refs, times, values and
histograms, and every one refused by Python given None; decode_columns takes the C reader."""

from __future__ import annotations

import random
import struct
import zlib

from fuzzing import Mutator
from hypothesis import given, settings
from hypothesis import strategies as st
from test_compact_fuzz import SEED, _columns_corpus, _header_edits, _rows

from xpusense.common import _compact, compact

MUTATIONS = 3000


def _same(data: bytes, max_samples: int, last: compact.Columns | None = None) -> bool:
    """Whether `data` was read (by both readers, to the same) rather than refused (by both)."""
    got = _compact.decode(data, max_samples, None if last is None else last.ref_deltas)
    try:
        want = compact.decode_columns_python(data, max_samples, last)
    except compact.CompactError:
        assert got is None, "the C reader read a block Python refuses"
        return False
    assert got is not None, "the C reader refused a block Python reads"
    refs, time, times, values, rising, histograms, ref_deltas = got
    if refs is None:   # encoded as last's: its refs taken, as Python takes them
        assert last is not None and want.refs is last.refs and ref_deltas is last.ref_deltas
        refs, rising = last.refs, last.rising
    assert refs == want.refs and rising is want.rising and ref_deltas == want.ref_deltas
    assert time == want.time and times == want.times and type(values) is bytes and values == want.values
    bits = {i: ([struct.pack("<d", b) for b in bounds], counts) for i, (bounds, counts) in histograms.items()}
    assert bits == {i: ([struct.pack("<d", b) for b in bounds], counts) for i, (bounds, counts) in want.histograms.items()}
    return True


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rows=_rows, data=st.data())
def test_valid_blocks_read_the_same(rows, data):
    histograms = {}
    for i in data.draw(st.sets(st.integers(0, max(0, len(rows) - 1)), max_size=4)) if rows else ():
        bounds = data.draw(st.lists(st.floats(allow_nan=True), max_size=compact.MAX_BUCKETS))
        histograms[i] = (bounds, data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(bounds) + 1,
                                                    max_size=len(bounds) + 1)))
    block = compact.encode_columns(rows, histograms)
    assert _same(block, len(rows))
    assert _same(block, len(rows) + 1000)
    assert _same(block, len(rows), compact.decode_columns_python(block, len(rows)))   # an agent's next round
    if rows:
        assert not _same(block, len(rows) - 1)


def test_mutated_blocks_are_read_the_same_or_refused_by_both():
    corpus = _columns_corpus()
    rng = random.Random(SEED)
    compressed = Mutator(corpus, SEED)
    inflated = Mutator([zlib.decompress(c) for c in corpus], SEED + 1)
    lasts = [None] + [compact.decode_columns_python(c, 100) for c in corpus]
    read = refused = 0
    for k in range(MUTATIONS):
        max_samples = rng.choice([0, 1, 3, 40, 41, 10_000])
        last = rng.choice(lasts)
        raw = inflated() if k % 2 else _header_edits(rng.choice(inflated.corpus), rng)
        for data in (compressed(), zlib.compress(raw, rng.choice([0, 1, 6, 9]))):
            if _same(data, max_samples, last):
                read += 1
            else:
                refused += 1
    assert read > MUTATIONS // 5 and refused > MUTATIONS // 5, (read, refused)


def test_bombs_and_the_bound_are_refused_as_python_refuses_them():
    bomb = zlib.compress(bytes(64 << 20), 9)   # 64 MiB of zeros in 64 kB
    for max_samples in (0, 100, 10_000):
        assert not _same(bomb, max_samples)
    # a sample with the largest histogram inflates to exactly the bound of one sample: read by both,
    # and a byte more is refused by both
    full = compact.MAX_BUCKETS
    edge = compact.encode_columns([(5, 9, 1 / 3)], {0: ([0.5] * full, [1] * (full + 1))})   # a raw value: 9 bytes
    assert len(zlib.decompress(edge)) == 17 + 4137
    assert _same(edge, 1) and _same(edge, 2) and _same(compact.encode_columns([]), 0)
    assert not _same(zlib.compress(zlib.decompress(edge) + b"\0"), 1)
    for data in (b"", b"x", zlib.compress(b"")[:-1], zlib.compress(b"\x01" + bytes(16)) + b"!"):
        assert not _same(data, 10)
    for bound in (-1, 2**62):   # not a bound read here: left to Python (which refuses -1 as zlib does)
        assert _compact.decode(compact.encode_columns([]), bound, None) is None


def test_decode_columns_takes_the_c_reader_and_python_says_why_a_block_is_refused(monkeypatch):
    block = compact.encode_columns([(1, 5, 0.5), (2, 5, 1.5)], {1: ([1.0], [1, 2])})
    first = compact.decode_columns(block, 10)
    calls = []
    monkeypatch.setattr(compact, "decode_columns_python", lambda *a: calls.append(a))
    got = compact.decode_columns(block, 10, first)
    assert calls == [] and got.refs is first.refs and got.time == 5 and got.rows() == [(1, 5, 0.5), (2, 5, 1.5)]
    monkeypatch.undo()
    try:
        compact.decode_columns(block, 1)
    except compact.CompactError as e:
        assert str(e) == "2 samples in one batch, more than 1"
    else:
        raise AssertionError("a block of 2 samples was read with a bound of 1")
