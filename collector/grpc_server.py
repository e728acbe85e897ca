"""A collector-side gRPC server (the single collector, cluster gateways, scheduler replicas): its
options, its interceptors, and binding its address with one clear line when that fails."""

from __future__ import annotations

import errno
import socket

import grpc

from xpusense.common.config import split_host_port


class BindError(Exception):
    pass


def check_bind(listen: str) -> None:
    """Bind the address once ourselves, so a busy port gives one clear line, not gRPC's log."""
    host, port = split_host_port(listen)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"cannot listen on {listen}: host {host!r} does not resolve ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            hint = "is another collector running? " if e.errno == errno.EADDRINUSE else ""
            raise BindError(f"cannot listen on {listen}: {e.strerror}; {hint}choose another address with --listen") from None


# Every collector-side gRPC server's options (the single collector, cluster gateways and scheduler
# replicas, bench/grpc_floor.py), beside its message size bound.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),   # a second collector on the same port must fail, not share it
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # No BDP probing: it pings the peer as data comes in, so every agent's batch a second came with
    # a ping and its ack (17 bytes up, a wake-up on both sides). The receive window stays at gRPC's
    # initial 64 KiB a stream: a spool of compact batches still drains at ~1 MB/s over 50 ms.
    ("grpc.http2.bdp_probe", 0),
]


def grpc_server(security=None, limits=None, max_message_bytes: int = 16 * 2**20) -> grpc.aio.Server:
    """security.interceptors(): with per-node tokens, every service needs a valid token;
    limits.interceptors(): a message that does not parse ends its call with INVALID_ARGUMENT."""
    interceptors = [*(security.interceptors() if security is not None else ()),
                    *(limits.interceptors() if limits is not None else ())]
    return grpc.aio.server(interceptors=interceptors or None,
                           options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_message_bytes)])


def bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None = None) -> None:
    check_bind(listen)
    try:
        port = server.add_secure_port(listen, credentials) if credentials is not None else server.add_insecure_port(listen)
    except RuntimeError as e:
        raise BindError(f"cannot listen on {listen}: {e}; is another collector running? "
                        f"choose another address with --listen") from None
    if port == 0:
        raise BindError(f"cannot listen on {listen}: address in use or not local; choose another address with --listen")
