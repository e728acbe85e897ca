"""The checks every stored batch passes wherever it is taken (collector/limits.py): at a gateway
with what it knows of what is stored (its marks, the series its stream introduced), at a worker
reading the stream (a message whose node, ids, receive time or seq is not sane is counted and
skipped), and a reader of the fleet bucket that does not trust a summary's clock."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import msgpack

from xpusense.collector.cluster.gateway import StreamStored
from xpusense.collector.cluster.scheduler import FleetIndex
from xpusense.collector.cluster.seq_marks import Marks
from xpusense.collector.cluster.subjects import KIND, MSG_ID, RECEIVED, msg_id, node_subject
from xpusense.collector.cluster.worker import Worker
from xpusense.collector.limits import Limits, seq_ceiling
from xpusense.v1 import telemetry_pb2 as pb

HUGE = 2**64 - 1


class _KV:
    """The marks bucket as a gateway reads it: one value per key."""

    def __init__(self, values: dict[str, bytes]):
        self.values = values

    async def get(self, key: str):
        import nats.js.errors
        if key not in self.values:
            raise nats.js.errors.KeyNotFoundError
        return SimpleNamespace(value=self.values[key], revision=1)


def _batch(seq: int, node: str = "n", boot: str = "b", names=("hw.gpu.utilization",)) -> pb.Batch:
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq, sent_unix_nano=time.time_ns())
    for i, name in enumerate(names):
        b.samples.add(name=name, unit="1", kind=pb.GAUGE, labels={"device": f"gpu{i}"}, value=0.5,
                      time_unix_nano=time.time_ns())
    return b


def test_seq_ceiling_is_one_bound():
    assert seq_ceiling(0, 100.0, 10, 1.0) is None                     # nothing stored: nothing to count from
    assert seq_ceiling(5, 0.0, 100, 10.0) == 105
    assert seq_ceiling(5, 30.0, 100, 10.0) == 405
    assert seq_ceiling(5, -30.0, 100, 10.0) == 105                    # a clock that stepped back adds nothing


def test_a_gateway_refuses_a_seq_far_beyond_the_boots_mark_and_counts_from_when_it_rose():
    now = [1000.0]
    marks = Marks(_KV({"n.b": b"40"}), clock=lambda: now[0])
    lim = Limits(max_seq_jump=100, batches_per_s=10.0)
    stored = StreamStored(marks, 3600.0)

    async def scenario():
        assert stored.seq_mark("n", "b") is None                      # not read yet
        assert await marks.get("n", "b") == 40
        v = lim.check("n", _batch(HUGE), stored)
        assert v is not None and v.code == grpc.StatusCode.FAILED_PRECONDITION and "max_seq_jump" in v.message
        assert lim.check("n", _batch(141), stored).code == grpc.StatusCode.FAILED_PRECONDITION
        assert lim.check("n", _batch(140), stored) is None
        now[0] += 30                                                  # 30 s later: 300 more
        assert lim.check("n", _batch(440), stored) is None and lim.check("n", _batch(441), stored) is not None
        marks.raised("n", "b", 440)                                   # acknowledged: the bound counts from it
        assert stored.seq_mark("n", "b") == (440, 0.0)
        marks.flush_s = 0
        await marks.flush("n", "b")                                   # the stream ended: forgotten...
        marks.kv = None
        assert "n" not in {k[0] for k in marks.marks}
        assert stored.seq_mark("n", "b") == (440, 0.0)                # ...but not its time
    asyncio.run(_with_writes(marks, scenario()))
    assert lim.hits["limits.max_seq_jump"] == 3


async def _with_writes(marks: Marks, coro):
    """Marks' writes answered by a bucket that takes every update."""
    class Writable(_KV):
        async def update(self, key, value, last=None):
            self.values[key] = value
            return (last or 0) + 1
    marks.kv = Writable(marks.kv.values)
    return await coro


def test_a_gateway_bounds_the_series_its_stream_introduces():
    now = [0.0]
    lim = Limits(max_series_per_node=3)
    stored = StreamStored(Marks(_KV({})), idle_s=60.0, clock=lambda: now[0])
    assert lim.check("n", _batch(1, names=("a", "b")), stored) is None
    assert stored.series_count("n") == 2
    assert lim.check("n", _batch(2, names=("a", "b")), stored) is None          # the same two again
    v = lim.check("n", _batch(3, names=("c", "d", "e")), stored)
    assert v is not None and v.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_series_per_node" in v.message
    now[0] += 61                                                                # idle past idle_s: let go
    assert lim.check("n", _batch(4, names=("c", "d", "e")), stored) is None
    assert stored.series_count("n") <= 3


# ------------------------------------------------------------------------------------------- worker

