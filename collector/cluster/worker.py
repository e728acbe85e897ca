"""Fleet state workers (`xpusense-collector worker --nats URLS`): each owns some partitions by
lease, reads their batches with one durable consumer per partition, keeps every node's latest values
(summary.NodeLatest) and writes each changed node's summary to the `fleet` bucket every `summary_s`,
acknowledging the messages a summary covers only once it is written. A worker trusts no message it
reads: what fails its checks is skipped and counted. docs/scale.md says how ownership, delivery and
failures work."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from xpusense.common.compact import CompactError
from xpusense.common.ids import bad_id
from xpusense.v1 import telemetry_pb2 as pb

from .. import clock as agent_clock
from .. import idle
from ..batch_rows import refs_of
from ..diagnoses import Diagnoses
from ..limits import Limits, RateLimitedLog
from ..series_dictionary import MissingDefinition
from ..wire import read_batch
from .config import NATS_SCHEMA
from .engine import list_bucket
from .series_defs import SeriesCache, is_compact
from .subjects import KIND, MSG_ID, RECEIVED, is_msg_id, node_of_subject, partition, partition_filter, stream_of, token
from .summary import NodeLatest, decode, fleet_key

log = logging.getLogger("xpusense.collector.cluster.worker")

_TRANSIENT = (nats.errors.TimeoutError, nats.js.errors.APIError, nats.errors.NoRespondersError,
              nats.js.errors.NoStreamResponseError, nats.errors.ConnectionReconnectingError, TimeoutError)


def _stream_time_ns(reply: str) -> int:
    """When JetStream stored the message, from its ack subject ($JS.ACK...)."""
    tokens = reply.split(".")
    try:
        return int(tokens[7] if len(tokens) == 9 else tokens[Msg.Ack.Timestamp])
    except (IndexError, ValueError):
        return time.time_ns()


def _delivery(reply: str) -> int:
    """Which delivery of its consumer the message is (1, 2, ... since the consumer was last reset),
    from its ack subject; 0 when unknown."""
    tokens = reply.split(".")
    try:
        return int(tokens[6] if len(tokens) == 9 else tokens[Msg.Ack.ConsumerSeq])
    except (IndexError, ValueError):
        return 0


class _NodeStored:
    """limits.Stored for a worker's node as of a message's stream time `t_ns`: each boot's highest
    seq taken and when that rose (SeqWindow). A worker keeps only a summary's series, not the
    node's: `max_series_per_node` is the gateways' to enforce (gateway.py StreamStored)."""

    def __init__(self) -> None:
        self.node: NodeLatest | None = None
        self.t_ns = 0

    def seq_mark(self, node_id: str, boot_id: str) -> tuple[int, float] | None:
        w = self.node.windows.get(boot_id) if self.node is not None else None
        if w is None or not w.high:
            return None
        return w.high, (self.t_ns - w.at) / 1e9

    def series_count(self, node_id: str) -> int:
        return 0

    def new_series(self, node_id: str, samples) -> set[tuple]:
        return set()

    def evict_expired(self, node_id: str, newest_ns: int = 0) -> int:
        return 0

    def admit(self, node_id: str, samples) -> None:
        pass


class _Partition:
    def __init__(self, k: int, revision: int):
        self.k, self.revision = k, revision
        self.task: asyncio.Task | None = None
        self.last: Msg | None = None          # newest message handled, not yet acknowledged
        self.ready = asyncio.Event()          # loaded and consuming
        self.stopping = False
        self.writing = asyncio.Lock()         # one summary write at a time (Worker._write)
        self.renewing = asyncio.Lock()        # one lease renewal at a time (a round's, a write's)
        self.lost = False                     # its lease was taken over: write and acknowledge nothing more
        self.next_delivery = 0                # the consumer sequence the next message must carry (0: any)


class Worker:
    """Exactly once into the summary: a new owner of a partition loads its summaries from the bucket
    (the previous owner's state, marks included), resets the durable consumer to its ack floor and
    drops by SeqWindow what was taken. Messages are acknowledged (AckPolicy ALL) only after the
    summaries that cover them are written, one write at a time per partition, and only while the
    lease is still this worker's. A gap in the consumer's delivery numbers is never acknowledged
    past (_delivered_again)."""

    def __init__(self, js, buckets, ncfg: Any, worker_id: str = "", max_open_diagnoses_per_node: int = 64,
                 max_clock_offset_s: float = 5.0, limits: Limits | None = None):
        self.js, self.buckets, self.ncfg = js, buckets, ncfg
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.nodes: dict[str, NodeLatest] = {}
        self.parts: dict[int, _Partition] = {}
        self.handled = 0          # batches
        self.messages = 0         # every message (batches, hello, inventory, bye)
        self.dropped = 0
        self.summaries_written = 0
        self.takeovers = 0
        self.counters: collections.Counter[str] = collections.Counter()   # this worker's (each node's: its summary)
        self.diagnoses = Diagnoses(self.counters)
        self.diagnoses.configure(max_open_diagnoses_per_node)
        self.max_clock_offset_ns = int(max_clock_offset_s * 1e9)
        self.idle_ns = 3600 * 10**9           # [state] series_idle_s (collector/idle.py)
        self.limits = limits or Limits()      # what a message read must keep to (_batch_refused)
        # Xps-Received at most this far ahead of JetStream's time, or behind it by this + publish_give_up_s.
        skew_s, give_up_s = (getattr(ncfg, k, NATS_SCHEMA[k].default) for k in ("max_received_skew_s", "publish_give_up_s"))
        self.received_ns = (int(skew_s * 1e9), int((skew_s + give_up_s) * 1e9))
        self.skipped = 0                      # messages read and not applied (counters: why)
        self._stored = _NodeStored()
        self._log = RateLimitedLog(log)
        bucket, boots = (getattr(ncfg, k, NATS_SCHEMA[k].default) for k in ("series_bucket", "series_cache_boots"))
        self.series = SeriesCache(js, bucket, boots, self.limits.max_series_per_node, counters=self.counters)

    # -- leases -----------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Leases renewed every lease_s / 3 and summaries written every summary_s, each on its own
        task: writing many summaries (a backlog, a takeover) never delays a renewal."""
        async def every(period_s: float, step, what: str) -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    await step()
                except _TRANSIENT as e:
                    log.info("worker %s: the cluster did not answer (%s): %s", self.id, what, e)
                except Exception:   # never die of one round: the leases would run out for nothing
                    log.exception("worker %s: %s round failed; trying again", self.id, what)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.05, period_s - (time.monotonic() - t0)))

        try:
            await asyncio.gather(every(self.ncfg.lease_s / 3, self._round, "leases"),
                                 every(self.ncfg.summary_s, self.write_summaries, "summaries"),
                                 every(idle.every_ns(self.idle_ns) / 1e9, self.expire_idle, "idle series"))
        finally:
            await self.release_all()

    async def release_all(self) -> None:
        """Hand every partition over, all at once (the worker is stopping). With the cluster gone,
        each handover waits out its publish timeout: one after another, a stop took partitions x
        publish_timeout_s (60 s for 12 partitions at 5 s, past a pod's grace period). A partition not
        handed over is logged; its lease runs out by itself."""
        ks = list(self.parts)
        outcomes = await asyncio.gather(*(self._release(k, delete=True) for k in ks), return_exceptions=True)
        for k, e in zip(ks, outcomes):
            if isinstance(e, Exception):
                log.info("worker %s: partition %d not handed over cleanly: %s", self.id, k, e)

    async def _round(self) -> None:
        """Renew `w.<id>` and the `p.<k>` of the partitions owned (compare-and-set on the revision),
        aim at ceil(P / workers alive): take free partitions (create: only one can), let one go when
        it has more. A dead worker's leases run out and the others take its partitions."""
        leases, n = self.buckets.leases, self.ncfg
        await leases.put(f"w.{token(self.id)}", b"")
        try:
            keys = await leases.keys()
        except nats.js.errors.NoKeysError:
            keys = []
        alive = max(1, sum(1 for key in keys if key.startswith("w.")))
        taken = {int(key[2:]) for key in keys if key.startswith("p.") and key[2:].isdigit()}
        for k, p in list(self.parts.items()):
            if p.lost or not await self._renew(p):   # lost: found taken over by a write (it may be free again)
                log.warning("worker %s: lost partition %d to another worker", self.id, k)
                await self._release(k, delete=False)
        target = math.ceil(n.partitions / alive)
        if len(self.parts) > target:
            await self._release(max(self.parts), delete=True)
            return
        start = partition(self.id, n.partitions)
        for i in range(n.partitions):
            if len(self.parts) >= target:
                break
            k = (start + i) % n.partitions
            if k in self.parts or k in taken:
                continue
            try:
                rev = await leases.create(f"p.{k}", self.id.encode())
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            self._acquire(k, rev)

    async def _renew(self, p: _Partition) -> bool:
        """Renew the partition's lease (compare-and-set on the revision held); False when another
        worker holds it now. One at a time (a round's, a write's): run together on a lease that had
        run out, one re-created it and the other, its create refused, took it for another worker's."""
        k, leases, me = p.k, self.buckets.leases, self.id.encode()
        async with p.renewing:
            try:
                p.revision = await leases.update(f"p.{k}", me, last=p.revision)
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            try:   # our last renewal may have been stored without its ack reaching us
                e = await leases.get(f"p.{k}")
            except nats.js.errors.NotFoundError:
                # Expired (this worker was held up past lease_s): nobody took it yet, so take it again.
                try:
                    p.revision = await leases.create(f"p.{k}", me)
                    log.info("worker %s: partition %d's lease had run out; renewed", self.id, k)
                    return True
                except nats.js.errors.KeyWrongLastSequenceError:
                    return False
            if e.value == me:
                p.revision = e.revision
                return True
            return False

    def _acquire(self, k: int, revision: int) -> None:
        p = self.parts[k] = _Partition(k, revision)
        p.task = asyncio.get_running_loop().create_task(self._consume(p))
        log.info("worker %s: took partition %d", self.id, k)

    async def _release(self, k: int, delete: bool) -> None:
        p = self.parts.pop(k, None)
        if p is None:
            return
        p.stopping = True
        if not delete:   # taken over: a write in flight acknowledges nothing (a lost one stays lost)
            p.lost = True
        if p.task is not None:
            p.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await p.task
        if delete:   # hand it over cleanly: what it covers written and acknowledged first
            with contextlib.suppress(*_TRANSIENT):
                await self._write(k, p)
                await self.buckets.leases.delete(f"p.{k}", last=p.revision)
        p.lost = True   # a round's write that comes later (its nodes are gone) acknowledges nothing
        for nid in [nid for nid, node in self.nodes.items() if node.part == k]:
            del self.nodes[nid]
        log.info("worker %s: let go of partition %d", self.id, k)

    # -- consuming ----------------------------------------------------------------------------------
    async def _consume(self, p: _Partition) -> None:
        n = self.ncfg
        stream, durable = stream_of(n.prefix, p.k, n.streams), f"w-p{p.k}"
        while not p.stopping:
            try:
                sub = await self._open(p, stream, durable)
                break
            except Exception as e:
                log.info("worker %s: partition %d not open yet: %s", self.id, p.k, e)
                await asyncio.sleep(0.5)
        p.ready.set()
        while not p.stopping:
            try:
                msgs = await sub.fetch(batch=512, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except Exception as e:   # transient (an election, a reconnect): the partition goes on
                log.debug("worker %s: partition %d fetch: %s", self.id, p.k, e)
                await asyncio.sleep(0.2)
                continue
            for msg in msgs:
                d = _delivery(msg.reply)
                if p.next_delivery and d and d != p.next_delivery:
                    sub = await self._delivered_again(p, sub, stream, durable, d)
                    break
                p.next_delivery = d + 1 if d else 0
                try:
                    try:
                        self._handle(p.k, msg)
                    except MissingDefinition as e:   # a compact batch of a boot whose tables are not held here
                        await self._load_series(p, e.node_id, e.boot_id)
                        self._handle(p.k, msg, loaded=True)
                except Exception:   # a message that does not parse must not stop the partition
                    log.exception("worker %s: partition %d: cannot handle a message on %s", self.id, p.k, msg.subject)
                p.last = msg

    async def _load_series(self, p: _Partition, node_id: str, boot_id: str) -> None:
        """A boot's series definitions from the bucket (series_defs.py), tried again while the
        cluster does not answer: a batch is never skipped for want of an answer."""
        while True:
            try:
                await self.series.load(node_id, boot_id)
                return
            except _TRANSIENT as e:
                if p.stopping:
                    raise
                log.info("worker %s: partition %d: series definitions not read yet: %s", self.id, p.k, e)
                await asyncio.sleep(0.5)

    async def _delivered_again(self, p: _Partition, sub, stream: str, durable: str, got: int):
        """Messages delivered to this worker were lost on the way (a connection the server cut, e.g.
        as a slow consumer): acknowledging a later one would acknowledge them too (AckPolicy ALL),
        so what was handled is written and acknowledged, and the consumer is reset to its ack floor
        on a new subscription (what the old one still receives is left behind): the lost ones come
        again, in order. Counted `worker.deliveries_lost`."""
        self.counters["worker.deliveries_lost"] += got - p.next_delivery
        log.warning("worker %s: partition %d: deliveries %d-%d never arrived; reading again from the "
                    "last acknowledged", self.id, p.k, p.next_delivery, got - 1)
        await self._write(p.k, p)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        while not p.stopping:
            try:
                await self.js.reset_consumer(stream, durable)
                p.next_delivery = 1
                return await self.js.pull_subscribe_bind(durable=durable, stream=stream)
            except Exception as e:   # transient (an election, a reconnect): tried again
                log.info("worker %s: partition %d: cannot reset its consumer yet: %s", self.id, p.k, e)
                await asyncio.sleep(0.5)
        return sub

    async def _open(self, p: _Partition, stream: str, durable: str):
        n = self.ncfg
        await self.js.add_consumer(stream, api.ConsumerConfig(
            durable_name=durable, filter_subject=partition_filter(n.prefix, p.k), ack_policy=api.AckPolicy.ALL,
            deliver_policy=api.DeliverPolicy.ALL, ack_wait=max(30.0, 10 * n.summary_s), max_ack_pending=-1,
            max_waiting=16, num_replicas=n.replicas))
        # Whatever the previous owner had been given and not acknowledged comes again, in order.
        await self.js.reset_consumer(stream, durable)
        p.next_delivery = 1
        await self._load(p.k)
        self.takeovers += 1
        return await self.js.pull_subscribe_bind(durable=durable, stream=stream)

    async def _load(self, k: int) -> None:
        """The partition's nodes as their summaries say (the previous owner's state)."""
        for _key, value, _rev in await list_bucket(self.js, self.ncfg.fleet_bucket, f"p{k}.*"):
            d = decode(value)
            if d is not None and d["node"] not in self.nodes:
                self.nodes[d["node"]] = NodeLatest.restore(d, k)

    def _handle(self, k: int, msg: Msg, loaded: bool = False) -> None:
        """One message of the partition. A compact batch with a ref whose definition is not held:
        MissingDefinition, before anything is changed (not `loaded`: the caller loads the boot's
        tables and hands it again), else skipped and counted."""
        if not loaded:
            self.messages += 1
        node_id = node_of_subject(msg.subject)
        t = _stream_time_ns(msg.reply)
        headers = msg.headers or {}
        kind = headers.get(KIND)
        raw = headers.get(RECEIVED, "")
        recv = int(raw) if raw.isdigit() else t
        batch: Any = None
        hello: pb.Hello | None = None
        if kind is None:
            batch, why = self._batch_refused(node_id, read_batch(msg.data), headers, raw, t, msg.data, loaded)
        elif kind == "hello":
            hello = pb.Hello.FromString(msg.data)
            why = self._hello_refused(node_id, hello, raw, t)
        elif kind == "inventory" and len(msg.data) > self.limits.max_inventory_bytes:
            why = "limits.max_inventory_bytes", f"an inventory of {len(msg.data)} bytes"
        elif kind not in ("inventory", "bye"):
            why = "kind", f"a message of kind {str(kind)[:64]!r}"
        else:
            why = None
        if why is not None:
            self._skip(node_id, why)
            return
        node = self.nodes.get(node_id)
        if node is None:
            if kind == "bye":   # of a node this worker does not have: nothing to end
                return
            node = self.nodes[node_id] = NodeLatest(node_id, k)
        if batch is not None:
            if not node.apply(batch, t, recv):
                self.dropped += 1
            elif batch.events or batch.boot_id != node.diagnoses_boot:
                self.diagnoses.batch(node, batch)
            self.handled += 1
            self._clock_observed(node, batch.sent_unix_nano, recv)
        elif hello is not None:
            node.hello(hello, headers.get("Xps-Session", ""), headers.get("Xps-Peer", ""), t)
            self.diagnoses.hello(node, hello.boot_id)   # a new agent boot: the last one's diagnoses end
            self._clock_observed(node, hello.time_unix_nano, recv)
        elif kind == "inventory":
            node.set_inventory(msg.data)
        elif kind == "bye":
            node.bye(headers.get("Xps-Session", ""))

    def _received_refused(self, raw: str, t_ns: int) -> tuple[str, str] | None:
        """A gateway's receive time (Xps-Received) missing, or not near when JetStream stored it."""
        if not raw.isdigit():
            return "received", f"no {RECEIVED} time ({raw[:32]!r})"
        lag = t_ns - int(raw)
        if lag < -self.received_ns[0] or lag > self.received_ns[1]:
            return "received", f"{RECEIVED} {lag / -1e9:+.1f} s from when JetStream stored it"
        return None

    def _batch_refused(self, node_id: str, batch: Any, headers: dict, raw: str, t_ns: int,
                       data: bytes, loaded: bool = False) -> tuple[Any, tuple[str, str] | None]:
        """The batch to apply (a compact one decoded: wire.CompactBatch) and why it is not applied,
        or None: (reason, what was wrong). Refused: a batch whose node is not its subject's, whose
        `Nats-Msg-Id` is not that of its node:boot:seq (subjects.is_msg_id), whose boot id or seq is
        not one an agent sends, without `Xps-Received` or with one too far from when JetStream stored
        it, compact columns that do not decode or use a ref with no definition in the series bucket,
        or that collector/limits.py refuses (its seq against `seq_ceiling` on JetStream's clock).
        Skipped messages are acknowledged with the rest, never applied (_skip)."""
        if batch.node_id != node_id:
            return batch, ("node", f"a batch of node {batch.node_id[:128]!r} on the subject of {node_id[:128]!r}")
        if (why := bad_id("boot_id", batch.boot_id)) or batch.seq < 1:
            return batch, ("ids", why or f"seq {batch.seq}")
        if not is_msg_id(mid := headers.get(MSG_ID), node_id, batch.boot_id, batch.seq):
            return batch, ("msg_id", f"{MSG_ID} {str(mid)[:300]!r} is not the batch's node:boot:seq")
        if (why_recv := self._received_refused(raw, t_ns)) is not None:
            return batch, why_recv
        if is_compact(batch):
            try:
                batch = self.series.decode(batch, self.limits.max_samples_per_batch)
            except MissingDefinition as e:
                if not loaded:
                    raise
                return batch, ("series_definition", str(e))
            except CompactError as e:
                return batch, ("columns", f"compact columns of seq {batch.seq}: {e}")
        stored = self._stored
        stored.node, stored.t_ns = self.nodes.get(node_id), t_ns
        try:
            v = self.limits.check(node_id, batch, stored, refs=refs_of(batch, data), rate=False)
        finally:
            stored.node = None
        return batch, None if v is None else (f"limits.{v.key or v.code.name}", v.message)

    def _hello_refused(self, node_id: str, hello: pb.Hello, raw: str, t_ns: int) -> tuple[str, str] | None:
        if hello.node_id != node_id:
            return "node", f"a Hello of node {hello.node_id[:128]!r} on the subject of {node_id[:128]!r}"
        if why := bad_id("boot_id", hello.boot_id):
            return "ids", why
        if (v := self.limits.check_inventory(hello.inventory)) is not None:
            return f"limits.{v.key}", v.message
        return self._received_refused(raw, t_ns)

    def _skip(self, node_id: str, why: tuple[str, str]) -> None:
        """A message read and not applied: counted by reason (the worker's, and the node's summary
        when this worker has the node), logged at most a few a second."""
        key = f"worker.skipped.{why[0]}"
        self.skipped += 1
        self.counters[key] += 1
        node = self.nodes.get(node_id)
        if node is not None:
            node.diagnosis_counts[key] = node.diagnosis_counts.get(key, 0) + 1
            node.dirty = True
        self._log.warning("worker %s: node %r: skipped a message: %s", self.id, node_id[:128], why[1])

    def _clock_observed(self, node: NodeLatest, agent_ns: int, now_ns: int) -> None:
        """A message the agent stamped `agent_ns` received at `now_ns`: the node's clock offset
        estimate, and its clock_offset diagnosis opened, updated or closed (collector/clock.py)."""
        node.offset.observe(agent_ns, now_ns)
        e = agent_clock.check(self.diagnoses, node, self.max_clock_offset_ns, now_ns)
        if e is not None:
            node.note_event(e, now_ns)

    # -- summaries ----------------------------------------------------------------------------------
    async def write_summaries(self) -> None:
        for k, p in list(self.parts.items()):
            if p.ready.is_set():
                await self._write(k, p)

    async def _write(self, k: int, p: _Partition) -> None:
        """The partition's changed summaries into the bucket, then the messages they cover
        acknowledged, while the lease is still this worker's; one write at a time per partition."""
        async with p.writing:
            await self._write_held(k, p)

    async def _write_held(self, k: int, p: _Partition) -> None:
        if p.lost:   # another worker's now: its summaries are that worker's to write
            return
        last = p.last
        dirty = [node for node in self.nodes.values() if node.part == k and node.dirty]
        now = time.time_ns()
        for i in range(0, len(dirty), 256):
            chunk = dirty[i:i + 256]
            for node in chunk:
                node.dirty = False
            results = await asyncio.gather(*(self.buckets.fleet.put(fleet_key(k, token(node.node_id)),
                                                                    node.encode(self.id, now)) for node in chunk),
                                           return_exceptions=True)
            failed = [node for node, r in zip(chunk, results) if isinstance(r, BaseException)]
            for node in failed:
                node.dirty = True
            self.summaries_written += len(chunk) - len(failed)
            if failed:
                log.info("worker %s: %d summaries not written (%s); next round", self.id, len(failed), results[0])
                return
        if last is None or p.lost:
            return
        with contextlib.suppress(*_TRANSIENT):
            if not await self._renew(p):   # taken over meanwhile: the new owner reads them again
                p.lost = True
                log.warning("worker %s: partition %d taken over while writing; not acknowledging", self.id, k)
                return
            await last.ack()
            if p.last is last:
                p.last = None

    async def expire_idle(self) -> None:
        """A pass of the idle sweep over this worker's nodes: their kept series with no point for
        [state] series_idle_s let go, their idle references forgotten (collector/idle.py; counted in
        the node's summary too, `counters`); idle.STEP series a step, the loop let go between steps."""
        now, looked = time.monotonic_ns(), 0
        for node in list(self.nodes.values()):
            series, refs = idle.expire_latest(node, now, self.idle_ns)
            if series:
                self.counters["state.series.expired"] += series
            if refs:
                self.counters["state.series_refs.expired"] += refs
            looked += len(node.series) + series + 1
            if looked >= idle.STEP:
                await asyncio.sleep(idle.STEP_GAP_NS / 1e9)
                now, looked = time.monotonic_ns(), 0

    def memory_nodes(self) -> int:
        return len(self.nodes)


async def run_worker(cfg: Any, stop: asyncio.Event) -> None:
    from .engine import connect, disconnect, ensure
    ncfg = cfg.nats
    nc = await connect(ncfg, "xpusense-worker", role="worker")
    js = nc.jetstream(timeout=ncfg.publish_timeout_s)
    buckets = await ensure(js, ncfg, create=False)   # a gateway creates them
    w = Worker(js, buckets, ncfg, max_open_diagnoses_per_node=cfg.state.max_open_diagnoses_per_node,
               max_clock_offset_s=cfg.state.max_clock_offset_s, limits=Limits.from_config(cfg.limits))
    w.idle_ns = int(cfg.state.series_idle_s * 1e9)
    log.info("worker %s: following %d partitions of the NATS cluster at %s", w.id, ncfg.partitions, ",".join(ncfg.urls))
    try:
        await w.run(stop)
    finally:
        await disconnect(nc)
