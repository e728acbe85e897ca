"""NVML errors as real drivers return them, through pynvml's ctypes code and the fake.

Unknown, Timeout, NotReady and InUse are transient: the reading comes back once the driver answers
again. ResetRequired is a health event, and the GPU keeps being asked, so a reset brings it back. A
GPU that cannot be opened at start is tried again."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, pick, write_scenario  # noqa: E402


def test_transient_errors_come_back_and_reset_required_is_a_health_event(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(3) + """
[gpu 0]
error = nvmlDeviceGetPowerUsage UNKNOWN 0 1.5
error = nvmlDeviceGetUtilizationRates TIMEOUT 0 0.6
error = nvmlDeviceGetClockInfo NOT_READY 0 0.6
error = nvmlDeviceGetMemoryInfo IN_USE 0.3 0.8
[gpu 1]
error = nvmlDeviceGetUtilizationRates RESET_REQUIRED 1 2.5
error = nvmlDeviceGetMemoryInfo RESET_REQUIRED 1 2.5
error = nvmlGpmSampleGet RESET_REQUIRED 1 2.5
[gpu 2]
error = nvmlDeviceGetHandleByIndex_v2 UNKNOWN 0 1   # the C name pynvml calls
""")
    out = drive(libdir, scn, "realtime,realtime,nearline,offline", until_t=6.5)
    assert out["errors"] == []
    rounds = out["rounds"]
    realtime = [r for r in rounds if r["tier"] == "realtime"]
    offline = [r for r in rounds if r["tier"] == "offline"]
    nearline = [r for r in rounds if r["tier"] == "nearline"]
    late = [r for r in realtime if r["st"] >= 5.0]
    # gpu0: every transient reading is back.
    assert late and all({"gpu0", "gpu1", "gpu2"} <= set(pick(r, "hw.gpu.utilization")) for r in late)
    assert all("gpu0" in pick(r, "hw.gpu.memory.usage") for r in late)
    assert "gpu0" in pick(nearline[-1], "xpusense.accelerator.clock.frequency", clock="sm")
    assert any("gpu0" in pick(r, "hw.power") for r in offline if r["st"] >= 1.5)
    assert not any(k.startswith("gpu0/") for k in out["describe"]["unavailable_readings"])
    # gpu1: one critical event when it asks for a reset, one info event when it answers again.
    health = [e for e in out["events"] if e["type"] == "health" and e["device"] == "gpu1"]
    assert [(e["severity"], e["attributes"]["status"]) for e in health] == [("critical", "reset_required"),
                                                                            ("info", "ok")]
    assert "nvidia-smi -r -i 1" in health[0]["message"]
    bad_from, ok_from = health[0]["round"], health[1]["round"]
    for i, r in enumerate(rounds):
        if r["tier"] == "offline" and bad_from < i <= ok_from:
            assert pick(r, "xpusense.accelerator.health", status="reset_required").get("gpu1") == 0.0
        if r["tier"] == "offline" and i > ok_from:
            assert pick(r, "xpusense.accelerator.health", status="ok").get("gpu1") == 1.0
    assert all("gpu1" in pick(r, "xpusense.accelerator.hbm.bandwidth.utilization") for r in late[1:])
    # gpu2: not there at start, opened on a later round and reporting since.
    assert [g["id"] for g in out["inventory"]] == ["gpu0", "gpu1"]
    assert any("gpu2" in pick(r, "hw.gpu.utilization") for r in realtime if r["st"] < 2.5)
    assert "gpu2: NVIDIA H100 80GB HBM3" in out["describe"]["devices"]
    assert not [e for e in out["events"] if e["device"] in ("gpu0", "gpu2")]
