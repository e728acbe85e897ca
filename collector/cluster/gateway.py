"""The cluster-mode gateway (`xpusense-collector serve --nats URLS`): the agent protocol of
collector/server.py, with JetStream as the store. Stateless: any number behind one Service, an
agent may move between them at any time.

Per agent stream: Hello -> the boot's mark from the `marks` bucket (seq_marks.py) -> a `hello` message
on the node's subject (inventory, for the workers) -> Welcome(stored_up_to = mark). Each batch above
what this stream has seen is published to `<prefix>.<region>.p<k>.<node>` with `Nats-Msg-Id` =
node:boot:seq and `Xps-Received` = when it was received (this gateway's clock, ns: the workers
judge freshness by it, collector/clock.py), and acknowledged to the agent, in order, only after
JetStream's publish ack (a duplicate by msg id is acknowledged as one). A publish that times out
(no stream leader during an election) is sent again with the same id until `publish_give_up_s`;
then the stream ends with UNAVAILABLE and the agent resends from its spool. A batch at or below the
mark is acknowledged as a duplicate without publishing.

Every batch passes collector/limits.py's checks, as at one collector, before it is published:
`StreamStored` gives them what a gateway knows of what is stored. The bound on sequence numbers
counts from the boot's mark (seq_marks.py `seq_mark`), read before the boot's first batch is checked,
so a forged seq of 2**64-1 is refused (FAILED_PRECONDITION) and never raises the mark. A gateway
holds no node's series: `max_series_per_node` bounds the series one stream introduces (by name and
labels, those not known by reference) within `[state] series_idle_s`; a node's series over
several streams or gateways are bounded by each stream's share only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import grpc
import nats.errors
import nats.js.api
import nats.js.errors

from xpusense.common.supervise import TASKS
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from ..batch_rows import refs_of
from ..limits import MalformedRequest, Violation, read_hello
from ..series import read_labels, series_key
from ..wire import batch_payload
from .seq_marks import Marks
from .subjects import KIND, MSG_ID, RECEIVED, msg_id, node_subject, partition

log = logging.getLogger("xpusense.collector.cluster")

_RETRY = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
          nats.js.errors.ServiceUnavailableError, nats.errors.ConnectionReconnectingError,
          nats.errors.OutboundBufferLimitError, TimeoutError)


class PublishFailed(Exception):
    pass


class Gateway:
    """The JetStream side of a gateway: connection, marks, and publishing with retries.

    A batch's first publish is pipelined (`publish_nowait`): the message goes out with a reply
    subject under this gateway's own inbox and a future waits for JetStream's ack, which one
    subscription hands over (no task, request or timer per batch: at 1,000 agents these were a
    quarter of the gateway's CPU). A future not answered within publish_timeout_s is failed by one
    sweeper; a failed first publish is sent again, with the same msg id, by `publish` (retrying).
    At most max_inflight batches per agent stream wait for their acks (`inflight_waits` counts a
    stream made to wait)."""

    def __init__(self, nc, js, buckets, ncfg: Any, max_inflight: int = 512):
        self.nc, self.js, self.buckets, self.ncfg = nc, js, buckets, ncfg
        self.marks = Marks(buckets.marks, flush_s=min(ncfg.marks_flush_s, ncfg.duplicate_window_s / 4))
        self.max_inflight = max_inflight
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.sessions = 0
        self.published = 0
        self.duplicates = 0
        self.retries = 0
        self.timeouts = 0          # first publishes not answered within publish_timeout_s
        self.inflight_waits = 0    # a stream had max_inflight batches waiting for acks
        self._acks: dict[bytes, tuple[asyncio.Future, float]] = {}   # reply token -> (future, deadline)
        self._inbox = b""
        self._next = 0
        self._sub = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        """Subscribe to this gateway's ack inbox and start the timeout sweeper."""
        self._inbox = f"{self.nc._inbox_prefix.decode()}.{uuid.uuid4().hex}.".encode()
        self._sub = await self.nc.subscribe(self._inbox.decode() + "*", cb=self._on_ack)
        self._sweeper = TASKS.task("gateway-sweeper", self._sweep)   # restarted when it fails (common/supervise.py)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for fut, _ in self._acks.values():
            if not fut.done():
                fut.set_exception(nats.errors.ConnectionClosedError())
        self._acks.clear()

    @property
    def acks_waiting(self) -> int:
        return len(self._acks)

    async def publish_nowait(self, subject: str, payload: bytes, headers: dict[str, str]) -> asyncio.Future:
        """Send one publish now; the future: True/False (a duplicate by msg id or not), or the
        error (one of _RETRY: send it again with `publish`; APIError; ConnectionClosedError)."""
        fut = asyncio.get_running_loop().create_future()
        self._next += 1
        token = b"%x" % self._next
        self._acks[token] = (fut, time.monotonic() + self.ncfg.publish_timeout_s)
        try:
            await self.nc.publish(subject, payload, reply=(self._inbox + token).decode(), headers=headers)
        except Exception as e:   # closed, reconnecting, buffer full: the caller's retry decides
            self._acks.pop(token, None)
            fut.set_exception(e)
        return fut

    async def _on_ack(self, msg) -> None:
        entry = self._acks.pop(msg.subject.encode()[len(self._inbox):], None)
        if entry is None or entry[0].done():   # answered after its timeout: it was sent again
            return
        fut = entry[0]
        if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == "503":   # no responders
            fut.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            resp = json.loads(msg.data)
        except ValueError as e:
            fut.set_exception(nats.js.errors.APIError(description=f"unreadable publish ack: {e}"))
            return
        if "error" in resp:
            try:
                nats.js.errors.APIError.from_error(resp["error"])   # raises the error's own class
            except nats.js.errors.APIError as e:
                fut.set_exception(e)
        else:
            fut.set_result(bool(resp.get("duplicate")))

    async def _sweep(self) -> None:
        every_s = min(1.0, self.ncfg.publish_timeout_s / 4)
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            late = [t for t, (_, deadline) in self._acks.items() if deadline < now]
            for t in late:
                fut, _ = self._acks.pop(t)
                if not fut.done():
                    self.timeouts += 1
                    fut.set_exception(nats.errors.TimeoutError())

    async def settle(self, fut: asyncio.Future, subject: str, payload: bytes, headers: dict[str, str],
                     since: float) -> bool:
        """The outcome of a publish_nowait: duplicate or not, after sending it again (same msg id)
        if it failed in a way that may pass; PublishFailed as `publish` raises it."""
        try:
            return await fut
        except _RETRY:
            self.retries += 1
        except nats.js.errors.APIError as e:
            if e.code is not None and e.code < 500:
                raise PublishFailed(f"JetStream refused {subject}: {e}") from None
            self.retries += 1
        except nats.errors.ConnectionClosedError as e:
            raise PublishFailed(f"the NATS connection is closed: {e}") from None
        ack = await self.publish(subject, payload, headers, since=since)
        return bool(ack.duplicate)

    def subject(self, node_id: str, inventory: pb.Inventory) -> str:
        n = self.ncfg
        return node_subject(n.prefix, inventory.labels.get("region", ""), partition(node_id, n.partitions), node_id)

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], since: float | None = None):
        """Publish until JetStream acknowledges (retrying with the same headers, so the same msg id),
        or raise PublishFailed publish_give_up_s after `since` (the first try; default now)."""
        n = self.ncfg
        give_up = (time.monotonic() if since is None else since) + n.publish_give_up_s
        while True:
            try:
                return await self.js.publish(subject, payload, timeout=n.publish_timeout_s, headers=headers)
            except _RETRY as e:
                err: Exception = e
            except nats.js.errors.APIError as e:   # 503 no leader, and the like: the cluster is electing
                if e.code is not None and e.code < 500:
                    raise PublishFailed(f"JetStream refused {subject}: {e}") from None
                err = e
            except nats.errors.ConnectionClosedError as e:
                raise PublishFailed(f"the NATS connection is closed: {e}") from None
            self.retries += 1
            if time.monotonic() > give_up:
                raise PublishFailed(f"no JetStream ack for {subject} in {n.publish_give_up_s:g} s "
                                    f"({type(err).__name__}: {err})")
            await asyncio.sleep(0.1)


