"""OTLP export in cluster mode (`xpusense-collector exporter --nats URLS`): the collector's OtlpExport
with the streams as its queue. One durable consumer per stream acknowledges batches only once the
backend took them (at least once; any number of exporters share the consumers), and inventories
come from the stream's hello/inventory messages or the node's summary (docs/scale.md). A compact
batch is exported as the samples the Sample encoding would have carried (series_defs.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from xpusense.common.compact import CompactError
from xpusense.v1 import telemetry_pb2 as pb

from ..inventory_book import InventoryBook
from ..limits import DEFAULTS as LIMITS
from ..limits import RateLimitedLog
from ..series_dictionary import MissingDefinition
from .seq_marks import SeqWindow
from .series_defs import is_compact
from .stream_history import series_cache
from .subjects import KIND, node_of_subject, partition, stream_name, token
from .summary import decode, fleet_key

log = logging.getLogger("xpusense.collector.cluster.export")
_log = RateLimitedLog(log)


class StreamBook(InventoryBook):
    """Every node's latest inventory, noted on the loop from the stream (or the fleet bucket) and
    read by the exporter's thread (InventoryBook.get)."""

    def note(self, node_id: str, raw: bytes) -> None:
        self._raw[node_id] = raw     # one dict store: atomic for the reading thread

    def has(self, node_id: str) -> bool:
        return node_id in self._raw