def _msg(node: str, data: bytes, kind: str | None = None, *, subject_node: str | None = None,
         mid: str | None = None, received: int | None = None):
    """A message of the stream as a gateway publishes it, unless told otherwise."""
    headers = {RECEIVED: str(time.time_ns() if received is None else received)}
    if kind:
        headers.update({KIND: kind, "Xps-Session": "s"})
    else:
        b = pb.Batch.FromString(data)
        headers[MSG_ID] = mid if mid is not None else msg_id(b.node_id, b.boot_id, b.seq)
    if received == -1:
        del headers[RECEIVED]
    return SimpleNamespace(subject=node_subject("xpusense", "r1", 0, subject_node or node), reply="",
                           headers=headers, data=data)


def test_a_worker_counts_and_skips_what_is_not_sane_and_keeps_applying_the_real_batches():
    w = Worker(None, None, SimpleNamespace(), "w1", limits=Limits(max_seq_jump=1000))
    hello = pb.Hello(node_id="a", boot_id="b", inventory=pb.Inventory(hostname="a"))
    w._handle(0, _msg("a", hello.SerializeToString(), "hello"))
    w._handle(0, _msg("a", _batch(1, node="a").SerializeToString()))
    w._handle(0, _msg("b", _batch(2, node="b").SerializeToString()))   # b has a node too
    forged = {
        "node": _msg("a", _batch(9, node="b").SerializeToString(), subject_node="a"),   # b's batch on a's subject
        "msg_id": _msg("a", _batch(9, node="a").SerializeToString(), mid="a:b:8"),
        "received": _msg("a", _batch(9, node="a").SerializeToString(), received=-1),
        "ids": _msg("a", _batch(0, node="a").SerializeToString()),
        "limits.max_seq_jump": _msg("a", _batch(HUGE, node="a").SerializeToString()),
    }
    ahead = _msg("a", _batch(9, node="a").SerializeToString(), received=time.time_ns() + 365 * 86400 * 10**9)
    w._handle(0, ahead)
    for m in forged.values():
        w._handle(0, m)
    w._handle(0, _msg("a", pb.Hello(node_id="b", boot_id="x").SerializeToString(), "hello"))   # b's Hello on a's subject
    a = w.nodes["a"]
    assert a.windows["b"].high == 1                       # nothing forged was taken
    assert {k: v for k, v in a.diagnosis_counts.items() if k.startswith("worker.skipped.")} == {
        "worker.skipped.node": 2, "worker.skipped.msg_id": 1, "worker.skipped.received": 2,
        "worker.skipped.ids": 1, "worker.skipped.limits.max_seq_jump": 1}
    assert w.skipped == 7 and w.counters["worker.skipped.node"] == 2
    assert set(w.nodes) == {"a", "b"} and w.nodes["b"].windows["b"].high == 2
    w._handle(0, _msg("a", _batch(2, node="a").SerializeToString()))   # the real agent's next batch
    assert a.windows["b"].high == 2 and a.batches_stored == 2
    w._handle(0, _msg("a", _batch(3, node="a").SerializeToString(), mid="a:b:3"))   # stored with the long id
    assert a.windows["b"].high == 3 and a.batches_stored == 3
    # a forged batch for a node the worker does not have makes no node
    w._handle(0, _msg("c", _batch(HUGE, node="c").SerializeToString(), mid="c:b:1"))
    assert "c" not in w.nodes and w.counters["worker.skipped.msg_id"] == 2


def test_a_workers_seq_bound_grows_with_the_streams_time_not_the_workers():
    w = Worker(None, None, SimpleNamespace(), "w1", limits=Limits(max_seq_jump=100, batches_per_s=10.0))
    t0 = time.time_ns()

    def at(seq: int, t_ns: int):
        m = _msg("a", _batch(seq, node="a").SerializeToString(), received=t_ns)
        m.reply = f"$JS.ACK.S.w.1.1.{seq}.{t_ns}.0"   # JetStream's stored time in the ack subject
        return m
    w._handle(0, at(1, t0))
    w._handle(0, at(102, t0))                          # beyond 1 + 100: skipped
    assert w.nodes["a"].windows["b"].high == 1
    w._handle(0, at(102, t0 + 10**9))                  # a second later on the stream: +10
    assert w.nodes["a"].windows["b"].high == 102


# -------------------------------------------------------------------------------------- fleet readers

def test_a_reader_of_the_fleet_does_not_trust_a_summarys_clock():
    now = [10**18]
    index = FleetIndex(clock=lambda: now[0])
    year = 365 * 86400 * 10**9
    summary = {"v": 1, "n": "future", "t": now[0] + year, "i": pb.Inventory(hostname="f").SerializeToString()}
    index.apply(msgpack.packb(summary, use_bin_type=True), revision=1)
    assert index.nodes["future"].last_seen_ns == now[0] and index.clock_ahead == 1
    now[0] += 60 * 10**9                               # a minute on: as old as its newest real stamp
    index.apply(msgpack.packb({**summary, "t": now[0] - 30 * 10**9}, use_bin_type=True), revision=2)
    assert index.nodes["future"].last_seen_ns == now[0] - 30 * 10**9
    index.apply(msgpack.packb({**summary, "t": now[0] + year}, use_bin_type=True), revision=3)
    assert index.nodes["future"].last_seen_ns == now[0] and index.clock_ahead == 2
