"""The scheduler core on a simulated fleet fed in-process (FleetState's hello/ingest, as the Ingest
stream does; no gRPC server: tests/e2e/test_place_grpc.py), its formulas, filters and config
checks, and the four score dimensions as the pure functions they are."""

from __future__ import annotations

import logging
import math
import random
import time

import pytest
from helpers import ROOT
from sched_sim import KINDS, GiB, assert_same_answer, dev_id, event, inventory, readings

from xpusense.collector.config import load_collector
from xpusense.collector.scheduler import inventory as sched_inventory
from xpusense.collector.scheduler import scoring
from xpusense.collector.scheduler.config import DEFAULT_WEIGHTS, PlaceError, resolve_weights
from xpusense.collector.scheduler.core import Scheduler
from xpusense.collector.scheduler.inventory import PeakTflops, parse_memory
from xpusense.collector.state import FleetState
from xpusense.common import catalog
from xpusense.common.config import ConfigError
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import telemetry_pb2 as pb

DEFAULTS = load_collector(None, env={})


def core(state: FleetState, cfg=None) -> Scheduler:
    """The core following `state`, with the collector's configuration (its defaults when None)."""
    cfg = cfg or DEFAULTS
    return Scheduler(state, cfg.scheduler, cfg.stale_s)


class SimAgent:
    """A simulated agent feeding the fleet state in-process as the Ingest stream does: Hello with
    its inventory, then Batches; `send` returns once the state stored the batch."""

    def __init__(self, state: FleetState, node_id: str, kind: str, devices: int = 8, **labels):
        self.state, self.node_id, self.kind, self.devices = state, node_id, kind, devices
        self.boot = f"boot-{node_id}-{time.monotonic_ns()}"
        self.seq = 0
        welcome = state.hello(pb.Hello(node_id=node_id, boot_id=self.boot, inventory=inventory(kind, devices, **labels)))
        assert welcome.boot_id == self.boot

    def send(self, samples=None, events=(), **readings_kw):
        self.seq += 1
        if samples is None:
            samples = readings(self.kind, self.devices, **readings_kw)
        b = pb.Batch(node_id=self.node_id, boot_id=self.boot, seq=self.seq, samples=samples, events=list(events),
                     sent_unix_nano=time.time_ns())
        assert self.state.ingest(b)   # stored, not a duplicate


class Fleet:
    """A FleetState (on `clock` when given) with the scheduler core following it (collector config
    `cfg`, the defaults when None), and agents on it (fleet.agent(...))."""

    def __init__(self, cfg=None, clock=None):
        self.state = FleetState(clock=clock) if clock else FleetState()
        self.core = core(self.state, cfg)

    def agent(self, node_id, kind, devices=8, send=True, **labels) -> SimAgent:
        a = SimAgent(self.state, node_id, kind, devices, **labels)
        if send:
            a.send()
        return a

    def place(self, **kw) -> spb.PlaceReply:
        return self.core.place(spb.PlaceRequest(**kw))


def write_cfg(tmp_path, text: str):
    p = tmp_path / "collector.toml"
    p.write_text(text)
    return load_collector(str(p), env={})


def dims(c: spb.Candidate) -> dict[str, float]:
    return {d.dimension: d.score for d in c.dimensions}


# -- the "done when" cases -------------------------------------------------

def test_40gb_request_gets_a_64gb_910b_or_an_80gb_a100_never_a_32gb_910b4():
    fleet = Fleet()
    fleet.agent("a100-1", "a100", region="r1", zone="z1", price=4.0)
    fleet.agent("910b-1", "910b", region="r1", zone="z2", price=2.0)
    fleet.agent("910b4-1", "910b4", region="r1", zone="z1", price=1.0)
    fleet.agent("910b4-2", "910b4", region="r1", zone="z2", price=0.5)
    # A100 whose every GPU already holds 50 GiB: 30 GiB free is not enough either.
    busy = fleet.agent("a100-busy", "a100", send=False, region="r1", zone="z1", price=1.0)
    busy.send(used_gib=50.0)

    for accel in (spb.ACCELERATOR_ANY, spb.ACCELERATOR_NPU, spb.ACCELERATOR_GPU):
        reply = fleet.place(accelerator=accel, memory_bytes=parse_memory("40GB"), count=2)
        got = {c.node_id: c.model for c in reply.candidates}
        want = {spb.ACCELERATOR_ANY: {"a100-1": "A100-SXM4-80GB", "910b-1": "Ascend-910B"},
                spb.ACCELERATOR_NPU: {"910b-1": "Ascend-910B"},
                spb.ACCELERATOR_GPU: {"a100-1": "A100-SXM4-80GB"}}[accel]
        assert got == want
        assert all(len(c.devices) == 2 for c in reply.candidates)
    reply = fleet.place(accelerator=spb.ACCELERATOR_ANY, memory_bytes=40 * GiB, count=2)
    excluded = {e.node_id: e for e in reply.excluded}
    assert {n: excluded[n].reason for n in ("910b4-1", "910b4-2", "a100-busy")} == \
        {"910b4-1": "memory", "910b4-2": "memory", "a100-busy": "memory"}
    assert "32.0GiB" in excluded["910b4-1"].detail and "30.0GiB" in excluded["a100-busy"].detail
    assert reply.excluded_counts["memory"] == 3 and reply.nodes_feasible == 2 and reply.nodes_total == 5
    # 32 GiB fits the 910B4s exactly.
    reply = fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=32 * GiB, count=8)
    assert sorted(c.node_id for c in reply.candidates) == ["910b-1", "910b4-1", "910b4-2"]


