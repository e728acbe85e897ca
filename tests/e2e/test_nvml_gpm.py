"""GPM as real drivers answer it, through pynvml's ctypes code and the fake.

A GPM call that fails on one GPU (Unknown, ResetRequired, NotSupported on a vGPU profile) is no
data for that GPU that round; every other GPU keeps its HBM bandwidth, and the failing GPU keeps its
other readings. Samples under 100 ms apart and NaN metrics never leave the source."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, fakenvml, h100s, pick, write_scenario  # noqa: E402

BW = "xpusense.accelerator.hbm.bandwidth.utilization"
GRAPHICS = "xpusense.accelerator.graphics.utilization"


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
    too_soon = out["describe"].get("gpm_rounds_too_soon", {})
    missed = 0
    for r in rounds[1:]:
        bw = pick(r, BW)
        # The healthy GPU reports every round after the first but one under 100 ms after its last
        # sample (a loaded machine can stall a round between the GPUs: counted, nothing read).
        assert bw.get("gpu0") in (0.5, None), (r["st"], bw)
        missed += "gpu0" not in bw
        assert "gpu1" not in bw and "gpu2" not in bw
        # The GPUs whose GPM fails keep every other reading.
        assert set(pick(r, "hw.gpu.utilization")) == {"gpu0", "gpu1", "gpu2", "gpu3"}
    assert missed <= too_soon.get("gpu0", 0) and missed < len(rounds) - 1
    # gpu3: nothing while its metrics call fails; after the window a new pair of samples, then data.
    assert all("gpu3" not in pick(r, BW) for r in rounds if r["st"] < 2.0)
    after = [r for r in rounds if r["st"] >= 2.0]
    gpu3 = [pick(r, BW).get("gpu3") for r in after[2:]]
    assert len(after) >= 4 and set(gpu3) - {None} == {0.5} and gpu3.count(None) <= too_soon.get("gpu3", 0)
    d = out["describe"]
    assert "Not Supported" in d["unavailable_readings"]["gpu2/gpm"]
    assert "Unknown" in d["retrying_readings"]["gpu1/gpm"]          # transient: asked again later
    assert not any(k.startswith("gpu3/") for k in d["retrying_readings"])   # recovered
    assert out["coverage"]["gpu0"] == "" and out["coverage"]["gpu1"] == ""
    assert "Not Supported" in out["coverage"]["gpu2"]


def test_samples_under_100ms_apart_are_never_used(libdir, tmp_path):
    # The fake answers pairs under 100 ms apart with 99 % and a success code, as a real driver
    # answers them with invalid values: a source that used them would report 0.99.
    scn = write_scenario(tmp_path, h100s(2, gpm_short_value="99"))
    out = drive(libdir, scn, "realtime", gap_s=0.02, until_t=1.5)
    assert out["errors"] == []
    values = [v for r in out["rounds"] for v in pick(r, BW).values()]
    assert values and set(values) == {0.5}           # reported, and only from pairs >= 100 ms apart
    with_bw = [r for r in out["rounds"] if "gpu0" in pick(r, BW)]
    gaps = [b["st"] - a["st"] for a, b in zip(with_bw, with_bw[1:])]
    assert gaps and min(gaps) >= 0.1 - 0.005         # no two reports from samples closer than 100 ms
    # Every round but the first (one sample, nothing to compare) either reported or was too soon.
    too_soon = out["describe"]["gpm_rounds_too_soon"].get("gpu0", 0)
    assert too_soon == len(out["rounds"]) - 1 - len(with_bw)
    short = sum(1 for a, b in zip(out["rounds"], out["rounds"][1:]) if b["st"] - a["st"] < 0.05)
    assert too_soon >= min(short, 1)                 # 20 ms rounds did come too soon


def test_nan_never_leaves_the_source(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(2) + """
[gpu 0]
gpm_nan = 10 1 2.5        # DRAM_BW_UTIL is NaN, with a success code, from t = 1 to 2.5
mem_temp_c = 0            # HBM sensor the driver reports as 0 C (nvbug 4300930)
[gpu 1]
mem_temp_c = 4294967295   # all-ones garbage
""")
    out = drive(libdir, scn, "realtime,offline", until_t=3.5)
    assert out["errors"] == []
    for r in out["rounds"]:
        for s in r["samples"]:
            assert isinstance(s["value"], float | int), s   # drive_source writes NaN as a string
    realtime = [r for r in out["rounds"] if r["tier"] == "realtime"]
    inside = [r for r in realtime if 1.3 <= r["st"] < 2.4]   # the pair ends inside the NaN window
    assert inside and all("gpu0" not in pick(r, BW) for r in inside)
    gpu1 = [pick(r, BW).get("gpu1") for r in realtime[1:]]                      # the other GPU is untouched
    assert set(gpu1) - {None} == {0.5}
    assert gpu1.count(None) <= out["describe"]["gpm_rounds_too_soon"].get("gpu1", 0)
    # ... and its other metrics are: in every inside round but those that came under 100 ms after
    # gpu0's last sample (a loaded machine stalls a round between the GPUs; nothing is read then).
    without_sm = [r for r in inside if "gpu0" not in pick(r, "xpusense.accelerator.sm.utilization")]
    assert len(without_sm) < len(inside)
    assert len(without_sm) <= out["describe"]["gpm_rounds_too_soon"].get("gpu0", 0), without_sm
    assert any(pick(r, BW).get("gpu0") == 0.5 for r in realtime if r["st"] >= 2.8)          # and it comes back
    offline = [r for r in out["rounds"] if r["tier"] == "offline"]
    assert all(pick(r, "hw.temperature", sensor="hbm") == {} for r in offline)
    assert all(set(pick(r, "hw.temperature", sensor="chip")) == {"gpu0", "gpu1"} for r in offline)
    dropped = out["describe"]["dropped_values"]
    assert "not a number" in dropped["gpu0/xpusense.accelerator.hbm.bandwidth.utilization"]
    assert "nvbug 4300930" in dropped["gpu0/hw.temperature{sensor=hbm}"]
    assert "outside" in dropped["gpu1/hw.temperature{sensor=hbm}"]


def test_two_samples_per_gpu_take_turns_and_are_freed_on_close(libdir, tmp_path):
    """A round fills the older of two samples allocated once (no alloc and free per round), and the
    metrics still come from consecutive samples; closing the source frees both."""
    calls = tmp_path / "calls.txt"
    out = drive(libdir, write_scenario(tmp_path, h100s(2)), "realtime", gap_s=0.15, until_t=1.5, calls=calls)
    assert out["errors"] == []
    with_bw = [r for r in out["rounds"] if pick(r, BW)]
    assert len(with_bw) >= 3 and 0.5 in pick(with_bw[-1], BW).values()
    n = fakenvml.read_calls(calls)
    assert n["nvmlGpmSampleGet"] >= len(with_bw) + 2          # a sample per GPU and round, however many
    assert n["nvmlGpmSampleAlloc"] == 4 and n["nvmlGpmSampleFree"] == 4, n


def test_graphics_engine_utilisation_where_gpm_answers_for_it(libdir, tmp_path):
    """GPM's GRAPHICS_UTIL (percent) as a ratio; a GPU without GPM (before Hopper) has none, as DCGM
    has no GR_ENGINE_ACTIVE for it, and a GPU whose driver refuses that one metric keeps the others."""
    scn = write_scenario(tmp_path, h100s(3) + """
[gpu 0]
gpm_graphics_util = 75
[gpu 1]
name = NVIDIA A100-SXM4-80GB
arch = 7
gpm = no
[gpu 2]
unsupported = gpm:1
""")
    out = drive(libdir, scn, "realtime", gap_s=0.15, until_t=1.5)
    assert out["errors"] == []
    with_gr = [pick(r, GRAPHICS) for r in out["rounds"] if pick(r, GRAPHICS)]
    assert len(with_gr) >= 3 and all(gr == {"gpu0": 0.75} for gr in with_gr), with_gr
    sm = [pick(r, "xpusense.accelerator.sm.utilization") for r in out["rounds"]]
    assert any("gpu2" in x for x in sm) and not any("gpu1" in x for x in sm)   # gpu2's other GPM metrics stay
    d = out["describe"]["unavailable_readings"]
    assert "Not Supported" in d["gpu2/gpm_metric_1"] and "Hopper or newer" in d["gpu1/hbm_bandwidth"]
