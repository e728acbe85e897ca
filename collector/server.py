"""The collector's gRPC server: the Ingest stream from agents, the Query API and gRPC health,
all on one port, on one asyncio event loop that owns the fleet state.

Bounds (collector/limits.py, `[limits]`): Ingest streams open at once (`max_streams`), node ids
(`max_nodes`). A collector without a durable store reads a stream's next message only once it has
acknowledged the last (one task a stream: gRPC's flow control holds back a client that does not read
its acks); with a store, reading and acknowledging are pipelined, bounded per stream by what was read
and not yet acknowledged (`max_stream_pending_batches`, `max_stream_pending_bytes`: past either the
stream is not read until acks go out). A stream's messages are let go when it ends, and the garbage
collector runs soon after (the exception of an aborted call holds them in a reference cycle).
ListNodes replies are pages of at most `max_reply_bytes`; boot ids go only to callers the collector
trusts (`QueryServicer.trusted`).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import gc
import logging
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xpusense.common.config import split_host_port
from xpusense.common.supervise import TASKS
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from . import gc_policy
from .batch_rows import BatchRows
from .limits import DEFAULTS as LIMITS
from .limits import MalformedRequest, Violation, read_hello, short_boot
from .query import state_query
from .scheduler.service import SCHEDULER_SERVICE
from .scheduler.service import add_to_server as add_scheduler
from .state import FleetState
from .store import StoreError
from .wire import INGEST_SERVICE, add_ingest, batch_wire

log = logging.getLogger("xpusense.collector")

QUERY_SERVICE = pb.DESCRIPTOR.services_by_name["Query"].full_name


class _Window:
    """What one stream holds between reading a batch and acknowledging it: at most `max_batches`
    batches and `max_bytes` bytes (as they came on the wire); past either, the reader waits."""

    def __init__(self, max_batches: int, max_bytes: int):
        self.max_batches, self.max_bytes = max_batches, max_bytes
        self.sizes: collections.deque[int] = collections.deque()
        self.bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def full(self) -> bool:
        return len(self.sizes) >= self.max_batches or self.bytes >= self.max_bytes

    def add(self, size: int) -> None:
        self.sizes.append(size)
        self.bytes += size
        if self.full():
            self._room.clear()

    def done(self) -> None:
        if self.sizes:
            self.bytes -= self.sizes.popleft()
        if not self.full():
            self._room.set()

    async def wait(self) -> None:
        await self._room.wait()


class _Reclaim:
    """Collect garbage cycles soon after a stream ended: an aborted call's exception and traceback
    keep its frames, and the last message read, in a cycle that reference counting does not free.
    Twice: `delay_s` after the end, and `late_s` after that (gRPC may still hold the call then),
    again if another stream ended meanwhile. Cheap in `serve`, where the long-lived state is
    frozen (gc_policy.freeze_long_lived, which does not freeze while runs are due, `reclaim_pending()`:
    a cycle frozen would be kept until its next sweep): only what is not frozen yet is looked at.
    But a message read before a freeze is frozen with everything else alive then: after a stream
    the collector aborted (a refused batch, often a large one), the late run is a sweep of
    everything (gc_policy.sweep, ~0.4 s of CPU at 1,000 nodes), at most every `deep_every_s`
    (later when one ran sooner), counted in `deep_runs`: a client refused again and again costs
    that pause that often, and its refused messages are held at most that long."""

    waiting = 0   # instances with runs due, in this process

    def __init__(self, delay_s: float = 0.05, late_s: float = 1.0, deep_every_s: float = 30.0):
        self.delay_s, self.late_s, self.deep_every_s = delay_s, late_s, deep_every_s
        self.pending = False   # runs are due
        self.again = False     # a stream ended after the first run
        self.runs = 0
        self.deep_wanted = False   # an aborted stream ended since the last sweep
        self.deep_runs = 0
        self.deep_last = -deep_every_s
        self.deep_timer: asyncio.TimerHandle | None = None

    def soon(self, aborted: bool = False) -> None:
        self.deep_wanted |= aborted
        if self.pending:
            self.again = True
            return
        self.pending = True
        _Reclaim.waiting += 1
        asyncio.get_running_loop().call_later(self.delay_s, self._run, True)

    def _run(self, first: bool) -> None:
        self.runs += 1
        if not first and self.deep_wanted:
            self._deep()
        else:
            gc.collect()
        if first or self.again:
            self.again = False
            asyncio.get_running_loop().call_later(self.late_s, self._run, False)
        else:
            self.pending = False
            _Reclaim.waiting -= 1

    def _deep(self) -> None:
        if not gc.get_freeze_count():   # nothing frozen (no freeze policy in this process)
            self.deep_wanted = False
            gc.collect()
            return
        loop = asyncio.get_running_loop()
        wait = self.deep_last + self.deep_every_s - loop.time()
        if wait > 0:
            gc.collect()
            if self.deep_timer is None:
                self.deep_timer = loop.call_later(wait, self._deep_due)
            return
        self.deep_wanted, self.deep_last = False, loop.time()
        self.deep_runs += 1
        gc_policy.sweep("after an aborted stream")

    def _deep_due(self) -> None:
        self.deep_timer = None
        if self.deep_wanted:
            self._deep()


def reclaim_pending() -> bool:
    """Whether a collection after a stream's end is due: garbage that a freeze now would keep."""
    return _Reclaim.waiting > 0


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
        self.open_streams = 0
        self.reclaim = _Reclaim()

    def _refuse(self, v: Violation, peer: str) -> None:
        if self.limits is not None:
            self.limits.count(v)
            self.limits.log.warning("refused stream from %s: %s", peer, v.message)

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        max_streams = self.limits.max_streams if self.limits is not None else LIMITS["max_streams"]
        if self.open_streams >= max_streams:
            v = Violation(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the collector has limits.max_streams = {max_streams} "
                          f"streams open; retry later", "max_streams")
            self._refuse(v, context.peer())
            await context.abort(v.code, v.message)
        self.open_streams += 1
        aborted = False
        try:
            async for out in self._stream(request_iterator, context):
                yield out
        except grpc.aio.AbortError:
            aborted = True
            raise
        finally:
            self.open_streams -= 1
            request_iterator = None
            self.reclaim.soon(aborted)

    def _admit(self, node_id: str, inventory: pb.Inventory) -> Violation | None:
        if self.limits is None:
            return None
        if (v := self.limits.check_inventory(inventory)) is not None:
            return v
        max_nodes = self.limits.max_nodes
        if node_id not in self.state.nodes and len(self.state.nodes) >= max_nodes:
            return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the collector holds limits.max_nodes = {max_nodes} "
                             f"nodes; node {node_id[:128]!r} is not taken", "max_nodes")
        if node_id not in self.state.nodes and getattr(self.state, "full", bool)():
            self.state.counters["state.max_memory.nodes_refused"] += 1
            return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the collector's fleet state is at its memory budget "
                             f"([state] max_memory) with its history at its shortest; node {node_id[:128]!r} is not "
                             f"taken (raise max_memory, or lower min_history_points or history_s)", "max_memory")
        return None

    async def _stream(self, request_iterator, context: grpc.aio.ServicerContext):
        peer = context.peer()
        hello = await read_hello(request_iterator, context, self.security)
        if hello is None:
            return
        node_id, boot_id = hello.node_id, hello.boot_id
        if (v := self._admit(node_id, hello.inventory)) is not None:
            self._refuse(v, peer)
            await context.abort(v.code, v.message)
        welcome = self.state.hello(hello, peer)
        if self.store is not None:
            self.store.append_nowait(["i", node_id, boot_id, hello.inventory.SerializeToString()])
        log.info("node %s connected from %s (boot %s, stored up to %d)", node_id, peer, short_boot(boot_id),
                 welcome.stored_up_to)
        if self.store is None:
            try:
                yield pb.CollectorMessage(welcome=welcome)
                async for ack in self._in_memory(request_iterator, context, node_id, boot_id):
                    yield ack
            finally:
                self.state.disconnected(node_id, boot_id)
                log.info("node %s disconnected", node_id)
                request_iterator = hello = None   # see below
            return
        # Reading and acknowledging are pipelined: batches are written to the store as they come,
        # and acknowledged in order once fsync'ed, so batches that arrive together share a group
        # commit (a spool draining after an outage is not held to one fsync per batch).
        pending: asyncio.Queue = asyncio.Queue()
        lim = self.limits
        window = _Window(int(lim.max_stream_pending_batches if lim else LIMITS["max_stream_pending_batches"]),
                         int(lim.max_stream_pending_bytes if lim else LIMITS["max_stream_pending_bytes"]))
        reader = asyncio.create_task(self._read(request_iterator, context, node_id, boot_id, pending, window))
        item = None   # the batch being acknowledged, until it is applied (see _apply_later)
        try:
            if self.undurable.get((node_id, boot_id)):
                # The Welcome's stored_up_to acknowledges what it covers: not before that is durable
                # (a boot with nothing in flight is welcomed at once, even while the disk fails).
                await asyncio.shield(self.store.barrier())
            yield pb.CollectorMessage(welcome=welcome)
            while True:
                item = await pending.get()
                if item is None:
                    break
                if isinstance(item, Violation):   # aborted here, in the handler's own task
                    await context.abort(item.code, item.message)
                b, previous, durable, b_rows = item
                try:   # shielded: if the stream ends meanwhile, _apply_later still sees how it went
                    await asyncio.shield(durable)
                except StoreError as e:
                    # Refused by the store (it holds too much not yet on disk): this batch and the
                    # later ones of the stream (not read, _read stopped) are resent by the agent.
                    if previous is not None:
                        self.state.unaccept(b, previous)
                    item = None
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                if previous is not None:
                    self.state.apply(b, b_rows)
                    self.store.untrack(durable)   # a snapshot now holds it (store/snapshotter.py)
                item = None
                yield pb.CollectorMessage(ack=pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=previous is None))
                window.done()
            await reader   # re-raises the reader's abort, if any
        finally:
            reader.cancel()
            self._apply_later(item, pending)
            self.state.disconnected(node_id, boot_id)
            log.info("node %s disconnected", node_id)
            # An abort's traceback keeps this frame alive (a cycle): let go of the messages now.
            request_iterator = hello = item = b = None

    async def _in_memory(self, request_iterator, context: grpc.aio.ServicerContext, node_id: str, boot_id: str):
        """Without a store: each batch is applied and acknowledged as it is read, in the stream's one
        task (nothing to wait for, so no reader task to hand batches over through a queue: that
        hand-over cost the loop a task switch and a future a batch)."""
        state = self.state
        try:
            async for msg in request_iterator:
                got = self._checked(msg, node_id, boot_id, context)
                if got is None:
                    continue
                if isinstance(got, Violation):
                    await context.abort(got.code, got.message)
                else:
                    b, _, b_rows = got
                    previous = state.accept(b)
                    if previous is not None:
                        state.apply(b, b_rows)
                    yield pb.CollectorMessage(ack=pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=previous is None))
        except MalformedRequest as e:
            await context.abort(e.violation.code, e.violation.message)
        finally:   # an abort's traceback keeps this frame alive (a cycle): let go of the messages now
            request_iterator = msg = got = b = b_rows = None

    def _checked(self, msg, node_id: str, boot_id: str, context) -> tuple | Violation | None:
        """A message of the stream after its Hello: a batch as (batch, its bytes as received, its
        BatchRows) once it is the stream's node's and within the limits; None for an inventory taken;
        else the Violation that ends the stream."""
        kind = msg.WhichOneof("msg")
        if kind == "batch":
            wire = batch_wire(msg)   # first: before anything here awaits (wire.py)
            b = msg.batch
            # An earlier boot's batches may come again (the agent's spool after a restart); another node's never.
            if b.node_id != node_id:
                return Violation(grpc.StatusCode.PERMISSION_DENIED,
                                 f"batch for node {b.node_id!r} on a stream opened by node {node_id!r}")
            b_rows = BatchRows(b, wire)   # read once, for the limits and the state
            if self.limits is not None and (why := self.limits.check(node_id, b, self.state, b_rows.refs)):
                return Violation(why.code, why.message)
            return b, wire, b_rows
        if kind == "inventory":
            return self._take_inventory(node_id, boot_id, msg.inventory, context)
        return Violation(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected message {kind!r} after Hello")

    def _settled(self, key: tuple[str, str], durable: asyncio.Future) -> None:
        if self.undurable.get(key, 0) > 1:
            self.undurable[key] -= 1
        else:
            self.undurable.pop(key, None)
        if durable.cancelled() or durable.exception() is not None:   # retrieved: the stream handles a refusal
            self.store.untrack(durable)   # never applied

    def _apply_later(self, item, pending: asyncio.Queue) -> None:
        """A stream ended with batches accepted but not yet applied: each is applied once durable
        (the agent's resend of it is then a duplicate, acknowledged once it is durable)."""
        items = [item] if item is not None else []
        while not pending.empty():
            items.append(pending.get_nowait())
        for it in items:
            if isinstance(it, Violation) or not isinstance(it, tuple) or it[1] is None:
                continue   # a refusal, the end, or a duplicate
            b, durable = it[0], it[2]
            if durable.done():
                self._apply_if_durable(b, durable)
            else:
                durable.add_done_callback(functools.partial(self._apply_if_durable, b))

    def _apply_if_durable(self, b: pb.Batch, durable: asyncio.Future) -> None:
        if not durable.cancelled() and durable.exception() is None:
            self.state.apply(b)
            self.store.untrack(durable)

    def _take_inventory(self, node_id: str, boot_id: str, inventory: pb.Inventory, context) -> Violation | None:
        """An inventory sent after the Hello (the node's accelerators changed): kept and stored, or refused."""
        if self.limits is not None and (v := self.limits.check_inventory(inventory)):
            self._refuse(v, context.peer())
            return v
        self.state.set_inventory(node_id, inventory)
        if self.store is not None:
            self.store.append_nowait(["i", node_id, boot_id, inventory.SerializeToString()])
        return None

    async def _read(self, request_iterator, context, node_id: str, boot_id: str, pending: asyncio.Queue,
                    window: _Window) -> None:
        try:
            async for msg in request_iterator:
                got = self._checked(msg, node_id, boot_id, context)
                if got is None:
                    continue
                if isinstance(got, Violation):
                    pending.put_nowait(got)
                    return
                b, wire, b_rows = got
                # a slow or failing disk: this stream waits, unread
                await self.store.wait_room(getattr(request_iterator, "wire_bytes", 0))
                previous = self.state.accept(b)
                if previous is None:   # a resend: acknowledged once what it resends is durable
                    durable = self.store.barrier()
                else:
                    durable = self.store.submit(["b", wire if wire is not None else b.SerializeToString()])
                    self.store.track(durable, node_id, b.boot_id, b.seq)
                    key = (node_id, b.boot_id)
                    self.undurable[key] = self.undurable.get(key, 0) + 1
                    durable.add_done_callback(functools.partial(self._settled, key))
                pending.put_nowait((b, previous, durable, b_rows))
                if durable.done() and durable.exception() is not None:
                    return   # refused: nothing after it may be stored before it (the handler ends the stream)
                window.add(getattr(request_iterator, "wire_bytes", 0))   # limits.GuardedRequests
                if window.full():   # not read further until acks go out (a client not reading them)
                    if self.limits is not None:
                        self.limits.hit("max_stream_pending_bytes" if window.bytes >= window.max_bytes
                                        else "max_stream_pending_batches")
                    await window.wait()
        except MalformedRequest as e:   # aborted by the handler's task, not this one (see MalformedRequest)
            pending.put_nowait(e.violation)
        finally:
            pending.put_nowait(None)


def counters(ingest: IngestServicer) -> dict[str, int]:
    """The collector's counters: each bound hit (by its config key), refusals, collections."""
    out: dict[str, int] = dict(ingest.state.counters)
    if ingest.limits is not None:
        out.update(ingest.limits.hits)
    if ingest.security is not None:
        out["auth.refusals"] = ingest.security.refusals
    out["streams.gc_runs"] = ingest.reclaim.runs
    out["streams.gc_sweeps"] = ingest.reclaim.deep_runs
    out["tasks.restarts"] = TASKS.total()   # background tasks that failed and were started again, and by task
    out.update({f"tasks.restarts.{name}": n for name, n in TASKS.counts().items()})
    if ingest.store is not None:   # collector/store/metrics.py says what each one is
        out.update({f"store.{k}": max(0, int(v)) for k, v in ingest.store.stats().items()})
    return out


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
]


