"""The Ingest stream's requests as they came on the wire: a batch is kept (the single collector's
durable store) or published (a cluster gateway) in the bytes the agent sent, not serialized again,
and the usual batch is read by a C reader (`_wire_rows`) rather than parsed by protobuf, a batch in
the compact encoding too (`CompactWire`), then read from its columns (`compact_batch`).
"""

from __future__ import annotations

from array import array
from typing import Any

import grpc

from xpusense.common import compact
from xpusense.common.compact_chain import with_columns
from xpusense.v1 import telemetry_pb2 as pb

from .limits import DEFAULTS as LIMITS
from .series_dictionary import Expanded, SeriesDictionary

try:   # built with the package where a C compiler was at hand (pyproject.toml ext-modules)
    from . import _wire_rows
except ImportError:
    _wire_rows = None  # type: ignore[assignment]

INGEST_SERVICE = pb.DESCRIPTOR.services_by_name["Ingest"].full_name
_BATCH_TAG = 0x12   # field 2 (batch), length-delimited


# An AgentMessage holding a batch is the Batch's own encoding after a tag (field 2, length-delimited)
# and a length, so those bytes are a slice of what was received. `parse_agent_message`, the Ingest
# stream's request deserializer, keeps the bytes of the message it parsed last, with the message
# itself (so that `batch_wire` can tell it is handed that very message, never a later one with a
# recycled id). A stream's reader takes them as soon as its `async for` hands over the message,
# before it awaits anything, so no other stream's message is parsed in between; taking them lets
# them go (at most one message's bytes are held beyond that: the last one parsed, until the next).
class _Received:
    __slots__ = ("raw", "msg")

    def __init__(self) -> None:
        self.raw: bytes = b""
        self.msg: pb.AgentMessage | None = None


_received = _Received()


class _ReadLean:
    """A Batch the C reader read from its bytes (`wire`), which it checked whole as protobuf would:
    node_id, boot_id, seq, sent_unix_nano, no events, and `columns`. Any other attribute is the
    whole Batch's, parsed from `wire` on first use."""
    __slots__ = ("node_id", "boot_id", "seq", "sent_unix_nano", "wire", "columns", "_batch")
    events: tuple = ()

    def __init__(self, node_id: str, boot_id: str, seq: int, sent_unix_nano: int, wire: bytes,
                 columns: Any) -> None:
        self.node_id, self.boot_id, self.seq, self.sent_unix_nano = node_id, boot_id, seq, sent_unix_nano
        self.wire, self.columns = wire, columns
        self._batch: pb.Batch | None = None

    def parsed(self) -> pb.Batch:
        if self._batch is None:
            self._batch = pb.Batch.FromString(self.wire)
        return self._batch

    def SerializeToString(self) -> bytes:   # noqa: N802 (protobuf's name)
        return self.wire

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parsed(), name)


class WireBatch(_ReadLean):
    """A Batch of samples as the C reader read it: `columns` are its samples' (batch_rows.BatchRows);
    `samples` the whole Batch's."""
    __slots__ = ()
    columns: tuple

    @property
    def samples(self) -> Any:
        return self.parsed().samples


class CompactWire(_ReadLean):
    """A Batch in the compact encoding as the C reader read it: `columns` the bytes of its
    Batch.columns (for compact_batch to decode), no sample carried whole (the C reader leaves a
    batch with both to protobuf)."""
    __slots__ = ()
    columns: bytes
    samples: tuple = ()


def with_ids(b: Any, payload: bytes, node_id: str, boot_id: str) -> tuple[Any, bytes]:
    """A batch that left out its stream's node id (and boot id: the compact encoding's version 2
    sends them in the Hello only), with them set, and the bytes it would have come as: theirs
    first, as protobuf writes fields in order, so what is kept is what an agent sending them sends."""
    head = pb.Batch(node_id=node_id, boot_id="" if b.boot_id else boot_id).SerializeToString()
    b.node_id, b.boot_id = node_id, b.boot_id or boot_id
    if isinstance(b, _ReadLean):
        b.wire, b._batch = head + b.wire, None
    return b, head + payload


def with_block(b: Any, payload: bytes, block: bytes) -> tuple[Any, bytes]:
    """A batch with its columns replaced by `block` (a chained block deflated alone again,
    common/compact_chain.py), and the bytes it would have come as."""
    # A CompactWire's fields are the ones the C reader checked (ids, seq, sent time, columns): its
    # columns found at its end need no walk over its fields.
    payload = with_columns(payload, block, old=b.columns if b.__class__ is CompactWire else b"")
    b.columns = block
    if isinstance(b, _ReadLean):
        b.wire, b._batch = payload, None
    return b, payload


def _lean(read: tuple) -> WireBatch | CompactWire:
    return CompactWire(*read) if read[5].__class__ is bytes else WireBatch(*read)