def test_data_sovereignty_removes_every_node_outside_the_region():
    fleet = Fleet()
    regions = {"n-bj-1": "cn-beijing", "n-bj-2": "cn-beijing", "n-sh-1": "cn-shanghai",
               "n-gz-1": "cn-guangzhou", "n-none": ""}
    for nid, region in regions.items():
        labels = {"zone": "z1", "price": 2.0, **({"region": region} if region else {})}
        fleet.agent(nid, "a100", **labels)
    reply = fleet.place(memory_bytes=10 * GiB, residency=spb.RESIDENCY_REGION, data_region="cn-beijing")
    assert sorted(c.node_id for c in reply.candidates) == ["n-bj-1", "n-bj-2"]
    assert reply.excluded_counts["residency"] == 3
    assert sorted(e.node_id for e in reply.excluded if e.reason == "residency") == ["n-gz-1", "n-none", "n-sh-1"]
    # Without the constraint, the same data region is only a preference.
    reply = fleet.place(memory_bytes=10 * GiB, data_region="cn-beijing")
    assert len(reply.candidates) == 5
    assert {c.node_id for c in reply.candidates[:2]} == {"n-bj-1", "n-bj-2"}
    # Allowed regions are a hard filter too; province residency needs the `province` label.
    reply = fleet.place(memory_bytes=10 * GiB, allowed_regions=["cn-shanghai", "cn-guangzhou"])
    assert sorted(c.node_id for c in reply.candidates) == ["n-gz-1", "n-sh-1"]
    assert reply.excluded_counts["region"] == 3
    reply = fleet.place(memory_bytes=10 * GiB, residency=spb.RESIDENCY_PROVINCE, data_province="beijing")
    assert not reply.candidates and reply.excluded_counts["residency"] == 5
    with pytest.raises(PlaceError, match="data region"):   # over gRPC: INVALID_ARGUMENT (tests/e2e/test_place_grpc.py)
        fleet.place(residency=spb.RESIDENCY_REGION)


def test_a_node_that_stopped_reporting_drops_out_once_stale():
    clock = [time.time_ns()]
    fleet = Fleet(clock=lambda: clock[0])   # stale_s defaults to 10 s; the collector's clock is ours
    quiet = fleet.agent("quiet", "a100", region="r1", zone="z1", price=2.0)
    talker = fleet.agent("talker", "a100", region="r1", zone="z1", price=2.0)
    assert {c.node_id for c in fleet.place(memory_bytes=GiB).candidates} == {"quiet", "talker"}
    clock[0] += int(9.5e9)
    talker.send()
    assert {c.node_id for c in fleet.place(memory_bytes=GiB).candidates} == {"quiet", "talker"}
    clock[0] += int(1e9)    # quiet: 10.5 s without telemetry
    talker.send()
    reply = fleet.place(memory_bytes=GiB)
    assert [c.node_id for c in reply.candidates] == ["talker"]
    assert [(e.node_id, e.reason) for e in reply.excluded] == [("quiet", "stale")]
    assert "10.5 s" in reply.excluded[0].detail and reply.excluded_counts["stale"] == 1
    quiet.send()            # reporting again: back in
    assert {c.node_id for c in fleet.place(memory_bytes=GiB).candidates} == {"quiet", "talker"}


def test_a_gpu_with_a_fresh_xid_is_not_offered(tmp_path):
    clock = [time.time_ns()]
    fleet = Fleet(write_cfg(tmp_path, "[scheduler]\nxid_window_s = 60\n"), clock=lambda: clock[0])
    a = fleet.agent("a", "a100", region="r1", zone="z1", price=2.0)
    # gpu3 is the idlest GPU: it would be chosen first for a single-GPU job.
    a.send(util={i: 0.5 for i in range(8) if i != 3}, events=[event("xid", "gpu3", clock[0], xid="79")])
    for _ in range(3):
        reply = fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=GiB, count=7)
        c = reply.candidates[0]
        assert "gpu3" not in c.devices and len(c.devices) == 7
        assert [(d.device, d.reason) for d in c.excluded_devices] == [("gpu3", "xid")]
        assert "XID 79" in c.excluded_devices[0].detail
        a.send(util=0.5)    # later batches without the event: still out
    reply = fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=GiB, count=8)
    assert not reply.candidates and [(e.node_id, e.reason) for e in reply.excluded] == [("a", "xid")]
    assert [d.device for d in reply.excluded[0].devices] == ["gpu3"]
    clock[0] += int(61e9)   # the window has passed: offered again, with no new batch needed
    a.send(util=0.5)
    reply = fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=GiB, count=8)
    assert "gpu3" in reply.candidates[0].devices


def test_unhealthy_accelerator_is_out_until_a_newer_reading_says_ok():
    fleet = Fleet()
    n = fleet.agent("n", "910b", send=False, region="r1", zone="z1", price=2.0)
    t = time.time_ns()
    n.send(health={0: "Alarm", 1: "OK"}, t_ns=t)
    reply = fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=GiB, count=7)
    c = reply.candidates[0]
    assert "npu0-0" not in c.devices and [(d.device, d.reason) for d in c.excluded_devices] == [("npu0-0", "unhealthy")]
    assert "Alarm" in c.excluded_devices[0].detail
    # A health event newer than the reading: npu1 goes Critical at once (the series lags, 5 min tier).
    # Newer on the collector's clock: a batch's stamps are put on it by when the batch arrived.
    n.send(events=[pb.Event(id="h1", type="health", severity="critical", device="npu1-0", message="Critical",
                            attributes={"status": "Critical"}, time_unix_nano=t + 10**9)], t_ns=t)
    reply = fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=GiB, count=7)
    assert not reply.candidates and reply.excluded[0].reason == "unhealthy"
    assert sorted(d.device for d in reply.excluded[0].devices) == ["npu0-0", "npu1-0"]
    n.send(health={0: "OK", 1: "OK"}, t_ns=t + 2 * 10**9)
    assert len(fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=GiB, count=8).candidates) == 1


