"""Process lists as each driver generation lays them out, through the fake.

pynvml reads `_v3` entries as 24 bytes; drivers 535.43-535.86 write 32 and older drivers lack `_v3`.
The source must list the right pids on every generation and never pass on a pid that cannot be a
process (0 would make the HBM watch signal its own process group).
"""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, pick, write_scenario  # noqa: E402

PROCS = """
[gpu 0]
process = 3001 1GiB python3
process = 3002 2GiB python3
process = 3003 3GiB python3
[gpu 1]
process = 4000 4GiB python3
"""
GENERATIONS = {
    # driver: (system keys, the call the source must use, its entry size)
    "r550": ("", "nvmlDeviceGetComputeRunningProcesses_v3", 24),
    "r535.54": ("process_info_size = 32\nmissing_symbols = nvmlDeviceGetRunningProcessDetailList\n",
                "nvmlDeviceGetComputeRunningProcesses_v3", 32),
    "r470": ("missing_symbols = nvmlDeviceGetComputeRunningProcesses_v3 nvmlDeviceGetRunningProcessDetailList "
             "nvmlDeviceGetConfComputeMemSizeInfo\n", "nvmlDeviceGetComputeRunningProcesses_v2", 24),
    "r418": ("missing_symbols = nvmlDeviceGetComputeRunningProcesses_v3 nvmlDeviceGetComputeRunningProcesses_v2 "
             "nvmlDeviceGetRunningProcessDetailList nvmlDeviceGetConfComputeMemSizeInfo\n",
             "nvmlDeviceGetComputeRunningProcesses", 16),
    # 32-byte entries although the symbols say 24: the pids they yield show it, and the source switches.
    "r535.54-patched": ("process_info_size = 32\n", "nvmlDeviceGetComputeRunningProcesses_v3", 32),
}


@pytest.mark.parametrize("driver", list(GENERATIONS))
def test_every_driver_generation_gives_the_right_pids(libdir, tmp_path, driver):
    system, function, size = GENERATIONS[driver]
    scn = write_scenario(tmp_path, system + h100s(2) + PROCS)
    out = drive(libdir, scn, "nearline,nearline", gap_s=0.05, t0_at=None)
    assert out["errors"] == []
    assert out["processes"] == {"3001": ["gpu0"], "3002": ["gpu0"], "3003": ["gpu0"], "4000": ["gpu1"]}
    for r in out["rounds"]:
        mem = {s["labels"]["pid"]: s["value"] for s in r["samples"]
               if s["name"] == "xpusense.accelerator.process.memory.usage"}
        assert mem == {"3001": 2**30, "3002": 2 * 2**30, "3003": 3 * 2**30, "4000": 4 * 2**30}
        assert pick(r, "xpusense.accelerator.processes") == {"gpu0": 3.0, "gpu1": 1.0}
    assert out["describe"]["process_list"].startswith(f"{function} ({size}-byte entries), 0 impossible")


def test_impossible_pids_never_leave_the_source(libdir, tmp_path):
    procs = tmp_path / "procs"
    procs.write_text("0 0 1073741824\n0 4294967295 1073741824\n0 99999999 1073741824\n0 3001 1073741824\n")
    scn = write_scenario(tmp_path, h100s(1))
    out = drive(libdir, scn, "nearline", t0_at=None, procs=procs)
    assert out["processes"] == {"3001": ["gpu0"]}
    pids = [s["labels"]["pid"] for s in out["rounds"][0]["samples"] if "pid" in s["labels"]]
    assert pids == ["3001"]
    assert out["describe"]["process_list"].endswith("3 impossible pid(s) left out")
