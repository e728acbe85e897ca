"""Running cluster mode's processes: the gateway (`serve --nats`), the worker (`worker`) and the
scheduler replica (`scheduler`), each on its own asyncio loop until SIGTERM/SIGINT.

The gateway's port serves what a single collector's does: Ingest (gateway.py), Query (ListNodes
from the `fleet` bucket, GetHistory from the stream: query.py), Scheduler.Place (from its own
watched index, scheduler.py) and gRPC health (Ingest NOT_SERVING while the NATS connection is down).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xpusense.common.supervise import TASKS
from xpusense.v1 import scheduler_pb2_grpc as spb_grpc
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from ..gc_policy import freeze_long_lived
from ..grpc_server import bind, grpc_server
from ..query import QUERY_SERVICE
from ..wire import INGEST_SERVICE, add_ingest
from .engine import connect, disconnect, ensure
from .gateway import ClusterIngestServicer, Gateway

log = logging.getLogger("xpusense.collector.cluster")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
# A gateway's frozen garbage cycles (an aborted stream's frame and its exception: no reclaim runs
# here as in the single collector) wait at most this long for the sweep that frees them.
GATEWAY_SWEEP_S = 300.0


class _PlaceElsewhere(spb_grpc.SchedulerServicer):
    async def Place(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "this is a cluster-mode gateway: Place is answered by the "
                            "scheduler replicas (`xpusense-collector scheduler --nats ...`; or set [nats] gateway_place)")


async def start_gateway(cfg: Any, security=None, limits=None, credentials=None, with_scheduler: bool | None = None):
    """Connect, make sure streams and buckets exist, serve on cfg.listen. Returns (server, gateway, closers)."""
    from .query import FleetSnapshot, cluster_query
    ncfg = cfg.nats
    hs = health.aio.HealthServicer()
    loop = asyncio.get_running_loop()

    def follow(ok: bool) -> None:
        for svc in ("", INGEST_SERVICE):
            loop.create_task(hs.set(svc, SERVING if ok else NOT_SERVING))

    nc = await connect(ncfg, "xpusense-gateway", on_state=follow, role="gateway")
    js = nc.jetstream(timeout=ncfg.publish_timeout_s)
    buckets = await ensure(js, ncfg)
    gw = Gateway(nc, js, buckets, ncfg)
    await gw.start()
    if limits is not None:   # its series-reference tables forget references idle this long (collector/idle.py)
        limits.series_idle_s = float(cfg.state.series_idle_s)
    server = grpc_server(security, limits, cfg.max_message_bytes)
    encodings = getattr(getattr(cfg, "ingest", None), "batch_encodings", None)   # [ingest] batch_encodings
    add_ingest(ClusterIngestServicer(gw, security, limits, encodings), server)
    snapshot = FleetSnapshot(js, buckets.fleet, ncfg.fleet_bucket, ncfg.snapshot_s, ncfg.partitions)
    pb_grpc.add_QueryServicer_to_server(cluster_query(snapshot, js, ncfg, security), server)
    closers: list = []
    services = ["", INGEST_SERVICE, QUERY_SERVICE]
    if with_scheduler is None:
        with_scheduler = ncfg.gateway_place
    if not with_scheduler:
        spb_grpc.add_SchedulerServicer_to_server(_PlaceElsewhere(), server)
    else:
        from .scheduler import add_scheduler
        sched = await add_scheduler(server, js, buckets.fleet, cfg)
        closers.append(sched.close)
        services.append(sched.service)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    bind(server, cfg.listen, credentials)
    await server.start()
    for svc in services:
        await hs.set(svc, SERVING)
    return server, gw, closers + [gw.close, lambda: disconnect(nc)]


async def run_gateway(cfg: Any, stop: asyncio.Event, security=None, limits=None, credentials=None) -> None:
    server, gw, closers = await start_gateway(cfg, security, limits, credentials)
    gc_task = TASKS.task("gc-policy", lambda: freeze_long_lived(stop, sweep_s=GATEWAY_SWEEP_S), stop)
    log.info("gateway %s listening on %s, publishing to the NATS cluster at %s", gw.id, cfg.listen,
             ",".join(cfg.nats.urls))
    await stop.wait()
    await gc_task
    await server.stop(grace=2.0)
    log.info("gateway %s stopping: %d batches published, %d duplicates, %d publishes sent again (%d not answered "
             "in time), %d stream waits for in-flight room, series tables %s", gw.id, gw.published, gw.duplicates,
             gw.retries, gw.timeouts, gw.inflight_waits, dict(gw.counts) or "none")
    unwritten = await gw.marks.flush_all(timeout_s=cfg.nats.publish_timeout_s)
    if unwritten:
        log.warning("gateway %s: %d marks not written to the cluster within %g s of stopping: those agents "
                    "will resend what followed them (dropped downstream as duplicates)", gw.id, unwritten,
                    cfg.nats.publish_timeout_s)
    for close in closers:
        try:
            await close()
        except Exception as e:
            log.debug("closing: %s", e)

