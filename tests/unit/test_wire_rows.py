"""The C reader of a batch's samples (collector/_wire_rows.c) reads the bytes as protobuf does, or
gives them back to protobuf (None): checked against protobuf's own reading of the same bytes, as
rows and as columns (collector/batch_rows.py)."""

import math
import struct
from array import array

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from xpusense.collector import _wire_rows, batch_rows
from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb


def _key(rows):
    """Rows compared bit for bit (a NaN equals itself, -0.0 is not 0.0)."""
    return [(ref, t, struct.pack("<d", v)) for ref, t, v in rows]


def _as_protobuf_reads(raw: bytes):
    return batch_rows.rows(pb.Batch.FromString(raw))


def _columns_agree(raw: bytes, expected) -> None:
    """columns(raw) says what the rows say: refs, their one time, values, whether refs rise."""
    refs, time, values, rising = _wire_rows.columns(raw)
    assert refs == tuple(r[0] for r in expected)
    times = {r[1] for r in expected}
    assert time == (times.pop() if len(times) == 1 else None)
    assert values == array("d", [r[2] for r in expected]).tobytes()
    assert rising == all(a[0] < b[0] for a, b in zip(expected, expected[1:]))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _long(n: int, width: int) -> bytes:
    """`n` (under 128) as a varint padded to `width` bytes: an overlong form."""
    return bytes([n | 0x80] + [0x80] * (width - 2) + [0])


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    if wire_type == 2:
        payload = _varint(len(payload)) + payload
    return _varint(number << 3 | wire_type) + payload


def _sample_wire(*fields: bytes) -> bytes:
    return _field(4, 2, b"".join(fields))


_doubles = st.floats(allow_nan=True, allow_infinity=True)
_samples = st.builds(
    dict,
    name=st.text(max_size=20), unit=st.sampled_from(["", "1", "By"]),
    kind=st.sampled_from([pb.GAUGE, pb.COUNTER, pb.HISTOGRAM]),
    labels=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    value=_doubles, time_unix_nano=st.integers(-2**63, 2**63 - 1), series_ref=st.integers(0, 2**32 - 1),
    histogram=st.none() | st.builds(lambda b, c: pb.Histogram(bounds=b, counts=c),
                                    st.lists(_doubles, max_size=3), st.lists(st.integers(0, 2**64 - 1), max_size=4)))


@settings(max_examples=300, deadline=None)
@given(samples=st.lists(_samples, max_size=12), events=st.integers(0, 2), seq=st.integers(0, 2**64 - 1))
def test_a_batch_is_read_as_protobuf_reads_it(samples, events, seq):
    b = pb.Batch(node_id="n1", boot_id="b1", seq=seq, sent_unix_nano=7)
    for s in samples:
        hist = s.pop("histogram")
        b.samples.add(**s)
        if hist is not None:
            b.samples[-1].histogram.CopyFrom(hist)
    for i in range(events):
        b.events.add(id=f"e{i}", type="xid", time_unix_nano=i)
    raw = b.SerializeToString()
    got = _wire_rows.rows(raw)
    assert got is not None
    assert _key(got) == _key(batch_rows.rows(b)) == _key(_as_protobuf_reads(raw))
    assert _key(batch_rows.rows(b, raw)) == _key(got)
    _columns_agree(raw, got)
    read = batch_rows.BatchRows(b, raw)
    assert list(read.refs) == [r[0] for r in got] and _key(read.rows()) == _key(got)
    slow = batch_rows.BatchRows(b)   # no bytes: protobuf's objects, rows only
    assert slow.time is None and not slow.rising and list(slow.refs) == list(read.refs)
    assert list(batch_rows.refs_of(b, raw)) == list(batch_rows.refs_of(b)) == list(read.refs)


