"""Scheduler replicas (`xpusense-collector scheduler --nats URLS`): the scheduler core fed from the
`fleet` bucket, listed then watched (as Kubernetes informers do) into a FleetIndex, a fleet_interface.Fleet
like the collector's FleetState. Each replica answers Place, Query and /metrics from its own index."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from xpusense.common.backoff import backoff_delays
from xpusense.common.supervise import TASKS
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import scheduler_pb2_grpc as spb_grpc
from xpusense.v1 import telemetry_pb2 as pb

from ..gc_policy import freeze_long_lived
from ..limits import RateLimitedLog
from ..scheduler.core import Scheduler
from ..scheduler.service import SCHEDULER_SERVICE, SchedulerServicer
from .engine import list_bucket
from .summary import CLOCK_AHEAD_NS, MirrorNode, decode, received_of

log = logging.getLogger("xpusense.collector.cluster.scheduler")
YIELD_S = 0.0005   # the watch's changes are applied for this long before the loop serves others (Place, Query)
GATHER_S = 0.005   # woken by a change after the watch ran dry: wait this long for more, applied together
WOKEN_S = 0.00005  # a wait for the next change longer than this was a wait on an empty watch
API_TIMEOUT_S = 10.0   # a replica's JetStream API calls (it publishes nothing: no publish timeout to keep)
WATCH_BACKOFF_S = (0.5, 5.0)   # first and longest wait before the bucket is listed and watched again
WATCH_HEALTHY_S = 60.0         # a watch that followed this long starts the backoff over when it ends


class _Changes:
    """What FleetView.on_change reads of a stored batch: the events new since the last summary, and
    when each happened on the collector's clock (the worker's, summary.received_of)."""
    __slots__ = ("events", "received_ns")

    def __init__(self, events: list, received_ns: list[int]):
        self.events, self.received_ns = events, received_ns


_NO_CHANGES = _Changes([], [])


class _Opened:
    """What collector/prometheus.py reads of FleetState.diagnoses: `opened`, rule -> diagnoses
    opened, here the sum of the nodes' summaries (each carried over worker takeovers)."""

    def __init__(self, nodes: dict[str, MirrorNode]):
        self.nodes = nodes

    @property
    def opened(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for n in list(self.nodes.values()):
            if n.diagnoses_opened:
                out.update(n.diagnoses_opened)
        return out


class FleetIndex:
    """The `fleet` bucket as a fleet_interface.Fleet for the scheduler core, the Query API and Prometheus.
    A node whose inventory is unchanged is updated in place (its series keep their identity, so the
    core's per-device references stay valid); a new inventory rebuilds it in the core."""

    readings_with_inventory = True   # a node comes with its latest values (fleet.py: no wait for a first batch)

    def __init__(self, clock=time.time_ns) -> None:
        self.nodes: dict[str, MirrorNode] = {}
        self.diagnoses = _Opened(self.nodes)
        self.watchers: list = []
        self.clock = clock
        self._inventory: dict[str, bytes] = {}
        self._events: dict[str, dict[str, pb.Event]] = {}
        self.ready = asyncio.Event()
        self.updates = 0
        self.watch_restarts = 0   # times the list-then-watch started again (follow)
        # waits (bounded) for the Place calls in flight; set by follow_fleet
        self.idle: Callable[[], Awaitable[None]] | None = None
        self.watch_clock = time.monotonic   # how long a list-then-watch round lasted (follow's backoff)
        self.clock_ahead = 0                # summaries whose "last seen" was ahead of this reader's clock
        self._log = RateLimitedLog(log)

    def apply(self, data: bytes, revision: int = 0) -> None:
        d = decode(data)
        if d is None:
            return
        nid, inv = d["node"], d.get("inventory") or b""
        now = self.clock()
        if (ahead := d.get("last_seen_ns", 0) - now) > CLOCK_AHEAD_NS:   # counted as seen now (summary.seen_at)
            self.clock_ahead += 1
            self._log.warning("fleet index: node %r's summary says last seen %.0f s ahead of this clock; "
                              "counted as seen now", nid[:128], ahead / 1e9)
        n = self.nodes.get(nid)
        if n is None:
            n = self.nodes[nid] = MirrorNode(d, revision, now)
            self.updates += 1
            self._inventory[nid] = inv
            self._events[nid] = {e.id: e for e in n.events}
            self._notify(n, None)
            if n.events:   # the core notes events as they come: the ones the node already has, oldest first
                rows = d.get("events") or ()
                self._notify(n, _Changes(list(reversed(n.events)), [received_of(r) for r in reversed(rows)]))
            return
        if n.revision and revision and revision <= n.revision:
            return   # older than what we have (a re-list)
        self.updates += 1
        n.update(d, revision, now)   # its diagnoses: the core reads them at the refresh the change below asks for
        rows = d.get("events") or ()
        known = self._events[nid]
        if len(rows) == len(known) and all(e[0] in known for e in rows):   # no new event: the usual case
            if inv == self._inventory[nid]:
                self._notify(n, _NO_CHANGES)
            else:
                self._new_inventory(n, inv)
            return
        events, new, received = [], [], []
        for e in rows:
            ev = known.get(e[0])
            if ev is None:
                ev = pb.Event(id=e[0], type=e[1], severity=e[2], device=e[3], message=e[4], attributes=e[5],
                              time_unix_nano=e[6])
                new.append(ev)
                received.append(received_of(e))
            events.append(ev)
        n.events = events
        self._events[nid] = {e.id: e for e in events}
        if inv != self._inventory[nid]:
            self._new_inventory(n, inv)
        else:
            self._notify(n, _Changes(list(reversed(new)), list(reversed(received))))

    def _new_inventory(self, n: MirrorNode, inv: bytes) -> None:
        self._inventory[n.node_id] = inv
        n.inventory = pb.Inventory.FromString(inv)
        self._notify(n, None)

    def _notify(self, n: MirrorNode, change: Any) -> None:
        for w in self.watchers:
            w(n, change)

    async def follow(self, js, kv, bucket: str) -> None:
        """List then watch the bucket until cancelled. The watch starts with every key's latest
        value again (older than what the list gave: ignored), so nothing between the two is missed.
        Whatever ends a round (the watch cannot start on a busy server: its consumer info times out;
        the connection goes), the next lists and watches again, after a backoff: a replica whose
        watch died would answer Place from an index nobody updates, every node going stale."""
        delays = backoff_delays(WATCH_BACKOFF_S[0], WATCH_BACKOFF_S[1])
        while True:
            started = self.watch_clock()
            try:
                await self._list_and_watch(js, kv, bucket)
                why = "the watch ended"
            except asyncio.CancelledError:
                raise
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            if self.watch_clock() - started >= WATCH_HEALTHY_S:   # it followed for long: not a failing loop
                delays = backoff_delays(WATCH_BACKOFF_S[0], WATCH_BACKOFF_S[1])
            self.watch_restarts += 1
            delay = next(delays)
            log.warning("fleet index: cannot follow bucket %s (%s); listing and watching again in %.1f s "
                        "(%d restarts)", bucket, why, delay, self.watch_restarts)
            await asyncio.sleep(delay)

    async def _list_and_watch(self, js, kv, bucket: str) -> None:
        for _key, value, revision in await list_bucket(js, bucket):
            self.apply(value, revision)
        log.info("fleet index: %d nodes listed; watching", len(self.nodes))
        self.ready.set()
        w = await kv.watchall()
        # A Place call takes ~5 turns of the loop (gRPC's completion queue, the handler, the reply);
        # changes applied one or two per turn as they come (~50 us each) sat in most of them
        # (measured: a Place over gRPC with a p50 of 1.7 ms for a 0.4 ms decision). So changes
        # are applied in batches: after the watch ran dry, the first new change waits GATHER_S for
        # those behind it; a batch gives the loop back after YIELD_S of work (a burst of queued
        # changes holds nothing up for longer: ~50 us a change, 0.7 ms at p99 on a busy machine).
        clock = time.perf_counter
        t_yield = clock() + YIELD_S
        try:
            while True:
                t_wait = clock()
                try:
                    e = await w.__anext__()
                except StopAsyncIteration:
                    break
                if clock() - t_wait > WOKEN_S:   # it had to wait: the watch was dry
                    await asyncio.sleep(GATHER_S)
                    if self.idle is not None:   # a Place call in flight goes first (bounded wait)
                        await self.idle()
                    t_yield = clock() + YIELD_S
                if e is not None and e.operation is None and e.value:
                    self.apply(e.value, e.revision or 0)
                    if clock() > t_yield:
                        await asyncio.sleep(0)
                        t_yield = clock() + YIELD_S
        finally:
            with contextlib.suppress(Exception):
                await w.stop()


class ClusterScheduler:
    """A scheduler core over a FleetIndex that follows the `fleet` bucket."""

    service = SCHEDULER_SERVICE

    def __init__(self, index: FleetIndex, core: Scheduler, task: asyncio.Task):
        self.index, self.core, self.task = index, core, task

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


async def follow_fleet(js, kv, cfg: Any, timeout_s: float = 60.0) -> ClusterScheduler:
    """List the bucket, build the core over it, then keep watching."""
    index = FleetIndex()
    task = TASKS.task("fleet-index", lambda: index.follow(js, kv, cfg.nats.fleet_bucket))   # its watch: follow() restarts it
    try:
        await asyncio.wait_for(index.ready.wait(), timeout_s)
    except BaseException:
        task.cancel()
        raise
    core = Scheduler(index, cfg.scheduler, cfg.stale_s)
    index.idle = core.view.idle
    return ClusterScheduler(index, core, task)


async def add_scheduler(server, js, kv, cfg: Any) -> ClusterScheduler:
    sched = await follow_fleet(js, kv, cfg)
    spb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(sched.core), server)
    return sched


