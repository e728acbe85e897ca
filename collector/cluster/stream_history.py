"""GetHistory in cluster mode: the stream is the history (it keeps `retention_s`), so one node's
series is read back from it on request: an ephemeral consumer over the node's subjects, every
batch of the window parsed for the one series. Nothing keeps points in process memory.

Each (boot, seq) is taken once (SeqWindow), so a resend stored twice beyond JetStream's duplicate
window does not show as two points. At most `max_batches` batches are read (the newest are kept).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from xpusense.v1 import telemetry_pb2 as pb

from ..series import read_labels, series_key
from .seq_marks import SeqWindow
from .subjects import KIND, node_filter, partition, stream_of


async def read_history(js, ncfg: Any, node_id: str, name: str, labels: dict[str, str],
                       since_s: float | None = None, max_batches: int = 20_000) -> pb.HistoryReply | None:
    """The points of series (name, labels) of the node over the stream's window; None when the
    node has no such series there."""
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
                w = windows.get(b.boot_id)
                if w is None:
                    w = windows[b.boot_id] = SeqWindow()
                if not w.take(b.seq):
                    continue
                for s in b.samples:
                    key = (b.boot_id, s.series_ref)
                    hit = refs.get(key) if s.series_ref else None
                    if hit is None:
                        hit = s.name == name and series_key(name, read_labels(s.labels)) == want
                        if s.series_ref:
                            refs[key] = hit
                    if hit:
                        unit = s.unit
                        points.append((s.time_unix_nano, s.value))
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


def _rfc3339(t: float):
    import datetime
    return datetime.datetime.fromtimestamp(t, datetime.UTC)
