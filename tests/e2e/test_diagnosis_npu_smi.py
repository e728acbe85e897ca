"""clocks_held_down on what the real npu-smi source reads from the fake npu-smi: an Ascend
910B4 whose AI Core runs below its rated clock while busy (`npu-smi info -t common`, nearline) and
whose AI Core usage is high (`-t usages`, realtime). The source's samples are replayed into the
Diagnoser on a simulated timeline (realtime every second, nearline every 15 s), so the rule judges
the values and labels the source really emits without minutes of waiting."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import ROOT, diagnosis_states, replay_rounds

from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.rules.clocks import ClocksHeldDown
from xpusense.agent.sources.base import NEARLINE, REALTIME, Sample
from xpusense.agent.sources.npu_smi.source import NpuSmiSource

FAKE = ROOT / "tests/fakes/npu-smi/npu-smi"
SCENARIO = ROOT / "tests/fixtures/npu-smi/scenario-8x910B4"
GENEROUS_S = 120.0
S = 1_000_000_000
T0 = 1_800_000_000 * S
CUR = "\tAicore curFreq(MHZ)            : 1000\n"


def set_line(path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


@pytest.fixture
def scenario(tmp_path, monkeypatch):
    """The 8x 910B4 scenario with NPU 2 busy (AI Core 95%); NPU 1 stays at its 20%."""
    d = tmp_path / "scenario"
    shutil.copytree(SCENARIO, d)
    monkeypatch.setenv("FAKE_NPU_SMI_DIR", str(d))
    for k in ("FAKE_NPU_SMI_DELAY_S", "FAKE_NPU_SMI_DELAY_ON", "FAKE_NPU_SMI_T0", "FAKE_NPU_SMI_NOW", "FAKE_NPU_SMI_LOG"):
        monkeypatch.delenv(k, raising=False)
    set_line(d / "usages-2.txt", "\tAicore Usage Rate(%)           : 30\n", "\tAicore Usage Rate(%)           : 95\n")
    return d


def read(src: NpuSmiSource) -> tuple[list[Sample], list[Sample]]:
    """(realtime, nearline) samples of one round each, as the source emits them."""
    return src.collect(REALTIME), src.collect(NEARLINE)


def clocks(samples: list[Sample], device: str) -> dict[str, float]:
    return {s.labels["clock"]: s.value for s in samples
            if s.name == "xpusense.accelerator.clock.frequency" and s.labels["device"] == device}


def test_ai_core_below_rated_while_busy_opens_clocks_held_down_and_back_at_rated_closes_it(scenario):
    src = NpuSmiSource(path=str(FAKE), timeout_s=GENEROUS_S, nearline_timeout_s=GENEROUS_S)
    src.setup()
    try:
        rated = read(src)
        # NPU 2 (busy) and NPU 1 (20%: not busy) held at 600 MHz of their rated 1000
        for n in (1, 2):
            set_line(scenario / f"common-{n}.txt", CUR, CUR.replace("1000", "600"))
        held = read(src)
    finally:
        src.close()
    assert clocks(rated[1], "npu2-0") == {"aicore": 1000e6, "aicore_rated": 1000e6}
    assert clocks(held[1], "npu2-0") == {"aicore": 600e6, "aicore_rated": 1000e6}
    assert clocks(held[1], "npu1-0")["aicore"] == 600e6
    busy = {s.labels["device"]: s.value for s in held[0] if s.name == "hw.gpu.utilization"}
    assert busy["npu2-0"] == 0.95 and busy["npu1-0"] == 0.20

    d = Diagnoser([ClocksHeldDown()], open_after_s=30, close_after_s=60, check_every_s=5)
    assert replay_rounds(d, 0, 300, rated, T0) == []
    events = replay_rounds(d, 300, 600, held, T0)
    assert diagnosis_states(events) == [("clocks_held_down", "npu2-0", "open")]     # not npu1-0: it is not busy
    e = events[0]
    assert 375 * S <= e.time_ns - T0 <= 380 * S     # readings 300..345 cover the minute, then 30 s
    assert e.attributes["diagnosis.cause"].startswith("AI Core at 600 MHz, 60% of its rated 1000 MHz while busy")
    assert "npu-smi info -t power" in e.attributes["diagnosis.remedy"]
    evidence = json.loads(e.attributes["diagnosis.evidence"])
    assert [(x["series"], x["labels"]) for x in evidence] == [
        ("xpusense.accelerator.clock.frequency", {"device": "npu2-0", "vendor": "huawei", "clock": "aicore"}),
        ("xpusense.accelerator.clock.frequency", {"device": "npu2-0", "vendor": "huawei", "clock": "aicore_rated"}),
        ("hw.gpu.utilization", {"device": "npu2-0", "vendor": "huawei"}),
    ]
    assert set(evidence[0]["values"]) == {600e6} and len(evidence[0]["values"]) >= 4
    assert set(evidence[1]["values"]) == {1000e6} and set(evidence[2]["values"]) == {0.95}
    assert evidence[0]["summary"].startswith("AI Core at most 600 MHz for ")
    assert evidence[1]["summary"] == "AI Core rated 1000 MHz"

    events = replay_rounds(d, 600, 800, rated, T0)
    assert diagnosis_states(events) == [("clocks_held_down", "npu2-0", "closed")]
    assert events[0].attributes["diagnosis.id"] == e.attributes["diagnosis.id"]
    assert 655 * S <= events[0].time_ns - T0 <= 660 * S    # last found at 595 (checks every 5 s), absent 60 s