class StreamStored:
    """limits.Stored for one agent stream at a gateway: the boots' marks (seq_marks.py) and the series
    (name, labels) this stream introduced, each let go `idle_s` after it came (at most once every
    EVICT_EVERY_S a look)."""

    EVICT_EVERY_S = 10.0

    def __init__(self, marks: Marks, idle_s: float, clock=time.monotonic):
        self.marks, self.idle_s, self.clock = marks, idle_s, clock
        self.series: dict[tuple, float] = {}   # (name, labels) -> when it came (clock)
        self.tried = clock()

    def seq_mark(self, node_id: str, boot_id: str) -> tuple[int, float] | None:
        return self.marks.seq_mark(node_id, boot_id)

    def series_count(self, node_id: str) -> int:
        return len(self.series)

    def new_series(self, node_id: str, samples) -> set[tuple]:
        return {k for s in samples if (k := series_key(s.name, read_labels(s.labels))) not in self.series}

    def evict_expired(self, node_id: str, newest_ns: int = 0) -> int:
        now = self.clock()
        if now - self.tried < self.EVICT_EVERY_S:
            return 0
        self.tried = now
        old = [k for k, t in self.series.items() if now - t > self.idle_s]
        for k in old:
            del self.series[k]
        return len(old)

    def admit(self, node_id: str, samples) -> None:
        now = self.clock()
        for s in samples:
            self.series.setdefault(series_key(s.name, read_labels(s.labels)), now)


