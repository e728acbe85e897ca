"""GetHistory in cluster mode: the stream is the history (it keeps `retention_s`), so one node's
series is read back from it on request: an ephemeral consumer over the node's subjects, every
batch of the window parsed for the one series. Nothing keeps points in process memory.

Each (boot, seq) is taken once (SeqWindow), so a resend stored twice beyond JetStream's duplicate
window does not show as two points. At most `max_batches` batches are read (the newest are kept).
A compact batch is read with the series definitions of the `series` bucket (series_defs.py); one
whose refs have none there is left out, counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from xpusense.common.compact import CompactError
from xpusense.v1 import telemetry_pb2 as pb

from ..limits import DEFAULTS as LIMITS
from ..limits import RateLimitedLog
from ..series import read_labels, series_key
from ..series_dictionary import MissingDefinition
from .config import NATS_SCHEMA
from .seq_marks import SeqWindow
from .series_defs import SeriesCache, is_compact
from .subjects import KIND, node_filter, partition, stream_of

_log = RateLimitedLog(logging.getLogger("xpusense.collector.cluster.history"))


def series_cache(js, ncfg: Any) -> SeriesCache:
    """The definitions GetHistory reads compact batches with, shared by a process's requests."""
    bucket, boots = (getattr(ncfg, k, NATS_SCHEMA[k].default) for k in ("series_bucket", "series_cache_boots"))
    return SeriesCache(js, bucket, boots)


async def read_history(js, ncfg: Any, node_id: str, name: str, labels: dict[str, str],
                       since_s: float | None = None, max_batches: int = 20_000,
                       cache: SeriesCache | None = None) -> pb.HistoryReply | None:
    """The points of series (name, labels) of the node over the stream's window; None when the
    node has no such series there. `cache`: the series definitions held (series_cache)."""
    cache = cache if cache is not None else series_cache(js, ncfg)
    part = partition(node_id, ncfg.partitions)
    stream = stream_of(ncfg.prefix, part, ncfg.streams)
    window_s = since_s if since_s is not None else ncfg.retention_s
    cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME, ack_policy=api.AckPolicy.NONE,
                             inactive_threshold=30.0, mem_storage=True, num_replicas=1,
                             opt_start_time=_rfc3339(time.time() - window_s))
    sub = await js.pull_subscribe(node_filter(ncfg.prefix, part, node_id), durable=None, stream=stream, config=cfg)
    want = series_key(name, labels)
    points: list[tuple[int, float]] = []
    unit = None
    windows: dict[str, SeqWindow] = {}
    refs: dict[tuple[str, int], bool] = {}
    read = 0
    try:
        while read < max_batches:
            try:
                msgs = await sub.fetch(batch=min(1000, max_batches - read), timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                break
            except nats.js.errors.ServiceUnavailableError:   # the consumer is not ready yet
                await asyncio.sleep(0.1)
                continue
            for msg in msgs:
                read += 1
                if msg.headers and msg.headers.get(KIND):
                    continue
                b = pb.Batch.FromString(msg.data)
                read_back = await _samples(b, node_id, cache, windows)
                if read_back is None:
                    continue
                samples, got = read_back
                for i, (ref, t, v) in enumerate(got):
                    key = (b.boot_id, ref)
                    hit = refs.get(key) if ref else None
                    if hit is None:
                        s = samples[i]
                        hit = s.name == name and series_key(name, read_labels(s.labels)) == want
                        if ref:
                            refs[key] = hit
                        if hit:
                            unit = s.unit
                    if hit:
                        points.append((t, v))
            if not msgs or msgs[-1].metadata.num_pending == 0:
                break
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    if unit is None:
        return None
    points.sort()
    reply = pb.HistoryReply(unit=unit)
    reply.points.extend(pb.Point(time_unix_nano=t, value=v) for t, v in points)
    return reply


async def _samples(b: pb.Batch, node_id: str, cache: SeriesCache,
                   windows: dict[str, SeqWindow]) -> tuple[Any, list] | None:
    """A batch's samples (each read only where needed) and (series_ref, time, value) rows, once per
    (boot, seq); None for one taken before, of another node, or compact with refs the series
    bucket does not define (counted `history.skipped`, logged)."""
    if b.node_id != node_id:
        return None
    w = windows.get(b.boot_id)
    if w is None:
        w = windows[b.boot_id] = SeqWindow()
    if not is_compact(b):
        return (b.samples, [(s.series_ref, s.time_unix_nano, s.value) for s in b.samples]) if w.take(b.seq) else None
    try:
        c = await cache.read(b, int(LIMITS["max_samples_per_batch"]))
    except (MissingDefinition, CompactError) as e:
        cache.counters["history.skipped"] += 1
        _log.warning("GetHistory of node %r: a batch left out: %s", node_id[:128], e)
        return None
    return (c.samples, c.rows()) if w.take(b.seq) else None


def _rfc3339(t: float):
    import datetime
    return datetime.datetime.fromtimestamp(t, datetime.UTC)
