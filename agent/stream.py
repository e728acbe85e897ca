"""The stream to the collector: one long-lived gRPC bidirectional stream, batches, acks, resends
(StreamClient). Loss is never silent: every batch is kept (spool or bounded queue) until the
collector acknowledges it, and every batch dropped or set aside is counted."""

from __future__ import annotations

import collections
import functools
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from xpusense.common import compact
from xpusense.common.backoff import backoff_delays
from xpusense.common.config import addresses, split_host_port
from xpusense.common.supervise import TASKS
from xpusense.common.tls import channel_options
from xpusense.v1 import telemetry_pb2 as pb

from .batch_build import BatchBuilder, batch_problem, event_to_proto, points
from .batch_send import Connection, Unsendable, encode_message
from .claims import Claims, ImpossibleClaim
from .grpc_waits import quiet_grpc_waits, wait_connecting
from .series_refs import SeriesRefs
from .sources.base import Event, Sample
from .spool import RecordError
from .spool.defs import SeriesDefs

log = logging.getLogger("xpusense.agent.stream")

# The collector's refusal of a batch that can never pass its limits (collector/limits.py) or decode (server.py).
REFUSED = re.compile(r"batch rejected|batch \d+ of boot \S+ refused: ")
IDLE_TICK_S = 1.0    # the batcher's wake-up while nothing comes: its progress() for the watchdog
STREAM_METHOD = "/xpusense.v1.Ingest/Stream"
FRESH_BATCHES = 8    # spooled batches whose bytes are kept until sent (older ones are read back)

def resolve(address: str) -> None:
    """Raise ValueError with a person-readable reason when a HOST:PORT of `address` (one, or several
    comma-separated) cannot be resolved."""
    for one in addresses(address):
        host, port = split_host_port(one)
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"collector address {one!r}: host {host!r} does not resolve ({e.strerror})") from None


class _StreamCall(Protocol):
    """What the Ingest.Stream call returns (a grpc call that is also an iterator of replies)."""

    def __iter__(self) -> Iterator[pb.CollectorMessage]: ...

    def cancel(self) -> bool: ...


