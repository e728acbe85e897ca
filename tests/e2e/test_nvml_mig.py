"""MIG as a monitoring agent meets it, through pynvml's ctypes code and the fake.

Without the MIG monitor capability (NVIDIA_MIG_MONITOR_DEVICES=all and CAP_SYS_ADMIN in a container)
the whole-GPU handle answers NO_PERMISSION for memory and processes; the GPU is not lost for it:
every GPU instance is read through its own handle (memory, processes) and GPM per instance through
nvmlGpmMigSampleGet (only instances with a compute instance); MIG mode can also change at run time."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, write_scenario  # noqa: E402

GiB = 2**30
BW = "xpusense.accelerator.hbm.bandwidth.utilization"
GRAPHICS = "xpusense.accelerator.graphics.utilization"


def by_instance(r: dict, name: str, device: str) -> dict:
    """mig_instance -> value ('' for the whole GPU) of one device's samples named `name`."""
    return {s["labels"].get("mig_instance", ""): s["value"] for s in r["samples"]
            if s["name"] == name and s["labels"]["device"] == device}


def test_mig_without_monitor_permission_reads_every_instance(libdir, tmp_path):
    procs = tmp_path / "procs"
    procs.write_text("0 5001 8589934592 1 0\n0 5002 1073741824 2 0\n")
    scn = write_scenario(tmp_path, h100s(2) + """
[gpu 0]
mig_mode = 1
mig_monitor = no                 # the agent lacks the MIG monitor capability
mig = 1 40GiB 10GiB 3g.40gb
mig = 2 20GiB 2GiB 2g.20gb
mig = 5 10GiB 0 1g.10gb noci     # a GPU instance without a compute instance: no MIG device, no GPM
[gpu 1]
mig_mode = 0:0 2:1               # MIG turned on at t = 2
mig = 1 40GiB 5GiB 3g.40gb
event = 2 mig_config
""")
    out = drive(libdir, scn, "realtime,realtime,nearline", until_t=4.0, procs=procs)
    assert out["errors"] == []
    assert not [e for e in out["events"] if e["severity"] == "critical"], out["events"]
    inv = {r["id"]: r for r in out["inventory"]}
    assert set(inv) == {"gpu0", "gpu1"}
    assert inv["gpu0"]["attributes"]["mig_mode"] == "enabled" and inv["gpu0"]["attributes"]["mig_instances"] == "2"
    realtime = [r for r in out["rounds"] if r["tier"] == "realtime"]
    for r in realtime:
        # Per instance, through the MIG device handles; nothing for the whole GPU (NO_PERMISSION).
        assert by_instance(r, "hw.gpu.memory.usage", "gpu0") == {"1": 10 * GiB, "2": 2 * GiB}
        assert by_instance(r, "hw.gpu.memory.limit", "gpu0") == {"1": 40 * GiB, "2": 20 * GiB}
        assert by_instance(r, "xpusense.accelerator.mig.instances", "gpu0") == {"": 2.0}
    for r in realtime[1:]:
        assert by_instance(r, BW, "gpu0") == {"1": 0.5, "2": 0.5}     # nvmlGpmMigSampleGet per instance
        assert by_instance(r, GRAPHICS, "gpu0") == {"1": 0.9, "2": 0.9}   # GRAPHICS_UTIL (the fake: gpu_util)
    nearline = [r for r in out["rounds"] if r["tier"] == "nearline"]
    for r in nearline:
        mem = {(s["labels"]["pid"], s["labels"].get("mig_instance")): s["value"] for s in r["samples"]
               if s["name"] == "xpusense.accelerator.process.memory.usage" and s["labels"]["device"] == "gpu0"}
        assert mem == {("5001", "1"): 8 * GiB, ("5002", "2"): 1 * GiB}
    assert out["processes"] == {"5001": ["gpu0", "gpu0/gi1"], "5002": ["gpu0", "gpu0/gi2"]}
    why = out["describe"]["unavailable_readings"]["gpu0/memory"]
    assert "Insufficient Permissions" in why and "NVIDIA_MIG_MONITOR_DEVICES=all" in why
    assert out["coverage"]["gpu0/gi1"] == "" and out["coverage"]["gpu0/gi2"] == ""
    assert "gpu0/gi5" not in out["coverage"]

    # gpu1: MIG turned on at run time: the layout is read again, the instances reported from then on.
    changed = next(e for e in out["events"] if e["type"] == "mig_config" and e["device"] == "gpu1")
    assert changed["severity"] == "info" and changed["attributes"]["instances"] == "1"
    before = [r for i, r in enumerate(out["rounds"]) if i < changed["round"] and r["tier"] == "realtime"]
    after = [r for i, r in enumerate(out["rounds"]) if i > changed["round"] and r["tier"] == "realtime"]
    assert before and all(by_instance(r, "hw.gpu.utilization", "gpu1") == {"": 0.9} for r in before)
    assert after and all(by_instance(r, "hw.gpu.memory.usage", "gpu1").get("1") == 5 * GiB for r in after)
    assert all(by_instance(r, "hw.gpu.utilization", "gpu1") == {} for r in after)   # NOT_SUPPORTED under MIG
    assert "gpu1: NVIDIA H100 80GB HBM3 MIG gi1 NVIDIA H100 80GB HBM3 MIG 3g.40gb" in out["describe"]["devices"]
