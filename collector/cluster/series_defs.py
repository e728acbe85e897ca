"""The compact encoding's series definitions in cluster mode: a gateway writes each SeriesTable an
agent sends to the `series` bucket (key `<node>.<boot>.<highest ref>`, `StreamTables`) before it
publishes any later batch of that stream, so every reader of the streams (workers, exporters,
GetHistory) decodes any compact batch it reads; a reader keeps a bounded cache of boots'
definitions (`SeriesCache`), loading a boot's tables from the bucket when a batch needs them."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

from ..limits import DEFAULTS as LIMITS
from ..limits import RateLimitedLog, Violation, short_boot
from ..series_dictionary import MissingDefinition, SeriesDictionary
from ..wire import CompactBatch, WireBatch, compact_batch
from .engine import list_bucket
from .subjects import token

_log = RateLimitedLog(logging.getLogger("xpusense.collector.cluster"))


def table_key(node_id: str, boot_id: str, high: int) -> str:
    """A table's key in the bucket: its node, boot and highest series_ref."""
    return f"{token(node_id)}.{token(boot_id)}.{high}"


def boot_keys(node_id: str, boot_id: str) -> str:
    """Every table of one boot of a node (a keys filter for engine.list_bucket)."""
    return f"{token(node_id)}.{token(boot_id)}.*"


def is_compact(batch: Any) -> bool:
    """A batch read from a stream (wire.read_batch) whose samples are compact columns."""
    return batch.__class__ is not WireBatch and bool(batch.columns)


def read_table(table: pb.SeriesTable, max_bytes: int, max_defs: int) -> tuple[int, list[pb.Sample]]:
    """The highest series_ref a table defines, and its definitions; compact.CompactError where they
    do not decode within `max_bytes`, are more than `max_defs`, or one has no series_ref."""
    defs = compact.decode_defs(table.defs, max_bytes)
    if not defs:
        raise compact.CompactError("a series table with no definitions")
    if len(defs) > max_defs:
        raise compact.CompactError(f"a series table of {len(defs)} definitions, more than {max_defs}")
    if any(not d.series_ref for d in defs):
        raise compact.CompactError("a series definition without a series_ref")
    return max(d.series_ref for d in defs), defs


class SeriesCache:
    """A reader's definitions: per (node, boot) a SeriesDictionary's, at most `max_boots` boots (the
    least recently used let go, counted `series.cache_evicted`). `read` decodes a compact batch,
    loading its boot's tables from the bucket when a ref has no definition here (counted
    `series.loads`); still none: MissingDefinition (the caller skips the batch and counts it)."""

    def __init__(self, js, bucket: str, max_boots: int, max_per_boot: int = 200_000,
                 max_bytes: int = 64 * 2**20, counters: collections.Counter | None = None):
        self.js, self.bucket, self.max_boots, self.max_bytes = js, bucket, max_boots, max_bytes
        self.dictionary = SeriesDictionary(max_per_boot)
        self.counters: collections.Counter[str] = counters if counters is not None else collections.Counter()
        self._used: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def _touch(self, key: tuple[str, str]) -> None:
        self._used[key] = None
        self._used.move_to_end(key)
        while len(self._used) > self.max_boots:
            (node, boot), _ = self._used.popitem(last=False)
            self.dictionary.forget(node, boot)
            self.counters["series.cache_evicted"] += 1

    def decode(self, b: pb.Batch, max_samples: int) -> CompactBatch:
        """`b` against the definitions held (MissingDefinition, compact.CompactError as wire.compact_batch)."""
        got = compact_batch(b, self.dictionary, max_samples)
        self._touch((b.node_id, b.boot_id))
        return got

    async def load(self, node_id: str, boot_id: str) -> int:
        """Every table of the boot from the bucket into the cache; how many were read. A table that
        does not decode is counted (`series.undecodable_tables`) and left out."""
        rows = await list_bucket(self.js, self.bucket, boot_keys(node_id, boot_id))
        self.counters["series.loads"] += 1
        for _key, value, _rev in rows:
            try:
                defs = compact.decode_defs(value, self.max_bytes)
            except compact.CompactError:
                self.counters["series.undecodable_tables"] += 1
                continue
            self.dictionary.add(node_id, boot_id, defs)
        self._touch((node_id, boot_id))
        return len(rows)

    async def read(self, b: pb.Batch, max_samples: int) -> CompactBatch:
        """`b` decoded, its boot's tables loaded from the bucket first when a ref has no definition
        held; MissingDefinition when the bucket has none either."""
        try:
            return self.decode(b, max_samples)
        except MissingDefinition:
            await self.load(b.node_id, b.boot_id)
        return self.decode(b, max_samples)