class StreamClient:
    """Samples and events handed to `put()` are cut into a batch `flush_s` after the first of them
    came (one batch a round); each batch gets the next sequence number of this boot once it is kept:
    in the spool (agent/spool/) or, without one or while it cannot write, in a bounded in-memory
    queue (`queue_batches`) until the collector acknowledges it. On a reconnect every unacknowledged
    batch is sent again, in order; the collector drops one it already stored. A collector claiming
    to hold more than was sent (agent/claims.py) ends the connection, nothing taken as acknowledged.
    A full queue drops its oldest batch, counted. A spooled batch that cannot be read back, does not
    decode or is not this node's is set aside and counted, never sent; so is one the collector
    refuses as never passing its limits (INVALID_ARGUMENT).

    Reconnects back off exponentially with jitter, from the initial delay again only after a
    connection stayed up `backoff_reset_s`; stop() interrupts the wait. Several addresses
    (cluster-mode gateways, `HOST:PORT,HOST:PORT`) are failed over in turn; while none answers each
    is tried again at least every `reconnect_max_s`. A DNS name with several records is failed over
    by gRPC itself (pick_first). No thread of the client dies of an error: `progress()` moves while
    both keep working, and the agent's systemd watchdog stops being fed when it does not."""

    def __init__(self, address: str, node_id: str, boot_id: str, inventory: Callable[[], pb.Inventory],
                 queue_batches: int = 3600, flush_s: float = 0.2, max_samples_per_batch: int = 5000,
                 backoff_initial_s: float = 0.2, backoff_max_s: float = 10.0, agent_version: str = "",
                 channel: Callable[[], grpc.Channel] | list[Callable[[], grpc.Channel]] | None = None, spool=None,
                 backoff_reset_s: float = 10.0, reconnect_max_s: float = 1.0, series_idle_s: float = 900.0,
                 batch_encoding: str = "", max_series_defs: int = 100_000):
        self.address = address
        self.addresses = addresses(address)   # several: failed over in turn
        self.node_id = node_id
        self.boot_id = boot_id
        self.inventory = inventory
        self.queue_batches = queue_batches
        self.flush_s = flush_s
        self.max_samples = max_samples_per_batch
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.backoff_reset_s = backoff_reset_s   # a connection must stay up this long to reset the backoff
        self.agent_version = agent_version
        self.reconnect_max_s = reconnect_max_s
        # How to reach each collector address (common/tls.py builds mTLS / token channels, one factory
        # per address); default plaintext.
        self.make_channels: list[Callable[[], grpc.Channel]]
        if channel is None:
            opts = channel_options(backoff_initial_s, min(backoff_max_s, reconnect_max_s), connect_timeout_s=5.0)
            self.make_channels = [functools.partial(grpc.insecure_channel, a, options=opts) for a in self.addresses]
        else:
            self.make_channels = list(channel) if isinstance(channel, list) else [channel]
        self.current = 0    # which address the stream uses (or tries) now

        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._arrived = threading.Condition(lock)   # the batcher's: the first samples of a round came
        self._samples: list[Sample] = []
        self._events: list[Event] = []
        # Batches not yet acknowledged, oldest first, keyed by (boot id, seq): a pb.Batch in memory,
        # or where it lies in the spool (agent/spool.py) when there is one.
        self._pending: collections.OrderedDict[tuple[str, int], Any] = collections.OrderedDict()
        self._unsent: collections.deque[tuple[str, int]] = collections.deque()  # on this connection
        # The keys of the pb.Batch values of _pending, oldest first: at most queue_batches.
        self._mem: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        # The encoded bytes of the newest spooled batches, until sent: a healthy stream sends each batch
        # from here, without reading it back from the spool and decoding it (at most FRESH_BATCHES).
        self._fresh: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        # Sent on this connection, not yet acknowledged; and those of them dropped meanwhile (over a
        # budget): counted as dropped only when the connection ends without their acknowledgement.
        self._inflight: set[tuple[str, int]] = set()
        self._maybe_delivered: dict[tuple[str, int], int] = {}
        self.spool = spool
        self._seq = 0
        self.claims = Claims()   # a collector claiming more than was sent (agent/claims.py)
        # This boot's series references and templates; those of series gone idle retired (agent/series_refs.py).
        # With the compact encoding (batch_encoding), each boot's series definitions, kept with the
        # spool when there is one (agent/spool/defs.py); batches built in it (agent/batch_build.py).
        self.encoding, version = batch_encoding, compact.VERSIONS.get(batch_encoding, 0)   # 0: Sample messages
        self.refs = SeriesRefs(4 * max_samples_per_batch, series_idle_s,
                               max_refs=max_series_defs if version else 0xFFFFFFFF)
        self.defs = SeriesDefs.beside(spool, max_series_defs)
        self.builder = BatchBuilder(self.refs, self.defs if version else None, boot_id, self._unencodable, version)
        self._conn: Connection = Connection(self.defs, "")
        self._welcomed = False    # this connection's Welcome came (batches wait for it when compact is offered)
        self._conn_no = 0         # connections made: a request generator of an earlier one stops
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
        self.unencodable_samples = 0
        self.set_aside = 0
        self.last_error = ""
        self.backoff_s = 0.0       # the last wait before a reconnect
        self.ticks = 0             # batcher rounds completed (progress(), for the watchdog)
        self._errors: dict[str, str] = {}   # thread -> its last unexpected error, logged once per change

    # -- producer side -------------------------------------------------------------------------
    def put(self, samples: list[Sample], events: list[Event] | None = None) -> None:
        with self._cond:
            if not self._samples and not self._events:
                self._arrived.notify()
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
        """Turn what was put so far into batches. A sequence number is used only by a batch that is
        kept (spooled, or in memory while the spool cannot write): never by one that is lost."""
        if self.refs.turn_if_due():
            log.debug("retired the series references of series with no sample for %gs or more (%d so far)",
                      self.refs.idle_s, self.refs.retired)
        while self._samples or self._events:
            chunk, self._samples = self._samples[: self.max_samples], self._samples[self.max_samples:]
            events, self._events = self._events, []
            b = pb.Batch(node_id=self.node_id, boot_id=self.boot_id, seq=self._seq + 1,
                         sent_unix_nano=time.time_ns())
            n, top = self.builder.build(b, chunk)
            b.events.extend(event_to_proto(e) for e in events)
            if not n and not b.events:
                continue
            self._seq += 1
            self._keep_locked((self.boot_id, self._seq), b, n, top)
        self.defs.retain(self._pending, self.boot_id)   # old boots' definitions: kept while they have batches
        self._cond.notify_all()

    def _unencodable(self, name: str, e: Exception) -> None:
        self.unencodable_samples += 1
        self.dropped_samples += 1
        if self.unencodable_samples == 1 or self.unencodable_samples % 1000 == 0:
            log.warning("sample %r cannot be encoded (%s): dropped; %d such samples so far", name, e,
                        self.unencodable_samples)

    def _keep_locked(self, key: tuple[str, int], b: pb.Batch, n: int, top: int) -> None:
        if self.spool is not None:
            # On disk before it is sent: survives a collector outage and a killed agent; so do the
            # definitions of the series it uses (agent/spool/defs.py), before it.
            self.defs.save()
            data = b.SerializeToString()
            loc = self.spool.append(key[0], key[1], n, data)
            if loc is not None:
                loc.top = top
                self._pending[key] = loc
                self._unsent.append(key)
                self._fresh[key] = data
                if len(self._fresh) > FRESH_BATCHES:
                    self._fresh.popitem(last=False)
                if self._mem:   # the spool takes writes again: what waited in memory goes there too
                    self._spill_locked()
                return
        self._pending[key] = b            # no spool, or it cannot write now (it logs and counts that)
        self._mem[key] = None
        self._unsent.append(key)
        while len(self._mem) > self.queue_batches:
            old, _ = self._mem.popitem(last=False)
            self._drop_locked([old], f"in-memory queue full ([stream] queue_batches = {self.queue_batches})"
                              + (" while the spool cannot write" if self.spool is not None else "")
                              + ": dropped the oldest")

    def _drop_locked(self, keys: list[tuple[str, int]], why: str) -> None:
        """Forget batches over a budget and count them, but for those in flight (see _inflight)."""
        batches = samples = 0
        for key in keys:
            val = self._pending.pop(key, None)
            self._mem.pop(key, None)
            if val is None:
                continue
            n = points(val) if isinstance(val, pb.Batch) else val.samples
            if key in self._inflight:
                self._maybe_delivered[key] = n
            else:
                batches, samples = batches + 1, samples + n
        if batches:
            self._count_drop(batches, samples, why)

    def _spill_locked(self) -> None:
        """Write the batches held in memory to the spool, oldest first, until it refuses one (the
        spool hands them back in seq order per boot after a restart, wherever they lie)."""
        assert self.spool is not None
        self.defs.save()
        for key in list(self._mem):
            b = self._pending[key]
            loc = self.spool.append(key[0], key[1], points(b), b.SerializeToString())
            if loc is None:
                return
            self._pending[key] = loc      # keeps its place in the sending order
            del self._mem[key]

    def _count_drop(self, batches: int, samples: int, why: str) -> None:
        before = self.dropped_batches
        self.dropped_batches += batches
        self.dropped_samples += samples
        if before == 0 or before // 100 != self.dropped_batches // 100:
            log.warning("%s; %d batches, %d samples lost so far", why, self.dropped_batches, self.dropped_samples)

    def spool_dropped(self, keys: list[tuple[str, int]], samples: int) -> None:
        """The spool deleted its oldest segment over budget: those batches are gone (called locked)."""
        self._drop_locked(keys, "spool over its disk budget: dropped its oldest segment")

    def resume(self, spooled: list) -> None:
        """Batches of earlier runs found in the spool: sent first, with their own boot id and seq.
        What the spool dropped or found damaged at start counts as dropped here too."""
        with self._cond:
            lost = getattr(self.spool, "lost_at_open", None) or {}
            batches = lost.get("dropped_batches", 0) + lost.get("damaged_records", 0)
            if batches:
                self._count_drop(batches, lost.get("dropped_samples", 0),
                                 "spool: batches damaged or over budget at start, skipped")
            for key, loc in spooled:
                self._pending[key] = loc
                self._unsent.append(key)
            if (damaged := self.defs.load({k[0] for k, _ in spooled}, self.boot_id)) and self.spool is not None:
                self.spool.damaged_records += damaged   # frames of its definitions files: damaged records too
            self.claims.spooled((k for k, _ in spooled), getattr(self.spool, "acked", None) or {})
            self._cond.notify_all()

    def series_refs(self) -> int:
        """Series references held (agent/series_refs.py)."""
        with self._cond:
            return len(self.refs)

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        quiet_grpc_waits()
        for target, name in ((self._batcher, "stream-batcher"), (self._sender, "stream-sender")):
            t = TASKS.thread(name, target, self._stop)   # a failure: logged, counted, started again
            t.start()
            self._threads.append(t)

    def flush(self) -> None:
        with self._cond:
            self._cut_locked()

    def drain(self, timeout_s: float) -> bool:
        """Cut what is buffered and wait until the collector has acknowledged everything, the batches
        dropped over a budget while in flight included (their fate is known only with their ack)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cut_locked()
            while self._pending or self._maybe_delivered:
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
            self._arrived.notify_all()
        call = self._call
        if call is not None:
            call.cancel()
        for t in self._threads:
            t.join(timeout=5)
        with self._cond:
            self._cut_locked()
            if self._mem and self.spool is not None:
                self._spill_locked()
            if self._mem:
                log.warning("%d batches held in memory (%s) are lost with this stop", len(self._mem),
                            "the spool could not write them" if self.spool is not None else "no spool")

    # -- threads ----------------------------------------------------------------------------------
    def _batcher(self) -> None:
        """Cuts a batch `flush_s` after the first samples since the last cut came, so that a round's
        sources, which finish within milliseconds of each other, go out as one batch (one spool record,
        one message, one ack); asleep while nothing comes, but for a tick a second (progress())."""
        while not self._stop.is_set():
            try:
                with self._cond:
                    if not self._samples and not self._events:
                        self._arrived.wait(IDLE_TICK_S)
                    came = bool(self._samples or self._events)
                if came and not self._stop.wait(self.flush_s):
                    with self._cond:
                        if self._samples or self._events:
                            self._cut_locked()
            except Exception as e:   # a bug: logged once per change; the next round tries again
                self._unexpected("stream-batcher", e)
                continue
            self.ticks += 1

    def _unexpected(self, where: str, e: BaseException) -> None:
        text = f"{type(e).__name__}: {e}"
        if self._errors.get(where) != text:
            log.error("%s: unexpected error, carrying on: %s", where, text, exc_info=e)
        self._errors[where] = text

    def progress(self) -> int:
        """Grows while the batcher completes its rounds and the sender is alive (the watchdog's
        measure of delivery); stands still when either is stuck or gone."""
        if not self._threads or not all(t.is_alive() for t in self._threads):
            return -1
        return self.ticks

    def _requests(self, no: int) -> Iterator[pb.AgentMessage | bytes]:
        """The agent's half of connection `no`: Hello, then every batch not yet sent on it."""
        yield pb.AgentMessage(hello=pb.Hello(node_id=self.node_id, boot_id=self.boot_id, agent_version=self.agent_version,
                                             inventory=self.inventory(), time_unix_nano=time.time_ns(),
                                             batch_encodings=compact.offered(self.encoding)))
        while True:
            with self._cond:   # batches wait for the Welcome where it chooses their encoding
                while not self._conn_closed and not self._inventory_dirty and not (self._unsent and self._welcomed):
                    self._cond.wait(1.0)
                if self._conn_closed or no != self._conn_no:
                    return
                conn = self._conn
                send_inventory, self._inventory_dirty = self._inventory_dirty, False
                batch: Any = None
                key, data = ("", 0), None
                while self._unsent and self._welcomed and batch is None:
                    key = self._unsent.popleft()
                    batch = self._pending.get(key)     # None: acknowledged or dropped meanwhile
                    data = self._fresh.pop(key, None)
                if batch is not None:
                    self._inflight.add(key)
            if send_inventory:
                yield pb.AgentMessage(inventory=self.inventory())
            if batch is not None:
                if not isinstance(batch, pb.Batch) and data is None:
                    data = self._load(key, batch)
                    if data is None:
                        continue
                try:
                    yield from conn.messages(key[0], batch if data is None else data,
                                             -1 if isinstance(batch, pb.Batch) else batch.top)
                except (Unsendable, DecodeError) as e:
                    self._set_aside(key, batch, str(e))

    def _load(self, key: tuple[str, int], loc) -> bytes | None:
        """A spooled batch, read back and checked; None (set aside and counted) when it cannot be sent."""
        try:
            data = self.spool.read(loc, key)
            why = batch_problem(self.node_id)(key[0], key[1], data)
        except KeyError:        # its segment was dropped over budget meanwhile (counted there)
            return None
        except (OSError, RecordError, DecodeError) as e:
            why = f"cannot be read back: {e}"
        if why is None:
            return data
        self._set_aside(key, loc, why)
        return None

    def _set_aside(self, key: tuple[str, int], val, why: str) -> None:
        """A batch that cannot be sent as what it stands for: set aside and counted, never sent."""
        with self._cond:
            self._inflight.discard(key)
            if self._pending.pop(key, None) is not None:
                self._mem.pop(key, None)
                self.set_aside += 1
                if isinstance(val, pb.Batch):
                    try:
                        n = points(val)
                    except compact.CompactError:
                        n = len(val.samples)
                else:
                    n = val.samples
                    self.spool.set_aside(key, val, why)
                self._count_drop(1, n, f"batch {key} {why}: set aside, not sent")
            self._cond.notify_all()

    def _refused(self, why: str) -> None:
        """The collector refused a batch that can never pass its limits (INVALID_ARGUMENT, after the
        acknowledgements of every batch before it): the oldest one in flight. It is set aside and
        counted, not sent again: resending it would silence the node."""
        with self._cond:
            key = next((k for k in self._pending if k in self._inflight), None)
            if key is None:
                return
            val = self._pending.pop(key)
            self._mem.pop(key, None)
            self._inflight.discard(key)
            self.set_aside += 1
            if self.spool is not None and not isinstance(val, pb.Batch):
                self.spool.set_aside(key, val, f"refused by the collector: {why}")
            n = points(val) if isinstance(val, pb.Batch) else val.samples
            self._count_drop(1, n, f"batch {key} refused by the collector ({why}): set aside, not sent again")

    def _handle(self, msg: pb.CollectorMessage, here: str = "") -> None:
        """Take an ack or a Welcome; ImpossibleClaim (the connection ends) for one claiming more than was sent."""
        what, boot, claimed = (("ack", msg.ack.boot_id, msg.ack.seq) if msg.HasField("ack")
                               else ("Welcome", msg.welcome.boot_id, msg.welcome.stored_up_to))
        if why := self.claims.impossible_claim(here, what, boot, claimed, (self.boot_id, self.last_seq())) or (
                what == "Welcome" and self.claims.impossible_definitions(here, boot, msg.welcome.series_defined_up_to, (
                    self.builder.top if boot == self.boot_id else max(self.defs.get(boot) or [0])))):   # refs defined
            if self._call is not None:
                self._call.cancel()       # nothing more is taken from it on this connection
            raise ImpossibleClaim(why)    # handled as the collector's failure: the next one is tried
        with self._cond:
            if msg.HasField("ack"):
                key = (msg.ack.boot_id, msg.ack.seq)
                val = self._pending.pop(key, None)
                self._inflight.discard(key)
                if val is None and self._maybe_delivered.pop(key, None) is not None:
                    self.acked += 1            # dropped over a budget while in flight, and delivered after all
                if val is not None:
                    self._mem.pop(key, None)
                    self.acked += 1
                    self.duplicates += msg.ack.duplicate
                    if self.spool is not None:
                        self.spool.ack(key[0], key[1], val if not isinstance(val, pb.Batch) else None)
            elif msg.HasField("welcome"):
                self._conn = Connection.welcomed(self.defs, self.encoding, msg.welcome, self.node_id, self.boot_id,
                                                 self.builder.top)
                self._welcomed = True
                done = [k for k in self._pending if k[0] == msg.welcome.boot_id and k[1] <= msg.welcome.stored_up_to]
                for k in done:
                    val = self._pending.pop(k)
                    self._mem.pop(k, None)
                    if self.spool is not None:
                        self.spool.ack(k[0], k[1], val if not isinstance(val, pb.Batch) else None)
            self._cond.notify_all()

    def _sender(self) -> None:
        try:
            self._send_loop()
        except Exception as e:   # a bug: said once here; the supervisor starts the loop again (common/supervise.py)
            self._unexpected("stream-sender", e)
            raise

    def _send_loop(self) -> None:
        delays = backoff_delays(self.backoff_initial_s, self.backoff_max_s)
        channels: list[grpc.Channel | None] = [None] * len(self.make_channels)
        gzip = grpc.Compression.Gzip if self.encoding else None   # gRPC gzips what shrinks: the Hello (docs/design.md)

        def channel_at(i: int) -> grpc.Channel:   # each collector's channel, made when first used
            ch = channels[i]
            if ch is None:
                ch = channels[i] = self.make_channels[i]()
            return ch
        try:
            while not self._stop.is_set():
                up_at = None
                here = self.addresses[self.current] if len(self.addresses) == len(channels) else self.address
                stream = channel_at(self.current).stream_stream(STREAM_METHOD, request_serializer=encode_message,
                                               response_deserializer=pb.CollectorMessage.FromString)
                with self._cond:
                    self._conn_closed = False
                    self._unsent = collections.deque(self._pending)  # resend all not acknowledged, in order
                    self._inflight.clear()
                    self._inventory_dirty = False
                    self._welcomed = not self.encoding   # nothing offered: Sample messages whatever it says
                    self._conn = Connection(self.defs, "")
                    self._conn_no += 1
                try:
                    call: _StreamCall = stream(self._requests(self._conn_no), compression=gzip)
                    self._call = call
                    for msg in call:
                        if not self.connected:
                            self.connected = True
                            self.reconnects += 1
                            up_at = time.monotonic()
                            log.info("connected to collector %s (%d batches to send)", here, self.pending())
                        self._handle(msg, here)
                    err = "collector closed the stream"
                    unanswered = False
                except grpc.RpcError as e:
                    err = f"{e.code().name}: {e.details()}"
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT and REFUSED.match(e.details() or ""):
                        self._refused(e.details() or "")
                    unanswered = up_at is None and e.code() == grpc.StatusCode.UNAVAILABLE
                finally:
                    with self._cond:
                        self._conn_closed = True
                        self._inflight.clear()
                        if self._maybe_delivered:   # their acknowledgement will not come now
                            lost, self._maybe_delivered = self._maybe_delivered, {}
                            self._count_drop(len(lost), sum(lost.values()),
                                             "batches dropped over a budget while in flight were not acknowledged")
                        self._cond.notify_all()
                if self._stop.is_set():
                    break
                if self.connected or err != self.last_error:
                    log.warning("collector %s unreachable (%s); retrying with backoff, %d batches queued",
                                here, err, self.pending())
                self.connected = False
                self.last_error = err
                # Only a connection that stayed up resets the backoff: a collector that accepts and
                # then fails at once (its disk full, say) is retried ever more slowly, like a down one.
                if up_at is not None and time.monotonic() - up_at >= self.backoff_reset_s:
                    delays = backoff_delays(self.backoff_initial_s, self.backoff_max_s)
                self.backoff_s = next(delays)
                if unanswered:   # no collector there at all: try again soon (a connect is cheap)
                    self.backoff_s = min(self.backoff_s, random.uniform(self.reconnect_max_s / 2, self.reconnect_max_s))
                self.current = (self.current + 1) % len(channels)   # the next collector, if there are several
                wait_connecting(channel_at(self.current), self._stop, self.backoff_s)
        finally:
            self.connected = False
            for ch in channels:
                if ch is not None:
                    ch.close()

    def health(self) -> str:
        """One line for systemd's STATUS=: what keeps delivery from being whole, if anything."""
        parts = ["measuring"]
        sp = self.spool
        if sp is not None and sp.state != "ok":
            parts.append(f"spool cannot {sp.error}, {len(self._mem)} batches held in memory")
        if not self.connected and self.last_error:
            parts.append(f"collector {self.address} unreachable ({self.last_error.split(':')[0]}), "
                         f"{len(self._pending)} batches queued")
        return "; ".join(parts)

    def status(self) -> dict:
        return {"address": self.address, "connected": self.connected, "pending_batches": self.pending(),
                "last_seq": self.last_seq(), "acked": self.acked, "duplicates": self.duplicates,
                "reconnects": self.reconnects, "dropped_batches": self.dropped_batches,
                "dropped_samples": self.dropped_samples, "last_error": self.last_error,
                "memory_batches": len(self._mem), "set_aside": self.set_aside,
                "impossible_acks": self.claims.impossible,
                "series_refs": self.series_refs(), "series_retired": self.refs.retired,
                "series_unnumbered": self.refs.unnumbered, "series_defs": len(self.defs),
                "series_defs_damaged": self.defs.damaged, "encoding": self._conn.encoding,
                "spool_bytes": self.spool.bytes_used() + self.defs.bytes if self.spool is not None else 0,
                "spool": self.spool.status() if self.spool is not None else None}
