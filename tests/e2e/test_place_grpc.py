"""The scheduler core behind the collector's gRPC server, in-process: fed by simulated agents on the
real Ingest stream and asked through Scheduler/Place; a request the core cannot answer is
INVALID_ARGUMENT with the core's reason. (The core itself: tests/unit/test_scheduler.py.)"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from helpers import InProcessCollector
from sched_sim import GiB, inventory, readings

from xpusense.collector.scheduler.inventory import parse_memory
from xpusense.collector.state import FleetState
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import scheduler_pb2_grpc as spb_grpc
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc


class Collector(InProcessCollector):
    """The real collector server (Ingest, Query, Scheduler) on its own event loop thread."""

    def __init__(self, cfg=None):
        super().__init__(state=FleetState(), config=cfg)
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = spb_grpc.SchedulerStub(self.channel)

    def place(self, **kw) -> spb.PlaceReply:
        return self.stub.Place(spb.PlaceRequest(**kw), timeout=10)

    def stop(self):
        self.channel.close()
        super().stop()


class SimAgent:
    """A simulated agent on the real Ingest stream: Hello with inventory, then Batches; `send`
    returns once the collector acknowledged (stored) the batch."""

    def __init__(self, addr: str, node_id: str, kind: str, devices: int = 8, **labels):
        self.node_id, self.kind, self.devices = node_id, kind, devices
        self.boot = f"boot-{node_id}-{time.monotonic_ns()}"
        self.seq = 0
        self.channel = grpc.insecure_channel(addr)
        self.out: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()
        hello = pb.Hello(node_id=node_id, boot_id=self.boot, inventory=inventory(kind, devices, **labels))
        self.out.put(pb.AgentMessage(hello=hello))
        self.calls = pb_grpc.IngestStub(self.channel).Stream(iter(self.out.get, None))
        first = next(self.calls)
        assert first.HasField("welcome")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        try:
            for msg in self.calls:
                self.acks.put(msg.ack)
        except grpc.RpcError:
            pass

    def send(self, samples=None, events=(), **readings_kw):
        self.seq += 1
        if samples is None:
            samples = readings(self.kind, self.devices, **readings_kw)
        b = pb.Batch(node_id=self.node_id, boot_id=self.boot, seq=self.seq, samples=samples, events=list(events),
                     sent_unix_nano=time.time_ns())
        self.out.put(pb.AgentMessage(batch=b))
        ack = self.acks.get(timeout=10)
        assert ack.seq == self.seq and not ack.duplicate

    def close(self):
        self.out.put(None)
        self.channel.close()


@pytest.fixture
def fleet():
    """Start a collector (fleet(cfg=...)) and agents on it (fleet.agent(...)); all closed after."""
    made: dict = {"coll": None, "agents": []}

    class Fleet:
        def __call__(self, cfg=None):
            made["coll"] = Collector(cfg)
            return self

        @property
        def coll(self) -> Collector:
            return made["coll"]

        def agent(self, node_id, kind, devices=8, send=True, **labels) -> SimAgent:
            a = SimAgent(made["coll"].addr, node_id, kind, devices, **labels)
            made["agents"].append(a)
            if send:
                a.send()
            return a

    yield Fleet()
    for a in made["agents"]:
        a.close()
    if made["coll"]:
        made["coll"].stop()


def test_40gb_request_over_the_ingest_stream_gets_a_910b_or_an_a100_never_a_910b4(fleet):
    fleet()
    fleet.agent("a100-1", "a100", region="r1", zone="z1", price=4.0)
    fleet.agent("910b-1", "910b", region="r1", zone="z2", price=2.0)
    fleet.agent("910b4-1", "910b4", region="r1", zone="z1", price=1.0)
    busy = fleet.agent("a100-busy", "a100", send=False, region="r1", zone="z1", price=1.0)
    busy.send(used_gib=50.0)   # 30 GiB free on every GPU
    reply = fleet.coll.place(accelerator=spb.ACCELERATOR_ANY, memory_bytes=parse_memory("40GB"), count=2)
    assert {c.node_id: c.model for c in reply.candidates} == {"a100-1": "A100-SXM4-80GB", "910b-1": "Ascend-910B"}
    assert all(len(c.devices) == 2 for c in reply.candidates)
    assert {e.node_id: e.reason for e in reply.excluded} == {"910b4-1": "memory", "a100-busy": "memory"}
    assert reply.nodes_feasible == 2 and reply.nodes_total == 4
    # Readings that arrive later are followed: the busy A100 frees its memory.
    busy.send(used_gib=0.0)
    reply = fleet.coll.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=40 * GiB, count=2)
    assert sorted(c.node_id for c in reply.candidates) == ["a100-1", "a100-busy"]


def test_a_request_the_core_refuses_is_invalid_argument_with_its_reason(fleet):
    fleet()
    fleet.agent("n1", "a100", region="r1", zone="z1", price=2.0)
    with pytest.raises(grpc.RpcError) as e:
        fleet.coll.place(residency=spb.RESIDENCY_REGION)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data region" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        fleet.coll.place(weights=spb.Weights(disaster_tolerance=0.3))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'disaster_tolerance'" in e.value.details()