async def run_scheduler(cfg: Any, stop: asyncio.Event, security=None, credentials=None) -> None:
    """`xpusense-collector scheduler`: Place and Query from the watched index, on cfg.listen."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

    from ..grpc_server import bind, grpc_server
    from ..query import QUERY_SERVICE
    from .engine import connect, disconnect, ensure
    from .query import cluster_query
    ncfg = cfg.nats
    nc = await connect(ncfg, "xpusense-scheduler", role="scheduler")
    # The replica publishes nothing: its JetStream API calls (the watch's consumer info, the list)
    # get a bound fit for a busy cluster, not the publish timeout.
    js = nc.jetstream(timeout=max(ncfg.publish_timeout_s, API_TIMEOUT_S))
    buckets = await ensure(js, ncfg, create=False)   # a gateway creates them
    server = grpc_server(security, None, cfg.max_message_bytes)
    sched = await add_scheduler(server, js, buckets.fleet, cfg)
    collections_held = TASKS.task("gc-policy", freeze_long_lived)
    counters: collections.Counter[str] = collections.Counter()   # the extender's, shown by ListNodes
    pb_grpc.add_QueryServicer_to_server(cluster_query(sched.index, js, ncfg, security, counters=counters), server)
    prometheus = _prometheus(cfg, sched.index)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    bind(server, cfg.listen, credentials)
    await server.start()
    from ..extender_http import start_extender
    try:
        extender = await start_extender(cfg, sched.core, security, counters)   # kube-scheduler's, over this core
    except BaseException:
        await server.stop(grace=None)
        raise
    for svc in ("", SCHEDULER_SERVICE, QUERY_SERVICE):
        await hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
    log.info("scheduler listening on %s, %d nodes in its index from the NATS cluster at %s", cfg.listen,
             len(sched.index.nodes), ",".join(ncfg.urls))
    try:
        await stop.wait()
    finally:
        if prometheus is not None:
            prometheus.stop()
        if extender is not None:
            await extender.stop()
        await server.stop(grace=2.0)
        collections_held.cancel()
        await sched.close()
        await disconnect(nc)


def _prometheus(cfg: Any, index: FleetIndex):
    """[export.prometheus] on a scheduler replica: the whole fleet's latest values (the series the
    summaries keep) at /metrics, as one collector serves them (collector/prometheus.py)."""
    if not cfg.export.prometheus.enabled:
        return None
    from ..grpc_server import BindError
    from ..inventory_book import InventoryBook
    from ..prometheus import PrometheusEndpoint
    book = InventoryBook().watch(index)
    for n in list(index.nodes.values()):   # listed before the book was watching
        book._on_change(n, None)
    endpoint = PrometheusEndpoint(cfg.export.prometheus, index, book)
    try:
        endpoint.start()
    except OSError as e:
        raise BindError(str(e)) from None
    return endpoint


__all__ = ["FleetIndex", "ClusterScheduler", "follow_fleet", "add_scheduler", "run_scheduler", "spb"]
