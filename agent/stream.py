"""The stream to the collector: one long-lived gRPC bidirectional stream, batches, acks, resends.

Samples and events handed to `put()` are cut into batches every `flush_s`; each batch gets the next
sequence number of this boot and stays in a bounded in-memory queue until the collector
acknowledges it. On a reconnect every unacknowledged batch is sent again, in order; the collector
drops one it has already stored, so nothing counts twice. When the queue is full the oldest batch
is dropped and counted (samples and batches): loss is never silent. Reconnects back off
exponentially with jitter, and stop() interrupts the wait.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from xpusense.common.backoff import backoff_delays
from xpusense.common.config import split_host_port
from xpusense.common.tls import channel_options
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from .sources.base import COUNTER, GAUGE, HISTOGRAM, Event, Sample

log = logging.getLogger("xpusense.agent.stream")

KINDS = {GAUGE: pb.GAUGE, COUNTER: pb.COUNTER, HISTOGRAM: pb.HISTOGRAM}

def sample_to_proto(s: Sample, series_ref: int = 0) -> pb.Sample:
    m = pb.Sample(name=s.name, unit=s.unit, kind=KINDS[s.kind], labels=s.labels, value=s.value,
                  time_unix_nano=s.time_ns, series_ref=series_ref)
    if s.kind == HISTOGRAM:
        m.histogram.bounds.extend(s.bounds)
        m.histogram.counts.extend(s.counts)
        m.histogram.sum = s.value
        m.histogram.count = s.counts[-1] if s.counts else 0
    return m


def event_to_proto(e: Event) -> pb.Event:
    return pb.Event(id=e.id, type=e.type, severity=e.severity, device=e.device, message=e.message,
                    attributes=e.attributes, time_unix_nano=e.time_ns)


def resolve(address: str) -> None:
    """Raise ValueError with a person-readable reason when HOST:PORT cannot be resolved."""
    host, port = split_host_port(address)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"collector address {address!r}: host {host!r} does not resolve ({e.strerror})") from None


class _StreamCall(Protocol):
    """What the Ingest.Stream call returns (a grpc call that is also an iterator of replies)."""

    def __iter__(self) -> Iterator[pb.CollectorMessage]: ...

    def cancel(self) -> bool: ...


class StreamClient:
    def __init__(self, address: str, node_id: str, boot_id: str, inventory: Callable[[], pb.Inventory],
                 queue_batches: int = 3600, flush_s: float = 0.2, max_samples_per_batch: int = 5000,
                 backoff_initial_s: float = 0.2, backoff_max_s: float = 10.0, agent_version: str = "",
                 channel: Callable[[], grpc.Channel] | None = None, spool=None):
        self.address = address
        self.node_id = node_id
        self.boot_id = boot_id
        self.inventory = inventory
        self.queue_batches = queue_batches
        self.flush_s = flush_s
        self.max_samples = max_samples_per_batch
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.agent_version = agent_version
        # How to reach the collector (common/tls.py builds mTLS / token channels); default plaintext.
        self.make_channel = channel or (lambda: grpc.insecure_channel(
            address, options=channel_options(backoff_initial_s, backoff_max_s)))

        self._cond = threading.Condition()
        self._samples: list[Sample] = []
        self._events: list[Event] = []
        # Batches not yet acknowledged, oldest first, keyed by (boot id, seq): a pb.Batch in memory,
        # or where it lies in the spool (agent/spool.py) when there is one.
        self._pending: collections.OrderedDict[tuple[str, int], Any] = collections.OrderedDict()
        self._unsent: collections.deque[tuple[str, int]] = collections.deque()  # on this connection
        self.spool = spool
        self._seq = 0
        self._refs: dict[tuple, int] = {}  # series (name, labels) -> series_ref, for this boot
        self._inventory_dirty = False
        self._stop = threading.Event()
        self._conn_closed = True
        self._call: _StreamCall | None = None
        self._threads: list[threading.Thread] = []
        # Figures, reported by the agent source and by `status()`.
        self.connected = False
        self.reconnects = 0
        self.acked = 0
        self.duplicates = 0
        self.dropped_batches = 0
        self.dropped_samples = 0
        self.last_error = ""

    # -- producer side -------------------------------------------------------------------------
    def put(self, samples: list[Sample], events: list[Event] | None = None) -> None:
        with self._cond:
            self._samples.extend(samples)
            if events:
                self._events.extend(events)
            if len(self._samples) >= self.max_samples:
                self._cut_locked()

    def inventory_changed(self) -> None:
        """Send the inventory again on the open stream (Agent calls it when its inventory changes)."""
        with self._cond:
            self._inventory_dirty = True
            self._cond.notify_all()

    def _cut_locked(self) -> None:
        """Turn what was put so far into batches (sequence numbers assigned here)."""
        while self._samples or self._events:
            chunk, self._samples = self._samples[: self.max_samples], self._samples[self.max_samples:]
            events, self._events = self._events, []
            self._seq += 1
            b = pb.Batch(node_id=self.node_id, boot_id=self.boot_id, seq=self._seq,
                         sent_unix_nano=time.time_ns())
            b.samples.extend(sample_to_proto(s, self._ref(s)) for s in chunk)
            b.events.extend(event_to_proto(e) for e in events)
            key = (self.boot_id, self._seq)
            if self.spool is not None:
                # On disk before it is sent: survives a collector outage and a killed agent.
                self._pending[key] = self.spool.append(self.boot_id, self._seq, len(b.samples),
                                                       b.SerializeToString())
            else:
                self._pending[key] = b
                while len(self._pending) > self.queue_batches:
                    _, old = self._pending.popitem(last=False)
                    self._count_drop(1, len(old.samples), f"in-memory queue full ({self.queue_batches} batches)")
            self._unsent.append(key)
        self._cond.notify_all()

    def _count_drop(self, batches: int, samples: int, why: str) -> None:
        before = self.dropped_batches
        self.dropped_batches += batches
        self.dropped_samples += samples
        if before == 0 or before // 100 != self.dropped_batches // 100:
            log.warning("%s: dropped the oldest; %d batches, %d samples lost so far", why,
                        self.dropped_batches, self.dropped_samples)

    def spool_dropped(self, keys: list[tuple[str, int]], samples: int) -> None:
        """The spool deleted its oldest segment over budget: those batches are gone (called locked)."""
        for key in keys:
            self._pending.pop(key, None)
        self._count_drop(len(keys), samples, "spool over its disk budget")

    def resume(self, spooled: list) -> None:
        """Batches of earlier runs found in the spool: sent first, with their own boot id and seq."""
        with self._cond:
            for key, loc in spooled:
                self._pending[key] = loc
                self._unsent.append(key)
            self._cond.notify_all()

    def _ref(self, s: Sample) -> int:
        key = (s.name, tuple(sorted(s.labels.items())))
        ref = self._refs.get(key)
        if ref is None:
            ref = self._refs[key] = len(self._refs) + 1
        return ref

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._batcher, "stream-batcher"), (self._sender, "stream-sender")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def flush(self) -> None:
        with self._cond:
            self._cut_locked()

    def drain(self, timeout_s: float) -> bool:
        """Cut what is buffered and wait until the collector has acknowledged everything."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cut_locked()
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, drain_s: float = 2.0) -> None:
        if self.connected:
            self.drain(drain_s)
        self._stop.set()
        with self._cond:
            self._conn_closed = True
            self._cond.notify_all()
        call = self._call
        if call is not None:
            call.cancel()
        for t in self._threads:
            t.join(timeout=5)

    # -- threads ----------------------------------------------------------------------------------
    def _batcher(self) -> None:
        while not self._stop.wait(self.flush_s):
            with self._cond:
                if self._samples or self._events:
                    self._cut_locked()

    def _requests(self):
        """The agent's half of one connection: Hello, then every batch not yet sent on it."""
        yield pb.AgentMessage(hello=pb.Hello(node_id=self.node_id, boot_id=self.boot_id,
                                             agent_version=self.agent_version,
                                             inventory=self.inventory(), time_unix_nano=time.time_ns()))
        while True:
            with self._cond:
                while not self._conn_closed and not self._inventory_dirty and not self._unsent:
                    self._cond.wait(1.0)
                if self._conn_closed:
                    return
                send_inventory, self._inventory_dirty = self._inventory_dirty, False
                batch, key = None, None
                while self._unsent and batch is None:
                    key = self._unsent.popleft()
                    batch = self._pending.get(key)     # None: acknowledged or dropped meanwhile
            if send_inventory:
                yield pb.AgentMessage(inventory=self.inventory())
            if batch is not None:
                if not isinstance(batch, pb.Batch):
                    try:
                        batch = pb.Batch.FromString(self.spool.read(batch))
                    except (KeyError, OSError) as e:
                        log.warning("batch %s could not be read back from the spool: %s", key, e)
                        continue
                yield pb.AgentMessage(batch=batch)

    def _handle(self, msg: pb.CollectorMessage) -> None:
        with self._cond:
            if msg.HasField("ack"):
                key = (msg.ack.boot_id, msg.ack.seq)
                val = self._pending.pop(key, None)
                if val is not None:
                    self.acked += 1
                    self.duplicates += msg.ack.duplicate
                    if self.spool is not None:
                        self.spool.ack(key[0], key[1], val if not isinstance(val, pb.Batch) else None)
            elif msg.HasField("welcome"):
                done = [k for k in self._pending if k[0] == msg.welcome.boot_id and k[1] <= msg.welcome.stored_up_to]
                for k in done:
                    val = self._pending.pop(k)
                    if self.spool is not None:
                        self.spool.ack(k[0], k[1], val if not isinstance(val, pb.Batch) else None)
            self._cond.notify_all()

    def _sender(self) -> None:
        delays = backoff_delays(self.backoff_initial_s, self.backoff_max_s)
        channel = self.make_channel()
        stub = pb_grpc.IngestStub(channel)
        try:
            while not self._stop.is_set():
                with self._cond:
                    self._conn_closed = False
                    self._unsent = collections.deque(self._pending)  # resend all not acknowledged, in order
                    self._inventory_dirty = False
                try:
                    call: _StreamCall = stub.Stream(self._requests())
                    self._call = call
                    for msg in call:
                        if not self.connected:
                            self.connected = True
                            self.reconnects += 1
                            delays = backoff_delays(self.backoff_initial_s, self.backoff_max_s)
                            log.info("connected to collector %s (%d batches to send)", self.address,
                                     self.pending())
                        self._handle(msg)
                    err = "collector closed the stream"
                except grpc.RpcError as e:
                    err = f"{e.code().name}: {e.details()}"
                finally:
                    with self._cond:
                        self._conn_closed = True
                        self._cond.notify_all()
                if self._stop.is_set():
                    break
                if self.connected or err != self.last_error:
                    log.warning("collector %s unreachable (%s); retrying with backoff, %d batches queued",
                                self.address, err, self.pending())
                self.connected = False
                self.last_error = err
                self._stop.wait(next(delays))
        finally:
            self.connected = False
            channel.close()

    def status(self) -> dict:
        return {"address": self.address, "connected": self.connected, "pending_batches": self.pending(),
                "last_seq": self.last_seq(), "acked": self.acked, "duplicates": self.duplicates,
                "reconnects": self.reconnects, "dropped_batches": self.dropped_batches,
                "dropped_samples": self.dropped_samples, "last_error": self.last_error,
                "spool_bytes": self.spool.bytes_used() if self.spool is not None else 0}
