"""The Query API (ListNodes, GetHistory) over a source of nodes and a reader of history, for the
single collector (its FleetState) and the cluster (the `fleet` bucket and the stream), and who may
see boot ids: a loopback caller running as the collector's user or root, or any caller where the
port authenticates its callers."""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import grpc

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from .fleet_interface import FleetNode
from .limits import DEFAULTS as LIMITS
from .node_pages import list_nodes

QUERY_SERVICE = pb.DESCRIPTOR.services_by_name["Query"].full_name

if TYPE_CHECKING:
    from .state import FleetState

NodeSource = Callable[[str], Awaitable[Mapping[str, FleetNode]]]   # node id ("": every node) -> nodes
HistoryReader = Callable[[str, str, dict[str, str]], Awaitable["pb.HistoryReply | None"]]
# (nodes, request, max bytes, boot ids shown) -> a ListNodes page (node_pages.list_nodes and counters)
Pager = Callable[[Mapping[str, FleetNode], pb.ListNodesRequest, int, bool], pb.ListNodesReply]


class Unavailable(Exception):
    """A source of nodes or history that cannot answer now: the call ends UNAVAILABLE."""


class QueryServicer(pb_grpc.QueryServicer):
    def __init__(self, nodes: NodeSource, history: HistoryReader, page: Pager = list_nodes, security=None,
                 max_reply_bytes: int = int(LIMITS["max_reply_bytes"]), proc_net: str = "/proc/net"):
        self.nodes, self.history, self.page, self.security = nodes, history, page, security
        self.max_reply_bytes, self.proc_net = max_reply_bytes, proc_net

    async def ListNodes(self, request, context):
        try:
            nodes = await self.nodes(request.node_id)
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            return self.page(nodes, request, self.max_reply_bytes, self.trusted(context.peer()))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def trusted(self, peer: str) -> bool:
        return trusted(self.security, peer, self.proc_net)

    async def GetHistory(self, request, context):
        try:
            reply = await self.history(request.node_id, request.name, dict(request.labels))
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no series {request.name!r} {dict(request.labels)} on node {request.node_id!r}")
        return reply


def state_query(state: FleetState, security=None, limits=None,
                counters: Callable[[], Mapping[str, int]] | None = None) -> QueryServicer:
    """The single collector's Query API, over its FleetState; every ListNodes reply shows `counters()`
    (the Ingest side's) and a page cut by its size is counted in the state's."""
    async def nodes(_node_id: str) -> Mapping[str, FleetNode]:
        return state.nodes

    async def history(node_id: str, name: str, labels: dict[str, str]) -> pb.HistoryReply | None:
        return state.history(node_id, name, labels)

    def page(nodes: Mapping[str, FleetNode], request: pb.ListNodesRequest, max_bytes: int,
             boot_ids: bool) -> pb.ListNodesReply:
        reply = list_nodes(nodes, request, max_bytes, boot_ids, state.clock(), state.counters)
        if counters is not None:
            reply.counters.update(counters())
        return reply

    return QueryServicer(nodes, history, page, security,
                         int(limits.max_reply_bytes if limits is not None else LIMITS["max_reply_bytes"]))


def trusted(security, peer: str, proc_net: str = "/proc/net") -> bool:
    """Whether this caller may see boot ids. A boot id is what a process needs to send batches
    as that boot (a forged sequence number far ahead would make the boot's real batches look
    like resends, up to limits.max_seq_jump), so where the port authenticates nobody they go
    only to a loopback caller running as the collector's own user or root (the owner of the
    peer's socket, from /proc/net/tcp). With tokens or mTLS every caller holds a credential of
    the fleet and sees them."""
    if security is not None and (security.mtls or security.tokens is not None):
        return True
    uid = loopback_peer_uid(peer, proc_net)
    return uid is not None and uid in (0, os.geteuid())


_PEER = re.compile(r"ipv4:([0-9.]+):(\d+)|ipv6:\[([0-9a-fA-F:.]+)\]:(\d+)")


def loopback_peer_uid(peer: str, proc_net: str = "/proc/net") -> int | None:
    """The uid that owns the client end of a loopback TCP connection, from gRPC's peer string
    ("ipv4:127.0.0.1:54321", "ipv6:[::1]:54321"); None when not loopback or not found."""
    m = _PEER.fullmatch(peer)
    if m is None:
        return None
    ip = ipaddress.ip_address(m.group(1) or m.group(3))
    port = int(m.group(2) or m.group(4))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_loopback:
        return None
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, name)) as f:
                uid = socket_owner(f, ip, port)
        except OSError:
            continue
        if uid is not None:
            return uid
    return None


def socket_owner(lines, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> int | None:
    """The uid column of the /proc/net/tcp or tcp6 line whose local address is ip:port (an
    IPv4-mapped IPv6 address matches its IPv4 address)."""
    want_port = f":{port:04X}"
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or not fields[1].endswith(want_port):
            continue
        raw = bytes.fromhex(fields[1][: -len(want_port)])
        # The kernel prints each 32-bit word of the address as a number in host byte order.
        addr = raw if sys.byteorder == "big" else b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        local = ipaddress.ip_address(addr)
        if isinstance(local, ipaddress.IPv6Address) and local.ipv4_mapped is not None:
            local = local.ipv4_mapped
        if local == ip:
            return int(fields[7])
    return None
