"""One agent's Ingest stream, as the single collector and a cluster gateway both serve it: the Hello,
admission, the Welcome (with the batch encoding chosen), the batches and series tables checked and
acknowledged in order, refusals. What a stream does with what it is sent (the fleet state and
store, or JetStream) is its sink (`Sink`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
from collections.abc import Callable
from typing import Any

import grpc

from xpusense.common import compact
from xpusense.common.compact_chain import Chain
from xpusense.common.ids import bad_id
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from .limits import DEFAULTS as LIMITS
from .limits import MalformedRequest, Violation, short_boot
from .wire import WireBatch, batch_payload, with_block, with_ids


class PendingWindow:
    """What one stream holds between reading a message and acknowledging it: at most `max_batches`
    messages and `max_bytes` bytes (as they came on the wire); past either, the reader waits until
    acks go out (a client that does not read its acks is held back by gRPC's flow control)."""

    def __init__(self, max_batches: int, max_bytes: int = sys.maxsize,
                 on_full: Callable[[str], None] | None = None):
        self.max_batches, self.max_bytes, self.on_full = max_batches, max_bytes, on_full
        self.sizes: collections.deque[int] = collections.deque()
        self.bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def full(self) -> bool:
        return len(self.sizes) >= self.max_batches or self.bytes >= self.max_bytes

    def add(self, size: int) -> bool:
        """Count a message read; whether the window is full now."""
        self.sizes.append(size)
        self.bytes += size
        if self.full():
            self._room.clear()
            return True
        return False

    def done(self) -> None:
        if self.sizes:
            self.bytes -= self.sizes.popleft()
        if not self.full():
            self._room.set()

    async def wait(self) -> None:
        """Wait for room; `on_full` is told which bound was reached (its limits key)."""
        if self.on_full is not None:
            self.on_full("max_stream_pending_bytes" if self.bytes >= self.max_bytes
                         else "max_stream_pending_batches")
        await self._room.wait()


class Sink:
    """What one stream does with its messages once the session checked that they are its node's.
    `window` None: each batch is kept as it is read, in the handler's own task (`take_now`); else a
    reader task takes them ahead (`take`) and the handler settles them in order (`settle`)."""

    node_id: str
    welcome: pb.Welcome
    ids: tuple[str, str] | None = None   # the Hello's node and boot, where a batch may leave them out
    chain: Chain | None = None           # where the Welcome chose chained blocks: the stream's end of the chain
    window: PendingWindow | None = None
    stopped = False   # set by `take`: the message it returned is the last one to read

    async def ready(self) -> None:
        """Awaited before the Welcome goes out."""

    def take_now(self, b: Any, payload: bytes) -> pb.Ack | Violation:
        """A batch read (`payload`: its bytes), kept: its Ack, or why it is refused."""
        raise NotImplementedError

    async def take(self, b: Any, payload: bytes, size: int) -> Any:
        """A batch read (`size`: its bytes on the wire): what `settle` acknowledges, or a Violation."""
        raise NotImplementedError

    async def inventory(self, inv: pb.Inventory) -> Any:
        """An inventory sent after the Hello, within the limits: None once kept, or what to settle."""
        raise NotImplementedError

    def series(self, table: pb.SeriesTable) -> Violation | None:
        """A SeriesTable of the node's (on a stream whose Welcome chose the compact encoding):
        None once kept, before any later batch of the stream is, or why it is refused."""
        raise NotImplementedError

    async def settle(self, item: Any, context: grpc.aio.ServicerContext) -> pb.Ack | None:
        """Wait until `item` is kept (aborting the call when it cannot be); its Ack, if it has one."""
        raise NotImplementedError

    def close(self, unsettled: list) -> None:
        """The stream ended; `unsettled`: what was taken and not settled."""


def _wrong_node(b: Any, node_id: str) -> Violation:
    """An earlier boot's batches may come again (the agent's spool after a restart); another node's never."""
    return Violation(grpc.StatusCode.PERMISSION_DENIED,
                     f"batch for node {b.node_id!r} on a stream opened by node {node_id!r}")


class ChainBroken(MalformedRequest):
    """Columns deflated on the stream's block before them that do not inflate on it: the stream ends
    FAILED_PRECONDITION, and the agent's next stream starts a chain anew (nothing is set aside)."""

    def __init__(self, violation: Violation):
        Exception.__init__(self, violation.message)
        self.violation = violation


def choose_encoding(hello: pb.Hello, allowed: list[str]) -> str:
    """The batch encoding a Welcome chooses: the newest compact one that the agent offers and the
    configuration (`[ingest] batch_encodings`) allows; "" (Sample messages) where there is none."""
    return next((e for e in compact.ENCODINGS if e in hello.batch_encodings and e in allowed), "")


def _table_refused(table: pb.SeriesTable, welcome: pb.Welcome) -> Violation | None:
    if welcome.batch_encoding not in compact.VERSIONS:
        return Violation(grpc.StatusCode.INVALID_ARGUMENT, "a SeriesTable on a stream whose Welcome chose "
                         f"batch encoding {welcome.batch_encoding!r}")
    if (why := bad_id("SeriesTable boot_id", table.boot_id)) is not None:
        return Violation(grpc.StatusCode.INVALID_ARGUMENT, why)
    return None


def _unexpected(kind: str | None) -> Violation:
    return Violation(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected message {kind!r} after Hello")


async def read_hello(request_iterator, context, security) -> pb.Hello | None:
    """The first message of an Ingest stream: a Hello with a node id and a boot id, from a peer
    whose credentials may speak for that node (`security`: collector/auth.py Security, or None).
    Aborts the call otherwise; None when the stream ended before any message."""
    first = await anext(aiter(request_iterator), None)
    if first is None:
        return None
    if not first.HasField("hello") or not first.hello.node_id or not first.hello.boot_id:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "the first message of a stream must be a Hello with node_id and boot_id")
    if security is not None:
        await security.authorize(context, first.hello.node_id)   # aborts the stream when not allowed
    return first.hello


class IngestSession(pb_grpc.IngestServicer):
    """The Ingest servicer: `admit` and `open` say what differs between deployments."""

    log = logging.getLogger("xpusense.collector")

    def __init__(self, security=None, limits=None):
        self.security = security   # collector/auth.py: who may report as which node
        self.limits = limits       # collector/limits.py: what one agent may send
        self.max_samples = int(limits.max_samples_per_batch if limits else LIMITS["max_samples_per_batch"])

    def received_batch(self, msg: Any, sink: Sink, peer: str) -> tuple[Any, bytes]:
        """A batch message's Batch and the bytes it came as: the Hello's ids put back where a batch
        of a version-2 stream left them out, and chained columns deflated alone again (ChainBroken,
        counted, where they do not inflate)."""
        payload = batch_payload(msg)
        b = msg.batch
        if not b.node_id and sink.ids is not None:
            b, payload = with_ids(b, payload, *sink.ids)
        if sink.chain is not None and (block := b.columns).__class__ is bytes and block:
            try:
                alone = sink.chain.receive(block)
            except compact.CompactError as e:
                v = Violation(grpc.StatusCode.FAILED_PRECONDITION, f"batch {b.seq} of node {b.node_id!r}: {e}")
                self.refused(v, peer)
                raise ChainBroken(v) from None
            if alone is not block:
                b, payload = with_block(b, payload, alone)
        return b, payload

    def refused(self, v: Violation | None, peer: str) -> Violation | None:
        """`v`, counted and logged (None passes)."""
        if v is not None and self.limits is not None:
            self.limits.count(v)
            self.limits.log.warning("refused stream from %s: %s", peer, v.message)
        return v

    def inventory_refused(self, inv: pb.Inventory) -> Violation | None:
        return self.limits.check_inventory(inv) if self.limits is not None else None

    def batch_refused(self, b: Any, node_id: str, welcome: pb.Welcome, peer: str) -> Violation | None:
        """Another node's batch, or one in the compact encoding where the Welcome did not choose it."""
        if b.node_id != node_id:
            return _wrong_node(b, node_id)
        if b.__class__ is not WireBatch and b.columns and welcome.batch_encoding not in compact.VERSIONS:
            return self.refused(Violation(grpc.StatusCode.INVALID_ARGUMENT,
                                          f"batch {b.seq} in the compact encoding on a stream whose Welcome "
                                          f"chose {welcome.batch_encoding!r}: send Sample messages"), peer)
        return None

    def admit(self, node_id: str, inventory: pb.Inventory) -> Violation | None:
        """Why a node's stream is refused at its Hello, or None."""
        return self.inventory_refused(inventory)

    async def open(self, hello: pb.Hello, peer: str, context: grpc.aio.ServicerContext) -> Sink:
        raise NotImplementedError

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        peer = context.peer()
        hello = await read_hello(request_iterator, context, self.security)
        if hello is None:
            return
        if (v := self.refused(self.admit(hello.node_id, hello.inventory), peer)) is not None:
            await context.abort(v.code, v.message)
        sink = await self.open(hello, peer, context)
        if compact.VERSIONS.get(sink.welcome.batch_encoding, 0) >= 2:   # its batches may leave the ids out
            sink.ids = (hello.node_id, hello.boot_id)
        if sink.welcome.batch_encoding == compact.CHAINED:
            sink.chain = Chain(self.max_samples)
        self.log.info("node %s connected from %s (boot %s, stored up to %d)", sink.node_id, peer,
                      short_boot(hello.boot_id), sink.welcome.stored_up_to)
        window = sink.window
        reader: asyncio.Task | None = None
        pending: asyncio.Queue = asyncio.Queue()
        item = None
        try:
            if window is not None:
                # Reading and acknowledging are pipelined: a reader task takes messages as they
                # come, and this task acknowledges them in order once each is kept.
                reader = asyncio.create_task(self._read(request_iterator, sink, peer, pending, window))
            await sink.ready()
            yield pb.CollectorMessage(welcome=sink.welcome)
            if window is None or reader is None:
                async for ack in self._inline(request_iterator, context, sink, peer):
                    yield ack
                return
            while (item := await pending.get()) is not None:
                if item.__class__ is Violation:   # aborted here, in the handler's own task
                    await context.abort(item.code, item.message)
                ack = await sink.settle(item, context)
                item = None
                if ack is not None:
                    yield pb.CollectorMessage(ack=ack)
                window.done()
            await reader   # re-raises the reader's abort, if any
        finally:
            unsettled = [item] if item is not None else []
            if reader is not None:
                reader.cancel()
                while not pending.empty():
                    unsettled.append(pending.get_nowait())
            sink.close(unsettled)
            self.log.info("node %s disconnected", sink.node_id)
            # An abort's traceback keeps this frame alive (a cycle): let go of the messages now.
            request_iterator = hello = item = None
            unsettled.clear()

    async def _inline(self, request_iterator, context, sink: Sink, peer: str):
        """Each batch kept as it is read, in the stream's one task: no reader task to hand batches
        over to, which would cost the loop a task switch and a future a batch."""
        node_id = sink.node_id
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                if kind == "batch":
                    b, payload = self.received_batch(msg, sink, peer)   # first: before anything here awaits (wire.py)
                    got = self.batch_refused(b, node_id, sink.welcome, peer) or sink.take_now(b, payload)
                elif kind == "series":
                    table = msg.series
                    got = self.refused(_table_refused(table, sink.welcome) or sink.series(table), peer)
                elif kind == "inventory":
                    inv = msg.inventory
                    got = self.refused(self.inventory_refused(inv), peer) or await sink.inventory(inv)
                else:
                    got = _unexpected(kind)
                if got.__class__ is Violation:
                    await context.abort(got.code, got.message)
                elif got is not None:
                    yield pb.CollectorMessage(ack=got)
        except MalformedRequest as e:
            await context.abort(e.violation.code, e.violation.message)
        finally:   # an abort's traceback keeps this frame alive (a cycle): let go of the messages now
            request_iterator = msg = got = b = table = None
            payload = b""

    async def _read(self, request_iterator, sink: Sink, peer: str, pending: asyncio.Queue,
                    window: PendingWindow) -> None:
        node_id = sink.node_id
        try:
            async for msg in request_iterator:
                size = getattr(request_iterator, "wire_bytes", 0)   # limits.GuardedRequests
                kind = msg.WhichOneof("msg")
                if kind == "batch":
                    b, payload = self.received_batch(msg, sink, peer)   # first: before anything here awaits (wire.py)
                    got = self.batch_refused(b, node_id, sink.welcome, peer) or await sink.take(b, payload, size)
                elif kind == "series":
                    table = msg.series
                    got = self.refused(_table_refused(table, sink.welcome) or sink.series(table), peer)
                elif kind == "inventory":
                    inv = msg.inventory
                    got = self.refused(self.inventory_refused(inv), peer) or await sink.inventory(inv)
                else:
                    got = _unexpected(kind)
                if got is None:
                    continue
                pending.put_nowait(got)
                if got.__class__ is Violation or sink.stopped:
                    return
                if window.add(size):   # full: not read further until acks go out
                    await window.wait()
        except MalformedRequest as e:   # aborted by the handler's task, not this one (see MalformedRequest)
            pending.put_nowait(e.violation)
        finally:
            pending.put_nowait(None)
            msg = b = got = table = None
            payload = b""