class CompactBatch:
    """A Batch in the compact encoding (`Batch.columns`, common/compact.py) as ingest reads it:
    node_id, boot_id, seq, sent_unix_nano and events of the Batch; `columns` (refs, time, values,
    rising, as a WireBatch's) of its samples, the columns' rows then the samples it carries whole;
    `samples` (series_dictionary.Expanded) each built from its series' definition only when read."""
    __slots__ = ("batch", "node_id", "boot_id", "seq", "sent_unix_nano", "events", "columns", "samples",
                 "_decoded")

    def __init__(self, batch: pb.Batch | CompactWire, decoded: compact.Columns, held: dict[int, pb.Sample]) -> None:
        self.batch, self._decoded = batch, decoded
        self.node_id, self.boot_id, self.seq = batch.node_id, batch.boot_id, batch.seq
        self.sent_unix_nano, self.events = batch.sent_unix_nano, batch.events
        whole = batch.samples
        self.samples = Expanded(held, decoded, whole)
        if not whole:
            self.columns = (decoded.refs, decoded.time, decoded.values, decoded.rising)
            return
        refs = decoded.refs + tuple(s.series_ref for s in whole)
        times = decoded.times + [s.time_unix_nano for s in whole]
        values = decoded.values + array("d", [s.value for s in whole]).tobytes()
        one = times[0] if times.count(times[0]) == len(times) else None
        self.columns = (refs, one, values, all(a < b for a, b in zip(refs, refs[1:])))

    def rows(self) -> list[tuple[int, int, float]]:
        """(series_ref, time, value) of each sample, in order (`samples`' order)."""
        return self._decoded.rows() + [(s.series_ref, s.time_unix_nano, s.value) for s in self.batch.samples]

    def SerializeToString(self) -> bytes:   # noqa: N802 (protobuf's name)
        return self.batch.SerializeToString()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.batch, name)


def compact_batch(batch: pb.Batch | CompactWire, dictionary: SeriesDictionary,
                  max_samples: int = int(LIMITS["max_samples_per_batch"])) -> CompactBatch:
    """A compact batch (`batch.columns` set) read against its node's and boot's definitions, as
    ingest, the store's replay and readers take it. compact.CompactError where its columns do not
    decode (or hold more than `max_samples`); series_dictionary.MissingDefinition where a ref of
    them has no definition."""
    decoded = dictionary.columns(batch.node_id, batch.boot_id, batch.columns, max_samples)
    return CompactBatch(batch, decoded, dictionary.definitions(batch.node_id, batch.boot_id))


class LeanMessage:
    """An AgentMessage holding a WireBatch or CompactWire, as the Ingest stream's readers use one;
    anything else they might read (`hello` of a batch sent first...) is the whole AgentMessage's,
    parsed then."""
    __slots__ = ("batch",)

    def __init__(self, batch: WireBatch | CompactWire) -> None:
        self.batch = batch

    def WhichOneof(self, group: str) -> str:   # noqa: N802 (protobuf's name)
        if group != "msg":
            raise ValueError(f"no oneof {group!r} in AgentMessage")
        return "batch"

    def HasField(self, name: str) -> bool:   # noqa: N802 (protobuf's name)
        return name in ("batch", "msg") or self.whole().HasField(name)

    def whole(self) -> pb.AgentMessage:
        m = pb.AgentMessage()
        m.batch.CopyFrom(self.batch.parsed())
        return m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.whole(), name)


def parse_agent_message(raw: bytes) -> pb.AgentMessage | LeanMessage:
    """A batch without events that the C reader accepts whole: a LeanMessage. Anything else:
    AgentMessage.FromString, keeping `raw` for batch_wire. The C reader checks every field of the
    usual batch as protobuf would and reads its ids, seq and samples' columns in one pass (of a
    compact batch, its columns' bytes: a CompactWire); the WireBatch parses the whole Batch only
    when something reads more than that (a new series' name and labels, an exporter's samples).
    Bytes it does not accept whole are parsed by protobuf, which refuses what it always refused."""
    if _wire_rows is not None and raw[:1] == b"\x12" and (lean := _wire_rows.lean_batch(raw)) is not None:
        _received.raw, _received.msg = b"", None   # what an earlier message left: not held on
        return LeanMessage(_lean(lean))
    m = pb.AgentMessage.FromString(raw)
    _received.raw, _received.msg = raw, m
    return m


def read_batch(data: bytes) -> WireBatch | CompactWire | pb.Batch:
    """A Batch's own bytes (a message of a cluster's stream): a WireBatch or CompactWire where the C
    reader accepts them whole, else protobuf's Batch (DecodeError where protobuf refuses them)."""
    if _wire_rows is not None and (lean := _wire_rows.lean_batch_wire(data)) is not None:
        return _lean(lean)
    return pb.Batch.FromString(data)


def batch_wire(msg: pb.AgentMessage | LeanMessage) -> bytes | None:
    """The Batch of `msg` in the bytes it came in: a LeanMessage's own; else when `msg` is the
    message parsed last and those bytes are exactly tag + length + batch; else None. Lets go of the
    bytes held either way."""
    if msg.__class__ is LeanMessage:
        return msg.batch.wire
    raw, same = _received.raw, _received.msg is msg
    _received.raw, _received.msg = b"", None
    if same and len(raw) > 2 and raw[0] == _BATCH_TAG:
        length, shift, i = 0, 0, 1
        while i < len(raw) and i < 6:
            byte = raw[i]
            length |= (byte & 0x7F) << shift
            i += 1
            if not byte & 0x80:
                if i + length == len(raw):
                    return raw[i:]
                break
            shift += 7
    return None


def batch_payload(msg: pb.AgentMessage | LeanMessage) -> bytes:
    """The Batch of `msg` encoded: batch_wire's bytes, or serialized again."""
    if msg.__class__ is LeanMessage:   # the usual batch
        return msg.batch.wire
    wire = batch_wire(msg)
    return wire if wire is not None else msg.batch.SerializeToString()


def add_ingest(servicer, server: grpc.aio.Server) -> None:
    """The generated add_IngestServicer_to_server, with parse_agent_message as the request
    deserializer."""
    handlers = {"Stream": grpc.stream_stream_rpc_method_handler(
        servicer.Stream, request_deserializer=parse_agent_message,
        response_serializer=pb.CollectorMessage.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(INGEST_SERVICE, handlers),))
    server.add_registered_method_handlers(INGEST_SERVICE, handlers)
