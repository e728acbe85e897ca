"""The collector's gRPC server: the Ingest stream from agents (the fleet state and its store as the
sink of collector/ingest_session.py; batches in the compact encoding read against the node's series
definitions), the Query API, Scheduler.Place and gRPC health, all on one port, on one asyncio event
loop that owns the fleet state.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xpusense.common import compact
from xpusense.common.supervise import TASKS
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from . import gc_policy
from .batch_rows import BatchRows
from .extender_http import start_extender
from .grpc_server import bind, grpc_server
from .ingest_session import IngestSession, PendingWindow, Sink, choose_encoding
from .limits import DEFAULTS as LIMITS
from .limits import Violation, short_boot
from .query import QUERY_SERVICE, state_query
from .scheduler.service import SCHEDULER_SERVICE
from .scheduler.service import add_to_server as add_scheduler
from .series_dictionary import MissingDefinition
from .state import FleetState
from .store import StoreError
from .wire import INGEST_SERVICE, CompactBatch, WireBatch, add_ingest, compact_batch

log = logging.getLogger("xpusense.collector")


class FleetStream(Sink):
    """One agent stream into the fleet state. Without a store each batch is accepted, applied and
    acknowledged as it is read. With one, batches are written to the store as they come and
    acknowledged in order once fsync'ed, then applied: batches that arrive together share a group
    commit (a spool draining after an outage is not held to one fsync per batch)."""

    def __init__(self, ingest: IngestServicer, node_id: str, boot_id: str, welcome: pb.Welcome, peer: str = ""):
        self.ingest, self.state, self.store, self.limits = ingest, ingest.state, ingest.store, ingest.limits
        self.node_id, self.boot_id, self.welcome, self.peer = node_id, boot_id, welcome, peer
        if self.store is not None:   # read and not yet acknowledged, per stream
            lim = self.limits
            self.window = PendingWindow(
                int(lim.max_stream_pending_batches if lim else LIMITS["max_stream_pending_batches"]),
                int(lim.max_stream_pending_bytes if lim else LIMITS["max_stream_pending_bytes"]),
                lim.hit if lim else None)

    def take_now(self, b, payload: bytes) -> pb.Ack | Violation:
        if b.__class__ is not WireBatch and b.columns and (b := self.ingest.decode(b, self.peer)).__class__ is Violation:
            return b
        rows = BatchRows(b, payload)   # read once, for the limits and the state
        if self.limits is not None and (why := self.limits.check(self.node_id, b, self.state, rows.refs)):
            return why
        previous = self.state.accept(b)
        if previous is not None:
            self.state.apply(b, rows)
        return pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=previous is None)

    async def take(self, b, payload: bytes, size: int):
        if b.__class__ is not WireBatch and b.columns and (b := self.ingest.decode(b, self.peer)).__class__ is Violation:
            return b
        rows = BatchRows(b, payload)
        if self.limits is not None and (why := self.limits.check(self.node_id, b, self.state, rows.refs)):
            return why
        store = self.store
        if not store.has_room(size):   # a slow or failing disk: this stream waits, unread
            await store.wait_room(size)
        previous = self.state.accept(b)
        if previous is None:   # a resend: acknowledged once what it resends is durable
            durable = store.barrier()
        else:
            durable = store.submit(["b", payload])
            store.track(durable, self.node_id, b.boot_id, b.seq)
            key = (self.node_id, b.boot_id)
            undurable = self.ingest.undurable
            undurable[key] = undurable.get(key, 0) + 1
            durable.add_done_callback(functools.partial(self.ingest.settled, key))
        if durable.done() and durable.exception() is not None:
            self.stopped = True   # refused: nothing after it may be stored before it (settle ends the stream)
        return b, previous, durable, rows

    def series(self, table: pb.SeriesTable) -> Violation | None:
        """The node's series definitions for one of its boots: logged in the store (before any later
        batch of the stream; durable with the next one), then kept in the state's dictionary."""
        max_bytes = int(self.limits.max_series_table_bytes if self.limits else LIMITS["max_series_table_bytes"])
        counters = self.state.counters
        try:
            defs = compact.decode_defs(table.defs, max_bytes)
        except compact.CompactError as e:
            counters["ingest.compact.tables_undecodable"] += 1
            over = str(e).startswith("series definitions inflate past")
            return Violation(grpc.StatusCode.INVALID_ARGUMENT,
                             f"SeriesTable of boot {short_boot(table.boot_id)} refused: {e}"
                             + (f" (limits.max_series_table_bytes = {max_bytes})" if over else ""),
                             "max_series_table_bytes" if over else "")
        check = self.limits.check_definition if self.limits is not None else None
        if (v := self.state.dictionary.refusal(self.node_id, table.boot_id, defs, check)) is not None:
            counters["ingest.compact.tables_refused"] += 1
            return v
        if self.store is not None:
            try:
                self.store.append_defs(self.node_id, table.SerializeToString())
            except StoreError as e:   # the agent sends every definition again on its next stream
                return Violation(grpc.StatusCode.UNAVAILABLE, str(e))
        self.state.define(self.node_id, table.boot_id, defs)
        counters["ingest.compact.tables"] += 1
        return None

    async def inventory(self, inv: pb.Inventory) -> None:
        """The node's accelerators changed: kept and stored."""
        self.state.set_inventory(self.node_id, inv)
        if self.store is not None:
            self.store.append_nowait(["i", self.node_id, self.boot_id, inv.SerializeToString()])

    async def ready(self) -> None:
        if self.store is not None and self.ingest.undurable.get((self.node_id, self.boot_id)):
            # The Welcome's stored_up_to acknowledges what it covers: not before that is durable
            # (a boot with nothing in flight is welcomed at once, even while the disk fails).
            await asyncio.shield(self.store.barrier())

    async def settle(self, item, context) -> pb.Ack:
        b, previous, durable, rows = item
        try:   # shielded: if the stream ends meanwhile, close() still sees how it went
            await asyncio.shield(durable)
        except StoreError as e:
            # Refused by the store (it holds too much not yet on disk): this batch and the later
            # ones of the stream (not read: the reader stopped) are resent by the agent.
            if previous is not None:
                self.state.unaccept(b, previous)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if previous is not None:
            self.state.apply(b, rows)
            self.store.untrack(durable)   # a snapshot now holds it (store/snapshot_taker.py)
        return pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=previous is None)

    def close(self, unsettled: list) -> None:
        """Batches accepted and not yet applied are applied once durable (the agent's resend of
        one is then a duplicate, acknowledged once it is durable)."""
        for it in unsettled:
            if it.__class__ is not tuple or it[1] is None:
                continue   # a refusal, the end, or a duplicate
            b, durable = it[0], it[2]
            if durable.done():
                self.ingest.apply_if_durable(b, durable)
            else:
                durable.add_done_callback(functools.partial(self.ingest.apply_if_durable, b))
        self.state.disconnected(self.node_id, self.boot_id)