def test_what_protobuf_reads_its_own_way_is_read_the_same():
    value = struct.pack("<d", 2.5)
    cases = {
        # a field given twice: the last one
        "repeated fields": _sample_wire(_field(8, 0, _varint(3)), _field(8, 0, _varint(4)),
                                        _field(5, 1, value), _field(5, 1, struct.pack("<d", -1.0))),
        # a uint32 sent as a longer varint: its low 32 bits
        "ref past 32 bits": _sample_wire(_field(8, 0, _varint(2**40 + 9))),
        # a negative int64: a 10-byte varint
        "negative time": _sample_wire(_field(6, 0, _varint((-5) & (2**64 - 1)))),
        # a known field number with another wire type: an unknown field
        "value as a varint": _sample_wire(_field(5, 0, _varint(77)), _field(8, 0, _varint(1))),
        "ref as fixed32": _sample_wire(_field(8, 5, b"\x01\x00\x00\x00"), _field(6, 0, _varint(5))),
        "time as bytes": _sample_wire(_field(6, 2, b"xyz"), _field(5, 1, value)),
        # unknown fields of every wire type but groups, in the sample and in the batch
        "unknown fields": (_field(99, 0, _varint(5)) + _field(98, 1, b"\0" * 8) + _field(97, 2, b"ab")
                           + _field(96, 5, b"\0" * 4)
                           + _sample_wire(_field(50, 2, b"q"), _field(8, 0, _varint(2)), _field(51, 5, b"1234"))),
        # samples with events and other batch fields between them, and an empty sample
        "interleaved": (_sample_wire(_field(8, 0, _varint(1))) + _field(5, 2, b"") + _field(1, 2, b"node")
                        + _sample_wire() + _field(3, 0, _varint(12)) + _sample_wire(_field(5, 1, value))),
        # samples as a field of another wire type: not samples
        "samples as a varint": _field(4, 0, _varint(3)) + _sample_wire(_field(8, 0, _varint(6))),
    }
    for what, raw in cases.items():
        got = _wire_rows.rows(raw)
        assert got is not None, what
        assert _key(got) == _key(_as_protobuf_reads(raw)), what
        _columns_agree(raw, got)


def test_bytes_it_does_not_read_are_left_to_protobuf():
    group = _varint(40 << 3 | 3) + _varint(40 << 3 | 4)
    cases = {
        "a group in a sample": _sample_wire(group),      # protobuf keeps it as an unknown field
        "a group in the batch": group + _sample_wire(_field(8, 0, _varint(1))),
        "field number 0": _sample_wire(_varint(0 << 3 | 0) + _varint(1)),
        "an 11-byte varint": _sample_wire(_varint(8 << 3 | 0) + b"\xff" * 10 + b"\x01"),
        "a sample past the end": _field(4, 2, b"\x40\x01")[:-1],
        "a length past the end": _varint(4 << 3 | 2) + _varint(100) + b"\x40\x01",
        "a value cut short": _sample_wire(_field(5, 1, b"\0" * 8))[:-2],
        "wire type 7": _sample_wire(_varint(9 << 3 | 7)),
    }
    for what, raw in cases.items():
        assert _wire_rows.rows(raw) is None and _wire_rows.columns(raw) is None, what
    raw = cases["a group in a sample"]
    b = pb.Batch.FromString(raw)   # read the slow way, as protobuf reads it
    assert batch_rows.rows(b, raw) == batch_rows.BatchRows(b, raw).rows() == [(0, 0, 0.0)]


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=64))
def test_any_bytes_are_read_as_protobuf_reads_them_or_given_back(raw):
    got = _wire_rows.rows(raw)
    try:
        expected = _as_protobuf_reads(raw)
    except Exception:   # not a Batch: never handed to the reader by the server; it must not crash
        return
    assert got is None or _key(got) == _key(expected)
    if got is not None:
        _columns_agree(raw, got)


def test_it_takes_any_bytes_like_object_and_refuses_others():
    raw = _sample_wire(_field(8, 0, _varint(5)), _field(5, 1, struct.pack("<d", math.pi)))
    assert _wire_rows.rows(memoryview(raw)) == _wire_rows.rows(bytearray(raw)) == [(5, 0, math.pi)]
    assert _wire_rows.columns(memoryview(raw))[0] == (5,)
    for read in (_wire_rows.rows, _wire_rows.columns):
        try:
            read("not bytes")
        except TypeError:
            pass
        else:
            raise AssertionError("a str was read as bytes")


def test_without_the_c_reader_the_samples_are_read_through_protobuf(monkeypatch):
    """A package installed where no C compiler was at hand (the extension is optional) reads the
    same rows and refs, through protobuf's objects."""
    b = pb.Batch(node_id="n1", boot_id="b1", seq=1)
    for ref in (3, 1, 2):
        b.samples.add(name="u", series_ref=ref, time_unix_nano=5, value=ref / 2)
    raw = b.SerializeToString()
    with_c = batch_rows.BatchRows(b, raw)
    monkeypatch.setattr(batch_rows, "_wire_rows", None)
    without = batch_rows.BatchRows(b, raw)
    assert without.time is None and not without.rising and without.values == b""
    assert list(without.refs) == list(with_c.refs) == [3, 1, 2] == list(batch_rows.refs_of(b, raw))
    assert without.rows() == with_c.rows() == batch_rows.rows(b, raw) == [(3, 5, 1.5), (1, 5, 0.5), (2, 5, 1.0)]


