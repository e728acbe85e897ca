"""Per-process utilisation through pynvml's real ctypes code and the fake: the driver's samples since
a timestamp, NOT_FOUND when there are none, the size handshake, the older call on older drivers,
MIG per MIG device where NVML answers, and the values at a real collector."""

from __future__ import annotations

import sys

import pytest
from helpers import BIN, FAST_NO_EBPF, ROOT, free_port, nodes_json, series, wait_until

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
import fakenvml  # noqa: E402
from driving import drive, h100s, rounds_of, write_scenario  # noqa: E402

UTIL = "xpusense.accelerator.process.utilization"
LEFT_OUT = "xpusense.nvml.process_utilization.left_out"
NEWER, OLDER = "nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization"

SHARED = """
[gpu 0]
process = 3001 10GiB python3
process = 3002 20GiB python3
process_util = 3001 30 10 0 5      # PID SM MEM ENC DEC (%)
process_util = 3002 50 20 0 0
"""


def util(r: dict, device: str) -> dict:
    """(pid, mig_instance or '', engine) -> value of one device's per-process utilisation in a round."""
    return {(s["labels"]["pid"], s["labels"].get("mig_instance", ""), s["labels"]["engine"]): s["value"]
            for s in r["samples"] if s["name"] == UTIL and s["labels"]["device"] == device}


def test_two_processes_sharing_a_gpu_and_one_in_a_mig_instance(libdir, tmp_path):
    procs = tmp_path / "procs"
    procs.write_text("1 5001 8589934592 1 0\n2 6001 8589934592 1 0\n")
    scn = write_scenario(tmp_path, h100s(3) + SHARED + """
[gpu 1]
mig_mode = 1
mig = 1 40GiB 10GiB 3g.40gb
mig_process_util = yes             # a driver whose MIG device handle answers for its instance
process_util = 5001 40 25 0 0
[gpu 2]
mig_mode = 1                       # as nvml.h says: not supported on MIG-enabled GPUs
mig = 1 40GiB 10GiB 3g.40gb
""")
    calls = tmp_path / "calls"
    out = drive(libdir, scn, "realtime", until_t=2.0, gap_s=0.3, procs=procs, calls=calls)
    assert out["errors"] == []
    rounds = rounds_of(out, "realtime")
    assert len(rounds) >= 3
    for r in rounds:
        got = util(r, "gpu0")
        assert got == {("3001", "", "sm"): 0.3, ("3001", "", "memory"): 0.1, ("3001", "", "encoder"): 0.0,
                       ("3001", "", "decoder"): 0.05, ("3002", "", "sm"): 0.5, ("3002", "", "memory"): 0.2,
                       ("3002", "", "encoder"): 0.0, ("3002", "", "decoder"): 0.0}
        assert sum(v for (_, _, e), v in got.items() if e == "sm") == pytest.approx(0.8)   # 30 % + 50 %
        assert util(r, "gpu1") == {("5001", "1", "sm"): 0.4, ("5001", "1", "memory"): 0.25,
                                   ("5001", "1", "encoder"): 0.0, ("5001", "1", "decoder"): 0.0}
        assert util(r, "gpu2") == {}
    assert out["describe"]["unavailable_readings"]["gpu2/gi1/process_utilization"] == "Not Supported"
    unavailable = out["describe"]["unavailable_readings"]
    assert not [k for k in unavailable if k.startswith(("gpu0/process", "gpu1/gi1/process"))]
    n = fakenvml.read_calls(calls)
    # One call per GPU (MIG device) and round: the buffer is big enough, no size handshake; gpu2 was
    # asked once (the newer call, then the older) and left alone after NOT_SUPPORTED.
    assert n[NEWER] == 2 * len(rounds) + 1 and n[OLDER] == 1
    assert out["describe"]["process_utilization"].startswith(NEWER + ", 0 read(s) over")


def test_shipped_h100x8_processes_have_utilisation(libdir):
    out = drive(libdir, "h100x8", "realtime,realtime", t0_at=10.0, gap_s=0.3)
    last = out["rounds"][-1]
    for i in range(8):
        got = util(last, f"gpu{i}")
        # One process per GPU takes the whole GPU's figures (gpu_util 97-99 %, decoder 12-14 % at t = 10).
        assert set(got) == {(str(4242 + i), "", e) for e in ("sm", "memory", "encoder", "decoder")}
        assert 0.97 <= got[(str(4242 + i), "", "sm")] <= 0.99 and 0.12 <= got[(str(4242 + i), "", "decoder")] <= 0.14


