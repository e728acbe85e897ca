"""Test helpers around drive_source.py: write a scenario, run the NVML source against the fake in a
child process, and pick values out of what it printed.

    out = drive(libdir, write_scenario(tmp_path, h100s(2) + "[gpu 1]\\nerror = ..."), "realtime", until_t=3)
    pick(out["rounds"][1], "hw.gpu.utilization")            # {"gpu0": 0.9, "gpu1": 0.9}
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import fakenvml

DRIVER = Path(__file__).resolve().parent / "drive_source.py"


def h100s(n: int, **values: str) -> str:
    """A scenario head: n H100 80GB GPUs with steady values (override any value key by keyword)."""
    v = {"gpu_util": "90", "mem_util": "40", "mem_used": "40GiB", "gpm_dram_bw_util": "50", "gpm_sm_util": "70",
         "gpm_tensor_util": "30", "power_mw": "500000", "gpu_temp_c": "60", "mem_temp_c": "68",
         "pcie_tx_kbps": "500000", "pcie_rx_kbps": "2000000", "sm_clock_mhz": "1980", "mem_clock_mhz": "2619",
         "nvlink_rx_mibps": "100000", "nvlink_tx_mibps": "100000", **values}
    lines = [f"gpu_count = {n}", "[gpu *]", "name = NVIDIA H100 80GB HBM3", "arch = 9", "compute_capability = 9.0",
             "memory_total = 81559MiB", "memory_reserved = 551MiB", "nvlink_links = 18", "gpm = yes"]
    lines += [f"{k} = {val}" for k, val in v.items()]
    return "\n".join(lines) + "\n"


def write_scenario(tmp_path: Path, text: str, name: str = "test.scn") -> Path:
    p = Path(tmp_path) / name
    p.write_text(textwrap.dedent(text))
    return p


def drive(libdir, scenario, rounds: str = "realtime", *, t0_at: float | None = 0.0, gap_s: float = 0.25,
          until_t: float | None = None, until_event: str = "", deadline_s: float = 40.0, extra=(),
          procs=None, timeout_s: float = 120.0, calls: Path | None = None) -> dict:
    """Run drive_source.py with the fake playing `scenario` (a path or a shipped name); return its JSON.
    `calls`: where the fake writes its per-function call counts (fakenvml.read_calls)."""
    path = scenario if isinstance(scenario, Path) else fakenvml.scenario(scenario)
    env = fakenvml.env(libdir, path, t0=None if t0_at is None else fakenvml.t0_at(t0_at), procs=procs, calls=calls)
    args = [sys.executable, str(DRIVER), rounds, "--gap-s", str(gap_s), "--deadline-s", str(deadline_s), *extra]
    if until_t is not None:
        args += ["--until-t", str(until_t)]
    if until_event:
        args += ["--until-event", until_event]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    out["stderr"] = r.stderr
    return out


def pick(round_: dict, name: str, **labels: str) -> dict:
    """device -> value of the samples of one round named `name` whose labels include `labels`."""
    return {s["labels"].get("device"): s["value"] for s in round_["samples"]
            if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items())}


def rounds_of(out: dict, tier: str) -> list[dict]:
    return [r for r in out["rounds"] if r["tier"] == tier]
