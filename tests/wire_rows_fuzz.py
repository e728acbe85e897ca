"""Fuzz driver of the C batch reader (collector/_wire_rows.c), run in a subprocess against a build
with AddressSanitizer and UBSan (tests/unit/test_wire_rows_sanitized.py): valid batches and agent
messages, mutated (tests/fuzzing.py), through every entry point, each from bytes and from an exact-
size malloc'd buffer; what the reader accepts is checked against protobuf's reading of the same bytes.
    python tests/wire_rows_fuzz.py MODULE.so SECONDS SEED LAST_INPUT_FILE [HEX]
Prints its counts as JSON; exit 1 with the input's hex on a disagreement (HEX: that one input)."""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import json
import mmap
import struct
import sys
import time
from array import array
from pathlib import Path

from google.protobuf.message import DecodeError

from xpusense.v1 import telemetry_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))   # run as a script: tests/ for its helpers
from fuzzing import Mutator  # noqa: E402

MIN_INPUTS = 4000
_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


def load(path: str, name: str = "_wire_rows"):
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def corpus() -> list[bytes]:
    """Valid Batches (samples, histograms, labels, events, unicode, extremes) and AgentMessages."""
    batches = [pb.Batch()]
    b = pb.Batch(node_id="gpu-node-ü", boot_id="b00t-€", seq=2**64 - 1, sent_unix_nano=-1)
    b.samples.add(name="gpu.utilization", unit="1", kind=pb.GAUGE, value=0.5, time_unix_nano=10**18,
                  series_ref=1, labels={"gpu": "0", "模型": "𝄞"})
    b.samples.add(name="x", value=float("nan"), time_unix_nano=-2**63, series_ref=2**32 - 1)
    b.samples.add(value=-0.0, time_unix_nano=2**63 - 1, series_ref=3)
    b.samples.add(value=float("-inf"))
    h = b.samples.add(name="lat", unit="s", kind=pb.HISTOGRAM, value=3.5, time_unix_nano=5, series_ref=4)
    h.histogram.bounds.extend([0.1, 1.0, float("inf")])
    h.histogram.counts.extend([1, 2, 3, 2**64 - 1])
    h.histogram.sum, h.histogram.count = 3.5, 9
    batches.append(b)
    r = pb.Batch(node_id="n", boot_id="b", seq=7, sent_unix_nano=1_700_000_000_000_000_000)
    for i in range(40):   # a tier's round: one time, rising refs
        r.samples.add(name=f"m{i % 5}", kind=pb.COUNTER, value=i * 1.25, time_unix_nano=1_700_000_000_000_000_000,
                      series_ref=i + 1, labels={"device": str(i % 8)})
    batches.append(r)
    e = pb.Batch(node_id="n", boot_id="b", seq=1)
    e.samples.add(value=1.0, series_ref=9, time_unix_nano=3)
    e.events.add(id="e1", type="xid", severity="critical", device="0", message="Xid 79 ☠", attributes={"xid": "79"})
    batches.append(e)
    batches.append(pb.Batch(node_id="n", boot_id="b", seq=2, columns=b"\x78\x9c\x03\x00\x00\x00\x00\x01"))
    batches.append(pb.Batch(node_id="n-ü", boot_id="b", seq=3, sent_unix_nano=5, columns=bytes(range(40))))
    both = pb.Batch(node_id="n", boot_id="b", seq=4, columns=b"\x78\x9c")   # given back: protobuf's
    both.samples.add(value=2.0, time_unix_nano=3)
    batches.append(both)
    raw = [x.SerializeToString() for x in batches]
    messages = [pb.AgentMessage(batch=x).SerializeToString() for x in batches]
    messages.append(pb.AgentMessage(hello=pb.Hello(node_id="n", boot_id="b")).SerializeToString())
    messages.append(pb.AgentMessage(series=pb.SeriesTable(boot_id="b", defs=b"\x78\x9c\x03\x00")).SerializeToString())
    return raw + messages


def _key(rows) -> list:
    """Rows compared bit for bit (a NaN equals itself, -0.0 is not 0.0)."""
    return [(ref, t, struct.pack("<d", v)) for ref, t, v in rows]


def _protobuf_rows(batch) -> list:
    return [(s.series_ref, s.time_unix_nano, s.value) for s in batch.samples]


def _check_columns(cols, rows) -> None:
    refs, one_time, values, rising = cols
    assert refs == tuple(r[0] for r in rows), "columns' refs"
    times = {r[1] for r in rows}
    assert one_time == (times.pop() if len(times) == 1 else None), "columns' one time"
    assert values == array("d", [r[2] for r in rows]).tobytes(), "columns' values"
    assert rising == all(a[0] < b[0] for a, b in zip(rows, rows[1:])), "columns' rising"