# -- lean_batch: a whole AgentMessage read strictly, before protobuf (collector/wire.py) -----------

def _message(b: pb.Batch) -> bytes:
    return pb.AgentMessage(batch=b).SerializeToString()


def _lean_agrees(raw: bytes, lean) -> None:
    """What lean_batch read is what protobuf reads of the same bytes."""
    m = pb.AgentMessage.FromString(raw)   # raises where protobuf refuses: lean_batch must not accept
    node, boot, seq, sent, wire, columns = lean
    b = m.batch
    assert m.WhichOneof("msg") == "batch" and not b.events
    assert (node, boot, seq, sent) == (b.node_id, b.boot_id, b.seq, b.sent_unix_nano)
    assert pb.Batch.FromString(wire) == b
    if b.columns:   # the compact encoding: its columns' bytes, and no sample carried whole
        assert columns.__class__ is bytes and columns == b.columns and not b.samples
    else:
        assert columns == _wire_rows.columns(wire)


@settings(max_examples=300, deadline=None)
@given(samples=st.lists(_samples, max_size=12), seq=st.integers(0, 2**64 - 1), sent=st.integers(-2**63, 2**63 - 1),
       node=st.text(max_size=12))
def test_a_batch_without_events_is_read_lean(samples, seq, sent, node):
    b = pb.Batch(node_id=node, boot_id="b1", seq=seq, sent_unix_nano=sent)
    for s in samples:
        b.samples.add(**{k: v for k, v in s.items() if v is not None})
    raw = _message(b)
    lean = _wire_rows.lean_batch(raw)
    assert lean is not None
    _lean_agrees(raw, lean)
    b.events.add(id="e1", type="xid")
    assert _wire_rows.lean_batch(_message(b)) is None   # events: parsed by protobuf


_VALID = _message(pb.Batch(node_id="n1", boot_id="b1", seq=3, samples=[
    pb.Sample(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, labels={"device": "0", "vendor": "nvidia"},
              value=0.5, time_unix_nano=10, series_ref=1),
    pb.Sample(name="xpusense.network.tcp.rtt", kind=pb.HISTOGRAM, time_unix_nano=10, series_ref=2,
              histogram=pb.Histogram(bounds=[1.0, 2.0], counts=[1, 2, 3], sum=4.0, count=6))]))


_VALID_COMPACT = _message(pb.Batch(node_id="n1", boot_id="b1", seq=3, sent_unix_nano=9,
                                   columns=compact.encode_columns([(1, 10, 0.5), (2, 10, 1.5)])))


@settings(max_examples=1500, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 2), st.integers(0, len(_VALID) - 1), st.integers(0, 255)),
                      min_size=1, max_size=3), valid=st.sampled_from([_VALID, _VALID_COMPACT]))
def test_lean_batch_never_accepts_what_protobuf_refuses(edits, valid):
    raw = bytearray(valid)
    for op, at, byte in edits:
        at %= max(1, len(raw))
        if op == 0 and raw:
            raw[at] = byte
        elif op == 1 and raw:
            del raw[at]
        else:
            raw.insert(at, byte)
    raw = bytes(raw)
    lean = _wire_rows.lean_batch(raw)
    if lean is not None:
        _lean_agrees(raw, lean)