def test_hbm_watch_firing_penalises_and_says_why():
    fleet = Fleet()
    fleet.agent("calm", "a100", region="r1", zone="z1", price=2.0)
    hot = fleet.agent("hot", "a100", region="r1", zone="z1", price=2.0)
    hot.send(bw={0: 0.95, 1: 0.95}, events=[event("checkpoint_request", "gpu0"), event("checkpoint_request", "gpu1")])
    reply = fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=GiB, count=8)
    by = {c.node_id: c for c in reply.candidates}
    assert [c.node_id for c in reply.candidates] == ["calm", "hot"]
    assert sorted(p.device for p in by["hot"].penalties) == ["gpu0", "gpu1"]
    assert by["hot"].penalties[0].factor == 0.5 and "checkpoint" in by["hot"].penalties[0].detail
    free_hot = (6 * 1.0 + 2 * (1 + 1 + 0.05) / 3) / 8    # mean `free` score of the 8 GPUs
    assert dims(by["hot"])["compute"] == pytest.approx(free_hot)
    assert by["hot"].score == pytest.approx((by["calm"].score - 0.4 * (1 - free_hot)) * 0.5)
    # Six GPUs are enough: the two the watch fired on are left aside, and there is no penalty.
    reply = fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=GiB, count=6)
    by = {c.node_id: c for c in reply.candidates}
    assert not by["hot"].penalties and not {"gpu0", "gpu1"} & set(by["hot"].devices)
    assert by["hot"].score == pytest.approx(by["calm"].score)


# -- the score ----------------------------------------------------------------------------------------

def test_score_is_the_weighted_sum_of_the_four_dimensions(tmp_path):
    cfg = write_cfg(tmp_path, """
[scheduler]
latency_ref_ms = 100
transfer_cost_ref = 0.10
[scheduler.region_latency_ms]
"r2/r1" = 50
[scheduler.region_transfer_cost]
"r2/r1" = 0.02
[scheduler.peak_tflops]
"Ascend-910B" = 300
""")
    fleet = Fleet(cfg)
    fleet.agent("cheap", "a100", region="r1", zone="z1", price=2.0, encryption="tdx", attestation="yes")
    fleet.agent("dear", "a100", region="r1", zone="z2", price=4.0, encryption="none")
    far = fleet.agent("far", "910b", send=False, region="r2", zone="z3", price=3.0, attestation="tpm")
    far.send(util=0.5, bw=0.2, used_gib=16.0)
    reply = fleet.place(memory_bytes=GiB, count=1, data_region="r1", replica_zones=["z1", "z9"])
    by = {c.node_id: c for c in reply.candidates}
    assert [c.node_id for c in reply.candidates] == ["cheap", "dear", "far"]
    w = DEFAULT_WEIGHTS
    # compute: 312 TFLOPS / 2 = 156 per price-hour is the fleet's best; the dear A100 gets half.
    # far: 300 / 3 = 100 -> 100/156, times free = mean(1 - 0.5, 48/64, 1 - 0.2) = 0.6833.
    assert dims(by["cheap"]) == pytest.approx({"compute": 1.0, "data_affinity": 1.0, "disaster_tolerance": 0.5,
                                               "compliance": 1.0})
    assert dims(by["dear"]) == pytest.approx({"compute": 0.5, "data_affinity": 1.0, "disaster_tolerance": 1.0,
                                              "compliance": 0.0})
    assert dims(by["far"]) == pytest.approx({"compute": 100 / 156 * (0.5 + 0.75 + 0.8) / 3,
                                             "data_affinity": 1 - 0.5 * 0.5 - 0.5 * 0.2,
                                             "disaster_tolerance": 1.0, "compliance": 0.5})
    for c in reply.candidates:
        assert c.score == pytest.approx(sum(w[k] * v for k, v in dims(c).items()))
        assert sum(d.weighted for d in c.dimensions) == pytest.approx(c.score)
    assert "312 TFLOPS / price 2" in by["cheap"].dimensions[0].detail
    assert "r2 -> r1: 50 ms" in by["far"].dimensions[1].detail
    # A node whose TFLOPS are unknown (no catalog figure, none in config) counts 0.5 for value.
    fleet.agent("b4", "910b4", region="r1", zone="z9", price=1.0)
    reply = fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=GiB, limit=5)
    b4 = {c.node_id: c for c in reply.candidates}["b4"]
    assert dims(b4)["compute"] == pytest.approx(0.5)
    assert "no peak TFLOPS for Ascend-910B4" in b4.dimensions[0].detail
    # Request weights override the configured ones: more weight on compute moves `dear` down.
    reply = fleet.place(memory_bytes=GiB, data_region="r1", replica_zones=["z1", "z9"],
                             weights=spb.Weights(compute=0.5, disaster_tolerance=0.15, compliance=0.10))
    assert reply.weights.compute == pytest.approx(0.5) and reply.weights.data_affinity == pytest.approx(0.25)
    for c in reply.candidates:
        assert c.score == pytest.approx(0.5 * dims(c)["compute"] + 0.25 * dims(c)["data_affinity"]
                                        + 0.15 * dims(c)["disaster_tolerance"] + 0.10 * dims(c)["compliance"])