def _check_lean(got, batch, own: bytes | None) -> None:
    """A lean reading of a Batch that protobuf reads as `batch`: ids, seq, sent time, the Batch's
    bytes and its samples' columns as protobuf has them (a compact batch: its Batch.columns)."""
    node, boot, seq, sent, wire, cols = got
    assert (node, boot, seq, sent) == (batch.node_id, batch.boot_id, batch.seq, batch.sent_unix_nano), "ids/seq/sent"
    assert not batch.events, "lean accepted a batch with events"
    again = pb.Batch.FromString(wire)
    assert again.SerializeToString(deterministic=True) == batch.SerializeToString(deterministic=True), "batch bytes"
    if batch.columns:
        assert not batch.samples, "lean accepted a batch with samples and compact columns"
        assert cols.__class__ is bytes and cols == batch.columns, "compact columns' bytes"
    else:
        _check_columns(cols, _protobuf_rows(batch))
    if own is not None:
        assert wire == own, "lean_batch_wire's bytes are not its input"


def _parse(cls, data: bytes):
    try:
        return cls.FromString(data)
    except DecodeError:
        return None


class Driver:
    def __init__(self, module, last_input: str):
        self.m = module
        self.counts = dict.fromkeys(("inputs", "rows", "protobuf_batches", "lean_batch", "lean_batch_wire", "rows_checked",
                                     "lean_compact"), 0)
        self._f = open(last_input, "r+b")
        self._last = mmap.mmap(self._f.fileno(), 0)

    def _exact(self, data: bytes):
        """`data` in a malloc'd buffer of exactly its size (a read past it is a heap overflow)."""
        ptr = _libc.malloc(len(data) or 1)
        ctypes.memmove(ptr, data, len(data))
        return ptr, (ctypes.c_char * len(data)).from_address(ptr)

    def _read(self, buf) -> tuple:
        m = self.m
        rows, cols = m.rows(buf), m.columns(buf)
        assert (rows is None) == (cols is None), "rows and columns disagree on reading"
        if rows is not None:
            _check_columns(cols, rows)
        return (None if rows is None else _key(rows)), cols, m.lean_batch(buf), m.lean_batch_wire(buf)

    def check(self, data: bytes) -> None:
        n = min(len(data), len(self._last) - 4)
        self._last[:4] = n.to_bytes(4, "little")
        self._last[4:4 + n] = data[:n]
        self.counts["inputs"] += 1
        ptr, exact = self._exact(data)
        try:
            from_exact = self._read(exact)
        finally:
            _libc.free(ptr)
        rows, cols, lean, lean_wire = self._read(data)
        assert from_exact[:2] == (rows, cols), "another reading from a buffer than from bytes"
        assert from_exact[2:] == (lean, lean_wire), "lean readings differ between a buffer and bytes"
        batch = _parse(pb.Batch, data)
        self.counts["protobuf_batches"] += batch is not None
        if rows is not None:
            self.counts["rows"] += 1
            if batch is not None:
                assert rows == _key(_protobuf_rows(batch)), "rows differ from protobuf's"
                self.counts["rows_checked"] += 1
        if lean_wire is not None:
            self.counts["lean_batch_wire"] += 1
            assert batch is not None, "lean_batch_wire read bytes protobuf refuses"
            _check_lean(lean_wire, batch, data)
        if lean is not None:
            self.counts["lean_batch"] += 1
            self.counts["lean_compact"] += lean[5].__class__ is bytes
            message = _parse(pb.AgentMessage, data)
            assert message is not None, "lean_batch read bytes protobuf refuses"
            assert message.WhichOneof("msg") == "batch", "lean_batch read a message that holds no batch"
            _check_lean(lean, message.batch, None)
            assert self.m.lean_batch_wire(lean[4]) == lean, "lean_batch and lean_batch_wire differ"


def main(argv: list[str]) -> int:
    module = load(argv[1])
    budget_s, seed, last_input = float(argv[2]), int(argv[3]), argv[4]
    d = Driver(module, last_input)
    for wrong in (None, 5, "text", [1]):   # not a buffer: a TypeError, nothing read
        for entry in (module.rows, module.columns, module.lean_batch, module.lean_batch_wire):
            try:
                entry(wrong)
            except TypeError:
                continue
            raise AssertionError(f"{entry.__name__}({wrong!r}) raised no TypeError")
    inputs = [bytes.fromhex(argv[5])] if len(argv) > 5 else corpus()
    mutate = Mutator(inputs, seed)
    deadline = time.monotonic() + budget_s
    data = b""
    try:
        for data in inputs:
            d.check(data)
        # the time budget, and at least MIN_INPUTS however slow the machine (when fuzzing the corpus)
        while time.monotonic() < deadline or (len(argv) <= 5 and d.counts["inputs"] < MIN_INPUTS):
            for _ in range(200):
                data = mutate()
                d.check(data)
    except AssertionError as e:
        print(f"FUZZ FAILURE: {e}; input {data.hex()}", file=sys.stderr)
        return 1
    print(json.dumps(d.counts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
