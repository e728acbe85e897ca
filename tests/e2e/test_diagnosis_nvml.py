"""Diagnosis rules on what the real NVML source reads from the fake libnvidia-ml: the
source's samples of a thermal slowdown, of memory at 97% and of a healthy GPU, replayed into the
Diagnoser on a simulated timeline (realtime readings every second, nearline every 15 s), so the
rules judge the values and labels the source really emits without minutes of waiting."""

from __future__ import annotations

import json
import sys

from helpers import ROOT, diagnosis_states, replay_rounds

from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.rules.clocks import ClocksHeldDown
from xpusense.agent.diagnosis.rules.memory import MemoryPressure
from xpusense.agent.sources.base import Sample

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, rounds_of, write_scenario  # noqa: E402

S = 1_000_000_000
T0 = 1_800_000_000 * S


def source_samples(libdir, tmp_path, name: str, **values: str) -> tuple[list[Sample], list[Sample]]:
    """(realtime, nearline) samples of one H100 as the NVML source reads the scenario."""
    scn = write_scenario(tmp_path, h100s(1, **values) + "process = 4242 70GiB python3\n", name=f"{name}.scn")
    out = drive(libdir, scn, "realtime,realtime,nearline", t0_at=None)
    assert out["errors"] == []
    [_, rt], [nl] = rounds_of(out, "realtime"), rounds_of(out, "nearline")
    return samples_of(rt), samples_of(nl)


def samples_of(rnd: dict) -> list[Sample]:
    return [Sample(s["name"], float(s["value"]), s["unit"], dict(s["labels"]), s["kind"]) for s in rnd["samples"]]


def test_a_thermal_slowdown_read_through_nvml_opens_clocks_held_down_and_its_end_closes_it(libdir, tmp_path):
    hot = source_samples(libdir, tmp_path, "hot", clocks_event_reasons="0x40", gpu_util="95", sm_clock_mhz="1200",
                         gpu_temp_c="91")
    cool = source_samples(libdir, tmp_path, "cool", clocks_event_reasons="0", gpu_util="95")
    d = Diagnoser([ClocksHeldDown(), MemoryPressure()], open_after_s=30, close_after_s=60, check_every_s=5)
    assert replay_rounds(d, 0, 300, cool, T0) == []
    events = replay_rounds(d, 300, 600, hot, T0)
    assert diagnosis_states(events) == [("clocks_held_down", "gpu0", "open")]
    e = events[0]
    assert 375 * S <= e.time_ns - T0 <= 380 * S     # readings 300..345 cover the minute, then 30 s
    assert e.attributes["throttle.reasons"] == "hw_thermal_slowdown"
    assert "hw_thermal_slowdown" in e.attributes["diagnosis.cause"] and "SM clock 1200 MHz" in e.attributes["diagnosis.cause"]
    evidence = json.loads(e.attributes["diagnosis.evidence"])
    assert [x["series"] for x in evidence] == ["xpusense.accelerator.throttle", "hw.gpu.utilization",
                                               "xpusense.accelerator.clock.frequency"]
    assert evidence[0]["labels"]["reason"] == "hw_thermal_slowdown" and set(evidence[0]["values"]) == {1.0}
    assert evidence[0]["labels"] == {"device": "gpu0", "vendor": "nvidia", "reason": "hw_thermal_slowdown"}
    assert set(evidence[1]["values"]) == {0.95}
    events = replay_rounds(d, 600, 800, cool, T0)
    assert diagnosis_states(events) == [("clocks_held_down", "gpu0", "closed")]
    assert 655 * S <= events[0].time_ns - T0 <= 660 * S


def test_memory_at_97_percent_read_through_nvml_opens_memory_pressure_and_closes_below_90(libdir, tmp_path):
    # usable = 81559 - 551 MiB reserved = 81008 MiB; 97% of it used
    full = source_samples(libdir, tmp_path, "full", mem_used="78578MiB")
    half = source_samples(libdir, tmp_path, "half", mem_used="40GiB")
    d = Diagnoser([ClocksHeldDown(), MemoryPressure()], open_after_s=30, close_after_s=60, check_every_s=5)
    assert replay_rounds(d, 0, 300, half, T0) == []
    events = replay_rounds(d, 300, 600, full, T0)
    assert diagnosis_states(events) == [("device_memory_pressure", "gpu0", "open")]
    e = events[0]
    assert 385 * S <= e.time_ns - T0 <= 395 * S    # the minute at 97% from 300, then 30 s
    assert e.attributes["process.pid"] == "4242" and "pid 4242 70.0 GiB" in e.attributes["diagnosis.cause"]
    assert "device memory at 97% of usable" in e.attributes["diagnosis.cause"]
    evidence = json.loads(e.attributes["diagnosis.evidence"])
    assert evidence[0]["series"] == "hw.gpu.memory.utilization"
    assert all(0.969 <= v <= 0.971 for v in evidence[0]["values"])
    assert evidence[1]["labels"]["pid"] == "4242"
    events = replay_rounds(d, 600, 800, half, T0)
    assert diagnosis_states(events) == [("device_memory_pressure", "gpu0", "closed")]
    assert 655 * S <= events[0].time_ns - T0 <= 665 * S
