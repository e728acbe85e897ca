"""What `nodes` and `top` print for a node with accelerators."""

from __future__ import annotations

from xpusense.collector.views import accelerators, render_table


def s(name, value, **labels):
    return {"name": name, "value": value, "labels": labels, "unit": "", "kind": "gauge"}


NODE = {
    "node_id": "n1", "connected": True, "stale": False, "last_seen_age_s": 0.4, "events": [
        {"type": "checkpoint_request", "severity": "warning", "device": "gpu1", "message": "HBM high",
         "time": "2026-11-29T17:00:00.000+00:00"}],
    "inventory": {"resources": [{"type": "GPU", "id": "gpu1", "vendor": "nvidia", "model": "H100-80GB-HBM3"},
                                {"type": "CPU", "id": "", "vendor": "x86_64", "model": "EPYC"}]},
    "series": [
        s("system.cpu.utilization", 0.25, state="idle"), s("system.memory.utilization", 0.5),
        s("hw.gpu.utilization", 0.97, device="gpu1", vendor="nvidia"),
        s("hw.gpu.memory.utilization", 0.81, device="gpu1", vendor="nvidia"),
        s("xpusense.accelerator.hbm.bandwidth.utilization", 0.92, device="gpu1", vendor="nvidia"),
        s("hw.power", 612.4, device="gpu1", vendor="nvidia"),
        s("hw.temperature", 58, device="gpu1", vendor="nvidia", sensor="chip"),
        s("hw.temperature", 66, device="gpu1", vendor="nvidia", sensor="hbm"),
        s("hw.gpu.memory.usage", 1.0, device="gpu1", vendor="nvidia", mig_instance="3"),
        s("hw.gpu.utilization", 0.10, device="npu0-0", vendor="huawei"),
    ],
}


def test_accelerator_rows_take_the_device_series():
    rows = {r["device"]: r for r in accelerators(NODE)}
    assert rows["gpu1"] == {"device": "gpu1", "vendor": "nvidia", "model": "H100-80GB-HBM3", "util": "97%",
                            "hbm_bw": "92%", "hbm": "81%", "power": "612W", "temp": "58C"}
    assert rows["npu0-0"]["util"] == "10%" and rows["npu0-0"]["vendor"] == "huawei"


def test_table_shows_host_accelerators_and_events_within_80_columns():
    out = render_table([NODE], width=80)
    assert "n1" in out and " 75% " in out and " 50% " in out
    assert "gpu1" in out and "612W" in out and "checkpoint_request" in out
    assert all(len(line) <= 80 for line in out.splitlines())
