"""The NVML source through pynvml's real ctypes code, against the fake libnvidia-ml.so.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import BIN, FAST_NO_EBPF, ROOT, free_port, nodes_json, series, wait_until

sys.path.insert(0, str(ROOT / "tests"))
from fakes.nvml import fakenvml  # noqa: E402

DRIVER = ROOT / "tests/fakes/nvml/drive_source.py"


def drive(libdir, scenario, rounds, t0_at=None, extra=(), procs=None):
    env = fakenvml.env(libdir, fakenvml.scenario(scenario),
                       t0=None if t0_at is None else fakenvml.t0_at(t0_at), procs=procs)
    r = subprocess.run([sys.executable, str(DRIVER), rounds, *extra], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def pick(round_, name, **labels):
    return {s["labels"].get("device"): s["value"] for s in round_["samples"]
            if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items())}


def test_h100_tiers_values_and_inventory(libdir):
    # t = 5..6 s of the 60 s cycle: gpu_util ~97.3, GPM DRAM ~71.5, memory 64 GiB of 81559 MiB.
    out = drive(libdir, "h100x8", "realtime,realtime,nearline,offline,realtime,realtime,offline", t0_at=5.0)
    assert out["errors"] == []
    inv = out["inventory"]
    assert len(inv) == 8 and {r["model"] for r in inv} == {"H100-80GB-HBM3"}
    g0 = inv[0]
    assert g0["id"] == "gpu0" and g0["attributes"]["compute_capability"] == "9.0"
    assert g0["attributes"]["memory"] == "80GB" and g0["attributes"]["nvlink_count"] == "18"
    assert g0["attributes"]["uuid"].startswith("GPU-") and g0["attributes"]["pci_bus_id"]
    assert g0["interconnects"] == [{"type": "NVLink", "bandwidth": "900GB/s"}]

    first, second, near, off1, _, _, off2 = out["rounds"]
    util = pick(second, "hw.gpu.utilization")
    assert set(util) == {f"gpu{i}" for i in range(8)} and all(0.97 <= v <= 0.99 for v in util.values())
    # GPM needs two samples: nothing in the first round, DRAM bandwidth in the second.
    assert pick(first, "xpusense.accelerator.hbm.bandwidth.utilization") == {}
    bw = pick(second, "xpusense.accelerator.hbm.bandwidth.utilization")
    assert len(bw) == 8 and all(0.70 <= v <= 0.74 for v in bw.values())
    assert all(0.57 <= v <= 0.62 for v in pick(second, "xpusense.accelerator.memory_controller.utilization").values())
    used = pick(second, "hw.gpu.memory.usage")
    # nvmlDeviceGetMemoryInfo_v2: the driver's reserved 551 MiB apart from used, as DCGM reports it.
    assert set(used.values()) == {64 * 2**30}, used
    assert set(pick(second, "xpusense.accelerator.memory.reserved").values()) == {551 * 2**20}
    assert all(v == 81559 * 2**20 for v in pick(second, "hw.gpu.memory.limit").values())
    rx1 = pick(first, "xpusense.accelerator.interconnect.io", direction="receive")
    rx2 = pick(second, "xpusense.accelerator.interconnect.io", direction="receive")
    rate = (rx2["gpu0"] - rx1["gpu0"]) / (second["t"] - first["t"])
    assert 38000 * 2**20 * 0.5 < rate < 41000 * 2**20 * 1.5  # ~38-41 GB/s over a real-time interval

    assert all(v == 1980e6 for v in pick(near, "xpusense.accelerator.clock.frequency", clock="sm").values())
    # 5,400,000 KB/s at t=0 rising to 5,600,000 at t=30: NVML's KB are KiB (x 1024 -> By/s)
    assert all(5.4e6 * 1024 <= v <= 5.45e6 * 1024
               for v in pick(near, "xpusense.accelerator.pcie.throughput", direction="receive").values())
    assert out["processes"] == {str(4242 + i): [f"gpu{i}"] for i in range(8)}
    assert pick(near, "xpusense.accelerator.process.memory.usage", pid="4242") == {"gpu0": 63 * 2**30}

    power = pick(off1, "hw.power")
    assert all(612 <= v <= 648 for v in power.values())
    assert all(66 <= v <= 67 for v in pick(off1, "hw.temperature", sensor="hbm").values())
    e1, e2 = pick(off1, "hw.energy"), pick(off2, "hw.energy")
    assert all(e2[d] > e1[d] for d in e1)
    assert pick(off1, "xpusense.accelerator.health") == {f"gpu{i}": 1.0 for i in range(8)}
    capped = pick(near, "xpusense.accelerator.throttle", reason="sw_power_cap")
    assert len(capped) == 8 and set(capped.values()) <= {0.0, 1.0}
    # Efficiency needs an energy delta (two offline rounds) and utilisation from the realtime
    # rounds between them: absent in the first offline round, present in the second.
    assert pick(off1, "xpusense.accelerator.energy.efficiency") == {}
    eff = pick(off2, "xpusense.accelerator.energy.efficiency")
    assert len(eff) == 8 and all(0.5 < v < 3.0 for v in eff.values())  # ~0.97 x 989.4 TFLOPS / ~620 W


def test_a100_has_no_hbm_bandwidth_and_says_why(libdir):
    out = drive(libdir, "a100x4", "realtime,realtime")
    assert out["errors"] == []
    assert pick(out["rounds"][1], "xpusense.accelerator.hbm.bandwidth.utilization") == {}
    # The memory-controller busy share is there, under its own name.
    assert len(pick(out["rounds"][1], "xpusense.accelerator.memory_controller.utilization")) == 4
    why = out["describe"]["unavailable_readings"]
    assert "GPM is not supported" in why["gpu0/hbm_bandwidth"] and "A100" in why["gpu0/hbm_bandwidth"]
    assert out["inventory"][0]["interconnects"] == [{"type": "NVLink", "bandwidth": "600GB/s"}]
    assert out["inventory"][0]["model"] == "A100-SXM4-40GB"


def test_lost_gpu_gives_a_health_event_and_the_other_goes_on(libdir):
    out = drive(libdir, "lost", "realtime", t0_at=3.5, extra=("--until-event", "health", "--gap-s", "0.2"))
    assert out["errors"] == []
    types = [(e["type"], e["device"]) for e in out["events"]]
    assert ("xid", "gpu1") in types and ("health", "gpu1") in types
    xid = next(e for e in out["events"] if e["type"] == "xid")
    assert xid["attributes"]["xid"] == "79" and xid["severity"] == "critical"
    lost_at = next(i for i, r in enumerate(out["rounds"]) if "gpu1" not in pick(r, "hw.gpu.utilization"))
    after = out["rounds"][lost_at:]
    assert after and all("gpu0" in pick(r, "hw.gpu.utilization") for r in after)
    assert out["describe"]["devices"] == ["gpu0: NVIDIA H100 80GB HBM3", "gpu1: NVIDIA H100 80GB HBM3 (lost)"]


@pytest.mark.parametrize("scenario,state,watched", [("a100x4", "unavailable", []),
                                                    ("h100x8", "running", [f"gpu{i}" for i in range(8)])])
def test_sources_says_which_gpus_the_hbm_watch_follows(libdir, scenario, state, watched):
    r = subprocess.run([str(BIN / "xpusense-agent"), "sources", "--format", "json"], capture_output=True, text=True,
                       timeout=30, env=fakenvml.env(libdir, fakenvml.scenario(scenario)))
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    watch = rows["hbm-watch"]
    assert watch["state"] == state and watch["watched"] == watched
    if not watched:
        assert watch["reason"].startswith("gpu0, gpu1, gpu2, gpu3: GPM is not supported on NVIDIA A100")


def test_no_library_means_unavailable_with_the_reason():
    r = subprocess.run([str(BIN / "xpusense-agent"), "sources", "--format", "json"], capture_output=True, text=True,
                       timeout=30, env={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/nonexistent",
                                        "XPUSENSE_AGENT_CONFIG": os.environ["XPUSENSE_AGENT_CONFIG"]})
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert rows["nvml"]["state"] == "unavailable" and "libnvidia-ml.so.1 not found" in rows["nvml"]["reason"]



def test_agent_and_collector_show_8_gpus_updating(libdir, procs, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector")
    cfg = tmp_path / "a.toml"
    cfg.write_text(FAST_NO_EBPF)
    env = fakenvml.env(libdir, fakenvml.scenario("h100x8"))
    procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr, "--node-id", "gpu-node"],
          "agent", env=env)

    def node():
        n = next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "gpu-node"), None)
        return n if n and series(n, "hw.energy") and series(n, "xpusense.accelerator.hbm.bandwidth.utilization") \
            and series(n, "xpusense.accelerator.clock.frequency") else None

    n1 = wait_until(node, timeout_s=30, what="realtime, nearline and offline GPU series")
    gpus = [r for r in n1["inventory"]["resources"] if r["type"] == "GPU"]
    assert len(gpus) == 8 and gpus[0]["model"] == "H100-80GB-HBM3"
    assert {s["labels"]["device"] for s in series(n1, "hw.gpu.utilization")} == {f"gpu{i}" for i in range(8)}
    t1 = series(n1, "hw.gpu.utilization", device="gpu3")[0]["time"]
    # The 1 s series keep updating: a newer point arrives.
    n2 = wait_until(lambda: (n := node()) and series(n, "hw.gpu.utilization", device="gpu3")[0]["time"] > t1 and n,
                    what="a newer realtime point")
    assert series(n2, "hw.energy", device="gpu0")[0]["unit"] == "J"
    assert series(n2, "xpusense.accelerator.hbm.bandwidth.utilization", device="gpu7")[0]["unit"] == "1"
    assert series(n2, "xpusense.agent.source.up", source="nvml", tier="realtime")[0]["value"] == 1.0