async def start_server(listen: str, state: FleetState, max_message_bytes: int = 16 * 1024 * 1024,
                       credentials: grpc.ServerCredentials | None = None, security=None,
                       limits=None, config=None, store=None) -> grpc.aio.Server:
    # security.interceptors(): with per-node tokens, Query and the rest need a valid token too;
    # limits.interceptors(): a message that does not parse ends its call with INVALID_ARGUMENT.
    interceptors = [*(security.interceptors() if security is not None else ()),
                    *(limits.interceptors() if limits is not None else ())]
    server = grpc.aio.server(interceptors=interceptors or None,
                             options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_message_bytes)])
    ingest = IngestServicer(state, security, limits, store)
    if limits is not None:
        state.max_series_per_node = limits.max_series_per_node
    if config is not None:   # [state] series_idle_s: idle series and references let go (collector/idle.py)
        state.series_idle_ns = int(config.state.series_idle_s * 1e9)
        if limits is not None:
            limits.series_idle_s = float(config.state.series_idle_s)
    if config is not None and hasattr(state, "configure"):   # [state]: the memory budget
        state.configure(config.state.max_memory, config.state.min_history_points,
                        config.state.max_open_diagnoses_per_node, config.state.max_clock_offset_s)
    add_ingest(ingest, server)   # a batch is stored in the bytes it came in (wire.py)
    pb_grpc.add_QueryServicer_to_server(
        state_query(state, security, limits, counters=functools.partial(counters, ingest)), server)
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
        store.on_change.append(functools.partial(_follow_store, hs, store))
        await _store_health(hs, store)
    return server


def _follow_store(hs, store, _writable: bool) -> None:
    """Health follows the store (a task: setting it awaits); one that fails sets it again from the
    store's state then (common/supervise.py)."""
    TASKS.task("store-health", functools.partial(_store_health, hs, store))


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
