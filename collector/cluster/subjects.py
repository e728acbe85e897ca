"""Where a node's messages go in JetStream: subject tokens and KV keys made from ids, the
partition of a node (a stable hash mod P), the subject `<prefix>.<region>.p<k>.<node>`, the stream
that holds a partition (partition k in stream k mod S, so S streams spread their RAFT leaders over
the servers), and the message id JetStream deduplicates on (a digest of `node:boot:seq`).

Node ids may hold any printable character but spaces (common/ids.py), subjects and KV keys only a
few: every byte outside [A-Za-z0-9_-] is written `=HH` (so `gpu-1.dc` is `gpu-1=2Edc`), which is
reversible and never makes a token empty or holding `.`, `*` or `>`.
"""

from __future__ import annotations

import base64
import hashlib
import re

_SAFE = re.compile(rb"[A-Za-z0-9_-]")
_ESCAPED = re.compile(r"=([0-9A-F]{2})")

# Headers of the messages a gateway publishes (besides JetStream's Nats-Msg-Id).
KIND = "Xps-Kind"                 # batch (default) | hello | inventory | bye
RECEIVED = "Xps-Received"         # when the gateway received it (its clock, ns): collector/clock.py
MSG_ID = "Nats-Msg-Id"


def token(text: str) -> str:
    """`text` as one subject token / KV key part (escaped, reversible)."""
    if text and all(c.isascii() and (c.isalnum() or c in "_-") for c in text):
        return text
    return "".join(chr(b) if _SAFE.fullmatch(bytes([b])) else f"={b:02X}" for b in text.encode())


def untoken(tok: str) -> str:
    if "=" not in tok:
        return tok
    raw = bytearray()
    i = 0
    while i < len(tok):
        if tok[i] == "=" and _ESCAPED.match(tok, i):
            raw.append(int(tok[i + 1:i + 3], 16))
            i += 3
        else:
            raw.extend(tok[i].encode())
            i += 1
    return raw.decode(errors="replace")


def partition(node_id: str, partitions: int) -> int:
    """The node's partition: a stable hash (the same in every process and release) mod P."""
    return int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=8).digest(), "big") % partitions


def stream_name(prefix: str, index: int) -> str:
    return f"{token(prefix).upper().replace('-', '_')}_{index}"


def stream_of(prefix: str, part: int, streams: int) -> str:
    return stream_name(prefix, part % streams)


def stream_subjects(prefix: str, index: int, partitions: int, streams: int) -> list[str]:
    return [partition_filter(prefix, k) for k in range(partitions) if k % streams == index]


def partition_filter(prefix: str, part: int) -> str:
    return f"{token(prefix)}.*.p{part}.*"


def node_subject(prefix: str, region: str, part: int, node_id: str) -> str:
    return f"{token(prefix)}.{token(region or 'none')}.p{part}.{token(node_id)}"


def node_filter(prefix: str, part: int, node_id: str) -> str:
    """Every region's subject of one node (a node that moved region keeps its history)."""
    return f"{token(prefix)}.*.p{part}.{token(node_id)}"


def node_of_subject(subject: str) -> str:
    return untoken(subject.rsplit(".", 1)[-1])


def msg_id(node_id: str, boot_id: str, seq: int) -> str:
    """A batch's `Nats-Msg-Id`: 16 characters (base64url of a 96-bit BLAKE2b digest of
    `node:boot:seq`), the same in every process and release; JetStream keeps it with every copy of
    every message, where `node:boot:seq` itself (long_msg_id) took ~50-100 bytes."""
    digest = hashlib.blake2b(long_msg_id(node_id, boot_id, seq).encode(), digest_size=12).digest()
    return base64.urlsafe_b64encode(digest).decode()


def long_msg_id(node_id: str, boot_id: str, seq: int) -> str:
    """`node:boot:seq`, whole: the message id of batches stored by gateways that wrote it so."""
    return f"{node_id}:{boot_id}:{seq}"


def is_msg_id(mid: object, node_id: str, boot_id: str, seq: int) -> bool:
    """Whether a stored batch's message id is that of its node, boot and seq, in either form."""
    return mid == msg_id(node_id, boot_id, seq) or mid == long_msg_id(node_id, boot_id, seq)


def mark_key(node_id: str, boot_id: str) -> str:
    return f"{token(node_id)}.{token(boot_id)}"