def test_lean_batch_gives_back_what_it_does_not_check_whole():
    def batch(*fields: bytes) -> bytes:
        return _field(2, 2, b"".join(fields))

    def sample(*fields: bytes) -> bytes:
        return _field(4, 2, b"".join(fields))

    label = _field(4, 2, _field(1, 2, b"device") + _field(2, 2, b"\xed\xa0\x80"))   # a surrogate
    refused = {   # protobuf refuses these too: the stream gets its usual error
        "a surrogate in a label": batch(sample(label)),
        "an overlong name": batch(sample(_field(1, 2, b"\xc0\xaf"))),
        "past U+10FFFF in the node id": batch(_field(1, 2, b"\xf4\x90\x80\x80")),
        "a cut UTF-8 sequence in the unit": batch(sample(_field(2, 2, b"ab\xe2\x82"))),
        "a packed count cut short": batch(sample(_field(7, 2, _field(2, 2, b"\x01\x80")))),
        # a length takes at most 5 varint bytes (a 32-bit size) in protobuf, overlong or not
        "a label key's length in 6 bytes": batch(sample(_field(4, 2, b"\x0a" + _long(6, 6) + b"device" + _field(2, 2, b"0")))),
        "the batch's length in 10 bytes": _varint(2 << 3 | 2) + _long(2, 10) + _field(3, 0, b"\x01"),
        "a sample's length in 7 bytes": batch(_varint(4 << 3 | 2) + _long(2, 7) + _field(8, 0, b"\x07")),
    }
    for what, raw in refused.items():
        assert _wire_rows.lean_batch(raw) is None, what
        with pytest.raises(DecodeError):
            pb.AgentMessage.FromString(raw)
    given_back = {   # protobuf reads these: the long way
        "an unknown field in a sample": batch(sample(_field(50, 0, _varint(1)))),
        "an unknown field in the batch": batch(_field(9, 0, _varint(1))),
        "a known field with another wire type": batch(sample(_field(5, 0, _varint(1)))),
        "a tag in two bytes": batch(sample(bytes([8 << 3 | 0x80, 0x00]) + _varint(1))),   # series_ref, padded
        "packed bounds of 7 bytes": batch(sample(_field(7, 2, _field(1, 2, b"\0" * 7)))),
        "an event": batch(_field(5, 2, _field(1, 2, b"e1"))),
        "a field after the batch": batch() + _field(10, 0, _varint(1)),
        "a hello": _field(1, 2, _field(1, 2, b"n1")),
    }
    for what, raw in given_back.items():
        assert _wire_rows.lean_batch(raw) is None, what
        try:
            pb.AgentMessage.FromString(raw)
        except DecodeError:   # protobuf may refuse some: either way not read lean
            pass
    # A length in 5 varint bytes, overlong: protobuf reads it, and so does lean_batch.
    raw = batch(_varint(1 << 3 | 2) + _long(2, 5) + b"n5", sample(_field(8, 0, b"\x07")))
    lean = _wire_rows.lean_batch(raw)
    assert lean is not None and lean[0] == "n5"
    _lean_agrees(raw, lean)
    # A label map entry that is only a value, a field given twice: read as protobuf reads them.
    raw = batch(_field(1, 2, b"a"), _field(1, 2, b"n2"), sample(_field(4, 2, _field(2, 2, b"v")), _field(8, 0, b"\x07")))
    lean = _wire_rows.lean_batch(raw)
    assert lean is not None and lean[0] == "n2" and lean[5][0] == (7,)
    _lean_agrees(raw, lean)


# -- a batch in the compact encoding (Batch.columns), read lean to its columns' bytes ------------

def _compact_message(**fields) -> bytes:
    return _message(pb.Batch(**fields))


@settings(max_examples=300, deadline=None)
@given(columns=st.binary(min_size=1, max_size=40), seq=st.integers(0, 2**64 - 1), sent=st.integers(-2**63, 2**63 - 1),
       node=st.text(max_size=12), boot=st.text(max_size=12))
def test_a_compact_batch_is_read_lean_to_its_columns_bytes(columns, seq, sent, node, boot):
    raw = _compact_message(node_id=node, boot_id=boot, seq=seq, sent_unix_nano=sent, columns=columns)
    lean = _wire_rows.lean_batch(raw)
    assert lean is not None and lean[5] == columns
    _lean_agrees(raw, lean)
    assert _wire_rows.lean_batch_wire(lean[4]) == lean
    assert _wire_rows.lean_batch(_compact_message(node_id=node, columns=columns, events=[pb.Event(id="e")])) is None


def test_a_compact_batch_lean_batch_does_not_read_whole_goes_to_protobuf():
    def batch(*fields: bytes) -> bytes:
        return _field(2, 2, b"".join(fields))

    ref = _field(4, 2, _field(8, 0, _varint(1)))   # a sample carried whole
    cols = _field(7, 2, b"\x78\x9c")
    given_back = {   # protobuf reads them: the long way (its Batch, then wire.compact_batch)
        "columns and then a sample": batch(cols, ref),
        "a sample and then columns": batch(ref, cols),
        "an empty sample beside columns": batch(cols, _field(4, 2, b"")),
        "columns as a varint": batch(_field(7, 0, _varint(5))),
    }
    for what, raw in given_back.items():
        assert _wire_rows.lean_batch(raw) is None, what
        pb.AgentMessage.FromString(raw)
    # columns' length in 6 varint bytes: protobuf refuses it, and lean_batch does not accept it
    raw = batch(_varint(7 << 3 | 2) + _long(2, 6) + b"xy")
    assert _wire_rows.lean_batch(raw) is None
    with pytest.raises(DecodeError):
        pb.AgentMessage.FromString(raw)
    # given twice: the last one, as protobuf reads it; an empty last one is no columns at all
    for fields, want in (((b"first", b"last"), b"last"), ((b"first", b"", ref), ((1,), 0, bytes(8), True))):
        raw = batch(_field(1, 2, b"n1"), *(f if f is ref else _field(7, 2, f) for f in fields))
        lean = _wire_rows.lean_batch(raw)
        assert lean is not None and lean[5] == want, fields
        _lean_agrees(raw, lean)


