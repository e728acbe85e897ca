"""Cluster mode's pure parts: ids as subject tokens and KV keys, partitions, SeqWindow (exactly
once downstream), the per-node summary (worker side -> bucket -> reader side), ListNodes pages
from summaries, and the scheduler's FleetIndex updating nodes in place."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xpusense.collector.cluster.config import split_urls
from xpusense.collector.cluster.query import list_nodes
from xpusense.collector.cluster.scheduler import FleetIndex
from xpusense.collector.cluster.seq_marks import SeqWindow
from xpusense.collector.cluster.subjects import (
    is_msg_id,
    msg_id,
    node_subject,
    partition,
    stream_of,
    stream_subjects,
    token,
    untoken,
)
from xpusense.collector.cluster.summary import MirrorNode, NodeLatest, decode
from xpusense.common import metric_names as m
from xpusense.v1 import telemetry_pb2 as pb


@given(st.text(st.characters(blacklist_categories=("Cs", "Zs", "Cc")), min_size=1, max_size=60))
def test_token_round_trip_and_is_one_safe_token(text):
    t = token(text)
    assert untoken(t) == text
    assert t and all(c.isascii() and (c.isalnum() or c in "_-=") for c in t)


def test_token_examples():
    assert token("gpu-1") == "gpu-1"
    assert token("gpu-1.dc") == "gpu-1=2Edc"
    assert token("a=b") == "a=3Db" and untoken("a=3Db") == "a=b"
    assert token("a*>") == "a=2A=3E"


def test_partitions_are_stable_and_streams_cover_them():
    assert partition("node-1", 12) == partition("node-1", 12)
    assert partition("node-1", 12) == 1   # the same in every process and release (blake2b, not hash())
    counts = [0] * 12
    for i in range(1200):
        counts[partition(f"node-{i}", 12)] += 1
    assert min(counts) > 60                # spread
    subjects = [s for i in range(3) for s in stream_subjects("xpusense", i, 12, 3)]
    assert len(subjects) == len(set(subjects)) == 12
    assert stream_of("xpusense", 7, 3) == "XPUSENSE_1" and "xpusense.*.p7.*" in stream_subjects("xpusense", 1, 12, 3)
    assert node_subject("xpusense", "", 7, "a.b") == "xpusense.none.p7.a=2Eb"


def test_a_batch_message_id_is_short_stable_and_names_one_batch():
    mid = msg_id("gpu-node-0001.dc1", "3f0c2a9e-5b1d-4c8e-9a7f-2d6b1e0c4a55", 86_400)
    assert mid == "NJ8hWSNoeG-MHuSK"   # the same in every process and release: JetStream deduplicates on it
    assert len(mid) == 16 and ":" not in mid
    assert len({msg_id("n", "b", seq) for seq in range(1, 10_001)} | {msg_id("m", "b", 1), msg_id("n", "c", 1)}) == 10_002
    assert is_msg_id(mid, "gpu-node-0001.dc1", "3f0c2a9e-5b1d-4c8e-9a7f-2d6b1e0c4a55", 86_400)
    assert is_msg_id("n:b:7", "n", "b", 7)   # the whole node:boot:seq, as older gateways wrote it
    assert not is_msg_id("n:b:8", "n", "b", 7) and not is_msg_id(msg_id("n", "b", 8), "n", "b", 7)
    assert not is_msg_id(None, "n", "b", 7)


def test_split_urls():
    assert split_urls("127.0.0.1:4222, nats://h:1,tls://x:2") == ["nats://127.0.0.1:4222", "nats://h:1", "tls://x:2"]


def test_seq_window_takes_each_seq_once_in_any_order():
    w = SeqWindow()
    assert [w.take(s) for s in (1, 2, 3, 2, 5, 4, 4, 3, 6)] == [True, True, True, False, True, True, False, False, True]
    assert w.high == 6
    w2 = SeqWindow(high=10)                # restored from a summary: everything up to 10 was taken
    assert not w2.take(10) and not w2.take(3) and w2.take(11)
    w3 = SeqWindow(span=8)
    w3.take(100)
    assert not w3.take(50)                 # far below: taken long ago (or dropped as a resend)


def _batch(seq, util, t, events=(), boot="b1"):
    b = pb.Batch(node_id="n1", boot_id=boot, seq=seq)
    b.samples.add(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, labels={"device": "0"}, value=util,
                  time_unix_nano=t, series_ref=1)
    b.samples.add(name="system.network.io", unit="By", kind=pb.COUNTER, labels={"device": "eth0", "direction": "receive"},
                  value=1000.0 * seq, time_unix_nano=t, series_ref=2)
    b.samples.add(name="hw.gpu.clock", unit="Hz", kind=pb.GAUGE, labels={"device": "0"}, value=1.0, time_unix_nano=t,
                  series_ref=3)                                           # not kept
    b.samples.add(name="hw.gpu.memory.usage", unit="By", kind=pb.GAUGE, labels={"device": "0", "pid": "7"},
                  value=5.0, time_unix_nano=t, series_ref=4)             # per process: not kept
    for e in events:
        b.events.add(id=e, type="checkpoint_request", severity="warning", device="0", message="m", time_unix_nano=t)
    return b


def test_summary_round_trip_and_takeover():
    n = NodeLatest("n1", 3)
    inv = pb.Inventory(hostname="h", labels={"region": "eu"})
    inv.resources.add(type="GPU", vendor="nvidia", model="H100", id="0", attributes={"memory": "80GB"})
    n.hello(pb.Hello(node_id="n1", boot_id="b1", inventory=inv), "gw/1", "ipv4:1.2.3.4:5", 10)
    assert n.apply(_batch(1, 0.5, 1_000_000_000, ["e1"]), 20)
    assert n.apply(_batch(2, 0.7, 2_000_000_000, ["e1", "e2"]), 30)
    assert not n.apply(_batch(2, 0.7, 2_000_000_000), 31)               # the same (boot, seq): dropped
    assert {s[0]: s[6] for s in decode(n.encode("w1", 35))["series"]}["system.network.io"] == pytest.approx(1000.0)
    # an older stamp (the agent's clock stepped back) received last: the latest, by when it arrived
    assert n.apply(_batch(3, 0.1, 1_500_000_000), 32, recv_ns=33)
    d = decode(n.encode("w1", 40))
    assert d["node"] == "n1" and d["streams"] == 1 and d["stored_up_to"] == {"b1": 3}
    assert d["batches_stored"] == 3 and d["batches_duplicate"] == 1
    kept = {s[0]: s for s in d["series"]}
    assert set(kept) == {"hw.gpu.utilization", "system.network.io"}
    assert kept["hw.gpu.utilization"][4] == 0.1 and d["received_ns"] == [33, 33]
    assert kept["system.network.io"][6] is None                         # its stamp went back: no rate
    assert [e[0] for e in d["events"]] == ["e2", "e1"]                        # newest first, each once
    m = MirrorNode(d)
    assert m.inventory.labels["region"] == "eu" and m.streams == 1 and m.stored_up_to == {"b1": 3}
    # a new owner restores it, and a redelivered batch is not taken twice
    r = NodeLatest.restore(d, 3)
    assert not r.apply(_batch(2, 0.9, 3_000_000_000), 50)
    assert r.apply(_batch(4, 0.9, 3_000_000_000, ["e2", "e3"]), 50)
    d2 = decode(r.encode("w2", 60))
    assert d2["inventory"] == d["inventory"] and [e[0] for e in d2["events"]] == ["e3", "e2", "e1"]
    r.bye("gw/1")
    assert decode(r.encode("w2", 61))["streams"] == 0


def test_a_summary_keeps_xid_counts_and_pod_use_for_the_replicas_metrics():
    """What a scheduler replica's /metrics can alert on and label by pod: the XID and error-code
    series, the pods' roll-ups and the kubelet's assignments (not the per-process series)."""
    n = NodeLatest("n1", 0)
    n.hello(pb.Hello(node_id="n1", boot_id="b1", inventory=pb.Inventory(hostname="h")), "gw/1", "p", 10)
    b = pb.Batch(node_id="n1", boot_id="b1", seq=1)
    pod = {"k8s.pod.name": "train-0", "k8s.namespace.name": "ml", "k8s.container.name": "trainer"}
    for name, kind, labels, value in (
            (m.XID_ERRORS, pb.COUNTER, {"device": "gpu0", "xid": "79"}, 1.0),
            (m.LAST_XID, pb.GAUGE, {"device": "gpu0"}, 79.0),
            (m.NPU_ERROR_CODES, pb.COUNTER, {"device": "npu0-0", "code": "0x80E18401"}, 2.0),
            (m.NPU_ERROR_CODE, pb.GAUGE, {"device": "npu0-0"}, float(0x80E18401)),
            (m.POD_UTILIZATION, pb.GAUGE, {"device": "gpu0", "engine": "sm", **pod}, 0.6),
            (m.POD_MEMORY_USAGE, pb.GAUGE, {"device": "gpu0", **pod}, 6e9),
            (m.DEVICE_ASSIGNED, pb.GAUGE, {"device": "gpu0", **pod}, 1.0),
            (m.PROCESS_UTILIZATION, pb.GAUGE, {"device": "gpu0", "engine": "sm", "pid": "7"}, 0.6)):
        b.samples.add(name=name, unit="1", kind=kind, labels=labels, value=value, time_unix_nano=1_000_000_000)
    assert n.apply(b, 20)
    kept = {s.name: s.value for s in MirrorNode(decode(n.encode("w1", 30))).series.values()}
    assert kept == {m.XID_ERRORS: 1.0, m.LAST_XID: 79.0, m.NPU_ERROR_CODES: 2.0, m.NPU_ERROR_CODE: float(0x80E18401),
                    m.POD_UTILIZATION: 0.6, m.POD_MEMORY_USAGE: 6e9, m.DEVICE_ASSIGNED: 1.0}


def test_a_summary_of_format_1_is_read_as_its_writer_wrote_it():
    """tests/fixtures/fleet/summary_format1.msgpack: a summary with two-letter keys, as workers of
    the format before write it: readers and a worker taking the node over read it, and what they
    write again says the same in format 2."""
    with open(os.path.join(os.path.dirname(__file__), "..", "fixtures", "fleet", "summary_format1.msgpack"), "rb") as f:
        d = decode(f.read())
    assert d is not None and d["format"] == 1 and d["node"] == "node-a" and d["written_ns"] == 40
    m = MirrorNode(d)
    assert (m.boot_id, m.streams, m.peer, m.worker) == ("b1", 1, "ipv4:10.0.0.1:5000", "w1")
    assert m.inventory.labels["region"] == "eu" and m.stored_up_to == {"b1": 2} and m.batches_stored == 2
    assert {s.name: s.value for s in m.series_list} == {"hw.gpu.utilization": 0.7, "system.network.io": 2000.0}
    assert [e.id for e in m.events] == ["e2", "e1"] and list(m.diagnoses) == ["d1"]
    assert m.diagnosis_counts == {"worker.skipped.ids": 2} and m.diagnoses_opened == {"pcie_contention": 1}
    again = decode(NodeLatest.restore(d, 0).encode("w1", 40))
    assert again is not None and again["format"] == 2
    def same(x: dict) -> dict:   # a restored series has no rate until its next point
        return {**x, "format": 0, "series": [row[:6] for row in x["series"]]}
    assert same(again) == same(d)
    assert decode(b"\x81\xa1v\x03") is None   # a format this reader does not know


def test_a_worker_reads_batches_lean_to_the_same_summary():
    """wire.read_batch: a batch without events, as the worker reads it from the stream, is a
    WireBatch (read by the C reader) where it was built; the summary it makes is the one protobuf's
    Batch makes, a series not known by its ref read from the samples then, and a batch with
    events still read by protobuf."""
    from xpusense.collector.wire import WireBatch, _wire_rows, read_batch

    batches = [_batch(1, 0.5, 1_000_000_000), _batch(2, 0.7, 2_000_000_000, ["e1"]), _batch(3, 0.1, 1_500_000_000),
               _batch(4, 0.9, 3_000_000_000)]
    batches[3].samples.add(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, labels={"device": "1"}, value=0.25,
                           time_unix_nano=3_000_000_000, series_ref=5)   # a new series, late
    slow, lean = NodeLatest("n1", 0), NodeLatest("n1", 0)
    for b in batches:
        read = read_batch(b.SerializeToString())
        assert (read.__class__ is WireBatch) == (_wire_rows is not None and not b.events)
        assert slow.apply(b, 5) and lean.apply(read, 5)
    assert decode(lean.encode("w", 9)) == decode(slow.encode("w", 9))
    kept = {tuple(sorted(x[3].items())): x[4] for x in decode(lean.encode("w", 9))["series"] if x[0] == "hw.gpu.utilization"}
    assert kept == {(("device", "0"),): 0.9, (("device", "1"),): 0.25}


def test_list_nodes_pages_by_node():
    nodes = {}
    for i in range(5):
        n = NodeLatest(f"n{i}", 0)
        n.hello(pb.Hello(node_id=f"n{i}", boot_id="b", inventory=pb.Inventory(hostname=f"h{i}")), "s", "", 1)
        nodes[f"n{i}"] = MirrorNode(decode(n.encode("w", 1)))
    req = pb.ListNodesRequest()
    assert [x.node_id for x in list_nodes(nodes, req).nodes] == ["n0", "n1", "n2", "n3", "n4"]
    assert [x.node_id for x in list_nodes(nodes, pb.ListNodesRequest(node_id="n3")).nodes] == ["n3"]
    if "page_size" in pb.ListNodesRequest.DESCRIPTOR.fields_by_name:
        page = list_nodes(nodes, pb.ListNodesRequest(page_size=2))
        assert [x.node_id for x in page.nodes] == ["n0", "n1"] and page.next_page_token
        page2 = list_nodes(nodes, pb.ListNodesRequest(page_size=2, page_token=page.next_page_token))
        assert [x.node_id for x in page2.nodes] == ["n2", "n3"]


def test_fleet_index_updates_in_place():
    idx = FleetIndex()
    seen = []
    idx.watchers.append(lambda node, change: seen.append((node.node_id, change)))
    n = NodeLatest("n1", 0)
    inv = pb.Inventory(hostname="h")
    inv.resources.add(type="GPU", vendor="nvidia", model="H100", id="0")
    n.hello(pb.Hello(node_id="n1", boot_id="b1", inventory=inv), "s", "", 1)
    n.apply(_batch(1, 0.5, 1_000_000_000, ["e1"]), 2)
    idx.apply(n.encode("w", 3), revision=10)
    assert [c is None for _, c in seen] == [True, False]                # rebuilt, then its events noted
    ser = idx.nodes["n1"].series[("hw.gpu.utilization", (("device", "0"),))]
    n.apply(_batch(2, 0.9, 2_000_000_000, ["e2"]), 4)
    idx.apply(n.encode("w", 5), revision=11)
    assert idx.nodes["n1"].series[("hw.gpu.utilization", (("device", "0"),))] is ser and ser.value == 0.9
    assert [e.id for e in seen[-1][1].events] == ["e2"]                  # only the new event
    idx.apply(n.encode("w", 5), revision=9)                               # older revision: ignored
    assert idx.updates == 2 and not math.isnan(ser.value)


def test_a_batch_is_kept_in_the_bytes_it_came_in():
    """wire.batch_payload (a gateway publishes it, the single collector's store keeps it): the
    wire bytes after the AgentMessage's tag and length. A batch without events that the C reader
    accepts whole is a LeanMessage holding those bytes; any other batch is parsed by protobuf, and
    its bytes are taken when the message is the one parsed last and holds nothing else, otherwise
    the batch is serialized again. Either way the bytes parse to the same Batch, and the bytes held
    are let go once taken (a big message does not stay in memory)."""
    from xpusense.collector import wire as received
    from xpusense.collector.wire import LeanMessage, batch_payload, batch_wire, parse_agent_message

    def framed(sent: bytes) -> bytes:
        n = len(sent)
        return bytes([0x12, 0x80 | (n & 0x7F), n >> 7]) + sent

    b = pb.Batch(node_id="n1", boot_id="b1")
    for d in range(200):   # over 127 bytes: a length of two varint bytes
        b.samples.add(name="hw.gpu.utilization", value=d / 200, labels={"device": str(d)})
    # as an agent might send it: seq last (not the order SerializeToString writes), so the two differ
    sent = b.SerializeToString() + pb.Batch(seq=7).SerializeToString()
    b.seq = 7
    assert sent != b.SerializeToString() and pb.Batch.FromString(sent) == b
    msg = parse_agent_message(framed(sent))
    if received._wire_rows is not None:   # the C reader: lean, its own bytes, whenever asked
        assert msg.__class__ is LeanMessage and msg.WhichOneof("msg") == "batch"
        assert batch_payload(msg) == batch_payload(msg) == sent and received._received.raw == b""
        lean = msg.batch
        assert (lean.node_id, lean.boot_id, lean.seq, lean.events) == ("n1", "b1", 7, ())
        assert lean.columns[0] == (0,) * 200 and lean._batch is None   # not parsed by protobuf
        assert lean.samples[3].labels["device"] == "3" and lean.parsed() == b   # parsed when read
        assert msg.HasField("batch") and not msg.HasField("hello") and msg.whole() == pb.AgentMessage(batch=b)
    # With an event: parsed by protobuf.
    b.events.add(id="e1", type="xid")
    sent = b.SerializeToString()
    wire = framed(sent)
    msg = parse_agent_message(wire)
    assert isinstance(msg, pb.AgentMessage)
    assert batch_payload(msg) == sent                       # the bytes it came in
    assert batch_payload(msg) == b.SerializeToString()      # taken once: then serialized again
    first, second = parse_agent_message(wire), parse_agent_message(wire)
    assert batch_payload(first) == b.SerializeToString()    # not the message parsed last
    msg = parse_agent_message(wire + bytes([0x50, 0x01]))   # a field after the batch (unknown here)
    assert not isinstance(msg, LeanMessage) and batch_payload(msg) == b.SerializeToString()
    assert second is not None
    hello = parse_agent_message(pb.AgentMessage(hello=pb.Hello(node_id="n1")).SerializeToString())
    assert batch_wire(hello) is None and received._received.raw == b"" and received._received.msg is None


def test_a_stopping_worker_hands_its_partitions_over_at_once():
    """Worker.release_all: every partition's handover (its summaries written, its lease deleted)
    is under way before any ends, so a stop with the cluster gone waits one publish timeout, not
    one a partition; each lease is deleted at the revision the worker holds, and a handover that
    fails is left to the lease's expiry without stopping the others."""
    import asyncio
    from types import SimpleNamespace

    from xpusense.collector.cluster.worker import Worker, _Partition

    parts = 12
    started: list[str] = []
    deleted: list[tuple[str, int]] = []

    class Leases:
        def __init__(self) -> None:
            self.all_started = asyncio.Event()

        async def delete(self, key: str, last: int) -> None:
            started.append(key)
            if len(started) == parts:
                self.all_started.set()
            await asyncio.wait_for(self.all_started.wait(), 30)   # one after another: never set
            if key == "p.3":
                raise RuntimeError("the cluster said no")
            deleted.append((key, last))

    async def scenario() -> Worker:
        w = Worker(None, SimpleNamespace(leases=Leases(), fleet=None), SimpleNamespace(), "w1")
        for k in range(parts):
            w.parts[k] = _Partition(k, revision=100 + k)
        await w.release_all()
        return w

    w = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert len(started) == parts and not w.parts
    assert sorted(deleted) == sorted((f"p.{k}", 100 + k) for k in range(parts) if k != 3)



def test_a_stopping_gateway_writes_its_marks_within_a_bound():
    """Marks.flush_all(timeout_s): the marks the cluster takes are written; those it never answers
    for are given up after the bound and counted (their agents resend, dropped downstream), not
    after 5 tries of a publish timeout each."""
    import asyncio

    from xpusense.collector.cluster.seq_marks import Marks
    from xpusense.collector.cluster.subjects import mark_key

    written: dict[str, bytes] = {}

    class Bucket:
        def __init__(self) -> None:
            self.never = asyncio.Event()

        async def update(self, key: str, value: bytes, last: int) -> int:
            if "silent" in key:
                await self.never.wait()   # a cluster that is gone: no answer
            written[key] = value
            return last + 1

    async def scenario() -> tuple[int, int]:
        marks = Marks(Bucket(), flush_s=3600)   # no timed write comes before the flush
        for node in ("ok-1", "ok-2", "silent-1"):
            marks.raised(node, "b1", 5)
        return await marks.flush_all(timeout_s=0.5), len(marks.marks)

    unwritten, left = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert unwritten == 1
    assert sorted(written) == [mark_key("ok-1", "b1"), mark_key("ok-2", "b1")]
    assert set(written.values()) == {b"5"}
    assert left == 0   # written or given up: none kept for a gateway that is stopping


class _LeaseBucket:
    """The `leases` bucket as Worker uses it: compare-and-set on the revision, like JetStream KV."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.rev = 0
        self.deleted: list[tuple[str, int]] = []

    def _next(self, key: str, value: bytes) -> int:
        self.rev += 1
        self.entries[key] = (value, self.rev)
        return self.rev

    @staticmethod
    async def _round_trip() -> None:
        """A request's way to the server: other tasks run meanwhile."""
        import asyncio
        await asyncio.sleep(0)

    async def create(self, key: str, value: bytes) -> int:
        from nats.js.errors import KeyWrongLastSequenceError
        await self._round_trip()
        if key in self.entries:
            raise KeyWrongLastSequenceError(f"{key} exists")
        return self._next(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        from nats.js.errors import KeyWrongLastSequenceError
        await self._round_trip()
        if key not in self.entries or self.entries[key][1] != last:
            raise KeyWrongLastSequenceError(f"{key}: wrong last sequence {last}")
        return self._next(key, value)

    async def get(self, key: str):
        from types import SimpleNamespace

        from nats.js.errors import NotFoundError
        await self._round_trip()
        if key not in self.entries:
            raise NotFoundError()
        value, rev = self.entries[key]
        return SimpleNamespace(value=value, revision=rev)

    async def delete(self, key: str, last: int) -> None:
        from nats.js.errors import KeyWrongLastSequenceError
        await self._round_trip()
        if key in self.entries and self.entries[key][1] != last:
            raise KeyWrongLastSequenceError(f"{key}: wrong last sequence {last}")
        self.deleted.append((key, last))
        self.entries.pop(key, None)


def _worker_mid_write():
    """A Worker owning partition 0 with node X (its Hello handled: inventory) whose summary write
    the `fleet` bucket holds back until `fleet.gate` is set; what it stores and the acks it gets
    are recorded with whether any summary put was still on its way."""
    import asyncio
    from types import SimpleNamespace

    from xpusense.collector.cluster.worker import Worker, _Partition

    log: list[tuple] = []

    class Fleet:
        def __init__(self) -> None:
            self.gate, self.held = asyncio.Event(), asyncio.Event()
            self.pending = 0
            self.stored: dict[str, bytes] = {}

        async def put(self, key: str, value: bytes) -> int:
            self.pending += 1
            if "node-x" in key:
                self.held.set()
                await self.gate.wait()
            self.stored[key] = value
            self.pending -= 1
            return len(self.stored)

    class Msg:
        def __init__(self, name: str) -> None:
            self.name = name

        async def ack(self) -> None:
            log.append(("ack", self.name, fleet.pending))

    fleet, leases = Fleet(), _LeaseBucket()
    w = Worker(None, SimpleNamespace(leases=leases, fleet=fleet), SimpleNamespace(), "w1")
    rev = leases._next("p.0", b"w1")
    p = w.parts[0] = _Partition(0, rev)
    p.ready.set()
    x = w.nodes["node-x"] = NodeLatest("node-x", 0)
    x.hello(pb.Hello(node_id="node-x", boot_id="b1", inventory=pb.Inventory(hostname="x")), "gw/1", "peer", 1)
    p.last = Msg("hello of x")
    return w, p, fleet, leases, log, Msg


async def _yield_until(cond, turns: int = 2000) -> bool:
    """Let the loop run (no timers: every fake here answers without waiting) until cond() or `turns`."""
    import asyncio
    for _ in range(turns):
        if cond():
            return True
        await asyncio.sleep(0)
    return cond()


def test_a_handover_waits_for_the_summaries_in_flight_before_acknowledging():
    """A partition handed over while a round's summary write is on its way: the handover's write
    waits for it, so no message is acknowledged (AckPolicy ALL: with all before it) before the
    summaries covering it are stored; the lease goes only then. (It acknowledged at once, and the
    next owner, loading the bucket, lost node X's Hello: its inventory, so Place never offered it.)"""
    import asyncio

    async def scenario():
        w, p, fleet, leases, log, Msg = _worker_mid_write()
        rounds = asyncio.create_task(w.write_summaries())
        await asyncio.wait_for(fleet.held.wait(), 30)
        y = w.nodes["node-y"] = NodeLatest("node-y", 0)   # a later message, for another node
        y.hello(pb.Hello(node_id="node-y", boot_id="b2"), "gw/1", "peer", 2)
        p.last = Msg("hello of y")
        handover = asyncio.create_task(w._release(0, delete=True))
        early = await _yield_until(lambda: handover.done() or bool(log))
        fleet.gate.set()
        await asyncio.wait_for(asyncio.gather(rounds, handover), 30)
        return early, log, fleet, leases

    early, log, fleet, leases = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert not early, f"acknowledged or handed over while X's summary was on its way: {log}"
    assert [a[:2] for a in log] == [("ack", "hello of x"), ("ack", "hello of y")]
    assert all(pending == 0 for _, _, pending in log), log   # each ack after the puts before it
    assert decode(fleet.stored["p0.node-x"])["inventory"] == pb.Inventory(hostname="x").SerializeToString()
    assert "p0.node-y" in fleet.stored
    assert leases.deleted == [("p.0", leases.rev)] and "p.0" not in leases.entries


def test_a_worker_whose_lease_was_taken_acknowledges_nothing():
    """The lease taken over (by compare-and-set) while a write was on its way: the write ends without
    acknowledging (the new owner, from the ack floor, reads those messages again), and the next
    round neither writes nor acknowledges, nor does the worker's stop (its handover of everything)."""
    import asyncio

    async def scenario():
        w, p, fleet, leases, log, _ = _worker_mid_write()
        rounds = asyncio.create_task(w.write_summaries())
        await asyncio.wait_for(fleet.held.wait(), 30)
        leases.entries["p.0"] = (b"w2", leases._next("w.w2", b""))   # w2 took it (the lease ran out)
        w2_lease = leases.entries["p.0"]
        fleet.gate.set()
        await asyncio.wait_for(rounds, 30)
        x = w.nodes["node-x"]
        x.dirty = True
        stored = dict(fleet.stored)
        await asyncio.wait_for(w.write_summaries(), 30)
        after_round = dict(fleet.stored)
        x.dirty = True
        await asyncio.wait_for(w.release_all(), 30)
        return p, log, stored, after_round, dict(fleet.stored), w2_lease, leases

    p, log, before, after_round, after_stop, w2_lease, leases = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert log == [] and p.lost
    assert before == after_round   # the next round wrote nothing over the new owner's summaries
    assert before == after_stop    # nor did the stop's handover
    assert leases.entries["p.0"] == w2_lease and leases.deleted == []


def test_a_rounds_and_a_writes_renewals_together_keep_the_lease():
    """The lease ran out (the cluster did not answer for a while) and a round and a write renew it
    at once: the worker keeps it, and it is not taken for lost. (Together, one re-created it and the
    other, its create refused, said another worker had it: the partition was never written again.)"""
    import asyncio

    async def scenario():
        w, p, fleet, leases, log, _ = _worker_mid_write()
        fleet.gate.set()            # no put held back here
        del leases.entries["p.0"]   # run out
        renewed = await asyncio.wait_for(asyncio.gather(w._renew(p), w._renew(p)), 30)
        w.nodes["node-x"].dirty = True
        await asyncio.wait_for(w.write_summaries(), 30)
        return renewed, p, leases, log

    renewed, p, leases, log = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert renewed == [True, True] and not p.lost
    assert leases.entries["p.0"] == (b"w1", p.revision)
    assert [a[:2] for a in log] == [("ack", "hello of x")]


def test_deliveries_lost_on_the_way_are_read_again_never_acknowledged_past():
    """A worker whose connection lost messages the server had delivered (deliveries 3 and 4 of 6,
    as when the server cuts a slow consumer) handles and acknowledges only up to the gap, then
    resets its consumer on a new subscription: the lost ones come again, in order, and the stale
    rest of the old delivery is never handled. Acknowledging delivery 5 would have acknowledged 3
    and 4 with it (AckPolicy ALL), losing them for good."""
    import asyncio
    from types import SimpleNamespace

    from xpusense.collector.cluster.worker import Worker, _Partition

    class Msg:
        def __init__(self, stream_seq: int, delivery: int) -> None:
            self.seq = stream_seq
            self.reply = f"$JS.ACK.XPS_0.w-p0.1.{stream_seq}.{delivery}.1700000000000000000.0"

    class Sub:
        def __init__(self, fetches: list[list[Msg]]) -> None:
            self.fetches, self.unsubscribed = fetches, False

        async def fetch(self, batch: int, timeout: float) -> list[Msg]:
            if not self.fetches:
                p.stopping = True
                return []
            return self.fetches.pop(0)

        async def unsubscribe(self) -> None:
            self.unsubscribed = True

    first = Sub([[Msg(1, 1), Msg(2, 2), Msg(5, 5), Msg(6, 6)], [Msg(7, 7)]])   # 3, 4 lost on the way
    again = Sub([[Msg(3, 1), Msg(4, 2), Msg(5, 3), Msg(6, 4)]])
    subs = [first, again]
    resets: list[str] = []

    async def reset_consumer(stream: str, durable: str) -> None:
        resets.append(durable)

    async def add_consumer(stream: str, config) -> None:
        pass

    async def pull_subscribe_bind(durable: str, stream: str) -> Sub:
        return subs.pop(0)

    js = SimpleNamespace(reset_consumer=reset_consumer, add_consumer=add_consumer, pull_subscribe_bind=pull_subscribe_bind)
    w = Worker(js, SimpleNamespace(), SimpleNamespace(prefix="xps", streams=1, replicas=1, summary_s=1.0), "w1")
    p = _Partition(0, 1)
    handled: list[int] = []
    acked: list[int] = []

    async def load(k: int) -> None:
        pass

    async def write(k: int, part) -> None:   # what the real one acknowledges: the newest handled
        if part.last is not None:
            acked.append(part.last.seq)

    w._load, w._write = load, write
    w._handle = lambda k, msg: handled.append(msg.seq)
    asyncio.run(asyncio.wait_for(w._consume(p), 30))
    assert handled == [1, 2, 3, 4, 5, 6]
    assert acked == [2], "acknowledged past the lost deliveries"
    assert resets == ["w-p0", "w-p0"] and first.unsubscribed   # at open, then at the gap
    assert w.counters["worker.deliveries_lost"] == 2