class IngestServicer(IngestSession):
    """The single collector's Ingest: agent streams into the fleet state (FleetStream), at most
    `max_streams` open at once and nodes admitted up to `max_nodes` and the state's memory budget."""

    def __init__(self, state: FleetState, security=None, limits=None, store=None,
                 batch_encodings: list[str] | None = None):
        super().__init__(security, limits)
        self.state = state
        # [ingest] batch_encodings: what a Welcome may choose when the agent offers it.
        self.batch_encodings = list(compact.ENCODINGS) if batch_encodings is None else list(batch_encodings)
        # collector/store/: batches are durable there before they are acknowledged (None: memory only).
        self.store = store
        # Batches submitted to the store, not yet durable, per (node, boot): a Welcome waits for them.
        self.undurable: dict[tuple[str, str], int] = {}
        self.open_streams = 0
        # A stream's messages are let go when it ends, and the garbage collector runs soon after (the
        # exception of an aborted call holds them in a reference cycle).
        self.reclaim = gc_policy.Reclaim()

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        max_streams = self.limits.max_streams if self.limits is not None else LIMITS["max_streams"]
        if self.open_streams >= max_streams:
            v = Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the collector has limits.max_streams = {max_streams} streams open; retry later",
                          "max_streams")
            self.refused(v, context.peer())
            await context.abort(v.code, v.message)
        self.open_streams += 1
        aborted = False
        try:
            async for out in super().Stream(request_iterator, context):
                yield out
        except grpc.aio.AbortError:
            aborted = True
            raise
        finally:
            self.open_streams -= 1
            request_iterator = None
            self.reclaim.soon(aborted)

    def admit(self, node_id: str, inventory: pb.Inventory) -> Violation | None:
        if self.limits is None:
            return None
        if (v := super().admit(node_id, inventory)) is not None:
            return v
        max_nodes = self.limits.max_nodes
        if node_id not in self.state.nodes and len(self.state.nodes) >= max_nodes:
            return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"the collector holds limits.max_nodes = {max_nodes} nodes; node {node_id[:128]!r} "
                             f"is not taken", "max_nodes")
        if node_id not in self.state.nodes and self.state.full():
            self.state.counters["state.max_memory.nodes_refused"] += 1
            return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"the collector's fleet state is at its memory budget ([state] max_memory) with its "
                             f"history at its shortest; node {node_id[:128]!r} is not taken (raise max_memory, or "
                             f"lower min_history_points or history_s)", "max_memory")
        return None

    async def open(self, hello: pb.Hello, peer: str, context) -> FleetStream:
        welcome = self.state.hello(hello, peer)
        welcome.batch_encoding = choose_encoding(hello, self.batch_encodings)
        if welcome.batch_encoding:
            # Refs 1..N of the boot are in the dictionary: the agent sends only later ones. Durable as
            # far as what is acknowledged: a table is logged before every batch read after it, so a
            # batch using it is durable only with it (after a crash the dictionary is what was, and
            # the Welcome says less).
            welcome.series_defined_up_to = self.state.dictionary.defined_up_to(hello.node_id, hello.boot_id)
        if self.store is not None:
            self.store.append_nowait(["i", hello.node_id, hello.boot_id, hello.inventory.SerializeToString()])
        return FleetStream(self, hello.node_id, hello.boot_id, welcome, peer)

    def decode(self, b: pb.Batch, peer: str) -> CompactBatch | Violation:
        """A batch in the compact encoding read against its boot's definitions, or why it is refused
        (counted, logged): INVALID_ARGUMENT where its columns do not decode (never resent),
        FAILED_PRECONDITION where a ref has no definition (the agent reconnects and sends them)."""
        counters = self.state.counters
        try:
            got = compact_batch(b, self.state.dictionary, self.max_samples)
        except compact.CompactError as e:
            counters["ingest.compact.batches_undecodable"] += 1
            v = Violation(grpc.StatusCode.INVALID_ARGUMENT,
                          f"batch {b.seq} of boot {short_boot(b.boot_id)} refused: {e}")
        except MissingDefinition as e:
            counters["ingest.compact.batches_missing_definition"] += 1
            v = Violation(grpc.StatusCode.FAILED_PRECONDITION, f"batch {b.seq} refused: {e}")
        else:
            counters["ingest.compact.batches"] += 1
            return got
        return self.refused(v, peer) or v

    def settled(self, key: tuple[str, str], durable: asyncio.Future) -> None:
        if self.undurable.get(key, 0) > 1:
            self.undurable[key] -= 1
        else:
            self.undurable.pop(key, None)
        if durable.cancelled() or durable.exception() is not None:   # retrieved: the stream handles a refusal
            self.store.untrack(durable)   # never applied

    def apply_if_durable(self, b: pb.Batch, durable: asyncio.Future) -> None:
        if not durable.cancelled() and durable.exception() is None:
            self.state.apply(b)
            self.store.untrack(durable)


