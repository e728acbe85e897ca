"""ListNodes pages, for the single collector and the cluster alike: nodes in id order, a page of at
most `page_size` nodes and `max_bytes` bytes, resumed with the page token "<at> <node id>" (at 0:
the whole node; k: its series k-1 on). Boot ids only for trusted callers (boot_tag tells boots apart)."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import time
from collections.abc import Mapping, MutableMapping

from xpusense.v1 import telemetry_pb2 as pb

from .fleet_interface import FleetNode


def list_nodes(nodes: Mapping[str, FleetNode], request: pb.ListNodesRequest, max_bytes: int = 0,
               boot_ids: bool = True, now_ns: int | None = None,
               counters: MutableMapping[str, int] | None = None) -> pb.ListNodesReply:
    """One page: the request's `node_id` alone if set, else every node from its token on. A page
    holds at most `page_size` nodes and `max_bytes` bytes (0: no bound), and always something; where
    it stops, `next_page_token` says where to resume, possibly within one node's series. A page cut
    by its size is counted in `counters["limits.max_reply_bytes"]`. ValueError for a token not made here."""
    reply = pb.ListNodesReply(time_unix_nano=time.time_ns() if now_ns is None else now_ns)
    node_id, name_prefix, page_token, page_size = (request.node_id, request.name_prefix, request.page_token,
                                                   request.page_size)
    first, at = parse_page_token(page_token) if page_token else ("", 0)
    ids = ([node_id] if node_id in nodes else []) if node_id else sorted(nodes)
    page = _Page(reply, max_bytes)
    for nid in itertools.islice(ids, bisect.bisect_left(ids, first) if first else 0, None):
        if page_size and len(reply.nodes) >= page_size:
            reply.next_page_token = page_token_for(nid, 0)
            break
        if not _add_node(page, nodes[nid], name_prefix, at if nid == first else 0, boot_ids):
            if counters is not None:
                counters["limits.max_reply_bytes"] = counters.get("limits.max_reply_bytes", 0) + 1
            break
    return reply


def _add_node(page: _Page, n: FleetNode, name_prefix: str, start: int, boot_ids: bool) -> bool:
    """Add node `n` to the page from position `start` (0: the whole node, k: series k-1 on);
    False when the page is full (its next_page_token set)."""
    nv = page.reply.nodes.add(node_id=n.node_id, boot_id=n.boot_id if boot_ids else "",
                              boot_tag=boot_tag(n.boot_id), connected=n.streams > 0,
                              last_seen_unix_nano=n.last_seen_ns, stored_up_to=n.stored_up_to.get(n.boot_id, 0),
                              batches_stored=n.batches_stored, batches_duplicate=n.batches_duplicate,
                              peer=n.peer, continued=start > 0)
    nv.series_total = (len(n.series) if not name_prefix
                       else sum(1 for ser in n.series.values() if ser.name.startswith(name_prefix)))
    if start == 0:
        nv.inventory.CopyFrom(n.inventory)
    fresh = page.items == 0
    if not page.fits(nv.ByteSize()):
        return page.full_before(n.node_id, start)
    if start == 0:
        for d in n.diagnoses.values():   # few (bounded per node): with the node, on its first page
            if not page.fits(d.ByteSize() + 4) and not fresh:
                return page.full_before(n.node_id, 0)
            nv.diagnoses.append(d)
        for i, e in enumerate(n.events):
            if not page.fits(e.ByteSize() + 4):
                if not fresh:   # on a page of their own they may fit
                    return page.full_before(n.node_id, 0)
                nv.events_omitted = len(n.events) - i
                break
            nv.events.append(e)
    for i, ser in enumerate(itertools.islice(n.series.values(), max(0, start - 1), None), max(0, start - 1)):
        if name_prefix and not ser.name.startswith(name_prefix):
            continue
        sv = nv.series.add(name=ser.name, unit=ser.unit, kind=ser.kind, labels=ser.labels,
                           value=ser.value, time_unix_nano=ser.time_ns, rate=ser.rate())
        if ser.histogram is not None:
            sv.histogram.CopyFrom(ser.histogram)
        if not page.fits(sv.ByteSize() + 4):
            del nv.series[-1]
            page.reply.next_page_token = page_token_for(n.node_id, i + 1)
            return False
    return True


class _Page:
    """The bytes of one ListNodes page so far. An item fits if the page stays within `max_bytes`
    (0: no bound), or if the page has nothing yet (a page always moves the reader on)."""

    __slots__ = ("reply", "max_bytes", "size", "items")

    def __init__(self, reply: pb.ListNodesReply, max_bytes: int):
        self.reply, self.max_bytes = reply, max_bytes
        self.size, self.items = 32, 0     # the reply's own fields, and the page token

    def fits(self, size: int) -> bool:
        if self.max_bytes and self.items and self.size + size > self.max_bytes:
            return False
        self.size += size
        self.items += 1
        return True

    def full_before(self, node_id: str, at: int) -> bool:
        """The page ends before the node view last added, which the next page starts at `at`."""
        del self.reply.nodes[-1]
        self.reply.next_page_token = page_token_for(node_id, at)
        self.max_bytes = -1   # nothing more fits
        return False


def boot_tag(boot_id: str) -> str:
    """A boot id's stand-in where the id itself is not shown: the same boot, the same tag."""
    return hashlib.sha256(boot_id.encode()).hexdigest()[:16] if boot_id else ""


def page_token_for(node_id: str, at: int) -> str:
    return f"{at} {node_id}"   # node ids have no spaces (common/ids.py)


def parse_page_token(token: str) -> tuple[str, int]:
    at, _, node_id = token.partition(" ")
    if not at.isdigit() or not node_id:
        raise ValueError(f"page_token {token[:64]!r} was not made by this collector")
    return node_id, int(at)
