"""JSON messages with file descriptors attached (SCM_RIGHTS) over an AF_UNIX SOCK_SEQPACKET pair:
the channel between the agent and its eBPF loader process. A message carries at most
FDS_PER_MESSAGE fds, more follow in messages of their own; an fd in flight belongs to the socket, so
the kernel closes it if either side dies before receiving it.
"""

from __future__ import annotations

import array
import json
import os
import socket
import time
from typing import Any

FDS_PER_MESSAGE = 200           # under the kernel's SCM_MAX_FD (253)
MAX_MESSAGE_BYTES = 1 << 20


class ChannelError(Exception):
    """The other side closed, timed out or sent something that is not a message of ours."""


def pair() -> tuple[socket.socket, socket.socket]:
    """(agent's end, loader's end): a SOCK_SEQPACKET pair, both close-on-exec (pass the loader's on)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: socket.socket, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    """One JSON object and its fds (the receiver gets them in this order)."""
    fds = list(fds)
    body = json.dumps({"nfds": len(fds), "data": obj}).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ChannelError(f"message of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
    first, rest = fds[:FDS_PER_MESSAGE], fds[FDS_PER_MESSAGE:]
    _sendmsg(sock, body, first)
    while rest:
        chunk, rest = rest[:FDS_PER_MESSAGE], rest[FDS_PER_MESSAGE:]
        _sendmsg(sock, b"+", chunk)


def _sendmsg(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([payload], anc)


def recv(sock: socket.socket, timeout_s: float | None) -> tuple[Any, list[int]]:
    """The next object and its fds (close-on-exec, owned by the caller). Raises ChannelError on EOF,
    on timeout (None: wait for ever) or on a malformed message; fds received so far are closed then."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    fds: list[int] = []
    try:
        payload, got = _recvmsg(sock, deadline)
        fds += got
        try:
            head = json.loads(payload)
            nfds, data = int(head["nfds"]), head["data"]
        except (ValueError, KeyError, TypeError) as e:
            raise ChannelError(f"not a message of ours ({len(payload)} bytes: {payload[:60]!r})") from e
        while len(fds) < nfds:
            more, got = _recvmsg(sock, deadline)
            fds += got
            if more != b"+" or not got:
                raise ChannelError(f"expected {nfds} fds, the stream broke after {len(fds)}")
        if len(fds) != nfds:
            raise ChannelError(f"expected {nfds} fds, got {len(fds)}")
        return data, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recvmsg(sock: socket.socket, deadline: float | None) -> tuple[bytes, list[int]]:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelError("timed out")
        sock.settimeout(left)
    else:
        sock.settimeout(None)
    space = socket.CMSG_SPACE(FDS_PER_MESSAGE * array.array("i").itemsize)
    try:
        payload, anc, flags, _ = sock.recvmsg(MAX_MESSAGE_BYTES, space, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise ChannelError("timed out") from None
    except OSError as e:
        raise ChannelError(f"receiving failed: {e}") from e
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[:len(data) - len(data) % a.itemsize])
            fds += list(a)
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        for fd in fds:
            os.close(fd)
        raise ChannelError("a message or its fds were cut short")
    if not payload and not fds:
        raise ChannelError("the other side closed the connection")
    return payload, fds
