"""Device memory as DCGM reports it: nvmlDeviceGetMemoryInfo_v2 where the driver has
it, reserved memory apart from used, used / (total - reserved); the v1 call on older drivers."""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import drive, h100s, pick, write_scenario  # noqa: E402

MiB, GiB = 2**20, 2**30
TOTAL, RESERVED = 81559 * MiB, 551 * MiB


@pytest.mark.parametrize("used", [0, 40 * GiB])
def test_reserved_memory_is_reported_apart_from_used(libdir, tmp_path, used):
    scn = write_scenario(tmp_path, h100s(1, mem_used=str(used)))
    out = drive(libdir, scn, "realtime", t0_at=None)
    r = out["rounds"][0]
    # An idle H100 shows 0 used, as dcgm-exporter does (not the ~0.5 GiB the v1 call gives).
    assert pick(r, "hw.gpu.memory.usage") == {"gpu0": used}
    assert pick(r, "xpusense.accelerator.memory.reserved") == {"gpu0": RESERVED}
    assert pick(r, "hw.gpu.memory.limit") == {"gpu0": TOTAL}
    assert pick(r, "xpusense.accelerator.memory.free") == {"gpu0": TOTAL - RESERVED - used}
    assert pick(r, "hw.gpu.memory.utilization")["gpu0"] == pytest.approx(used / (TOTAL - RESERVED))
    assert out["describe"]["memory_call"].startswith("nvmlDeviceGetMemoryInfo_v2")


def test_a_driver_without_the_v2_call_gives_v1_memory_and_says_so(libdir, tmp_path):
    scn = write_scenario(tmp_path, "missing_symbols = nvmlDeviceGetMemoryInfo_v2\n" + h100s(1, mem_used="40GiB"))
    out = drive(libdir, scn, "realtime,realtime", t0_at=None)
    assert out["errors"] == []
    for r in out["rounds"]:
        assert pick(r, "hw.gpu.memory.usage") == {"gpu0": 40 * GiB + RESERVED}    # v1: reserved counted as used
        assert pick(r, "xpusense.accelerator.memory.reserved") == {}
        assert pick(r, "hw.gpu.memory.utilization")["gpu0"] == pytest.approx((40 * GiB + RESERVED) / TOTAL)
    assert "v1" in out["describe"]["memory_call"]
    assert not out["describe"]["unavailable_readings"].get("gpu0/memory")
