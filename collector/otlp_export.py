"""OTLP export from the collector: every point the fleet stored to an OpenTelemetry backend over
OTLP gRPC, and with `logs` every stored event as a log record (docs/export.md). The queue is the
durable store where there is one (a cursor committed once the backend took the points: at least
once), else a bounded in-memory queue fed by the fleet's watchers (the oldest dropped, counted).
One thread sends, with a backoff on failure; events have a queue and backoff of their own, so a
backend that takes metrics but not logs never holds the metrics up."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from xpusense.common.backoff import backoff_delays
from xpusense.common.otlp import (
    OtlpSender,
    Resources,
    StartTimes,
    device_attributes,
    log_records,
    metrics_data,
    resource_attributes,
)

from .fleet_interface import Fleet
from .inventory_book import InventoryBook
from .store import StoreReader

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData

    from xpusense.v1 import telemetry_pb2 as pb

log = logging.getLogger("xpusense.collector.otlp")

LOG_REQUEST_EVENTS = 1000


class StoreQueue:
    """The durable store as the export queue (collector/store.py StoreReader, cursor `otlp`)."""

    def __init__(self, store, name: str = "otlp"):
        self.reader = StoreReader(store, name)
        self._k = 64   # batches per read, shrunk when they hold more points than one request takes

    def peek(self, max_points: int):
        k = self._k
        while True:
            batches, cursor = self.reader.read(max_batches=k)
            points = sum(len(b.samples) for b in batches)
            if points <= max_points or len(batches) <= 1:
                break
            # Too many points for one request: read a prefix (a re-read returns the same batches).
            k = max(1, len(batches) * max_points // points)
        self._k = max(1, min(256, (k * max_points // points) if points else 64))
        return batches, cursor

    def commit(self, token) -> None:
        self.reader.commit(token)

    def status(self) -> dict:
        return {"queue": "store", "cursor": list(self.reader.cursor)}


class MemoryQueue:
    """Batches as the fleet stores them (its watchers), bounded: the oldest dropped first, counted."""

    def __init__(self, max_batches: int):
        self.max_batches = max_batches
        self._q: collections.deque[tuple[int, pb.Batch]] = collections.deque()   # (seq, batch)
        self._seq = 0
        self._lock = threading.Lock()
        self.dropped_batches = 0
        self.dropped_points = 0
        self.dropped_events = 0

    def watch(self, state: Fleet) -> MemoryQueue:
        state.watchers.append(self._on_batch)
        return self

    def _on_batch(self, node, batch) -> None:
        if batch is None or not (batch.samples or batch.events):
            return
        with self._lock:
            self._seq += 1
            self._q.append((self._seq, batch))
            if len(self._q) > self.max_batches:
                _, old = self._q.popleft()
                self.dropped_batches += 1
                self.dropped_points += len(old.samples)
                self.dropped_events += len(old.events)
                if self.dropped_batches in (1, 10, 100) or self.dropped_batches % 1000 == 0:
                    log.warning("OTLP export queue full (%d batches, no data_dir): dropped %d batches, "
                                "%d points, %d events so far; the backend is slow or away (set data_dir for a "
                                "durable queue)", self.max_batches, self.dropped_batches, self.dropped_points,
                                self.dropped_events)

    def peek(self, max_points: int) -> tuple[list[pb.Batch], int | None]:
        out: list[pb.Batch] = []
        points = 0
        last: int | None = None
        with self._lock:
            for seq, b in self._q:
                if out and points + len(b.samples) > max_points:
                    break
                out.append(b)
                points += len(b.samples)
                last = seq
        return out, last

    def commit(self, token) -> None:
        if token is None:
            return
        with self._lock:
            while self._q and self._q[0][0] <= token:
                self._q.popleft()

    def status(self) -> dict:
        with self._lock:
            return {"queue": "memory", "queued_batches": len(self._q), "dropped_batches": self.dropped_batches,
                    "dropped_points": self.dropped_points, "dropped_events": self.dropped_events}


class OtlpExport:
    def __init__(self, cfg, book: InventoryBook, queue, sender: OtlpSender | None = None,
                 log_sender: OtlpSender | None = None):
        """cfg: the [export.otlp] table; book: inventories (watching the state); queue: a StoreQueue
        (created before the store is opened, so the replay keeps unread segments) or a MemoryQueue."""
        self.cfg = cfg
        self.book = book
        self.queue = queue
        self.sender = sender or OtlpSender(cfg.endpoint, cfg.insecure, cfg.headers, cfg.timeout_s)
        self.log_sender = log_sender if log_sender is not None else (
            OtlpSender(cfg.endpoint, cfg.insecure, cfg.headers, cfg.timeout_s, logs=True)
            if getattr(cfg, "logs", False) else None)
        self.exported_events = 0
        self.log_queue: collections.deque[tuple[str, pb.Event]] = collections.deque()   # (node, event)
        self.max_log_queue = getattr(cfg, "queue_events", 10_000)
        self.dropped_events = 0
        self.log_failures = 0
        self._log_delays: Iterator[float] | None = None
        self._log_next_try = 0.0   # monotonic: while the logs endpoint fails, not before this
        self.starts = StartTimes()
        self.resources = Resources()
        self.stop_event = threading.Event()
        self.exported_points = 0
        self.exported_batches = 0
        self.failures = 0
        self.last_error = ""
        self._thread: threading.Thread | None = None

    def convert(self, batches: list[pb.Batch]) -> MetricsData:
        by_node: dict[str, list] = {}
        for b in batches:
            by_node.setdefault(b.node_id, []).extend(b.samples)
        groups = []
        for node_id, samples in by_node.items():
            inv = self.book.get(node_id)
            groups.append((resource_attributes(node_id, inv), device_attributes(inv), samples))
        return metrics_data(groups, self.starts, legacy_names=self.cfg.legacy_names, resources=self.resources)

    def convert_logs(self, events: list[tuple[str, pb.Event]]) -> list:
        """(node, event) pairs as log records, with the same resource per node as the metrics."""
        by_node: dict[str, list] = {}
        for node_id, e in events:
            by_node.setdefault(node_id, []).append(e)
        groups = [(resource_attributes(node_id, self.book.get(node_id)), events) for node_id, events in by_node.items()]
        return log_records(groups, time.time_ns(), resources=self.resources)

    def export_once(self) -> bool | None:
        """Send one request's worth from the queue: None when nothing was queued, else whether the
        backend accepted it (and the queue moved on)."""
        batches, token = self.queue.peek(self.cfg.max_request_points)
        if not batches:
            if token is not None and isinstance(self.queue, StoreQueue) and tuple(token) != self.queue.reader.cursor:
                self.queue.commit(token)   # records with no samples (inventories, checkpoints) passed over
            return None
        points = sum(len(b.samples) for b in batches)
        if points and not self.sender.send(self.convert(batches)):
            self.failures += 1
            if not self.last_error:
                log.warning("OTLP export to %s failed: %d points kept and sent again with backoff "
                            "(up to %.1f s between tries)", self.cfg.endpoint, points, self.cfg.backoff_max_s)
            self.last_error = "export failed"
            return False
        self.queue.commit(token)
        self.exported_points += points
        self.exported_batches += len(batches)
        if self.log_sender is not None:   # events: at least once until here, at most once from here on
            self._queue_events(batches)
        if self.last_error:
            log.info("OTLP export to %s works again", self.cfg.endpoint)
        self.last_error = ""
        return True

    def _queue_events(self, batches: list[pb.Batch]) -> None:
        q = self.log_queue
        for b in batches:
            for e in b.events:
                q.append((b.node_id, e))
                if len(q) > self.max_log_queue:
                    q.popleft()
                    self.dropped_events += 1
                    if self.dropped_events in (1, 10, 100) or self.dropped_events % 1000 == 0:
                        log.warning("OTLP log record queue full (%d events): dropped %d events so far; the "
                                    "backend's LogsService is slow or away (set [export.otlp] logs = false if "
                                    "it has none)", self.max_log_queue, self.dropped_events)

    def export_logs_once(self) -> bool | None:
        """Send up to LOG_REQUEST_EVENTS queued events as log records: None when none are queued (or
        the logs endpoint's backoff is not over), else whether the backend accepted them."""
        q = self.log_queue
        if self.log_sender is None or not q or time.monotonic() < self._log_next_try:
            return None
        events = [q[i] for i in range(min(len(q), LOG_REQUEST_EVENTS))]
        if self.log_sender.send(self.convert_logs(events)):
            for _ in events:
                q.popleft()
            self.exported_events += len(events)
            if self._log_delays is not None:
                log.info("OTLP log export to %s works again", self.cfg.endpoint)
            self._log_delays, self._log_next_try = None, 0.0
            return True
        self.log_failures += 1
        if self._log_delays is None:
            log.warning("OTLP log export to %s failed: %d events kept and sent again with backoff (up to %.1f s "
                        "between tries)", self.cfg.endpoint, len(q), self.cfg.backoff_max_s)
            self._log_delays = backoff_delays(self.cfg.interval_s, self.cfg.backoff_max_s)
        self._log_next_try = time.monotonic() + next(self._log_delays)
        return False

    def _run(self) -> None:
        delays = None
        while not self.stop_event.is_set():
            try:
                ok = self.export_once()
            except Exception:
                log.exception("OTLP export round failed")
                ok = False
            try:
                logs_ok = self.export_logs_once()
            except Exception:
                log.exception("OTLP log export round failed")
                logs_ok = False
            if ok is None and logs_ok and self.log_queue:
                continue   # more events queued: on at once
            if ok is None:
                delays = None
                self.stop_event.wait(self.cfg.interval_s)
            elif ok:
                delays = None   # more may be queued: go on at once
            else:
                delays = delays or backoff_delays(self.cfg.interval_s, self.cfg.backoff_max_s)
                self.stop_event.wait(next(delays))

    def start(self) -> None:
        log.info("OTLP export to %s every %.1f s (%s queue)", self.cfg.endpoint, self.cfg.interval_s,
                 self.queue.status()["queue"])
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.sender.shutdown()   # interrupts the SDK's retry wait inside a send
        if self.log_sender is not None:
            self.log_sender.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.timeout_s + 2)

    def status(self) -> dict:
        return {"endpoint": self.cfg.endpoint, "exported_points": self.exported_points,
                "exported_events": self.exported_events, "exported_batches": self.exported_batches,
                "failures": self.failures, "log_failures": self.log_failures, "queued_events": len(self.log_queue),
                "dropped_events_logs": self.dropped_events, **self.queue.status()}
