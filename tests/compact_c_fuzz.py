"""Fuzz driver of the compact encoding's C reader (common/_compact.c), run in a subprocess against a
build with AddressSanitizer and UBSan (tests/unit/test_wire_rows_sanitized.py): valid blocks mutated
as compressed bytes and as inflated bytes recompressed, header counts at their bounds, zlib bombs,
each read from bytes and from an exact-size malloc'd buffer, against decode_columns read in Python;
and its deflate, with and without a preset dictionary, at each level, against zlib's own.
    python tests/compact_c_fuzz.py MODULE.so SECONDS SEED LAST_INPUT_FILE [HEX MAX_SAMPLES]
Prints its counts as JSON; exit 1 with the input's hex on a disagreement (HEX: that one input)."""

from __future__ import annotations

import ctypes
import json
import mmap
import random
import struct
import sys
import time
import zlib
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "unit")]
from fuzzing import Mutator  # noqa: E402
from test_compact_fuzz import _columns_corpus, _header_edits  # noqa: E402
from wire_rows_fuzz import _libc, load  # noqa: E402

from xpusense.common import compact  # noqa: E402

MIN_INPUTS = 4000
BOUNDS = (0, 1, 3, 40, 41, 10_000)


def _key(c) -> tuple:
    hists = {i: ([struct.pack("<d", b) for b in bounds], counts) for i, (bounds, counts) in c[5].items()}
    return c[0], c[1], c[2], c[3], c[4], hists, c[6]


class Driver:
    def __init__(self, module, last_input: str):
        self.m = module
        self.counts = dict.fromkeys(("inputs", "read", "refused", "like_last", "deflated"), 0)
        self._f = open(last_input, "r+b")
        self._last = mmap.mmap(self._f.fileno(), 0)

    def check(self, data: bytes, max_samples: int, last: compact.Columns | None) -> None:
        n = min(len(data), len(self._last) - 4)
        self._last[:4] = n.to_bytes(4, "little")
        self._last[4:4 + n] = data[:n]
        self.counts["inputs"] += 1
        deltas = None if last is None else last.ref_deltas
        got = self.m.decode(data, max_samples, deltas)
        ptr = _libc.malloc(len(data) or 1)
        try:
            ctypes.memmove(ptr, data, len(data))
            exact = self.m.decode((ctypes.c_char * len(data)).from_address(ptr), max_samples, deltas)
        finally:
            _libc.free(ptr)
        assert (got is None) == (exact is None) and (got is None or _key(got) == _key(exact)), \
            "another reading from a buffer than from bytes"
        try:
            want = compact.decode_columns_python(data, max_samples, last)
        except compact.CompactError:
            assert got is None, f"read a block Python refuses (max_samples {max_samples})"
            self.counts["refused"] += 1
            return
        assert got is not None, f"refused a block Python reads (max_samples {max_samples})"
        self.counts["read"] += 1
        refs, rising = got[0], got[4]
        if refs is None:
            assert last is not None and want.refs is last.refs, "refs taken from a last block not alike"
            refs, rising = last.refs, last.rising
            self.counts["like_last"] += 1
        w = (want.refs, want.time, want.times, want.values, want.rising, want.histograms, want.ref_deltas)
        assert _key((refs, got[1], got[2], got[3], rising, got[5], got[6])) == _key(w), "read otherwise than Python"

    def deflate(self, raw: bytes, level: int, zdict: bytes) -> None:
        """The C deflate gives zlib's bytes, which inflate back to `raw`."""
        self.counts["deflated"] += 1
        got = self.m.deflate(raw, level, zdict)
        z = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS, 8, zlib.Z_DEFAULT_STRATEGY, *([zdict] if zdict else []))
        assert got == z.compress(raw) + z.flush(), f"deflated otherwise than zlib (level {level}, dictionary {len(zdict)} bytes)"
        back = zlib.decompressobj(zdict=zdict) if zdict else zlib.decompressobj()
        assert back.decompress(got) == raw and back.eof, "deflated bytes that do not inflate back"


def main(argv: list[str]) -> int:
    module = load(argv[1], "_compact")
    budget_s, seed, last_input = float(argv[2]), int(argv[3]), argv[4]
    d = Driver(module, last_input)
    for wrong in ((None, 1, None), ("text", 1, None), (b"", "x", None), (b"",)):   # a TypeError, nothing read
        try:
            module.decode(*wrong)
        except TypeError:
            continue
        raise AssertionError(f"decode{wrong!r} raised no TypeError")
    for wrong in ((None, 6), (b"", "x"), (b"", 6, "text"), (b"",)):
        try:
            module.deflate(*wrong)
        except TypeError:
            continue
        raise AssertionError(f"deflate{wrong!r} raised no TypeError")
    if len(argv) > 5:
        inputs = [(bytes.fromhex(argv[5]), int(argv[6]), None)]
    else:
        corpus = _columns_corpus()
        inputs = [(c, m, None) for c in corpus for m in BOUNDS]
        inputs += [(zlib.compress(bytes(n), 9), m, None) for n in (17, 4153, 1 << 16, 64 << 20) for m in (0, 1, 100, 10_000)]
    rng = random.Random(seed)
    compressed = Mutator(_columns_corpus(), seed)
    inflated = Mutator([zlib.decompress(c) for c in _columns_corpus()], seed + 1)
    lasts = [None] + [compact.decode_columns_python(c, 100) for c in _columns_corpus()]
    deadline = time.monotonic() + budget_s
    data = b""
    try:
        for data, m, last in inputs:
            d.check(data, m, last)
        k = 0
        while len(argv) <= 5 and (time.monotonic() < deadline or d.counts["inputs"] < MIN_INPUTS):
            for _ in range(100):
                k += 1
                raw = inflated() if k % 2 else _header_edits(rng.choice(inflated.corpus), rng)
                for data in (compressed(), zlib.compress(raw, rng.choice([0, 1, 6, 9]))):
                    d.check(data, rng.choice(BOUNDS), rng.choice(lasts))
                if k % 10 == 0:   # the same raw bytes deflated alone and on a dictionary, at levels that differ
                    d.deflate(raw, rng.choice([0, 1, 6, 6, 9]), rng.choice([b"", raw[::-1], rng.randbytes(40_000)]))
    except AssertionError as e:
        print(f"FUZZ FAILURE: {e}; input {data.hex()}", file=sys.stderr)
        return 1
    print(json.dumps(d.counts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