def test_no_new_sample_gives_no_stale_value_and_no_error(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(2) + SHARED + """
[gpu 0]
process_util = 3001 30 10 0 5 0 1   # samples only while 0 <= t < 1: the process went idle
[gpu 1]
process = 4000 1GiB python3
process_util = 4000 60 30 0 0 0 1   # the only process: from then on the driver answers NOT_FOUND
""")
    out = drive(libdir, scn, "realtime", until_t=3.0, gap_s=0.25)
    assert out["errors"] == []
    rounds = rounds_of(out, "realtime")
    early = [r for r in rounds if r["st"] < 0.8]
    late = [r for r in rounds if r["st"] >= 1.5]
    assert early and late
    assert all(("3001", "", "sm") in util(r, "gpu0") and ("4000", "", "sm") in util(r, "gpu1") for r in early)
    for r in late:
        assert {pid for pid, _, _ in util(r, "gpu0")} == {"3002"}     # 3001's last sample was read already
        assert util(r, "gpu1") == {}
    d = out["describe"]
    assert not [k for k in {**d["unavailable_readings"], **d["retrying_readings"]} if "process_utilization" in k]


def test_older_drivers_use_the_older_call_or_say_neither(libdir, tmp_path):
    scn = write_scenario(tmp_path, f"missing_symbols = {NEWER}\n" + h100s(1) + SHARED)
    calls = tmp_path / "calls"
    out = drive(libdir, scn, "realtime,realtime", gap_s=0.3, calls=calls)
    assert out["errors"] == []
    for r in out["rounds"]:
        got = util(r, "gpu0")
        assert got[("3001", "", "sm")] == 0.3 and got[("3002", "", "sm")] == 0.5 and len(got) == 8
    assert fakenvml.read_calls(calls)[OLDER] == 2
    assert out["describe"]["process_utilization"].startswith(OLDER + ",")

    scn = write_scenario(tmp_path, f"missing_symbols = {NEWER} {OLDER}\n" + h100s(1) + SHARED, "neither.scn")
    out = drive(libdir, scn, "realtime,realtime", gap_s=0.3)
    assert out["errors"] == [] and all(util(r, "gpu0") == {} for r in out["rounds"])
    why = out["describe"]["unavailable_readings"]["gpu0/process_utilization"]
    assert NEWER in why and OLDER in why


def test_the_bound_keeps_the_busiest_and_counts_the_rest(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(1) + SHARED + """
[gpu 0]
process = 3003 1GiB python3
process_util = 3003 10 5 0 0
""")
    calls = tmp_path / "calls"
    out = drive(libdir, scn, "realtime,realtime", gap_s=0.3, calls=calls, extra=["--max-process-samples", "1"])
    assert out["errors"] == []
    for i, r in enumerate(out["rounds"]):
        assert {pid for pid, _, _ in util(r, "gpu0")} == {"3002"}     # 50 % SM: the busiest of three
        [left_out] = [s for s in r["samples"] if s["name"] == LEFT_OUT]
        assert left_out["value"] == 2.0 * (i + 1) and left_out["kind"] == "counter"
        assert left_out["labels"]["device"] == "gpu0"
    # Three samples, room for one: INSUFFICIENT_SIZE with the count, then the call again with room.
    assert fakenvml.read_calls(calls)[NEWER] == 4
    assert out["describe"]["process_utilization"] == f"{NEWER}, 2 read(s) over max_process_samples = 1, " \
                                                     "4 process(es) left out"



def test_each_process_utilisation_at_a_real_collector(libdir, procs, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector")
    cfg = tmp_path / "a.toml"
    cfg.write_text(FAST_NO_EBPF)
    scn = write_scenario(tmp_path, h100s(1) + SHARED)
    procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr, "--node-id", "shared-gpu"],
          "agent", env=fakenvml.env(libdir, scn))

    def shares():
        n = next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "shared-gpu"), None)
        got = {(s["labels"]["pid"], s["labels"]["engine"]): s["value"]
               for s in (series(n, UTIL, device="gpu0") if n else [])}
        return got if len(got) == 8 else None

    got = wait_until(shares, timeout_s=60, what="both processes' utilisation at the collector")
    assert got[("3001", "sm")] == 0.3 and got[("3002", "sm")] == 0.5
    assert got[("3001", "memory")] + got[("3002", "memory")] == pytest.approx(0.3)