def test_chosen_devices_are_the_least_busy_of_those_that_fit():
    fleet = Fleet()
    a = fleet.agent("a", "a100", send=False, region="r1", zone="z1", price=2.0)
    # free GiB: 10, 70, 35, 80, 60, 1, 20, 50; `free` score = mean(1 - util, free share, 1 - bw)
    a.send(used_gib={0: 70, 1: 10, 2: 45, 3: 0, 4: 20, 5: 79, 6: 60, 7: 30}, util={1: 0.5, 3: 0.9})
    place = lambda mem, n: fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=mem * GiB, count=n)
    assert list(place(40, 2).candidates[0].devices) == ["gpu4", "gpu7"]       # 0.917, 0.875
    # gpu2 (0.8125) is third best but has 35 GiB free: passed over for gpu1 and gpu3.
    c = place(40, 4).candidates[0]
    assert list(c.devices) == ["gpu4", "gpu7", "gpu1", "gpu3"]
    fs = {"gpu4": (1 + 60 / 80 + 1) / 3, "gpu7": (1 + 50 / 80 + 1) / 3, "gpu1": (0.5 + 70 / 80 + 1) / 3,
          "gpu3": (0.1 + 1 + 1) / 3}
    assert dims(c)["compute"] == pytest.approx(sum(fs.values()) / 4)
    assert list(place(75, 1).candidates[0].devices) == ["gpu3"]
    reply = place(40, 5)
    assert not reply.candidates and reply.excluded[0].reason == "memory"
    assert "the 5 most free have at least 35.0GiB" in reply.excluded[0].detail
    reply = place(1, 9)
    assert reply.excluded[0].reason == "count" and "8 GPU on the node, 9 asked" in reply.excluded[0].detail


def test_same_domain_keeps_the_devices_in_one_hccs_or_nvlink_domain():
    fleet = Fleet()
    fleet.agent("atlas800", "910a", region="r1", zone="z1", price=1.0)    # two HCCS groups: npu0-3, npu4-7
    fleet.agent("pcie", "a100pcie", devices=4, region="r1", zone="z1", price=1.0)
    fleet.agent("hgx", "a100", region="r1", zone="z1", price=1.0)
    reply = fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=GiB, count=4, same_domain=True)
    c = reply.candidates[0]
    groups = ({f"npu{i}-0" for i in range(4)}, {f"npu{i}-0" for i in range(4, 8)})
    assert set(c.devices) in groups and c.domain in ("hccs0", "hccs1")
    reply = fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=GiB, count=5, same_domain=True)
    assert not reply.candidates and reply.excluded[0].reason == "domain"
    assert len(fleet.place(accelerator=spb.ACCELERATOR_NPU, memory_bytes=GiB, count=5).candidates) == 1
    reply = fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=GiB, count=2, same_domain=True)
    assert [c.node_id for c in reply.candidates] == ["hgx"] and reply.candidates[0].domain == "nvlink"
    assert [(e.node_id, e.reason) for e in reply.excluded] == [("pcie", "domain")]


def test_compliance_capabilities_can_be_required():
    fleet = Fleet()
    fleet.agent("plain", "a100", region="r1", zone="z1", price=1.0)
    fleet.agent("enc", "a100", region="r1", zone="z1", price=1.0, encryption="sme")
    fleet.agent("both", "a100", region="r1", zone="z1", price=1.0, encryption="tdx", attestation="true")
    reply = fleet.place(memory_bytes=GiB, require_encryption=True)
    assert [c.node_id for c in reply.candidates] == ["both", "enc"]
    reply = fleet.place(memory_bytes=GiB, require_encryption=True, require_attestation=True)
    assert [c.node_id for c in reply.candidates] == ["both"]
    assert {e.node_id: e.reason for e in reply.excluded} == {"plain": "encryption", "enc": "attestation"}


# -- weights and config ------------------------------------------------------------------------------

def test_weights_out_of_range_are_refused_naming_the_weight(tmp_path):
    with pytest.raises(ConfigError, match=r"'scheduler\.weights\.compute' must be between 0\.3 and 0\.5"):
        write_cfg(tmp_path, "[scheduler.weights]\ncompute = 0.6\n")
    with pytest.raises(ConfigError, match=r"'scheduler\.weights\.compliance' .* \(a ratio: 0\.1 for 10%\)"):
        write_cfg(tmp_path, "[scheduler.weights]\ncompliance = 10\n")
    with pytest.raises(ConfigError, match=r"'scheduler\.weights' add up to 0\.95, not 1"):
        write_cfg(tmp_path, "[scheduler.weights]\ncompute = 0.35\n")
    cfg = write_cfg(tmp_path, "[scheduler.weights]\ncompute = 0.45\ndata_affinity = 0.20\n")
    assert vars(cfg.scheduler.weights) == {"compute": 0.45, "data_affinity": 0.20, "disaster_tolerance": 0.20,
                                           "compliance": 0.15}
    with pytest.raises(PlaceError, match=r"weight 'data_affinity' must be between 0\.2 and 0\.3"):
        resolve_weights(DEFAULT_WEIGHTS, spb.Weights(data_affinity=0.35))
    with pytest.raises(PlaceError, match=r"add up to 1\.05"):
        resolve_weights(DEFAULT_WEIGHTS, spb.Weights(compute=0.45))
    fleet = Fleet()
    with pytest.raises(PlaceError, match="'disaster_tolerance'"):   # over gRPC: INVALID_ARGUMENT
        fleet.place(weights=spb.Weights(disaster_tolerance=0.3))


