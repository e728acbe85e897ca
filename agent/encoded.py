"""Messages of the agent's stream that go out already encoded: a spooled batch is sent as its bytes.

The spool holds each batch encoded; sending it as a pb.Batch would decode it only for grpc to encode
it again. `encode_message` is the stream's request serializer: a message is encoded as usual, bytes
go as they are.
"""

from __future__ import annotations

from xpusense.v1 import telemetry_pb2 as pb


def encode_message(m: pb.AgentMessage | bytes) -> bytes:
    """The stream's request serializer: a message, or an AgentMessage already encoded."""
    return m if isinstance(m, bytes) else m.SerializeToString()


def batch_message(batch: bytes) -> bytes:
    """AgentMessage{batch} encoded around an encoded Batch (field 2, length-delimited): what
    AgentMessage(batch=Batch.FromString(batch)).SerializeToString() would be, without the decoding."""
    n, head = len(batch), bytearray(b"\x12")
    while n >= 0x80:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + batch