def _stored(st) -> dict:
    """Every series' latest value, time, histogram and whole history, by node, name and labels."""
    out = {}
    for n in st.view().nodes:
        for s in n.series:
            h = st.history(n.node_id, s.name, dict(s.labels))
            out[(n.node_id, s.name, tuple(sorted(s.labels.items())))] = (
                s.unit, s.kind, s.value, s.time_unix_nano, s.histogram.SerializeToString(),
                [(p.time_unix_nano, p.value) for p in h.points])
    return out


def _stream(encodings: list[str]):
    """A real collector's Ingest servicer (fleet state, limits, no store) and one node's stream of it,
    whose Hello offered the compact encoding."""
    import asyncio

    from xpusense.collector.limits import Limits
    from xpusense.collector.server import IngestServicer
    from xpusense.collector.state import FleetState
    servicer = IngestServicer(FleetState(), limits=Limits(), batch_encodings=encodings)
    hello = pb.Hello(node_id="n1", boot_id="boot-1", batch_encodings=[compact.ENCODING])
    return servicer, asyncio.run(servicer.open(hello, "peer", None))


def _ingest(servicer, sink, raw: bytes, parse):
    from xpusense.collector.wire import batch_payload
    msg = parse(raw)
    payload = batch_payload(msg)
    b = msg.batch
    return msg, servicer.batch_refused(b, "n1", sink.welcome, "peer") or sink.take_now(b, payload)


def test_compact_batches_read_lean_are_stored_as_protobuf_reads_them_and_refused_alike():
    from compact_support import as_compact, rounds

    from xpusense.collector.limits import Violation
    from xpusense.collector.wire import CompactWire, LeanMessage, parse_agent_message, read_batch

    lean_side, protobuf_side = _stream([compact.ENCODING]), _stream([compact.ENCODING])
    read_lean = 0
    for b in rounds():
        cb, defs = as_compact(b)
        raw = _message(cb)
        got = []
        for (servicer, sink), parse in ((lean_side, parse_agent_message), (protobuf_side, pb.AgentMessage.FromString)):
            assert sink.series(pb.SeriesTable(boot_id="boot-1", defs=compact.encode_defs(defs))) is None
            got.append(_ingest(servicer, sink, raw, parse))
            assert got[-1][1].__class__ is pb.Ack and got[-1][1].seq == b.seq and not got[-1][1].duplicate, got
        msg = got[0][0]
        if not b.events and all(s.series_ref for s in b.samples):   # what the C reader reads whole
            assert msg.__class__ is LeanMessage and msg.batch.__class__ is CompactWire
            assert msg.batch._batch is None   # stored without protobuf's parse of the Batch
            assert read_batch(cb.SerializeToString()).__class__ is CompactWire
            read_lean += 1
    assert read_lean == 5
    want = _stored(protobuf_side[0].state)
    assert len(want) == 9 and _stored(lean_side[0].state) == want
    # refused as they were: where the Welcome did not choose the encoding, a ref with no definition,
    # columns that do not decode; nothing of them stored
    cb, defs = as_compact(rounds(t0=9_000 * 10**9)[0])
    cb.seq = 50
    plain = _stream([])
    cases = [(plain, cb, "INVALID_ARGUMENT", "in the compact encoding on a stream whose Welcome chose ''"),
             (_stream([compact.ENCODING]), cb, "FAILED_PRECONDITION", "no definition for series_ref 1 of node 'n1'")]
    bad = pb.Batch()
    bad.CopyFrom(cb)
    bad.columns = cb.columns[:-3]
    cases.append((lean_side, bad, "INVALID_ARGUMENT", "batch 50 of boot boot-1 refused: .*cut short"))
    import re
    for (servicer, sink), batch, code, why in cases:
        msg, got = _ingest(servicer, sink, _message(batch), parse_agent_message)
        assert msg.batch.__class__ is CompactWire
        assert got.__class__ is Violation and got.code.name == code and re.search(why, got.message), got
        assert servicer.state.nodes["n1"].stored_up_to.get("boot-1", 0) < 50
    assert _stored(lean_side[0].state) == want