@pytest.mark.parametrize("text, key", [
    ('[scheduler.region_latency_ms]\n"r1-r2" = 5\n', "scheduler.region_latency_ms.'r1-r2'"),
    ('[scheduler.region_transfer_cost]\n"r1/r2" = "cheap"\n', "scheduler.region_transfer_cost.'r1/r2'"),
    ('[scheduler.peak_tflops]\n"Ascend-910B4" = 0\n', "scheduler.peak_tflops.'Ascend-910B4'"),
    ("[scheduler]\nhbm_watch_factor = 2\n", "scheduler.hbm_watch_factor"),
    ("[scheduler]\nweight = 1\n", "scheduler.weight"),
])
def test_bad_scheduler_config_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as e:
        write_cfg(tmp_path, text)
    assert f"'{key}'" in str(e.value)


def test_example_config_and_defaults():
    cfg = load_collector(None, env={})
    assert vars(cfg.scheduler.weights) == DEFAULT_WEIGHTS and sum(DEFAULT_WEIGHTS.values()) == pytest.approx(1.0)
    assert cfg.stale_s == 10.0 and cfg.scheduler.xid_window_s == 600.0
    assert load_collector(str(ROOT / "examples/collector.toml"), env={}) == cfg


def test_parse_memory():
    assert parse_memory("40GB") == 40 * GiB == parse_memory("40 GiB") == parse_memory("40960MB")
    assert parse_memory("1073741824") == GiB and parse_memory("1.5TB") == int(1.5 * 2**40)
    for bad in ("forty", "40XB", "-1GB", ""):
        with pytest.raises(ValueError):
            parse_memory(bad)


# -- following the state -------------------------------------------------------------------------------

def test_scheduler_started_after_the_nodes_sees_them_and_their_events():
    st = FleetState()
    st.hello(pb.Hello(node_id="n", boot_id="b", inventory=inventory("a100", region="r1", zone="z1", price=2.0)))
    st.ingest(pb.Batch(node_id="n", boot_id="b", seq=1, samples=readings("a100"), events=[event("xid", "gpu0")]))
    sch = core(st)
    reply = sch.place(spb.PlaceRequest(memory_bytes=GiB, count=8))
    assert reply.excluded[0].reason == "xid"
    st.set_inventory("n", inventory("a100", devices=4, region="r2", zone="z1", price=2.0))
    reply = sch.place(spb.PlaceRequest(memory_bytes=GiB, count=3))
    assert reply.candidates[0].labels["region"] == "r2" and len(reply.candidates[0].devices) == 3


def test_a_decision_over_1000_nodes_is_one_pass(tmp_path):
    """Not the bench (bench/place_latency.py): a guard against a decision that grows worse than linear."""
    st = FleetState()
    sch = core(st)
    kinds = ["a100", "910b", "910b4"]
    for i in range(1000):
        kind = kinds[i % 3]
        st.hello(pb.Hello(node_id=f"n{i}", boot_id="b",
                          inventory=inventory(kind, region=f"r{i % 4}", zone=f"z{i % 8}", price=1 + i % 5)))
        st.ingest(pb.Batch(node_id=f"n{i}", boot_id="b", seq=1, samples=readings(kind, util=(i % 10) / 10)))
    req = spb.PlaceRequest(memory_bytes=40 * GiB, count=2, data_region="r1", replica_zones=["z1"])
    best = math.inf
    for _ in range(20):
        t = time.perf_counter()
        reply = sch.place(req)
        best = min(best, time.perf_counter() - t)
    assert reply.nodes_feasible == 667 and reply.excluded_counts["memory"] == 333
    assert best < 0.02, f"one decision over 1,000 nodes took {best * 1e3:.1f} ms"


