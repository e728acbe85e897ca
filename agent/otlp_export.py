"""The agent's direct OTLP export (opentelemetry-sdk's OTLP gRPC metric exporter), for operators who
want only observability: samples from the tier loop into a bounded queue, sent by one thread.
The conversion is xpusense.common.otlp's, shared with the collector.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from xpusense.common.backoff import backoff_delays
from xpusense.common.otlp import (
    OtlpSender,
    Resources,
    StartTimes,
    device_attributes,
    local_host_attributes,
    metrics_data,
    resource_attributes,
)
from xpusense.common.supervise import TASKS
from xpusense.v1 import telemetry_pb2 as pb

from .batch_build import sample_to_proto

log = logging.getLogger("xpusense.otlp")


class AgentOtlpExporter:
    """The agent's direct OTLP export: samples from the tier loop into a bounded queue, sent every
    `interval_s` by one thread; a failed send is retried (jittered exponential backoff that stop()
    interrupts) with the same points, and what does not fit the queue is dropped oldest first and
    counted (`dropped`)."""

    def __init__(self, cfg, node_id: str, inventory, sender: OtlpSender | None = None):
        self.cfg = cfg
        self.node_id = node_id
        self.inventory = inventory            # () -> pb.Inventory
        self.only = bool(cfg.only)
        self.sender = sender or OtlpSender(cfg.endpoint, cfg.insecure, cfg.headers, cfg.timeout_s)
        self.queue: deque = deque()
        self.max_points = cfg.queue_points
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.starts = StartTimes()
        self.resources = Resources()
        self._host: dict[str, str] | None = None   # the SDK's host detector, asked once
        self.dropped = 0
        self.exported = 0
        self.failures = 0
        self._thread: threading.Thread | None = None
        self._inv: tuple[float, pb.Inventory | None] = (0.0, None)

    def put(self, samples) -> None:
        protos = [sample_to_proto(s) for s in samples]
        with self.lock:
            self.queue.extend(protos)
            over = len(self.queue) - self.max_points
            for _ in range(max(0, over)):
                self.queue.popleft()
            if over > 0:
                self.dropped += over
                log.warning("OTLP export queue full (%d points): dropped %d oldest (%d in all)",
                            self.max_points, over, self.dropped)

    def start(self) -> None:
        self._thread = TASKS.thread("otlp-export", self._run, self.stop_event)   # a failure: logged, counted, started again
        self._thread.start()

    def _inventory(self) -> pb.Inventory | None:
        t, inv = self._inv
        if inv is None or time.monotonic() - t > 30:
            try:
                inv = self.inventory()
            except Exception as e:
                log.debug("inventory for OTLP resource attributes: %s", e)
            self._inv = (time.monotonic(), inv)
        return inv

    def resource_attributes(self, inv: pb.Inventory | None) -> dict[str, str]:
        """The node's resource as the collector would make it, plus what the SDK's host detector
        finds here where the inventory has no HOST resource (host source off)."""
        attrs = resource_attributes(self.node_id, inv)
        if "host.id" not in attrs:
            if self._host is None:
                self._host = local_host_attributes()
            attrs = {**self._host, **attrs}
        return attrs

    def flush(self) -> bool:
        """Send what is queued, one request per `max_request_points`; False on the first failure."""
        while True:
            with self.lock:
                chunk = [self.queue[i] for i in range(min(len(self.queue), self.cfg.max_request_points))]
            if not chunk:
                return True
            inv = self._inventory()
            data = metrics_data([(self.resource_attributes(inv), device_attributes(inv), chunk)], self.starts,
                                legacy_names=self.cfg.legacy_names, resources=self.resources)
            if not self.sender.send(data):
                self.failures += 1
                return False
            with self.lock:
                # Drops may have removed some of what was sent from the front meanwhile: remove only
                # what is still the sent chunk's tail.
                n = len(chunk)
                while n and self.queue and self.queue[0] is chunk[len(chunk) - n]:
                    self.queue.popleft()
                    n -= 1
                if n:   # the front moved (drops): drop the sent ones wherever they are
                    sent = {id(x) for x in chunk}
                    self.queue = deque(x for x in self.queue if id(x) not in sent)
            self.exported += len(chunk)

    def _run(self) -> None:
        delays = None
        while not self.stop_event.is_set():
            if self.flush():
                delays = None
                self.stop_event.wait(self.cfg.interval_s)
            else:
                delays = delays or backoff_delays(min(1.0, self.cfg.interval_s), self.cfg.backoff_max_s)
                self.stop_event.wait(next(delays))

    def stop(self, flush_s: float = 2.0) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=flush_s + self.cfg.timeout_s)
        self.sender.shutdown()


def build_agent_exporter(cfg, inventory):
    """From the agent config: None when [export.otlp] is off."""
    o = cfg.export.otlp
    if not o.enabled:
        return None
    return AgentOtlpExporter(o, cfg.node_id, inventory)
