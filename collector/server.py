"""The collector's gRPC server: the Ingest stream from agents, the Query API and gRPC health,
all on one port, on one asyncio event loop that owns the fleet state."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from typing import NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xpusense.common.config import split_host_port
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from .scheduler.service import SCHEDULER_SERVICE
from .scheduler.service import add_to_server as add_scheduler
from .state import FleetState
from .store import StoreError

log = logging.getLogger("xpusense.collector")

INGEST_SERVICE = pb.DESCRIPTOR.services_by_name["Ingest"].full_name
QUERY_SERVICE = pb.DESCRIPTOR.services_by_name["Query"].full_name


class _Refusal(NamedTuple):
    code: grpc.StatusCode
    message: str


class IngestServicer(pb_grpc.IngestServicer):
    def __init__(self, state: FleetState, security=None, limits=None, store=None):
        self.state = state
        # collector/store/: batches are durable there before they are acknowledged (None: memory only).
        self.store = store
        # Batches submitted to the store, not yet durable, per (node, boot): a Welcome waits for them.
        self.undurable: dict[tuple[str, str], int] = {}
        # collector/auth.py: who may report as which node (mTLS identity or per-node token).
        self.security = security
        # collector/limits.py: per-node limits on batches (size, series, labels, rate).
        self.limits = limits

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        peer = context.peer()
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if not first.HasField("hello") or not first.hello.node_id or not first.hello.boot_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the first message of a stream must be a Hello with node_id and boot_id")
        hello = first.hello
        node_id, boot_id = hello.node_id, hello.boot_id
        if self.security is not None:
            await self.security.authorize(context, node_id)   # aborts the stream when not allowed
        welcome = self.state.hello(hello, peer)
        if self.store is not None:
            self.store.append_nowait(["i", node_id, boot_id, hello.inventory.SerializeToString()])
        log.info("node %s connected from %s (boot %s, stored up to %d)", node_id, peer, boot_id,
                 welcome.stored_up_to)
        # Reading and acknowledging are pipelined: batches are written to the store as they come,
        # and acknowledged in order once fsync'ed, so batches that arrive together share a group
        # commit (a spool draining after an outage is not held to one fsync per batch).
        pending: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._read(request_iterator, context, node_id, boot_id, pending))
        try:
            if self.store is not None and self.undurable.get((node_id, boot_id)):
                # The Welcome's stored_up_to acknowledges what it covers: not before that is durable
                # (a boot with nothing in flight is welcomed at once, even while the disk fails).
                await asyncio.shield(self.store.barrier())
            yield pb.CollectorMessage(welcome=welcome)
            while True:
                item = await pending.get()
                if item is None:
                    break
                if isinstance(item, _Refusal):   # aborted here, in the handler's own task
                    await context.abort(item.code, item.message)
                b, previous, durable = item
                if durable is not None:
                    try:   # shielded: a batch is applied (_stored) once durable, even if its stream ended
                        await asyncio.shield(durable)
                    except StoreError as e:
                        # Refused by the store (it holds too much not yet on disk): this batch and the
                        # later ones of the stream (not read, _read stopped) are resent by the agent.
                        if previous is not None:
                            self.state.unaccept(b, previous)
                        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                elif previous is not None:
                    self.state.apply(b)   # no store: from memory
                yield pb.CollectorMessage(ack=pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=previous is None))
            await reader   # re-raises the reader's abort, if any
        finally:
            reader.cancel()
            self.state.disconnected(node_id)
            log.info("node %s disconnected", node_id)

    def _stored(self, b: pb.Batch, durable: asyncio.Future) -> None:
        key = (b.node_id, b.boot_id)
        if self.undurable.get(key, 0) > 1:
            self.undurable[key] -= 1
        else:
            self.undurable.pop(key, None)
        if not durable.cancelled() and durable.exception() is None:
            self.state.apply(b)

    async def _read(self, request_iterator, context, node_id: str, boot_id: str, pending: asyncio.Queue) -> None:
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                if kind == "batch":
                    b = msg.batch
                    # An earlier boot's batches may come again (the agent's spool after a restart);
                    # another node's never.
                    if b.node_id != node_id:
                        pending.put_nowait(_Refusal(grpc.StatusCode.PERMISSION_DENIED,
                                                    f"batch for node {b.node_id!r} on a stream opened by node {node_id!r}"))
                        return
                    if self.limits is not None and (why := self.limits.check(node_id, b)):
                        pending.put_nowait(_Refusal(why.code, why.message))
                        return
                    if self.store is not None:   # a slow or failing disk: this stream waits, unread
                        await self.store.wait_room(b.ByteSize())
                    previous = self.state.accept(b)
                    durable = None
                    if self.store is not None:
                        if previous is None:   # a resend: acknowledged once what it resends is durable
                            durable = self.store.barrier()
                        else:
                            durable = self.store.submit(["b", b.SerializeToString()])
                            key = (node_id, b.boot_id)
                            self.undurable[key] = self.undurable.get(key, 0) + 1
                            durable.add_done_callback(functools.partial(self._stored, b))
                    pending.put_nowait((b, previous, durable))
                    if durable is not None and durable.done() and durable.exception() is not None:
                        return   # refused: nothing after it may be stored before it (the handler ends the stream)
                elif kind == "inventory":
                    self.state.set_inventory(node_id, msg.inventory)
                    if self.store is not None:
                        self.store.append_nowait(["i", node_id, boot_id, msg.inventory.SerializeToString()])
                else:
                    pending.put_nowait(_Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                                f"unexpected message {kind!r} after Hello"))
                    return
        finally:
            pending.put_nowait(None)


class QueryServicer(pb_grpc.QueryServicer):
    def __init__(self, state: FleetState):
        self.state = state

    async def ListNodes(self, request, context):
        return self.state.view(request.node_id, request.name_prefix)

    async def GetHistory(self, request, context):
        reply = self.state.history(request.node_id, request.name, dict(request.labels))
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no series {request.name!r} {dict(request.labels)} on node {request.node_id!r}")
        return reply


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


async def start_server(listen: str, state: FleetState, max_message_bytes: int = 16 * 1024 * 1024,
                       credentials: grpc.ServerCredentials | None = None, security=None,
                       limits=None, config=None, store=None) -> grpc.aio.Server:
    # security.interceptors(): with per-node tokens, Query and the rest need a valid token too;
    # limits.interceptors(): a message that does not parse ends its call with INVALID_ARGUMENT.
    interceptors = [*(security.interceptors() if security is not None else ()),
                    *(limits.interceptors() if limits is not None else ())]
    server = grpc.aio.server(interceptors=interceptors or None, options=[
        ("grpc.so_reuseport", 0),   # a second collector on the same port must fail, not share it
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ])
    pb_grpc.add_IngestServicer_to_server(IngestServicer(state, security, limits, store), server)
    pb_grpc.add_QueryServicer_to_server(QueryServicer(state), server)
    server.scheduler = add_scheduler(server, state, config)   # config None: the defaults
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    check_bind(listen)
    try:
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError as e:
        raise BindError(f"cannot listen on {listen}: {e}; is another collector running? "
                        f"choose another address with --listen") from None
    if port == 0:
        raise BindError(f"cannot listen on {listen}: address in use or not local; "
                        f"choose another address with --listen")
    await server.start()
    for svc in ("", INGEST_SERVICE, QUERY_SERVICE, SCHEDULER_SERVICE):
        await hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
    if store is not None:   # overall and Ingest health: NOT_SERVING while the store cannot write
        server.store_health = set()   # the tasks that set it, held until done
        store.on_change.append(functools.partial(_follow_store, hs, store, server.store_health))
        await _store_health(hs, store)
    return server


def _follow_store(hs, store, tasks: set, _writable: bool) -> None:
    task = asyncio.get_running_loop().create_task(_store_health(hs, store))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _store_health(hs, store) -> None:
    status = health_pb2.HealthCheckResponse.NOT_SERVING if store.failing else health_pb2.HealthCheckResponse.SERVING
    for svc in ("", INGEST_SERVICE):
        await hs.set(svc, status)


async def serve(listen: str, state: FleetState, max_message_bytes: int, stop: asyncio.Event, config=None,
                store=None, credentials: grpc.ServerCredentials | None = None, security=None,
                limits=None) -> None:
    server = await start_server(listen, state, max_message_bytes, config=config, store=store,
                                credentials=credentials, security=security, limits=limits)
    log.info("collector listening on %s", listen)
    await stop.wait()
    await server.stop(grace=2.0)
