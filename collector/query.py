"""The Query API: ListNodes and GetHistory, and who may see boot ids (a loopback caller running
as the collector's user or root, or any caller where the port authenticates its callers)."""

from __future__ import annotations

import ipaddress
import os
import re
import sys

import grpc

from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from .limits import DEFAULTS as LIMITS
from .state import FleetState


class QueryServicer(pb_grpc.QueryServicer):
    def __init__(self, state: FleetState, security=None, limits=None, counters=None, proc_net: str = "/proc/net"):
        self.state = state
        self.security = security
        self.limits = limits
        self.counters = counters   # () -> {name: count}: the Ingest side's, shown with every reply
        self.proc_net = proc_net

    async def ListNodes(self, request, context):
        max_bytes = self.limits.max_reply_bytes if self.limits is not None else LIMITS["max_reply_bytes"]
        try:
            reply = self.state.view(request.node_id, request.name_prefix, request.page_token, request.page_size,
                                    max_bytes, boot_ids=self.trusted(context.peer()))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.counters is not None:
            reply.counters.update(self.counters())
        return reply

    def trusted(self, peer: str) -> bool:
        return trusted(self.security, peer, self.proc_net)

    async def GetHistory(self, request, context):
        reply = self.state.history(request.node_id, request.name, dict(request.labels))
        if reply is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no series {request.name!r} {dict(request.labels)} on node {request.node_id!r}")
        return reply


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