class StreamTables:
    """The series tables one agent stream sent a gateway. Each is checked as one collector checks it
    (its definitions decode within limits.max_series_table_bytes, each with a ref and within a
    sample's bounds on name, unit and labels), kept in the stream's own dictionary (so
    the gateway refuses a compact batch that does not decode or uses a ref the stream did not
    define, as one collector does) and written to the bucket by `put` (the gateway's, retried as its
    publishes are); `written` is awaited before any later batch is published. The tables' bytes are
    kept (at most max_series_table_bytes a stream) and written again every `ttl_s / 2` while the
    stream lasts, so the bucket outlives its batches."""

    def __init__(self, put: Callable[[str, bytes], Awaitable[Any]], node_id: str, limits: Any, ttl_s: float,
                 counts: collections.Counter, clock=time.monotonic):
        get = (lambda k: getattr(limits, k)) if limits is not None else LIMITS.__getitem__
        self.put, self.node_id, self.ttl_s, self.counts, self.clock = put, node_id, ttl_s, counts, clock
        self.max_bytes, self.max_samples = int(get("max_series_table_bytes")), int(get("max_samples_per_batch"))
        self.dictionary = SeriesDictionary(int(get("max_series_per_node")))
        # a sample's bounds on name, unit and labels (collector/limits.py)
        self.check: Callable[[pb.Sample], Violation | None] | None = getattr(limits, "check_definition", None)
        self.tables: dict[str, bytes] = {}
        self.bytes = 0
        self.pending: list[asyncio.Task] = []
        self.written_at = 0.0

    def add(self, table: pb.SeriesTable) -> Violation | None:
        """A table read from the stream: its put started (None), or why the stream is refused."""
        try:
            high, defs = read_table(table, self.max_bytes, self.dictionary.max_per_boot)
        except compact.CompactError as e:
            self.counts["series.tables_refused"] += 1
            return Violation(grpc.StatusCode.INVALID_ARGUMENT,
                             f"SeriesTable of boot {short_boot(table.boot_id)} refused: {e}")
        if (v := self.dictionary.refusal(self.node_id, table.boot_id, defs, self.check)) is not None:
            self.counts["series.tables_refused"] += 1
            return v
        key = table_key(self.node_id, table.boot_id, high)
        size = len(table.defs) - len(self.tables.get(key, b""))
        if self.bytes + size > self.max_bytes:
            self.counts["series.tables_refused"] += 1
            return Violation(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"SeriesTable of boot {short_boot(table.boot_id)} refused: this stream's tables "
                             f"take more than limits.max_series_table_bytes = {self.max_bytes}",
                             "max_series_table_bytes")
        self.dictionary.add(self.node_id, table.boot_id, defs)
        self.tables[key] = table.defs
        self.bytes += size
        self.pending.append(asyncio.ensure_future(self._put(key, table.defs)))
        return None

    async def _put(self, key: str, defs: bytes) -> Exception | None:
        try:
            await self.put(key, defs)
        except Exception as e:   # handed to `written` (a task's exception is never left unread)
            return e
        self.counts["series.tables_written"] += 1
        return None

    async def written(self) -> Violation | None:
        """The tables read so far in the bucket (and every table written again when `ttl_s / 2`
        passed since they last were); UNAVAILABLE where the bucket refused or did not answer."""
        now = self.clock()
        if self.tables and now - self.written_at > self.ttl_s / 2:
            if self.written_at:
                self.pending += [asyncio.ensure_future(self._put(k, v)) for k, v in self.tables.items()]
            self.written_at = now
        if not self.pending:
            return None
        pending, self.pending = self.pending, []
        failed = [e for e in await asyncio.gather(*pending) if e is not None]
        if not failed:
            return None
        self.counts["series.tables_unwritten"] += len(failed)
        _log.warning("node %r: %d series tables not written to the series bucket: %s %s; ending its stream "
                     "(the agent sends them again)", self.node_id[:128], len(failed), type(failed[0]).__name__,
                     failed[0])
        return Violation(grpc.StatusCode.UNAVAILABLE, f"series definitions not written to the cluster's "
                         f"series bucket: {type(failed[0]).__name__} {failed[0]}; send them again")

    def batch(self, b: pb.Batch) -> CompactBatch | Violation:
        """A compact batch read against this stream's definitions, or why it is refused."""
        try:
            return compact_batch(b, self.dictionary, self.max_samples)
        except compact.CompactError as e:
            v = Violation(grpc.StatusCode.INVALID_ARGUMENT, f"batch {b.seq} of boot {short_boot(b.boot_id)}: "
                          f"compact columns refused: {e}")
        except MissingDefinition as e:
            v = Violation(grpc.StatusCode.FAILED_PRECONDITION, f"batch {b.seq} refused: {e}")
        self.counts["series.batches_refused"] += 1
        _log.warning("node %r: %s", self.node_id[:128], v.message)
        return v

    def close(self) -> None:
        for t in self.pending:
            t.cancel()
        self.pending = []