class StreamQueue:
    """The queue interface of OtlpExport (peek, commit, status) over the cluster's streams. The
    methods are called from the exporter's thread and run on `loop`, where the NATS client lives."""

    def __init__(self, js, buckets, ncfg: Any, loop: asyncio.AbstractEventLoop, name: str = "otlp",
                 timeout_s: float = 30.0):
        self.js, self.buckets, self.ncfg, self.loop, self.name = js, buckets, ncfg, loop, name
        self.timeout_s = timeout_s
        self.book = StreamBook()
        self.subs: dict[str, Any] = {}
        self.held: list[pb.Batch] = []              # fetched, not yet accepted by the backend
        self.held_points = 0
        self.tail: dict[str, Any] = {}              # stream -> newest message fetched (acks all before it)
        self.last_seq: dict[str, int] = {}          # stream -> its stream sequence (redeliveries skipped)
        # (node, boot) -> its seqs exported: each once per process (a resend stored twice beyond the
        # duplicate window is not)
        self.windows: dict[tuple[str, str], SeqWindow] = {}
        self.skipped = 0
        self.series = series_cache(js, ncfg)   # compact batches' definitions

    async def open(self) -> None:
        n = self.ncfg
        for i in range(n.streams):
            stream = stream_name(n.prefix, i)
            durable = f"{self.name}-{i}"
            await self.js.add_consumer(stream, api.ConsumerConfig(
                durable_name=durable, ack_policy=api.AckPolicy.ALL, deliver_policy=api.DeliverPolicy.ALL,
                ack_wait=3600.0, max_ack_pending=-1, num_replicas=n.replicas))
            self.subs[stream] = await self.js.pull_subscribe_bind(durable=durable, stream=stream)

    # -- called from the exporter's thread -----------------------------------------------------------
    def peek(self, max_points: int):
        return asyncio.run_coroutine_threadsafe(self._peek(max_points), self.loop).result(self.timeout_s)

    def commit(self, tok) -> None:
        asyncio.run_coroutine_threadsafe(self._commit(tok), self.loop).result(self.timeout_s)

    def status(self) -> dict:
        return {"queue": "stream", "held_batches": len(self.held), "skipped_resends": self.skipped,
                "skipped_undefined": self.series.counters["export.skipped"]}

    # -- on the loop ----------------------------------------------------------------------------------
    async def _peek(self, max_points: int):
        while self.held_points < max_points:
            got = 0
            for stream, sub in self.subs.items():
                try:
                    msgs = await sub.fetch(batch=16, timeout=0.2)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except (nats.errors.Error, nats.js.errors.Error) as e:   # an election, a reconnect
                    log.debug("exporter: fetch from %s: %s", stream, e)
                    continue
                for m in msgs:
                    got += 1
                    await self._take(stream, m)
                if self.held_points >= max_points:
                    break
            if not got:
                break
        return list(self.held), dict(self.tail)

    async def _take(self, stream: str, m) -> None:
        seq = m.metadata.sequence.stream
        if seq <= self.last_seq.get(stream, 0):
            return                      # delivered again (ack_wait passed while the backend was away)
        self.last_seq[stream] = seq
        self.tail[stream] = m
        node_id = node_of_subject(m.subject)
        kind = (m.headers or {}).get(KIND)
        if kind == "hello":
            self.book.note(node_id, pb.Hello.FromString(m.data).inventory.SerializeToString())
            return
        if kind == "inventory":
            self.book.note(node_id, m.data)
            return
        if kind is not None:
            return
        b = pb.Batch.FromString(m.data)
        if is_compact(b) and (b := await self._expanded(node_id, b)) is None:
            return
        w = self.windows.get((node_id, b.boot_id))
        if w is None:
            w = self.windows[(node_id, b.boot_id)] = SeqWindow()
        if not w.take(b.seq):
            self.skipped += 1
            return
        if not self.book.has(node_id):
            await self._inventory_from_fleet(node_id)
        if b.samples:
            self.held.append(b)
            self.held_points += len(b.samples)

    async def _expanded(self, node_id: str, b: pb.Batch) -> pb.Batch | None:
        """A compact batch as the Sample encoding would have carried it; None (counted, logged) where
        it is another node's, its columns do not decode or a ref has no definition in the bucket. The
        bucket not answering is waited out: a batch taken past is acknowledged with the later ones."""
        try:
            if b.node_id != node_id:
                raise CompactError(f"a batch of node {b.node_id[:128]!r} on the subject of {node_id[:128]!r}")
            while True:
                try:
                    c = await self.series.read(b, int(LIMITS["max_samples_per_batch"]))
                    break
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as e:
                    log.info("exporter: node %r: series definitions not read yet: %s", node_id[:128], e)
                    await asyncio.sleep(0.5)
        except (MissingDefinition, CompactError) as e:
            self.series.counters["export.skipped"] += 1
            _log.warning("exporter: node %r: a batch not exported: %s", node_id[:128], e)
            return None
        out = pb.Batch(node_id=b.node_id, boot_id=b.boot_id, seq=b.seq, sent_unix_nano=b.sent_unix_nano)
        out.events.extend(b.events)
        out.samples.extend(c.samples)
        return out

    async def _inventory_from_fleet(self, node_id: str) -> None:
        key = fleet_key(partition(node_id, self.ncfg.partitions), token(node_id))
        with contextlib.suppress(nats.js.errors.NotFoundError, nats.errors.Error):
            e = await self.buckets.fleet.get(key)
            d = decode(e.value) if e.value else None
            if d is not None and d.get("inventory"):
                self.book.note(node_id, d["inventory"])

    async def _commit(self, tok) -> None:
        if not tok:
            return
        for m in tok.values():
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
                await m.ack()
        # What the committed peek returned is what was held then: the oldest entries.
        self.held.clear()
        self.held_points = 0
        for stream, m in tok.items():
            if self.tail.get(stream) is m:
                del self.tail[stream]


async def run_exporter(cfg: Any, stop: asyncio.Event) -> None:
    """`xpusense-collector exporter`: [export.otlp] from the streams until stopped."""
    from ..otlp_export import OtlpExport
    from .engine import ClusterUnavailable, connect, disconnect, ensure
    if not cfg.export.otlp.enabled:
        raise ClusterUnavailable("the exporter has nothing to do: set [export.otlp] enabled = true (and its endpoint)")
    ncfg = cfg.nats
    nc = await connect(ncfg, "xpusense-exporter", role="exporter")
    js = nc.jetstream(timeout=ncfg.publish_timeout_s)
    buckets = await ensure(js, ncfg, create=False)   # a gateway creates them
    queue = StreamQueue(js, buckets, ncfg, asyncio.get_running_loop())
    await queue.open()
    export = OtlpExport(cfg.export.otlp, queue.book, queue)
    export.start()
    log.info("exporter: OTLP to %s from the %d streams of the NATS cluster at %s", cfg.export.otlp.endpoint,
             ncfg.streams, ",".join(ncfg.urls))
    try:
        await stop.wait()
    finally:
        await asyncio.get_running_loop().run_in_executor(None, export.stop)
        await disconnect(nc)
