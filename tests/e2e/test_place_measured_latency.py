"""Data affinity from measured latency, through the real collector: simulated agents on the real
Ingest stream send `xpusense.network.tcp.rtt{remote_region}` histograms as the tcp_rtt source makes
them (agent/sources/ebpf/source.py hist_sample, agent/batch_build.py sample_to_proto), and Place, over
gRPC, uses the measured median RTT of a region pair instead of the configured matrix, says so, and
goes back to the configured figure once the measurement is older than measured_latency_max_age_s.
Time moves through the fleet state's clock; no sleeps."""

from __future__ import annotations

import grpc
import pytest
from helpers import InProcessCollector, wait_until
from sched_sim import GiB, readings
from test_place_grpc import SimAgent

from xpusense.agent.batch_build import sample_to_proto
from xpusense.agent.sources.ebpf.source import hist_sample
from xpusense.collector.config import load_collector
from xpusense.collector.state import FleetState
from xpusense.common.metric_names import NETWORK_TCP_RTT
from xpusense.probes.specs import log2_bounds_s
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import scheduler_pb2_grpc as spb_grpc
from xpusense.v1 import telemetry_pb2 as pb

S = 1_000_000_000
T0 = 1_700_000_000 * S
SLOTS = 40
BOUNDS = log2_bounds_s(SLOTS)


def slot(seconds: float) -> int:
    return min(int(seconds * 1e9).bit_length(), SLOTS - 1)   # bpf_log2l(ns), as probes/tcp_rtt.bpf.c


def bucket_middle(seconds: float) -> float:
    """The interpolated median, in ms, of samples that all fall in the bucket of `seconds`."""
    i = slot(seconds)
    return (BOUNDS[i - 1] + BOUNDS[i]) / 2 * 1e3


def rtt_sample(remote: str, per_slot: dict[int, int], t: int) -> pb.Sample:
    slots = [per_slot.get(i, 0) for i in range(SLOTS)]
    s = hist_sample(NETWORK_TCP_RTT, "s", {"remote_region": remote}, slots, 0.0, 1e-9)
    s.time_ns = t
    return sample_to_proto(s)


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self) -> int:
        return self.now


class Agent(SimAgent):
    """A simulated agent (test_place_grpc's, on the real Ingest stream) whose batches carry the fleet
    clock's time and its RTT histogram to region "data"; send() returns once the batch is stored."""

    def __init__(self, addr: str, node_id: str, clock: Clock, region: str):
        super().__init__(addr, node_id, "a100", 8, region=region, zone=f"z-{node_id}", price=2.0)
        self.clock = clock
        self.rtt: dict[int, int] = {}   # its cumulative RTT slots to region "data"

    def send(self, rtt_s: float | None = None, n: int = 0, with_rtt: bool = True):
        """Readings, and (with_rtt) its RTT histogram after `n` more samples of `rtt_s` seconds."""
        t = self.clock()
        samples = readings("a100", 8, util=0.1, used_gib=1.0, t_ns=t)
        if rtt_s is not None:
            self.rtt[slot(rtt_s)] = self.rtt.get(slot(rtt_s), 0) + n
        if with_rtt and self.rtt:
            samples.append(rtt_sample("data", self.rtt, t))
        self.seq += 1
        b = pb.Batch(node_id=self.node_id, boot_id=self.boot, seq=self.seq, samples=samples, sent_unix_nano=t)
        self.out.put(pb.AgentMessage(batch=b))
        ack = self.acks.get(timeout=10)
        assert ack.seq == self.seq and not ack.duplicate


CONFIG = """
stale_s = 60
[scheduler]
index_refresh_ms = 0            # each batch reaches the index on the ingest loop, before its ack
measured_latency_window_s = 180
measured_latency_max_age_s = 300
latency_ref_ms = 100
[scheduler.region_latency_ms]
"near/data" = 5
"mid/data" = 20
"far/data" = 50
"""


@pytest.fixture
def fleet(tmp_path, request):
    p = tmp_path / "collector.toml"
    p.write_text(getattr(request, "param", CONFIG))
    clock = Clock()
    coll = InProcessCollector(state=FleetState(clock=clock), config=load_collector(str(p), env={}))
    channel = grpc.insecure_channel(coll.addr)
    agents: dict[str, Agent] = {}
    try:
        for nid, region in (("near-1", "near"), ("near-2", "near"), ("near-3", "near"), ("mid-1", "mid"),
                            ("far-1", "far"), ("far-2", "far")):
            agents[nid] = Agent(coll.addr, nid, clock, region)
        yield clock, agents, spb_grpc.SchedulerStub(channel)
    finally:
        for a in agents.values():
            a.close()
        channel.close()
        coll.stop()


def place(stub) -> dict[str, spb.Candidate]:
    reply = stub.Place(spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=GiB, count=1,
                                        data_region="data", limit=10), timeout=10)
    return {c.node_id: c for c in reply.candidates}


