"""The cluster-mode gateway (`xpusense-collector serve --nats URLS`): the agent's Ingest stream of
collector/ingest_session.py with JetStream as its sink. Stateless: any number behind one Service, an
agent may move between them at any time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import nats.errors
import nats.js.api
import nats.js.errors

from xpusense.common import compact
from xpusense.common.supervise import TASKS
from xpusense.v1 import telemetry_pb2 as pb

from ..batch_rows import refs_of
from ..ingest_session import IngestSession, PendingWindow, Sink, choose_encoding
from ..limits import Violation
from ..series import read_labels, series_key
from .config import NATS_SCHEMA
from .seq_marks import Marks
from .series_defs import StreamTables, is_compact
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
        self.counts: collections.Counter[str] = collections.Counter()   # series tables (series_defs.py)
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
        return await self._acked(subject, lambda: self.js.publish(subject, payload, timeout=n.publish_timeout_s,
                                                                   headers=headers), since)

    async def put(self, kv, key: str, value: bytes):
        """A KV bucket's put, retried as a publish is (a stream leader's election passes unseen)."""
        return await self._acked(f"key {key}", lambda: kv.put(key, value))

    async def _acked(self, what: str, send: Callable[[], Awaitable[Any]], since: float | None = None):
        n = self.ncfg
        give_up = (time.monotonic() if since is None else since) + n.publish_give_up_s
        while True:
            try:
                return await send()
            except _RETRY as e:
                err: Exception = e
            except nats.js.errors.APIError as e:   # 503 no leader, and the like: the cluster is electing
                if e.code is not None and e.code < 500:
                    raise PublishFailed(f"JetStream refused {what}: {e}") from None
                err = e
            except nats.errors.ConnectionClosedError as e:
                raise PublishFailed(f"the NATS connection is closed: {e}") from None
            self.retries += 1
            if time.monotonic() > give_up:
                raise PublishFailed(f"no JetStream ack for {what} in {n.publish_give_up_s:g} s "
                                    f"({type(err).__name__}: {err})")
            await asyncio.sleep(0.1)


class StreamStored:
    """limits.Stored for one agent stream at a gateway: the boots' marks (seq_marks.py) and the series
    (name, labels) this stream introduced, each let go `idle_s` after it came (at most once every
    EVICT_EVERY_S a look). A gateway holds no node's series: `max_series_per_node` bounds what one
    stream introduces; a node's series over several streams or gateways by each stream's share only."""

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


class GatewayStream(Sink):
    """One agent stream at a gateway. Each batch above what is stored of its boot (the boot's mark,
    or what this stream took since) is published to the node's subject with `Nats-Msg-Id` =
    node:boot:seq and `Xps-Received` = when this gateway received it (the workers judge freshness by
    it, collector/clock.py), and acknowledged after JetStream's publish ack (a duplicate by msg id is
    acknowledged as one); a batch at or below is acknowledged as a duplicate, unpublished. Every
    batch passes collector/limits.py's checks first, with what a gateway knows of what is stored
    (StreamStored): the seq bound counts from the boot's mark, so a forged seq is refused and never
    raises it. At most `Gateway.max_inflight` messages of a stream wait for their publish acks."""

    def __init__(self, ingest: ClusterIngestServicer, node_id: str, boot_id: str, session: str, subject: str,
                 mark: int, encoding: str = ""):
        self.gw, self.limits = ingest.gw, ingest.limits
        self.node_id, self.session, self.subject = node_id, session, subject
        self.welcome = pb.Welcome(boot_id=boot_id, stored_up_to=mark, batch_encoding=encoding)
        ttl_s = getattr(self.gw.ncfg, "series_ttl_s", NATS_SCHEMA["series_ttl_s"].default)
        series = self.gw.buckets.series
        self.tables = StreamTables(lambda k, v: self.gw.put(series, k, v), node_id, self.limits, ttl_s, self.gw.counts)
        self.seen: dict[str, int] = {boot_id: mark}   # per boot on this stream: the highest seq taken
        self.stored = StreamStored(self.gw.marks, getattr(self.limits, "series_idle_s", 3600.0))
        self.window = PendingWindow(self.gw.max_inflight, on_full=self._waits)

    def _waits(self, _key: str) -> None:
        self.gw.inflight_waits += 1

    def series(self, table: pb.SeriesTable) -> Violation | None:
        """A SeriesTable: checked, and its write to the series bucket started (`take` awaits it
        before it publishes the next batch)."""
        return self.tables.add(table)

    async def take(self, b, payload: bytes, size: int):
        gw, node_id = self.gw, self.node_id
        if (why := await self.tables.written()) is not None:
            return why
        high = self.seen.get(b.boot_id)
        if high is None:   # an earlier boot's batches, resent from the spool
            high = self.seen[b.boot_id] = await gw.marks.get(node_id, b.boot_id)
        if is_compact(b) and (b := self.tables.batch(b)).__class__ is Violation:   # published as received
            return b
        limits = self.limits
        if limits is not None and (why := limits.check(node_id, b, self.stored, refs=refs_of(b, payload))):
            return why
        if b.seq <= high:
            return b, None, None
        self.seen[b.boot_id] = b.seq
        headers = {MSG_ID: msg_id(node_id, b.boot_id, b.seq), RECEIVED: str(time.time_ns())}
        again = (self.subject, payload, headers, time.monotonic())
        return b, await gw.publish_nowait(*again[:3]), again

    async def inventory(self, inv: pb.Inventory):
        self.subject = self.gw.subject(self.node_id, inv)
        again = (self.subject, inv.SerializeToString(), {KIND: "inventory", "Xps-Session": self.session},
                 time.monotonic())
        return None, await self.gw.publish_nowait(*again[:3]), again

    async def settle(self, item, context) -> pb.Ack | None:
        b, fut, again = item
        gw = self.gw
        if fut is None:   # at or below the mark: stored before
            gw.duplicates += 1
            return pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=True)
        try:
            duplicate = await gw.settle(fut, *again)
        except PublishFailed as e:
            log.warning("node %s: %s; ending its stream (the agent resends)", self.node_id, e)
            item = fut = again = b = None
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if b is None:     # an inventory message: nothing to acknowledge
            return None
        gw.marks.raised(self.node_id, b.boot_id, b.seq)
        if duplicate:
            gw.duplicates += 1
        else:
            gw.published += 1
        return pb.Ack(boot_id=b.boot_id, seq=b.seq, duplicate=duplicate)

    def close(self, unsettled: list) -> None:
        self.tables.close()
        asyncio.get_running_loop().create_task(self._bye(self.welcome.boot_id))

    async def _bye(self, boot_id: str) -> None:
        gw = self.gw
        try:
            await gw.marks.flush(self.node_id, boot_id)
            await gw.js.publish(self.subject, b"", timeout=gw.ncfg.publish_timeout_s,
                                headers={KIND: "bye", "Xps-Session": self.session})
        except Exception as e:   # best effort: workers also age sessions out
            log.debug("node %s: bye not published: %s", self.node_id, e)


class ClusterIngestServicer(IngestSession):
    """A gateway's Ingest: at a Hello, the boot's mark from the `marks` bucket (seq_marks.py) and a
    `hello` message on the node's subject (its inventory, for the workers), then Welcome(stored_up_to
    = mark, the compact encoding where the agent offers it and `batch_encodings` allows); the
    stream's messages go to JetStream (GatewayStream), its series tables to the series bucket."""

    log = log

    def __init__(self, gw: Gateway, security=None, limits=None, batch_encodings: list[str] | None = None):
        super().__init__(security, limits)
        self.gw = gw
        self.batch_encodings = list(batch_encodings) if batch_encodings is not None else list(compact.ENCODINGS)

    async def open(self, hello: pb.Hello, peer: str, context) -> GatewayStream:
        gw = self.gw
        node_id, boot_id = hello.node_id, hello.boot_id
        gw.sessions += 1
        session = f"{gw.id}/{gw.sessions}"
        subject = gw.subject(node_id, hello.inventory)
        try:
            mark = await gw.marks.get(node_id, boot_id)
            await gw.publish(subject, hello.SerializeToString(), {
                KIND: "hello", "Xps-Session": session, "Xps-Peer": peer[:200], RECEIVED: str(time.time_ns())})
        except (PublishFailed, nats.errors.Error) as e:
            log.warning("node %s: cannot reach JetStream for the Hello: %s", node_id, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the cluster is not answering: {e}")
        return GatewayStream(self, node_id, boot_id, session, subject, mark,
                             choose_encoding(hello, self.batch_encodings))
