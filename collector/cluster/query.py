"""The cluster's Query API (collector/query.py) sources: ListNodes from the `fleet` bucket, as a
gateway reads it when asked (FleetSnapshot) or as a scheduler replica keeps it (its FleetIndex), and
GetHistory read back from the stream (stream_history.py). Each reply's counters add up the
diagnosis counters of the node summaries it was built from."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import nats.errors
import nats.js.errors

from xpusense.v1 import telemetry_pb2 as pb

from .. import node_pages
from ..fleet_interface import Fleet, FleetNode
from ..query import QueryServicer, Unavailable
from .engine import list_bucket
from .stream_history import read_history, series_cache
from .subjects import partition, token
from .summary import MirrorNode, decode, fleet_key

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


def list_nodes(nodes: Mapping[str, FleetNode], request: pb.ListNodesRequest, max_bytes: int = MAX_REPLY_BYTES,
               boot_ids: bool = True) -> pb.ListNodesReply:
    """A page of the fleet (node_pages.list_nodes); its counters add up the diagnosis counters of the
    node summaries it was read from (few nodes have any)."""
    reply = node_pages.list_nodes(nodes, request, max_bytes, boot_ids)
    counters: dict[str, int] = {}
    for n in list(nodes.values()):
        for key, k in (n.diagnosis_counts if isinstance(n, MirrorNode) else {}).items():
            counters[key] = counters.get(key, 0) + k
    reply.counters.update(counters)
    return reply


def cluster_query(source: FleetSnapshot | Fleet, js, ncfg, security=None, max_bytes: int = MAX_REPLY_BYTES,
                  counters: Mapping[str, int] | None = None) -> QueryServicer:
    """Query for a gateway (a FleetSnapshot) or a scheduler replica (its FleetIndex); every ListNodes
    reply adds this process's `counters` (a replica's extender) to the summaries'."""
    cache = series_cache(js, ncfg)
    async def nodes(node_id: str) -> Mapping[str, FleetNode]:
        if not isinstance(source, FleetSnapshot):
            return source.nodes
        try:
            return await (source.one(node_id) if node_id else source.all())
        except (TimeoutError, nats.errors.Error) as e:
            raise Unavailable(f"the fleet bucket is not answering: {e}") from None

    async def history(node_id: str, name: str, labels: dict[str, str]) -> pb.HistoryReply | None:
        try:
            return await read_history(js, ncfg, node_id, name, labels, cache=cache)
        except (TimeoutError, nats.errors.Error) as e:
            raise Unavailable(f"the stream is not answering: {e}") from None

    def page(nodes: Mapping[str, FleetNode], request: pb.ListNodesRequest, max_bytes: int,
             boot_ids: bool) -> pb.ListNodesReply:
        reply = list_nodes(nodes, request, max_bytes, boot_ids)
        for key, k in (counters or {}).items():
            reply.counters[key] = reply.counters.get(key, 0) + k
        return reply

    return QueryServicer(nodes, history, page, security, max_bytes)
