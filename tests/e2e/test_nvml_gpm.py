"""GPM as real drivers answer it (issue 14, items 1 and 3), through pynvml's ctypes code and the fake.

Item 1: a GPM call that fails on one GPU (Unknown, ResetRequired, NotSupported on a vGPU profile) is
no data for that GPU that round; every other GPU keeps its HBM bandwidth, and the failing GPU keeps
its other readings. Item 3: samples under 100 ms apart and NaN metrics never leave the source.
"""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, pick, write_scenario  # noqa: E402

BW = "xpusense.accelerator.hbm.bandwidth.utilization"


def test_a_failing_gpm_call_costs_that_gpu_only(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(4) + """
[gpu 1]
error = nvmlGpmSampleGet UNKNOWN          # every sample fails: Unknown Error
[gpu 2]
error = nvmlGpmSampleGet NOT_SUPPORTED    # vGPU profile not backed by MIG: GPM answers, samples do not
[gpu 3]
error = nvmlGpmMetricsGet RESET_REQUIRED 0 2   # the metrics call fails for the first 2 s, then works
""")
    out = drive(libdir, scn, "realtime", t0_at=0.0, until_t=4.0)
    assert out["errors"] == [], out["errors"]     # nothing raised out of a round
    rounds = out["rounds"]
    assert len(rounds) >= 8
    for r in rounds[1:]:
        bw = pick(r, BW)
        assert bw.get("gpu0") == 0.5, (r["st"], bw)   # the healthy GPU reports every round after the first
        assert "gpu1" not in bw and "gpu2" not in bw
        # The GPUs whose GPM fails keep every other reading.
        assert set(pick(r, "hw.gpu.utilization")) == {"gpu0", "gpu1", "gpu2", "gpu3"}
    # gpu3: nothing while its metrics call fails; after the window a new pair of samples, then data.
    assert all("gpu3" not in pick(r, BW) for r in rounds if r["st"] < 2.0)
    after = [r for r in rounds if r["st"] >= 2.0]
    assert len(after) >= 4 and all(pick(r, BW).get("gpu3") == 0.5 for r in after[2:])
    d = out["describe"]
    assert "Not Supported" in d["unavailable_readings"]["gpu2/gpm"]
    assert "Unknown" in d["retrying_readings"]["gpu1/gpm"]          # transient: asked again later
    assert not any(k.startswith("gpu3/") for k in d["retrying_readings"])   # recovered
    assert out["coverage"]["gpu0"] == "" and out["coverage"]["gpu1"] == ""
    assert "Not Supported" in out["coverage"]["gpu2"]