class ClusterIngestServicer(pb_grpc.IngestServicer):
    def __init__(self, gw: Gateway, security=None, limits=None):
        self.gw, self.security, self.limits = gw, security, limits

    async def Stream(self, request_iterator, context: grpc.aio.ServicerContext):
        gw = self.gw
        peer = context.peer()
        hello = await read_hello(request_iterator, context, self.security)
        if hello is None:
            return
        node_id, boot_id = hello.node_id, hello.boot_id
        if (why := self._inventory_refused(node_id, hello.inventory)) is not None:
            await context.abort(why.code, why.message)
        gw.sessions += 1
        session = f"{gw.id}/{gw.sessions}"
        subject = gw.subject(node_id, hello.inventory)
        try:
            mark = await gw.marks.get(node_id, boot_id)
            await gw.publish(subject, hello.SerializeToString(), {KIND: "hello", "Xps-Session": session,
                                                                  "Xps-Peer": peer[:200], RECEIVED: str(time.time_ns())})
        except (PublishFailed, nats.errors.Error) as e:
            log.warning("node %s: cannot reach JetStream for the Hello: %s", node_id, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the cluster is not answering: {e}")
        log.info("node %s connected from %s (boot %s, stored up to %d)", node_id, peer, boot_id, mark)
        pending: asyncio.Queue = asyncio.Queue()
        room = asyncio.Semaphore(gw.max_inflight)
        state = {"subject": subject}
        reader = asyncio.create_task(self._read(request_iterator, node_id, boot_id, mark, session, state, pending, room))
        try:
            yield pb.CollectorMessage(welcome=pb.Welcome(boot_id=boot_id, stored_up_to=mark))
            while True:
                item = await pending.get()
                if item is None:
                    break
                if isinstance(item, Violation):
                    await context.abort(item.code, item.message)
                b, fut, again = item
                if fut is None:   # at or below the mark: stored before
                    gw.duplicates += 1
                    yield pb.CollectorMessage(ack=pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=True))
                    continue
                try:
                    duplicate = await gw.settle(fut, *again)
                except PublishFailed as e:
                    log.warning("node %s: %s; ending its stream (the agent resends)", node_id, e)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                finally:
                    room.release()
                    item = fut = again = None
                if b is None:     # an inventory message: nothing to acknowledge
                    continue
                gw.marks.raised(node_id, b.boot_id, b.seq)
                if duplicate:
                    gw.duplicates += 1
                else:
                    gw.published += 1
                yield pb.CollectorMessage(ack=pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=duplicate))
            await reader
        finally:
            reader.cancel()
            asyncio.get_running_loop().create_task(self._bye(node_id, boot_id, state["subject"], session))
            log.info("node %s disconnected", node_id)
            request_iterator = hello = None

    def _inventory_refused(self, node_id: str, inv: pb.Inventory):
        """collector/limits.py's bound on an inventory (counted and logged as the collector does)."""
        check = getattr(self.limits, "check_inventory", None)
        if check is None:
            return None
        v = check(inv)
        if v is not None:
            self.limits.count(v)
            self.limits.log.warning("node %r: %s", node_id[:128], v.message)
        return v

    async def _bye(self, node_id: str, boot_id: str, subject: str, session: str) -> None:
        try:
            await self.gw.marks.flush(node_id, boot_id)
            await self.gw.js.publish(subject, b"", timeout=self.gw.ncfg.publish_timeout_s,
                                     headers={KIND: "bye", "Xps-Session": session})
        except Exception as e:   # best effort: workers also age sessions out
            log.debug("node %s: bye not published: %s", node_id, e)

    async def _read(self, request_iterator, node_id: str, boot_id: str, mark: int, session: str, state: dict,
                    pending: asyncio.Queue, room: asyncio.Semaphore) -> None:
        gw = self.gw
        seen: dict[str, int] = {boot_id: mark}   # per boot on this stream: the highest seq taken
        stored = StreamStored(gw.marks, getattr(self.limits, "series_idle_s", 3600.0))
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("msg")
                if kind == "batch":
                    payload = batch_payload(msg)   # first: before anything here awaits
                    b = msg.batch
                    if b.node_id != node_id:
                        pending.put_nowait(Violation(grpc.StatusCode.PERMISSION_DENIED,
                                                f"batch for node {b.node_id!r} on a stream opened by node {node_id!r}"))
                        return
                    high = seen.get(b.boot_id)
                    if high is None:   # an earlier boot's batches, resent from the spool
                        high = seen[b.boot_id] = await gw.marks.get(node_id, b.boot_id)
                    if self.limits is not None and (why := self.limits.check(node_id, b, stored,
                                                                             refs=refs_of(b, payload))):
                        pending.put_nowait(Violation(why.code, why.message))
                        return
                    if b.seq <= high:
                        pending.put_nowait((b, None, None))
                        continue
                    seen[b.boot_id] = b.seq
                    if room.locked():
                        gw.inflight_waits += 1
                    await room.acquire()
                    again = (state["subject"], payload, {MSG_ID: msg_id(node_id, b.boot_id, b.seq),
                                                         RECEIVED: str(time.time_ns())}, time.monotonic())
                    pending.put_nowait((b, await gw.publish_nowait(*again[:3]), again))
                elif kind == "inventory":
                    if (why := self._inventory_refused(node_id, msg.inventory)) is not None:
                        pending.put_nowait(Violation(why.code, why.message))
                        return
                    state["subject"] = gw.subject(node_id, msg.inventory)
                    if room.locked():
                        gw.inflight_waits += 1
                    await room.acquire()
                    again = (state["subject"], msg.inventory.SerializeToString(),
                             {KIND: "inventory", "Xps-Session": session}, time.monotonic())
                    pending.put_nowait((None, await gw.publish_nowait(*again[:3]), again))
                else:
                    pending.put_nowait(Violation(grpc.StatusCode.INVALID_ARGUMENT,
                                                 f"unexpected message {kind!r} after Hello"))
                    return
        except MalformedRequest as e:   # aborted by the handler's task, not this one (see MalformedRequest)
            pending.put_nowait(e.violation)
        finally:
            pending.put_nowait(None)
