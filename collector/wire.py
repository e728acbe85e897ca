"""The Ingest stream's requests as they came on the wire: a batch is kept (the single collector's
durable store) or published (a cluster gateway) in the bytes the agent sent, not serialized again.

An AgentMessage holding a batch is the Batch's own encoding after a tag (field 2, length-delimited)
and a length, so those bytes are a slice of what was received. `parse_agent_message` is the Ingest
stream's request deserializer: it keeps the bytes of the message it parsed last, with the message
itself (so that `batch_wire` can tell it is handed that very message, never a later one with a
recycled id). A stream's reader takes them as soon as its `async for` hands over the message,
before it awaits anything, so no other stream's message is parsed in between; taking them lets
them go (at most one message's bytes are held beyond that: the last one parsed, until the next).
"""

from __future__ import annotations

import grpc

from xpusense.v1 import telemetry_pb2 as pb

INGEST_SERVICE = pb.DESCRIPTOR.services_by_name["Ingest"].full_name
_BATCH_TAG = 0x12   # field 2 (batch), length-delimited


class _Received:
    __slots__ = ("raw", "msg")

    def __init__(self) -> None:
        self.raw: bytes = b""
        self.msg: pb.AgentMessage | None = None


_received = _Received()


def parse_agent_message(raw: bytes) -> pb.AgentMessage:
    """AgentMessage.FromString, keeping `raw` for batch_wire."""
    m = pb.AgentMessage.FromString(raw)
    _received.raw, _received.msg = raw, m
    return m


def batch_wire(msg: pb.AgentMessage) -> bytes | None:
    """The Batch of `msg` in the bytes it came in: when `msg` is the message parsed last and those
    bytes are exactly tag + length + batch; else None. Lets go of the bytes held either way."""
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


def batch_payload(msg: pb.AgentMessage) -> bytes:
    """The Batch of `msg` encoded: batch_wire's bytes, or serialized again."""
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