def counters(ingest: IngestServicer) -> dict[str, int]:
    """The collector's counters: each bound hit (by its config key), refusals, collections."""
    out: dict[str, int] = dict(ingest.state.counters)
    out.update(ingest.state.dictionary.hits)
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


async def start_server(listen: str, state: FleetState, max_message_bytes: int = 16 * 1024 * 1024,
                       credentials: grpc.ServerCredentials | None = None, security=None,
                       limits=None, config=None, store=None) -> grpc.aio.Server:
    server = grpc_server(security, limits, max_message_bytes)
    ingest = IngestServicer(state, security, limits, store,
                            config.ingest.batch_encodings if config is not None else None)
    if limits is not None:
        state.max_series_per_node = state.dictionary.max_per_boot = limits.max_series_per_node
    if config is not None:   # [state]: idle series let go (collector/idle.py), the memory budget
        state.series_idle_ns = int(config.state.series_idle_s * 1e9)
        if limits is not None:
            limits.series_idle_s = float(config.state.series_idle_s)
        state.configure(config.state.max_memory, config.state.min_history_points,
                        config.state.max_open_diagnoses_per_node, config.state.max_clock_offset_s)
    add_ingest(ingest, server)   # a batch is stored in the bytes it came in (wire.py)
    pb_grpc.add_QueryServicer_to_server(
        state_query(state, security, limits, counters=functools.partial(counters, ingest)), server)
    server.scheduler = add_scheduler(server, state, config)   # config None: the defaults
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    bind(server, listen, credentials)
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
    try:   # kube-scheduler's extender over the same core, its bounds counted with the state's counters
        extender = await start_extender(config, server.scheduler, security, state.counters)
    except BaseException:
        await server.stop(grace=None)
        raise
    log.info("collector listening on %s", listen)
    try:
        await stop.wait()
    finally:
        if extender is not None:
            await extender.stop()
    await server.stop(grace=2.0)
