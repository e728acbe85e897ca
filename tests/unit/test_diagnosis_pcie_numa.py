"""The pcie_contention and numa_misplacement rules on simulated time (sample timestamps, no sleeps),
with the NVML topology helpers they depend on: link capacity, NUMA node from sysfs, switch groups;
NUMA placement read from recorded procfs/sysfs trees and from a real process of the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until

from xpusense.agent.config import load_agent
from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.registry import build_diagnoser
from xpusense.agent.diagnosis.rules.numa import NumaMisplacement, parse_allowed, parse_cpulist, parse_stat_cpu
from xpusense.agent.diagnosis.rules.pcie import PcieContention
from xpusense.agent.sources.base import Sample
from xpusense.agent.sources.nvml import topology
from xpusense.agent.sources.nvml.device import Gpu

S = 1_000_000_000
T0 = 1_800_000_000 * S
GEN5_X16 = 32e9 * 128 / 130 / 8 * 16      # 63.0 GB/s


def gpu_round(t_s: int, util: dict[str, float], rx: dict[str, float], switch: dict[str, str] | None = None,
              numa: dict[str, int] | None = None) -> list[Sample]:
    """One second of a node: utilisation every second, PCIe and the link every 15 s (nearline)."""
    t = T0 + t_s * S
    out = [Sample("hw.gpu.utilization", u, "1", {"device": d}, time_ns=t) for d, u in util.items()]
    if t_s % 15 == 0:
        for d, v in rx.items():
            out += [Sample("xpusense.accelerator.pcie.throughput", v, "By/s", {"device": d, "direction": "receive"},
                           time_ns=t),
                    Sample("xpusense.accelerator.pcie.throughput", 1e9, "By/s", {"device": d, "direction": "transmit"},
                           time_ns=t),
                    Sample("xpusense.accelerator.pcie.link.capacity", GEN5_X16, "By/s",
                           {"device": d, **({"pcie_switch": switch[d]} if switch else {})}, time_ns=t)]
        out += [Sample("xpusense.accelerator.numa.node", float(n), "{node}", {"device": d}, time_ns=t)
                for d, n in (numa or {}).items()]
    return out


def states(events) -> list[tuple[str, str]]:
    return [(e.device, e.attributes["diagnosis.state"]) for e in events]


# -- NVML topology helpers ---------------------------------------------------------------------------
def test_link_capacity_by_generation_and_width():
    assert topology.link_capacity(1, 1) == pytest.approx(250e6)           # 2.5 GT/s, 8b/10b
    assert topology.link_capacity(2, 16) == pytest.approx(8e9)
    assert topology.link_capacity(3, 16) == pytest.approx(15.7538e9, rel=1e-4)   # 8 GT/s, 128b/130b
    assert topology.link_capacity(5, 16) == pytest.approx(GEN5_X16)
    assert topology.link_capacity(6, 8) == pytest.approx(64e9 * 128 / 130 / 8 * 8)
    assert topology.link_capacity(7, 16) is None and topology.link_capacity(4, 0) is None


def test_numa_node_from_sysfs(tmp_path):
    for addr, node in (("0000:18:00.0", "1"), ("0000:3b:00.0", "-1"), ("0001:af:00.0", "0")):
        (tmp_path / "bus/pci/devices" / addr).mkdir(parents=True)
        (tmp_path / "bus/pci/devices" / addr / "numa_node").write_text(node + "\n")
    assert topology.sysfs_pci_address("00000000:18:00.0") == "0000:18:00.0"
    assert topology.numa_node(str(tmp_path), "00000000:18:00.0") == 1
    assert topology.numa_node(str(tmp_path), "00000001:AF:00.0") == 0       # NVML writes hex upper-case
    assert topology.numa_node(str(tmp_path), "00000000:3B:00.0") is None    # -1: none
    assert topology.numa_node(str(tmp_path), "00000000:99:00.0") is None    # no such device
    assert topology.numa_node(str(tmp_path), "garbage") is None


class FakeNv:
    """Answers nvmlDeviceGetTopologyCommonAncestor from a table (handles are GPU indexes)."""

    class NVMLError(Exception):
        pass

    def __init__(self, levels: dict[frozenset, int], fail: frozenset = frozenset()):
        self.levels, self.fail = levels, fail

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        if frozenset((a, b)) in self.fail:
            raise self.NVMLError("Not Supported")
        return self.levels[frozenset((a, b))]


def test_switch_groups_are_transitive_and_numbered_by_first_gpu():
    gpus = [Gpu(i, i) for i in range(5)]
    single, multiple, node, system = 10, 20, 40, 50
    levels = {frozenset((a, b)): system for a in range(5) for b in range(5) if a != b}
    levels[frozenset((1, 3))] = single
    levels[frozenset((3, 4))] = multiple     # 1-3-4 under one switch (4 two switches down)
    levels[frozenset((0, 2))] = node
    groups, why = topology.switch_groups(FakeNv(levels), gpus)
    assert groups == {"gpu0": "0", "gpu1": "1", "gpu2": "2", "gpu3": "1", "gpu4": "1"} and why == ""
    # NOT_SUPPORTED for every pair of gpu4: it is left out (no group), and the reason said.
    groups, why = topology.switch_groups(FakeNv(levels, frozenset(frozenset((4, b)) for b in range(4))), gpus)
    assert "gpu4" not in groups and groups["gpu3"] == groups["gpu1"] and "Not Supported" in why


# -- pcie_contention ---------------------------------------------------------------------------------
def swinging(t: int) -> float:
    return 0.95 if t % 4 < 2 else 0.15     # CV 0.73 around 0.55


def test_pcie_contention_opens_with_evidence_and_closes_once_the_link_is_free():
    d = Diagnoser([PcieContention()], open_after_s=30, close_after_s=60, check_every_s=5)
    events = []
    # Healthy for 10 minutes: idle (mean below util_floor) with a busy link, steady with a busy link,
    # swinging with a quiet link; a steady quiet stretch between them (no window holds two of them).
    phases = [(150, lambda t: 0.05 * (t % 2), 0.9), (240, lambda t: 0.9, 0.2), (390, lambda t: 0.9, 0.95),
              (480, lambda t: 0.9, 0.2), (600, swinging, 0.2)]
    for t in range(0, 600):
        util, rx = next((u, r) for end, u, r in phases if t < end)
        events += d.observe(gpu_round(t, {"gpu0": util(t)}, {"gpu0": rx * GEN5_X16}, numa={"gpu0": 1}))
    assert events == []
    # Contention from t=600: the window (60 s) fills by 654, then 30 s more.
    for t in range(600, 800):
        events += d.observe(gpu_round(t, {"gpu0": swinging(t)}, {"gpu0": 0.9 * GEN5_X16}, numa={"gpu0": 1}))
    assert states(events) == [("gpu0", "open")]
    e = events[0]
    assert 680 * S <= e.time_ns - T0 <= 700 * S
    assert e.attributes["diagnosis.rule"] == "pcie_contention" and e.attributes["pcie.direction"] == "receive"
    assert "numactl --cpunodebind=1 --membind=1" in e.attributes["diagnosis.remedy"]
    util, rx, link = json.loads(e.attributes["diagnosis.evidence"])
    assert util["series"] == "hw.gpu.utilization" and set(util["values"]) == {0.95, 0.15} and util["window_s"] == 60
    assert "coefficient of variation 0.7" in util["summary"] and "(threshold 0.3)" in util["summary"]
    assert rx["labels"]["direction"] == "receive" and "90% of the link's 63.0 GB/s" in rx["summary"]
    assert link["series"] == "xpusense.accelerator.pcie.link.capacity" and link["values"] == [round(GEN5_X16, 6)]
    # The link quiet again from t=800 (utilisation still swinging): closed once the window is clear + 60 s.
    events = []
    for t in range(800, 1000):
        events += d.observe(gpu_round(t, {"gpu0": swinging(t)}, {"gpu0": 0.1 * GEN5_X16}, numa={"gpu0": 1}))
    assert states(events) == [("gpu0", "closed")]
    assert events[0].attributes["diagnosis.id"] == e.attributes["diagnosis.id"]
    assert 860 * S <= events[0].time_ns - T0 <= 875 * S   # mean of the window below 0.8 at 810, + 60 s


def test_gpus_under_one_switch_saturating_it_together():
    d = Diagnoser([PcieContention()], open_after_s=30, close_after_s=60, check_every_s=5)
    switch = {"gpu0": "0", "gpu1": "0", "gpu2": "1"}
    events = []
    # gpu0 and gpu1 at 45% each of their links (steady utilisation): 90% of one link together;
    # gpu2 at 70% alone under its own switch: nothing.
    for t in range(0, 200):
        events += d.observe(gpu_round(t, {"gpu0": 0.9, "gpu1": 0.9, "gpu2": 0.9},
                                      {"gpu0": 0.45 * GEN5_X16, "gpu1": 0.45 * GEN5_X16, "gpu2": 0.7 * GEN5_X16},
                                      switch))
    assert states(events) == [("", "open")]
    a = events[0].attributes
    assert a["pcie.switch"] == "0" and a["hw.ids"] == "gpu0,gpu1" and a["pcie.direction"] == "receive"
    assert "90% of one link" in a["diagnosis.cause"]
    # gpu1 stops: gpu0 alone at 45% is not contention; closed.
    events = []
    for t in range(200, 400):
        events += d.observe(gpu_round(t, {"gpu0": 0.9, "gpu1": 0.0, "gpu2": 0.9},
                                      {"gpu0": 0.45 * GEN5_X16, "gpu1": 0.0, "gpu2": 0.7 * GEN5_X16}, switch))
    assert states(events) == [("", "closed")]


def test_config_builds_both_rules_with_their_keys(tmp_path):
    p = tmp_path / "agent.toml"
    p.write_text("[diagnosis.pcie_contention]\ncv_threshold = 0.5\nnear_capacity = 0.9\n"
                 "[diagnosis.numa_misplacement]\nenabled = true\n")
    d = build_diagnoser(load_agent(str(p), env={}).diagnosis, Context())
    assert d is not None
    [pcie] = [r for r in d.rules if r.name == "pcie_contention"]
    assert (pcie.cv_threshold, pcie.near_capacity, pcie.window_s) == (0.5, 0.9, 60.0)
    assert any(r.name == "numa_misplacement" for r in d.rules)


# -- numa_misplacement -------------------------------------------------------------------------------
def test_parsers():
    stat = "4242 (python3 ) (x) S 1 4242 4242 0 -1 4194560 " + " ".join(["0"] * 29) + " 13 0 0"
    assert parse_stat_cpu(stat) == 13
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_allowed("Name:\tx\nCpus_allowed:\tff00\nCpus_allowed_list:\t8-15\n") == "8-15"


def write_nodes(sysfs: Path, lists: dict[int, str]) -> None:
    for n, cpus in lists.items():
        (sysfs / f"devices/system/node/node{n}").mkdir(parents=True, exist_ok=True)
        (sysfs / f"devices/system/node/node{n}/cpulist").write_text(cpus + "\n")


def write_proc(procfs: Path, pid: int, comm: str, last_cpu: int, allowed: str) -> None:
    d = procfs / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 29 + [str(last_cpu), "0", "0"]
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")
    (d / "status").write_text(f"Name:\t{comm}\nCpus_allowed_list:\t{allowed}\n")
    (d / "comm").write_text(comm + "\n")


def numa_rounds(d: Diagnoser, start: int, end: int, numa: dict[str, int]) -> list:
    events = []
    for t in range(start, end):
        events += d.observe(gpu_round(t, {g: 0.9 for g in numa}, {g: 1e9 for g in numa}, numa=numa))
    return events


def test_a_process_pinned_off_the_gpus_node_in_a_recorded_tree(tmp_path):
    procfs, sysfs = tmp_path / "proc", tmp_path / "sys"
    write_nodes(sysfs, {0: "0-7", 1: "8-15"})
    write_proc(procfs, 4242, "python3", 3, "0-15")       # gpu0 (node 0): on node 0
    write_proc(procfs, 4243, "trainer", 3, "0-15")       # gpu1 (node 1): unpinned, ran on node 0 last
    write_proc(procfs, 4244, "loader", 12, "0-7")        # gpu0: just pinned to node 0, not run since
    procs = {4242: {"gpu0"}, 4244: {"gpu0/gi1"}, 4245: {"gpu1"}}   # 4245: gone (no /proc entry)
    ctx = Context(processes=lambda: procs, procfs=str(procfs), sysfs=str(sysfs))
    d = Diagnoser([NumaMisplacement(ctx)], open_after_s=30, close_after_s=60, check_every_s=5)
    numa = {"gpu0": 0, "gpu1": 1}
    assert numa_rounds(d, 0, 600, numa) == []       # 10 minutes healthy
    # 4243 starts on gpu1, pinned to node 0's CPUs: opens after 30 s.
    write_proc(procfs, 4243, "trainer", 5, "0-7")
    procs[4243] = {"gpu1"}
    events = numa_rounds(d, 600, 700, numa)
    assert states(events) == [("gpu1", "open")]
    a = events[0].attributes
    assert (a["process.pid"], a["process.executable.name"]) == ("4243", "trainer")
    assert "numactl --cpunodebind=1 --membind=1" in a["diagnosis.remedy"] and "taskset -acp 8-15 4243" in a["diagnosis.remedy"]
    node, where = json.loads(a["diagnosis.evidence"])
    assert node["series"] == "xpusense.accelerator.numa.node" and node["values"] == [1.0]
    assert where["labels"] == {"pid": "4243"} and where["values"] == [5.0]
    assert "CPU 5 (NUMA node 0); allowed CPUs 0-7 (nodes 0)" in where["summary"]
    # Pinned back to node 1 (taskset): the stat still says CPU 5 until it runs, but it is confined now.
    write_proc(procfs, 4243, "trainer", 5, "8-15")
    events = numa_rounds(d, 700, 800, numa)
    assert states(events) == [("gpu1", "closed")]
    assert events[0].attributes["diagnosis.id"] == a["diagnosis.id"]


def test_one_numa_node_or_no_gpu_node_is_nothing_to_misplace(tmp_path):
    procfs, sysfs = tmp_path / "proc", tmp_path / "sys"
    write_nodes(sysfs, {0: "0-15"})
    write_proc(procfs, 4243, "trainer", 12, "8-15")
    ctx = Context(processes=lambda: {4243: {"gpu0"}}, procfs=str(procfs), sysfs=str(sysfs))
    d = Diagnoser([NumaMisplacement(ctx)], open_after_s=0, close_after_s=60, check_every_s=1)
    assert numa_rounds(d, 0, 100, {"gpu0": 0}) == []
    write_nodes(sysfs, {1: "8-15"})
    d2 = Diagnoser([NumaMisplacement(ctx)], open_after_s=0, close_after_s=60, check_every_s=1)
    assert numa_rounds(d2, 0, 100, {}) == []       # the GPU's node unknown (sysfs -1): no gauge


SPIN = "import sys\nsys.stdout.write('go\\n'); sys.stdout.flush()\nwhile True:\n    pass\n"


def last_cpu(pid: int) -> int:
    return parse_stat_cpu(Path(f"/proc/{pid}/stat").read_text())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin a process off a node")
def test_a_real_process_pinned_off_and_back(tmp_path):
    cpu_a, cpu_b = sorted(os.sched_getaffinity(0))[:2]
    sysfs = tmp_path / "sys"
    write_nodes(sysfs, {0: str(cpu_a), 1: str(cpu_b)})   # a recorded two-node map over this machine's CPUs
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "go\n"
        os.sched_setaffinity(child.pid, {cpu_b})     # the GPU is on node 0; the process on node 1
        wait_until(lambda: last_cpu(child.pid) == cpu_b, 30, what="the child running on its pinned CPU")
        ctx = Context(processes=lambda: {child.pid: {"gpu0"}}, procfs="/proc", sysfs=str(sysfs))
        d = Diagnoser([NumaMisplacement(ctx)], open_after_s=30, close_after_s=60, check_every_s=5)
        events = numa_rounds(d, 0, 100, {"gpu0": 0})
        assert states(events) == [("gpu0", "open")]
        a = events[0].attributes
        assert a["process.pid"] == str(child.pid) and a["process.executable.name"].startswith("python")
        assert f"last ran on CPU {cpu_b} (NUMA node 1); allowed CPUs {cpu_b} (nodes 1)" in a["diagnosis.evidence"]
        os.sched_setaffinity(child.pid, {cpu_a})     # pinned back to the GPU's node
        wait_until(lambda: last_cpu(child.pid) == cpu_a, 30, what="the child moved to its node")
        events = numa_rounds(d, 100, 200, {"gpu0": 0})
        assert states(events) == [("gpu0", "closed")]
    finally:
        child.kill()
        child.wait()