def test_indexed_search_answers_as_the_full_scan_does():
    """The decision uses per-bucket arrays and levels (search.search); the plain walk over
    every node (scan=True) is the reference. Random fleets (types, sizes, labels, loads, XIDs,
    health, HBM watch, stale nodes, label changes) and random requests: same ranking, same counts."""
    rng = random.Random(9)
    for round_ in range(12):
        clock = [10**18]
        st = FleetState(clock=lambda clock=clock: clock[0])
        sch = core(st)
        kinds = ["a100", "910b", "910b4", "910a", "a100pcie"]
        nodes = {}
        for i in range(rng.randrange(20, 120)):
            kind = rng.choice(kinds)
            devices = rng.choice((4, 8, 8))
            labels = {"region": rng.choice(["r1", "r2", "r3", ""]), "zone": rng.choice(["z1", "z2", ""]),
                      "price": rng.choice(["1", "2.5", "4", ""])}
            for lab, values in (("province", ["p1", "p2"]), ("encryption", ["tdx", "none"]), ("attestation", ["tpm"])):
                if rng.random() < 0.4:
                    labels[lab] = rng.choice(values)
            labels = {k: v for k, v in labels.items() if v}
            nid = f"n{i:03d}"
            inv = inventory(kind, devices, **labels)
            if kind == "a100" and rng.random() < 0.1:   # a node with GPUs and NPUs
                inv.resources.extend(inventory("910b", 4).resources[:4])
            st.hello(pb.Hello(node_id=nid, boot_id="b", inventory=inv))
            nodes[nid] = [kind, devices, 0]

        def feed(nid, st=st, clock=clock, nodes=nodes):
            kind, devices, seq = nodes[nid]
            nodes[nid][2] = seq = seq + 1
            hbm = KINDS[kind][4] / GiB
            samples = readings(kind, devices, util={d: rng.random() for d in range(devices)},
                               used_gib={d: rng.random() * hbm * rng.choice((0.1, 0.9)) for d in range(devices)},
                               bw={d: rng.random() for d in range(devices)},
                               health={d: rng.choice(["OK"] * 12 + ["Alarm"]) for d in range(devices)},
                               t_ns=clock[0])
            events = []
            if rng.random() < 0.1:
                events.append(event(rng.choice(["xid", "checkpoint_request", "health"]),
                                    dev_id(kind, rng.randrange(devices)), clock[0], status="Critical"))
            st.ingest(pb.Batch(node_id=nid, boot_id="b", seq=seq, samples=samples, events=events))

        for nid in nodes:
            feed(nid)
        for step in range(3):
            clock[0] += int(rng.choice((1, 4, 7)) * 1e9)
            for nid in nodes:
                if rng.random() < 0.7:
                    feed(nid)
            if step == 1:
                for nid in rng.sample(sorted(nodes), 3):   # labels change: the node moves bucket
                    kind, devices, _ = nodes[nid]
                    st.set_inventory(nid, inventory(kind, devices, region="r9", zone="z1", price="3"))
            for _ in range(15):
                req = spb.PlaceRequest(
                    accelerator=rng.choice([spb.ACCELERATOR_ANY, spb.ACCELERATOR_GPU, spb.ACCELERATOR_NPU]),
                    memory_bytes=int(rng.choice((1, 16, 30, 32, 40, 40.5, 60, 79)) * GiB),
                    count=rng.choice((1, 2, 3, 4, 5, 8)), same_domain=rng.random() < 0.3,
                    data_region=rng.choice(["", "r1", "r2"]), replica_zones=rng.sample(["z1", "z2", "z3"], rng.randrange(3)),
                    limit=rng.choice((1, 3, 10)), max_excluded=200)
                if rng.random() < 0.2:
                    req.allowed_regions.extend(["r1", "r9"])
                if rng.random() < 0.15:
                    req.residency, req.data_region = spb.RESIDENCY_REGION, "r2"
                if rng.random() < 0.1:
                    req.require_encryption = True
                fast, ref = sch.place(req), sch.place(req, scan=True)
                where = f"round {round_} step {step} request {req}"
                assert_same_answer(fast, ref, where)


# -- the four dimensions, as pure functions ----------------------------------------------------------------

def test_compute_efficiency_free_score_value_and_norm():
    nan = math.nan
    # mean(1 - util, free / HBM, 1 - bandwidth) over the readings a device has
    assert scoring.free_score(0.5, 16 * GiB, 48 * GiB, 64 * GiB, 0.2) == (0.5 + 0.75 + 0.8) / 3
    assert scoring.free_score(0.0, 0.0, 80 * GiB, 80 * GiB, 0.0) == 1.0
    assert scoring.free_score(1.7, nan, 80 * GiB, 80 * GiB, 0.25) == 0.375   # over 1 counts as 1; no HBM reading
    assert scoring.free_score(0.25, 8 * GiB, 0.0, 0.0, nan) == 0.75          # HBM size unknown: that half is left out
    assert scoring.free_score(nan, nan, 80 * GiB, 80 * GiB, nan) == scoring.NO_READINGS_FREE == 0.5
    # value = peak TFLOPS / price; value_norm = value / the fleet's best
    assert scoring.value_per_price(312.0, 2.0) == 156.0
    for tflops, price in ((None, 2.0), (312.0, None), (0.0, 2.0)):
        assert scoring.value_per_price(tflops, price) == -1.0
    assert scoring.value_norm(64.0, 1 / 128) == 0.5 and scoring.value_norm(128.0, 1 / 128) == 1.0
    assert scoring.value_norm(-1.0, 1 / 128) == scoring.UNKNOWN_VALUE_NORM == 0.5
    assert scoring.compute_efficiency(0.5, 0.75) == 0.375 and scoring.compute_efficiency(1.0, 1.0) == 1.0


def test_data_affinity_from_the_region_matrix():
    regions = scoring.region_matrix({"r2/r1": "25", "r3/r1": "250", "a/b": "10", "b/a": "30"},
                                    {"r2/r1": "0.125", "r4/r1": "0.25"}, 100.0, 0.5)
    assert scoring.data_affinity("r2", "r1", regions) == 1 - 0.5 * 0.25 - 0.5 * 0.25 == 0.75
    assert scoring.data_affinity("r1", "r2", regions) == 0.75          # symmetric unless both directions are given
    assert regions.latency_ms[("a", "b")] == 10.0 and regions.latency_ms[("b", "a")] == 30.0
    assert scoring.data_affinity("r3", "r1", regions) == 0.0           # latency past the reference, cost unknown: 1 + 1
    assert scoring.data_affinity("r4", "r1", regions) == 0.25          # latency unknown (1), cost 0.25 / 0.5
    assert scoring.data_affinity("r5", "r1", regions) == 0.0           # a pair the matrix lacks
    assert scoring.data_affinity("r1", "r1", regions) == 1.0           # in the data's region
    assert scoring.data_affinity("", "r1", regions) == 0.0             # no region label
    assert scoring.data_affinity("r2", "", regions) == 1.0             # no data region in the request


