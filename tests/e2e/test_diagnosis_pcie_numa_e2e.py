"""pcie_contention and numa_misplacement on what the real NVML source reads (pynvml over the fake
libnvidia-ml): link capacity from the current generation x width, the NUMA node from a recorded sysfs
tree, the switch group from nvmlDeviceGetTopologyCommonAncestor. The source's rounds are replayed into
the Diagnoser on a simulated timeline, each sample stamped with its round's scenario time x SCALE
(the fake's clock), so minutes of rule time take seconds and nothing sleeps to synchronise."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.rules.numa import NumaMisplacement
from xpusense.agent.diagnosis.rules.pcie import PcieContention
from xpusense.agent.sources.base import Sample

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
import fakenvml  # noqa: E402
from driving import drive, h100s, write_scenario  # noqa: E402

S = 1_000_000_000
T0 = 1_800_000_000 * S
GEN5_X16 = 32e9 * 128 / 130 / 8 * 16


def write_sysfs(root: Path, numa: dict[str, int], nodes: dict[int, str]) -> Path:
    """A recorded sysfs: NUMA node per NVML bus id, and the CPUs of each node."""
    for bus_id, node in numa.items():
        d = root / "bus/pci/devices" / bus_id.lower()[4:]
        d.mkdir(parents=True, exist_ok=True)
        (d / "numa_node").write_text(f"{node}\n")
    for n, cpus in nodes.items():
        (root / f"devices/system/node/node{n}").mkdir(parents=True, exist_ok=True)
        (root / f"devices/system/node/node{n}/cpulist").write_text(cpus + "\n")
    return root


def replay(d: Diagnoser, out: dict, scale: float) -> list:
    """Every round of the source, stamped at its scenario time x scale."""
    events = []
    for r in out["rounds"]:
        t = T0 + int(r["st"] * scale * S)
        events += [(r["st"], e) for e in d.observe([Sample(s["name"], float(s["value"]), s["unit"], dict(s["labels"]),
                                                            s["kind"], time_ns=t) for s in r["samples"]])]
    return events


def swinging_keyframes(until: float, step: float = 0.25) -> str:
    """gpu_util 95 / 15 in steps of `step` scenario seconds."""
    frames, t, hi = [], 0.0, True
    while t < until:
        v = 95 if hi else 15
        frames += [f"{t:g}:{v}", f"{t + step:g}:{v}"]
        t, hi = t + step, not hi
    return " ".join(frames)


def test_pcie_near_capacity_with_swinging_utilisation_through_nvml(libdir, tmp_path):
    sysfs = write_sysfs(tmp_path / "sys", {"00000000:10:00.0": 1, "00000000:11:00.0": 0}, {0: "0-7", 1: "8-15"})
    # gpu0: utilisation swinging, PCIe receive at 52e6 KiB/s = 84% of the gen5 x16 link until t=6, then
    # 1e6 KiB/s; gpu1 steady and quiet. Each on its own switch (the fake's default).
    scn = write_scenario(tmp_path, h100s(2) + f"""