def affinity(c: spb.Candidate) -> spb.DimensionScore:
    return next(d for d in c.dimensions if d.dimension == "data_affinity")


def test_measured_rtt_replaces_the_configured_latency_until_it_is_older_than_the_bound(fleet):
    clock, agents, stub = fleet
    # The first histogram of each series: samples since the agent started (here ~200 ms, long ago):
    # a baseline only, never counted. far-2 measures nothing.
    for nid, a in agents.items():
        a.send(0.2, 100) if nid != "far-2" else a.send()
    # Before any new sample: every pair is configured (near 5 ms first).
    by = place(stub)
    assert list(by)[:1] == ["near-1"]
    assert "5 ms configured (no RTT measurement in the last 300 s)" in affinity(by["near-1"]).detail
    # 15 s on: near (configured 5 ms) measures ~40 ms (one node ~300 ms), far (configured 50 ms) ~1 ms.
    clock.now += 15 * S
    measured_at = clock.now
    for nid, (rtt, n) in {"near-1": (0.04, 30), "near-2": (0.04, 50), "near-3": (0.3, 40),
                          "far-1": (0.001, 25)}.items():
        agents[nid].send(rtt, n)
    agents["mid-1"].send()        # its histogram again, unchanged: nothing measured
    agents["far-2"].send()
    by = place(stub)
    ranked = list(by)
    # The measured 1 ms region first, then the configured 20 ms, then the region configured at
    # 5 ms that measures ~40 ms.
    assert ranked == ["far-1", "far-2", "mid-1", "near-1", "near-2", "near-3"]
    far_ms, near_ms = bucket_middle(0.001), bucket_middle(0.04)   # ~0.79 ms and ~50.3 ms
    assert affinity(by["far-1"]).score == pytest.approx(1 - 0.5 * far_ms / 100 - 0.5)   # no transfer cost: 1
    assert affinity(by["far-2"]).score == affinity(by["far-1"]).score   # the region's figure: far-2 has none
    assert affinity(by["near-1"]).score == pytest.approx(1 - 0.5 * near_ms / 100 - 0.5)
    assert affinity(by["mid-1"]).score == pytest.approx(1 - 0.5 * 20 / 100 - 0.5)
    far = affinity(by["far-1"]).detail
    assert f"far -> data: {far_ms:.3g} ms measured (median RTT over 1 node(s) of far, last 0 s ago" in far
    assert "configured 50 ms" in far and "interpolated" in far
    near = affinity(by["near-2"]).detail
    assert f"{near_ms:.3g} ms measured (median RTT over 3 node(s) of near" in near   # near-3's 300 ms: not the median
    assert "20 ms configured" in affinity(by["mid-1"]).detail
    # 299 s after the last new sample (heartbeats resend the histograms unchanged): still measured.
    clock.now = measured_at + 299 * S
    for a in agents.values():
        a.send()
    by = place(stub)
    assert list(by)[:2] == ["far-1", "far-2"]
    assert "measured (median RTT over 1 node(s) of far, last 299 s ago" in affinity(by["far-1"]).detail
    # Past measured_latency_max_age_s: the configured matrix again, and the answer says so.
    clock.now = measured_at + 301 * S
    for a in agents.values():
        a.send()
    by = place(stub)
    assert list(by) == ["near-1", "near-2", "near-3", "mid-1", "far-1", "far-2"]
    assert affinity(by["far-1"]).score == pytest.approx(1 - 0.5 * 50 / 100 - 0.5)
    assert "50 ms configured (no RTT measurement in the last 300 s)" in affinity(by["far-1"]).detail
    assert "5 ms configured" in affinity(by["near-1"]).detail and "measured" not in affinity(by["near-1"]).detail
    # New samples measure the pair again.
    agents["far-1"].send(0.001, 5)
    by = place(stub)
    assert list(by)[:2] == ["far-1", "far-2"] and "measured" in affinity(by["far-2"]).detail


@pytest.mark.parametrize("fleet", [CONFIG.replace("index_refresh_ms = 0 ", "index_refresh_ms = 200 ")], indirect=True)
def test_measured_figure_reaches_the_index_through_its_refresh_timer(fleet):
    """With index_refresh_ms > 0 a stored batch only marks its node; the figure is worked out when
    the index's timer (or the catch-up before a decision) refreshes it."""
    clock, agents, stub = fleet
    for a in agents.values():
        a.send(0.2, 10)
    clock.now += 15 * S
    agents["far-1"].send(0.001, 25)
    wait_until(lambda: "measured" in affinity(place(stub)["far-1"]).detail, what="the measured figure")
    by = place(stub)
    assert list(by)[:2] == ["far-1", "far-2"]
    assert f"{bucket_middle(0.001):.3g} ms measured (median RTT over 1 node(s) of far" in affinity(by["far-2"]).detail