def test_disaster_tolerance_by_the_other_replicas_zones():
    assert scoring.disaster_tolerance("z1", ["z1", "z9"]) == 0.5
    assert scoring.disaster_tolerance("z2", ["z1", "z9"]) == 1.0
    assert scoring.disaster_tolerance("z1", ["z1", "z1", "z2", "z3"]) == 0.5
    assert scoring.disaster_tolerance("z1", ["z1"]) == 0.0
    assert scoring.disaster_tolerance("z1", []) == 1.0                 # no other replicas given
    assert scoring.disaster_tolerance("", ["z1"]) == 0.5               # no zone label


def test_compliance_from_the_capability_labels():
    assert scoring.compliance(True, True) == 1.0
    assert scoring.compliance(True, False) == scoring.compliance(False, True) == 0.5
    assert scoring.compliance(False, False) == 0.0
    assert all(scoring.capable(x) for x in ("tdx", "sme", "tpm", "true", "yes", "1"))
    assert not any(scoring.capable(x) for x in (None, "", "none", "None", " false ", "no", "off", "0", "n/a", "unsupported"))


def test_peak_tflops_from_config_then_the_vendors_catalog(monkeypatch, caplog):
    tflops = PeakTflops({"Ascend-910B": 300.0, "A100-SXM4-80GB": 100.0})
    assert tflops("nvidia", "A100-SXM4-80GB") == 100.0          # the operator's figure first
    assert tflops("huawei", "Ascend-910B") == 300.0
    assert PeakTflops({})("nvidia", "A100-SXM4-80GB") == 312.0   # common/catalog/nvidia.toml
    assert PeakTflops({})("NVIDIA", "H100-PCIe-80GB") == 756.0
    assert PeakTflops({})("huawei", "Ascend-910A") == 256.0      # common/catalog/huawei.toml
    assert PeakTflops({})("huawei", "Ascend-910B4") is None      # no public figure: value per price unknown
    assert PeakTflops({})("", "Ascend-910A") == 256.0            # a vendor the catalog lacks: every catalog
    assert PeakTflops({})("amd", "MI300X") is None

    def broken(vendor, model):
        raise catalog.CatalogError(f"catalog {vendor}.toml is not valid TOML")
    monkeypatch.setattr(sched_inventory.catalog, "peak_tflops", broken)
    tflops = PeakTflops({"Ascend-910B": 300.0})
    with caplog.at_level(logging.ERROR, logger="xpusense.collector.scheduler"):
        assert tflops("nvidia", "A100-SXM4-80GB") is None and tflops("nvidia", "H100") is None
        assert tflops("huawei", "Ascend-910B") == 300.0
    assert [r.getMessage().count("nvidia.toml") for r in caplog.records] == [1]   # reported once


