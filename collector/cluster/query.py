"""The Query API in cluster mode: ListNodes from the `fleet` bucket (the whole fleet, whichever
gateway or scheduler is asked), GetHistory read back from the stream (stream_history.py).

A gateway answers from a snapshot of the bucket taken when asked (at most `snapshot_s` old, one
read shared by the calls that come together; one node alone is one KV get), so ingest pays nothing
for it while nobody looks; a scheduler replica answers from the index it keeps by watching the
bucket (scheduler.py). Both build the reply here, as FleetState.view does: nodes in id order, pages
of at most `page_size` nodes and `max_reply_bytes` bytes, resumed with `page_token` (a node id).
Each node's open diagnoses (NodeView.diagnoses) come from its summary, and the reply's `counters`
add up the diagnosis counters of the nodes' summaries it was built from (summary.py: `dc`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import nats.js.errors

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from ..query import trusted
from .engine import list_bucket
from .stream_history import read_history
from .subjects import partition, token
from .summary import MirrorNode, decode, fleet_key

log = logging.getLogger("xpusense.collector.cluster")

_REQ_FIELDS = pb.ListNodesRequest.DESCRIPTOR.fields_by_name
_REPLY_FIELDS = pb.ListNodesReply.DESCRIPTOR.fields_by_name
_NODE_FIELDS = pb.NodeView.DESCRIPTOR.fields_by_name
MAX_REPLY_BYTES = 4 * 2**20


class FleetSnapshot:
    """The `fleet` bucket read on demand: {node id: MirrorNode}, at most `max_age_s` old."""

    def __init__(self, js, kv, bucket: str, max_age_s: float = 1.0, partitions: int = 1):
        self.js, self.kv, self.bucket, self.max_age_s, self.partitions = js, kv, bucket, max_age_s, partitions
        self.nodes: dict[str, MirrorNode] = {}
        self.taken = -1e9
        self._reading: asyncio.Future | None = None

    async def all(self) -> dict[str, MirrorNode]:
        if time.monotonic() - self.taken <= self.max_age_s:
            return self.nodes
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        reading = self._reading
        try:
            return await asyncio.shield(reading)
        finally:
            if self._reading is reading and reading.done():
                self._reading = None

    async def _read(self) -> dict[str, MirrorNode]:
        nodes: dict[str, MirrorNode] = {}
        for _key, value, revision in await list_bucket(self.js, self.bucket):
            d = decode(value)
            if d is not None:
                nodes[d["node"]] = MirrorNode(d, revision)
        self.nodes, self.taken = nodes, time.monotonic()
        return nodes

    async def one(self, node_id: str) -> dict[str, MirrorNode]:
        try:
            e = await self.kv.get(fleet_key(partition(node_id, self.partitions), token(node_id)))
        except nats.js.errors.NotFoundError:
            return {}
        d = decode(e.value) if e.value else None
        return {d["node"]: MirrorNode(d, e.revision or 0)} if d is not None and d["node"] == node_id else {}


def node_view(n: Any, name_prefix: str, boot_ids: bool) -> pb.NodeView:
    nv = pb.NodeView(node_id=n.node_id, boot_id=n.boot_id if boot_ids else "", connected=n.streams > 0,
                     last_seen_unix_nano=n.last_seen_ns, stored_up_to=n.stored_up_to.get(n.boot_id, 0),
                     batches_stored=n.batches_stored, batches_duplicate=n.batches_duplicate, peer=n.peer)
    if "boot_tag" in _NODE_FIELDS:
        from ..state import boot_tag
        nv.boot_tag = boot_tag(n.boot_id)
    nv.inventory.CopyFrom(n.inventory)
    for ser in n.series.values():
        if name_prefix and not ser.name.startswith(name_prefix):
            continue
        nv.series.add(name=ser.name, unit=ser.unit, kind=ser.kind, labels=ser.labels, value=ser.value,
                      time_unix_nano=ser.time_ns, rate=ser.rate())
    if "series_total" in _NODE_FIELDS:
        nv.series_total = len(nv.series)
    if "diagnoses" in _NODE_FIELDS:
        nv.diagnoses.extend(getattr(n, "diagnoses", {}).values())
    nv.events.extend(n.events)
    return nv


def list_nodes(nodes: dict[str, Any], request: pb.ListNodesRequest, max_bytes: int = MAX_REPLY_BYTES,
               boot_ids: bool = True) -> pb.ListNodesReply:
    """A page of the fleet, as the single collector's ListNodes answers."""
    reply = pb.ListNodesReply(time_unix_nano=time.time_ns())
    counters: dict[str, int] = {}
    for n in list(nodes.values()):   # the diagnosis counters of each node's summary (few nodes have any)
        for key, k in (getattr(n, "diagnosis_counts", None) or {}).items():
            counters[key] = counters.get(key, 0) + k
    reply.counters.update(counters)
    page_size = request.page_size if "page_size" in _REQ_FIELDS else 0
    start = request.page_token if "page_token" in _REQ_FIELDS else ""
    if start and " " in start:   # the single collector's token form: "<at> <node id>"
        start = start.partition(" ")[2]
    ids = sorted(nid for nid in nodes if nid >= start) if not request.node_id else (
        [request.node_id] if request.node_id in nodes else [])
    size = 0
    for nid in ids:
        nv = node_view(nodes[nid], request.name_prefix, boot_ids)
        nsize = nv.ByteSize() + 8
        if reply.nodes and ((page_size and len(reply.nodes) >= page_size) or size + nsize > max_bytes):
            if "next_page_token" in _REPLY_FIELDS:
                reply.next_page_token = f"0 {nid}"
            break
        reply.nodes.append(nv)
        size += nsize
    return reply


class ClusterQueryServicer(pb_grpc.QueryServicer):
    """Query for a gateway (FleetSnapshot) or a scheduler replica (its watched index)."""

    def __init__(self, source: Any, js, ncfg: Any, stale_s: float = 10.0, security=None, max_bytes: int = MAX_REPLY_BYTES):
        self.source, self.js, self.ncfg, self.stale_s = source, js, ncfg, stale_s
        self.security, self.max_bytes = security, max_bytes

    async def _nodes(self, node_id: str) -> dict[str, Any]:
        if isinstance(self.source, FleetSnapshot):
            return await (self.source.one(node_id) if node_id else self.source.all())
        return self.source.nodes

    async def ListNodes(self, request, context):
        try:
            nodes = await self._nodes(request.node_id)
        except (TimeoutError, nats.errors.Error) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the fleet bucket is not answering: {e}")
        try:
            return list_nodes(nodes, request, self.max_bytes, trusted(self.security, context.peer()))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def GetHistory(self, request, context):
        try:
            reply = await read_history(self.js, self.ncfg, request.node_id, request.name, dict(request.labels))
        except (TimeoutError, nats.errors.Error) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the stream is not answering: {e}")
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no series {request.name!r} {dict(request.labels)} on node {request.node_id!r}")
        return reply
