"""Values as drivers of different generations answer them, through pynvml's
ctypes code and the fake: field values read by their valueType, impossible temperatures dropped, the
newest temperature and throttle calls the driver has."""

from __future__ import annotations

import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, pick, write_scenario  # noqa: E402

HBM = {"sensor": "hbm"}


def test_memory_temperature_by_value_type_and_range(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(7) + """
[gpu 0]
field_type = 82:sint
[gpu 1]
field_type = 82:double
[gpu 2]
field_type = 82:ushort
[gpu 3]
field_type = 82:9          # a value type newer than the agent: not guessed at
[gpu 4]
mem_temp_c = 0             # nvbug 4300930: drivers report 0 for the memory sensor of some parts
[gpu 5]
mem_temp_c = 250           # DCGM rejects memory temperatures above 200 C
[gpu 6]
field_type = 82:sll
""")
    out = drive(libdir, scn, "offline,offline", gap_s=0.1, t0_at=None)
    assert out["errors"] == []
    for r in out["rounds"]:
        assert pick(r, "hw.temperature", **HBM) == {"gpu0": 68, "gpu1": 68, "gpu2": 68, "gpu6": 68}
        assert set(pick(r, "hw.temperature", sensor="chip")) == {f"gpu{i}" for i in range(7)}
    d = out["describe"]
    assert "value type 9" in d["unavailable_readings"]["gpu3/hbm_temperature"]
    assert "nvbug 4300930" in d["dropped_values"]["gpu4/hw.temperature{sensor=hbm}"]
    assert "outside" in d["dropped_values"]["gpu5/hw.temperature{sensor=hbm}"]
    assert d["calls"]["temperature"] == "nvmlDeviceGetTemperatureV"


def test_chip_temperature_on_drivers_before_and_after_the_versioned_call(libdir, tmp_path):
    # Before R570 there is no nvmlDeviceGetTemperatureV; CUDA 14 drops nvmlDeviceGetTemperature.
    for missing, used in (("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                          ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV")):
        scn = write_scenario(tmp_path, f"missing_symbols = {missing}\n" + h100s(2), name=f"{missing}.scn")
        out = drive(libdir, scn, "offline,offline", gap_s=0.1, t0_at=None)
        assert out["errors"] == []
        assert all(pick(r, "hw.temperature", sensor="chip") == {"gpu0": 60, "gpu1": 60} for r in out["rounds"])
        assert out["describe"]["calls"]["temperature"] == used
        assert not any("temperature" in k for k in out["describe"]["unavailable_readings"])


def test_throttle_reasons_on_drivers_before_nvml_12_2(libdir, tmp_path):
    # R525/R530: no nvmlDeviceGetCurrentClocksEventReasons; the older call has the same bits.
    scn = write_scenario(tmp_path, "missing_symbols = nvmlDeviceGetCurrentClocksEventReasons\n"
                         + h100s(1, clocks_event_reasons="0x34"))   # SwPowerCap | SyncBoost | SwThermalSlowdown
    out = drive(libdir, scn, "nearline", t0_at=None)
    r = out["rounds"][0]
    flags = {s["labels"]["reason"]: s["value"] for s in r["samples"] if s["name"] == "xpusense.accelerator.throttle"}
    assert flags == {"applications_clocks_setting": 0.0, "sw_power_cap": 1.0, "hw_slowdown": 0.0, "sync_boost": 1.0,
                     "sw_thermal_slowdown": 1.0, "hw_thermal_slowdown": 0.0, "hw_power_brake_slowdown": 0.0}
    assert out["describe"]["calls"]["throttle"] == "nvmlDeviceGetCurrentClocksThrottleReasons"


def test_pcie_is_kib_per_s_and_what_power_means_is_in_the_inventory(libdir, tmp_path):
    out = drive(libdir, write_scenario(tmp_path, h100s(1)), "nearline", t0_at=None)
    # pcie_rx_kbps = 2,000,000 "KB/s" (a 20 ms snapshot): KiB, as GPM's MiB/s of the same counter.
    assert pick(out["rounds"][0], "xpusense.accelerator.pcie.throughput", direction="receive") == {"gpu0": 2e6 * 1024}
    assert out["inventory"][0]["attributes"]["power_reading"] == "1s_average"
    a100 = drive(libdir, "a100x4", "nearline", t0_at=None)
    assert {r["attributes"]["power_reading"] for r in a100["inventory"]} == {"instantaneous"}   # GA100
