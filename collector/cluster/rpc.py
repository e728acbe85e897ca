"""The gRPC server of a cluster-mode process (gateway, scheduler): the single collector's options
(collector/server.py) and one clear line for a busy port."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

from ..server import SERVER_OPTIONS, BindError, check_bind

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def grpc_server(security=None, limits=None, max_message_bytes: int = 16 * 2**20) -> grpc.aio.Server:
    interceptors = [*(security.interceptors() if security is not None else ()),
                    *(limits.interceptors() if limits is not None else ())]
    return grpc.aio.server(interceptors=interceptors or None,
                           options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_message_bytes)])


def bind(server: grpc.aio.Server, listen: str, credentials=None) -> None:
    check_bind(listen)
    try:
        port = server.add_secure_port(listen, credentials) if credentials is not None else server.add_insecure_port(listen)
    except RuntimeError as e:
        raise BindError(f"cannot listen on {listen}: {e}; choose another address with --listen") from None
    if port == 0:
        raise BindError(f"cannot listen on {listen}: address in use or not local; choose another address with --listen")
