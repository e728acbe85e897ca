"""What the NVML source reads for the semantic conventions' GPU metrics, through pynvml's
ctypes code and the fake libnvidia-ml: NVENC/NVDEC utilisation (OTLP hw.gpu.utilization with
hw.gpu.task encoder/decoder) and the temperature limits of the chip and HBM sensors (OTLP
hw.temperature.limit); a driver or GPU without them costs only those readings."""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, pick, write_scenario  # noqa: E402

LIMIT = "hw.temperature.limit"


def test_encoder_decoder_utilisation_and_temperature_limits(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(2, enc_util="25", dec_util="0:10 60:70") + """
[gpu 1]
temp_shutdown_c = 90
temp_mem_max_c = 0          # a part without a memory limit: NOT_SUPPORTED
""")
    out = drive(libdir, scn, "nearline,offline", t0_at=30.0)
    assert out["errors"] == []
    near, off = out["rounds"]
    assert pick(near, "xpusense.accelerator.encoder.utilization") == {"gpu0": 0.25, "gpu1": 0.25}
    assert pick(near, "xpusense.accelerator.decoder.utilization")["gpu0"] == pytest.approx(0.40, abs=0.02)
    assert pick(off, LIMIT, sensor="chip", limit="shutdown") == {"gpu0": 92.0, "gpu1": 90.0}
    assert pick(off, LIMIT, sensor="chip", limit="slowdown") == {"gpu0": 89.0, "gpu1": 89.0}
    assert pick(off, LIMIT, sensor="chip", limit="max") == {"gpu0": 87.0, "gpu1": 87.0}
    assert pick(off, LIMIT, sensor="hbm", limit="max") == {"gpu0": 95.0}
    units = {s["unit"] for s in off["samples"] if s["name"] == LIMIT}
    assert units == {"Cel"}
    assert "Not Supported" in out["describe"]["unavailable_readings"]["gpu1/thermal_mem_max"]


def test_a_driver_without_the_calls_loses_only_them(libdir, tmp_path):
    scn = write_scenario(tmp_path, "missing_symbols = nvmlDeviceGetEncoderUtilization nvmlDeviceGetDecoderUtilization "
                                   "nvmlDeviceGetTemperatureThreshold\n" + h100s(1))
    out = drive(libdir, scn, "nearline,offline")
    assert out["errors"] == []
    near, off = out["rounds"]
    assert not pick(near, "xpusense.accelerator.encoder.utilization") and not pick(off, LIMIT)
    assert pick(off, "hw.temperature", sensor="chip") == {"gpu0": 60}
    assert pick(near, "xpusense.accelerator.pcie.throughput", direction="transmit") == {"gpu0": 500000 * 1024.0}
    why = out["describe"]["unavailable_readings"]
    assert {"gpu0/encoder", "gpu0/decoder", "gpu0/thermal_shutdown"} <= set(why)