[gpu 0]
gpu_util = {swinging_keyframes(14)}
pcie_rx_kbps = 0:52000000 6:52000000 6:1000000
""")
    out = drive(libdir, scn, "realtime,nearline", gap_s=0.05, until_t=12, deadline_s=60,
                extra=["--sysfs", str(sysfs)])
    assert out["errors"] == []
    inv = {e["id"]: e["attributes"] for e in out["inventory"]}
    assert (inv["gpu0"]["numa_node"], inv["gpu1"]["numa_node"]) == ("1", "0")
    assert inv["gpu0"]["pcie_switch"] != inv["gpu1"]["pcie_switch"]
    d = Diagnoser([PcieContention()], open_after_s=30, close_after_s=60, check_every_s=5)
    events = replay(d, out, scale=30)     # 12 s of scenario: 6 minutes of rule time
    assert [(e.device, e.attributes["diagnosis.state"]) for _, e in events] == [("gpu0", "open"), ("gpu0", "closed")]
    (st_open, opened), (st_closed, closed) = events
    assert 2.5 <= st_open < 6.0 and 6.0 < st_closed <= 6.0 + (60 + 60 + 15) / 30
    util, rx, link = json.loads(opened.attributes["diagnosis.evidence"])
    assert util["series"] == "hw.gpu.utilization" and {0.95, 0.15} <= set(util["values"])
    assert rx["labels"] == {"device": "gpu0", "vendor": "nvidia", "direction": "receive"}
    assert set(rx["values"]) == {52e6 * 1024} and "84% of the link's 63.0 GB/s" in rx["summary"]
    assert link["values"] == [pytest.approx(GEN5_X16)] and link["labels"]["pcie_switch"] == inv["gpu0"]["pcie_switch"]
    assert "numactl --cpunodebind=1 --membind=1" in opened.attributes["diagnosis.remedy"]
    assert closed.attributes["diagnosis.id"] == opened.attributes["diagnosis.id"]


def test_two_gpus_under_one_switch_saturating_it_through_nvml(libdir, tmp_path):
    # gpu0 and gpu1 under switch 5 (two hops for gpu1: MULTIPLE), 45% of a link each, steady.
    scn = write_scenario(tmp_path, h100s(3, pcie_rx_kbps="27700000") + """
[gpu 0-1]
pcie_switch = 5
[gpu 1]
pcie_switch_hops = 2
""")
    out = drive(libdir, scn, "realtime,nearline", gap_s=0.05, until_t=6, deadline_s=60)
    assert out["errors"] == [] and out["describe"]["topology"] == "ok"
    d = Diagnoser([PcieContention()], open_after_s=30, close_after_s=60, check_every_s=5)
    events = [e for _, e in replay(d, out, scale=30)]
    assert [(e.device, e.attributes["diagnosis.state"]) for e in events] == [("", "open")]
    assert events[0].attributes["hw.ids"] == "gpu0,gpu1"


def test_a_healthy_fake_node_fires_neither_rule_over_ten_minutes(libdir, tmp_path):
    scn = fakenvml.scenario("h100x8")
    bus_ids = re.findall(r"^pci_bus_id = (\S+)", Path(scn).read_text(), re.M)
    assert len(bus_ids) == 8
    sysfs = write_sysfs(tmp_path / "sys", {b: i // 4 for i, b in enumerate(bus_ids)}, {0: "0-7", 1: "8-15"})
    procfs = tmp_path / "proc"
    for i in range(8):   # each GPU's python3 (pids 4242-4249) running on its GPU's node
        p = procfs / str(4242 + i)
        p.mkdir(parents=True)
        fields = ["S"] + ["0"] * 35 + [str(i // 4 * 8 + i % 4), "0", "0"]
        (p / "stat").write_text(f"{4242 + i} (python3) " + " ".join(fields) + "\n")
        (p / "status").write_text("Name:\tpython3\nCpus_allowed_list:\t0-15\n")
        (p / "comm").write_text("python3\n")
    out = drive(libdir, "h100x8", "realtime,nearline", gap_s=0.05, until_t=10, deadline_s=60,
                extra=["--sysfs", str(sysfs)])
    assert out["errors"] == [] and out["processes"] == {
        str(4242 + i): [f"gpu{i}"] for i in range(8)}
    procs = {int(k): set(v) for k, v in out["processes"].items()}
    ctx = Context(processes=lambda: procs, procfs=str(procfs), sysfs=str(sysfs))
    d = Diagnoser([PcieContention(), NumaMisplacement(ctx)], open_after_s=30, close_after_s=60, check_every_s=5)
    assert replay(d, out, scale=60) == []        # 10 s of scenario: 10 minutes of rule time
    assert d.rule_errors == 0 and d.recent.window("xpusense.accelerator.numa.node", d.recent.newest_ns, 600)