def test_the_core_does_not_import_the_agent():
    import subprocess
    import sys
    code = ("import sys, xpusense.collector.scheduler.core; "
            "print(sorted(m for m in sys.modules if m.startswith('xpusense.agent')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- the index off the ingest path -------------------------------------------------

def test_the_index_is_refreshed_off_the_ingest_path_and_place_never_uses_data_older_than_its_bound():
    """A stored batch only marks its node dirty; Place refreshes every node marked more than
    index_refresh_ms ago (its timer may be late on a busy loop), and the loop's timer refreshes the
    rest in bulk without any Place. Time on the index's monotonic clock is faked; the loop is real."""
    import asyncio

    async def run() -> None:
        fleet = Fleet(cfg=None)
        view = fleet.core.view
        assert view.refresh_ns == 1_000_000_000   # the default [scheduler] index_refresh_ms
        mono = [10**12]
        view.mono = lambda: mono[0]
        view.extra_s = 0.0   # a Place refreshes only what is due (not the next ones while it has time)
        agent = fleet.agent("a100-1", "a100", region="r1", zone="z1", price=1.0)   # 80 GiB free each
        ask = {"accelerator": spb.ACCELERATOR_GPU, "memory_bytes": 40 * GiB, "count": 1}
        assert [c.node_id for c in fleet.place(**ask).candidates] == ["a100-1"]
        refreshes = view.refreshes
        agent.send(used_gib=60.0)   # 20 GiB free: too little from now on
        assert view.refreshes == refreshes and "a100-1" in view.dirty   # ingest did not refresh
        mono[0] += view.refresh_ns - 1          # within the bound: the answer may miss it...
        assert [c.node_id for c in fleet.place(**ask).candidates] == ["a100-1"]
        mono[0] += 1                            # ...and never past it
        reply = fleet.place(**ask)
        assert not reply.candidates and reply.excluded[0].reason == "memory"
        assert not view.dirty and view.refreshes == refreshes + 1
        # Many batches within the bound: one refresh, by the loop's timer, no Place needed.
        for _ in range(5):
            agent.send(used_gib=0.0)
        assert "a100-1" in view.dirty and view.timer is not None
        await asyncio.sleep(view.refresh_ns / 1e9 + 0.2)
        assert not view.dirty and view.refreshes == refreshes + 2
        assert [c.node_id for c in fleet.place(**ask).candidates] == ["a100-1"]

    asyncio.run(run())


def test_the_bulk_refresh_waits_for_a_place_call_in_flight_then_runs_when_it_is_answered():
    """While a Place call is in flight (the servicer's serve_begin .. serve_end) the bulk refresh
    timer puts its slice off (counted `held`); the call's end runs it at once; a call that never
    ends holds it at most HOLD_MAX_S; a decision still refreshes whatever is due (catch_up)."""
    import asyncio

    from xpusense.collector.scheduler import fleet as fleet_mod

    async def run() -> None:
        fleet = Fleet(cfg=None)
        view = fleet.core.view
        agent = fleet.agent("a100-1", "a100", region="r1", zone="z1", price=1.0)
        agent.send(used_gib=60.0)
        assert "a100-1" in view.dirty and view.timer is not None
        view.serve_begin()
        idle = asyncio.ensure_future(view.idle(timeout_s=60.0))
        view.timer.cancel()
        view._on_timer()                      # the timer falls due during the call
        assert view.held == 1 and "a100-1" in view.dirty and view.timer is not None
        assert not idle.done()
        view.serve_end()                      # answered: the slice runs on the next loop turn
        deadline = asyncio.get_running_loop().time() + 30
        while view.dirty and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert not view.dirty
        await asyncio.wait_for(idle, 30)
        # A call that never ends holds the refresh at most HOLD_MAX_S.
        agent.send(used_gib=0.0)
        view.serve_begin()
        view.timer.cancel()
        view._on_timer()
        assert view.held == 2 and "a100-1" in view.dirty
        deadline = asyncio.get_running_loop().time() + 30
        while view.dirty and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(fleet_mod.HOLD_MAX_S)
        assert not view.dirty and view.serving == 1
        view.serve_end()

    asyncio.run(run())


def test_place_refreshes_what_it_has_time_for_beyond_the_bound():
    """With its small time allowance (PLACE_EXTRA_S) a Place also refreshes nodes not yet due: in
    a small fleet the answer follows the batch acknowledged just before."""
    import asyncio

    async def run() -> None:
        fleet = Fleet()
        agent = fleet.agent("a100-1", "a100")
        agent.send(used_gib=60.0)
        assert "a100-1" in fleet.core.view.dirty
        reply = fleet.place(accelerator=spb.ACCELERATOR_GPU, memory_bytes=40 * GiB, count=1)
        assert not reply.candidates and not fleet.core.view.dirty

    asyncio.run(run())


def test_a_node_whose_accelerators_are_gone_from_its_inventory_leaves_the_index():
    """A new inventory regroups the node whatever its readings: with no accelerators left (none
    to read, so none moved) it is in no pool."""
    fleet = Fleet()
    fleet.agent("a100-1", "a100")
    ask = {"accelerator": spb.ACCELERATOR_ANY, "count": 1}
    assert [c.node_id for c in fleet.place(**ask).candidates] == ["a100-1"]
    fleet.state.set_inventory("a100-1", pb.Inventory(hostname="a100-1"))
    reply = fleet.place(**ask)
    assert not reply.candidates and reply.nodes_feasible == 0
    assert all("a100-1" not in pool.entries for pool in fleet.core.view.pools)


def test_index_refresh_ms_0_refreshes_on_every_batch(tmp_path):
    fleet = Fleet(cfg=write_cfg(tmp_path, "[scheduler]\nindex_refresh_ms = 0\n"))
    agent = fleet.agent("a100-1", "a100")
    before = fleet.core.view.refreshes
    agent.send(used_gib=60.0)
    assert fleet.core.view.refreshes == before + 1 and not fleet.core.view.dirty


def test_a_candidate_ranked_again_for_the_same_request_is_copied_not_made_again(monkeypatch):
    """explain.fill_reply keeps each candidate on its group per answer shape: the same request
    ranked again copies it (explain.candidate is not called), with the same words as one made
    afresh; another shape (weights, data region, replicas), or the node's new readings (new groups),
    makes it again; a reply the caller changes does not change the next one."""
    from xpusense.collector.scheduler import explain
    fleet = Fleet()
    agents = [fleet.agent(f"n{i}", "a100", region="r1" if i % 2 else "r2", zone=f"z{i}", price=2.0 + i)
              for i in range(4)]
    made = []
    real = explain.candidate
    monkeypatch.setattr(explain, "candidate", lambda *a: (made.append(a[4].node.node_id), real(*a))[1])

    def fresh(**kw) -> spb.PlaceReply:   # the reference: every group's kept words dropped first
        for x in fleet.core.view.summaries.values():
            for g in {id(g): g for gs in x.pool_groups for g in gs}.values():
                g.explained.clear()
        return fleet.place(**kw)

    def words(r: spb.PlaceReply) -> list:
        return [c.SerializeToString(deterministic=True) for c in r.candidates]

    ask = dict(memory_bytes=GiB, count=2, data_region="r1", replica_zones=["z1"], limit=4)
    first = fresh(**ask)
    assert len(made) == 4
    made.clear()
    again = fleet.place(**ask)
    assert made == [] and words(again) == words(first)
    first.candidates[0].dimensions[0].detail = "changed by the caller"
    assert words(fleet.place(**ask)) == words(again) and made == []
    for other in (dict(ask, weights=spb.Weights(compute=0.45, data_affinity=0.2)), dict(ask, data_region="r2"),
                  dict(ask, replica_zones=["z2"]), dict(ask, same_domain=True)):
        made.clear()
        reply = fleet.place(**other)
        assert len(made) == 4, other
        assert words(reply) == words(fresh(**other)), other
    fleet.place(**ask)
    agents[1].send(util=0.9, used_gib=10.0)   # new readings: new groups for n1
    fleet.core.view.catch_up()
    made.clear()
    reply = fleet.place(**ask)
    assert made == ["n1"]
    assert words(reply) == words(fresh(**ask))
