"""The diagnosis engine and the memory-pressure rule on simulated time (no sleeps, exact events)."""

from __future__ import annotations

import json

import pytest

from xpusense.agent.config import load_agent
from xpusense.agent.diagnosis.base import Context, Evidence, Finding, Rule
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.recent import Recent, Series, counter_rate, histogram_quantile
from xpusense.agent.diagnosis.registry import build_diagnoser
from xpusense.agent.diagnosis.rules.memory import MemoryPressure
from xpusense.agent.sources.base import COUNTER, HISTOGRAM, Sample

S = 1_000_000_000
T0 = 1_800_000_000 * S


def mem(t_s: float, ratio: float, device: str = "gpu0") -> list[Sample]:
    t = T0 + int(t_s * S)
    return [Sample("hw.gpu.memory.utilization", ratio, "1", {"device": device}, time_ns=t),
            Sample("xpusense.accelerator.process.memory.usage", ratio * 80 * 2**30, "By",
                   {"device": device, "pid": "4242"}, time_ns=t)]


def run(d: Diagnoser, start_s: int, end_s: int, ratio_at) -> list:
    events = []
    for t in range(start_s, end_s):
        events += d.observe(mem(t, ratio_at(t)))
    return events


def test_memory_pressure_opens_once_with_evidence_and_closes_once_it_ends():
    d = Diagnoser([MemoryPressure(threshold=0.95, clear_below=0.90, window_s=60)], open_after_s=30,
                  close_after_s=60, check_every_s=1)
    # 10 minutes of a healthy node (memory swinging 40-90%): nothing opens.
    assert run(d, 0, 600, lambda t: 0.4 + 0.5 * ((t % 37) / 36)) == []
    # Memory at 97% from t=600: the window (60 s) fills at 660, then it must hold 30 s more.
    events = run(d, 600, 1000, lambda t: 0.97)
    assert [e.attributes["diagnosis.state"] for e in events] == ["open"]
    e = events[0]
    assert e.type == "diagnosis" and e.device == "gpu0" and e.severity == "warning"
    assert 690 * S <= e.time_ns - T0 <= 692 * S
    assert e.attributes["diagnosis.rule"] == "device_memory_pressure"
    assert e.attributes["process.pid"] == "4242" and "pid 4242" in e.attributes["diagnosis.cause"]
    evidence = json.loads(e.attributes["diagnosis.evidence"])
    assert evidence[0]["series"] == "hw.gpu.memory.utilization" and evidence[0]["labels"] == {"device": "gpu0"}
    assert evidence[0]["window_s"] == 60 and set(evidence[0]["values"]) == {0.97}
    # Down to 92%: above clear_below, still open (hysteresis on the threshold); then 50%: closes 60 s later.
    assert run(d, 1000, 1100, lambda t: 0.92) == []
    events = run(d, 1100, 1300, lambda t: 0.5)
    assert [x.attributes["diagnosis.state"] for x in events] == ["closed"]
    assert events[0].attributes["diagnosis.id"] == e.attributes["diagnosis.id"]
    assert events[0].time_ns - T0 == 1159 * S   # last seen at 1099 (the window still held 92%), + 60 s
    assert d.open_now() == [] and (d.opened, d.closed) == (1, 1)


def test_a_finding_that_comes_and_goes_opens_nothing():
    class Flapping(Rule):
        name, reads = "flap", ("x",)

        def check(self, recent, now_ns, held):
            on = ((now_ns - T0) // S) % 20 < 10   # 10 s on, 10 s off
            return [Finding("flap", "gpu0", "s", "c", "r", ())] if on else []
    d = Diagnoser([Flapping()], open_after_s=30, close_after_s=60, check_every_s=1)
    events = []
    for t in range(0, 600):
        events += d.observe([Sample("x", 1.0, "1", time_ns=T0 + t * S)])
    assert events == [] and d.opened == 0


def test_a_failing_rule_keeps_its_open_diagnoses_and_the_others_run():
    class Boom(Rule):
        name, reads = "boom", ("x",)
        fail = False

        def check(self, recent, now_ns, held):
            if self.fail:
                raise RuntimeError("bug")
            return [Finding("boom", "gpu1", "s", "c", "r", (Evidence("x", {}, (1.0,), 1.0, "x"),))]
    boom = Boom()
    d = Diagnoser([boom, MemoryPressure(window_s=10)], open_after_s=0, close_after_s=5, check_every_s=1)
    events = run(d, 0, 5, lambda t: 0.5)
    assert [e.device for e in events] == ["gpu1"]
    boom.fail = True
    events = run(d, 5, 40, lambda t: 0.99)
    assert [(e.device, e.attributes["diagnosis.state"]) for e in events] == [("gpu0", "open")]
    assert d.rule_errors >= 30 and {f.device for f in d.open_now()} == {"gpu0", "gpu1"}


def test_open_diagnoses_are_bounded_and_the_excess_counted():
    class Many(Rule):
        name, reads = "many", ("x",)

        def check(self, recent, now_ns, held):
            return [Finding("many", f"gpu{i}", "s", "c", "r", ()) for i in range(10)]
    d = Diagnoser([Many()], open_after_s=0, close_after_s=5, check_every_s=1, max_open=4)
    events = []
    for t in range(3):
        events += d.observe([Sample("x", 1.0, "1", time_ns=T0 + t * S)])
    assert len(events) == 4 and d.refused == 6 * 3 and len(d.open_now()) == 4


def test_recent_keeps_only_what_rules_read_within_its_bounds():
    r = Recent({"a"}, keep_s=10, max_series=2, max_points_per_series=5)
    for t in range(20):
        r.add([Sample("a", t, "1", {"i": str(i)}, time_ns=T0 + t * S) for i in range(3)] +
              [Sample("b", t, "1", time_ns=T0 + t * S)])
    assert r.dropped_series == 20 and r.dropped_points == 15 * 2
    [s0, s1] = r.window("a", T0 + 19 * S, 100)
    assert s0.values == [15, 16, 17, 18, 19] and r.window("b", T0 + 19 * S, 100) == []
    c = [Sample("c", v, "1", kind=COUNTER, time_ns=T0 + i * S) for i, v in enumerate([10, 20, 5, 15])]
    r2 = Recent({"c", "h"})
    r2.add(c)
    assert counter_rate(r2.window("c", T0 + 3 * S, 10)[0]) == (10 + 5 + 10) / 3
    h = [Sample("h", 0, "s", kind=HISTOGRAM, bounds=(0.001, 0.01, 0.1), counts=cnt, time_ns=T0 + i * S)
         for i, cnt in enumerate([(5, 5, 5, 5), (100, 190, 199, 200)])]
    r2.add(h)
    [hs] = r2.window("h", T0 + 2 * S, 10)
    # Counted in the window, per bucket: 95, 90, 9, 1 (0 past 0.1). Interpolated inside the bucket.
    assert histogram_quantile(hs, 0.5) == (pytest.approx(0.001 + 0.009 * 2.5 / 90), 195)
    assert histogram_quantile(hs, 0.99) == (pytest.approx(0.01 + 0.09 * (193.05 - 185) / 9), 195)
    # A lone point: what it counted since the probe started; the top one past the last bound reads as it.
    assert histogram_quantile(Series("h", {}, [h[1]]), 1.0) == (pytest.approx(0.1), 200)


def test_the_config_builds_every_enabled_rule():
    cfg = load_agent(None, env={})
    d = build_diagnoser(cfg.diagnosis, Context())
    assert d is not None and "device_memory_pressure" in {r.name for r in d.rules}
    cfg.diagnosis.device_memory_pressure.enabled = False
    assert "device_memory_pressure" not in {r.name for r in build_diagnoser(cfg.diagnosis, Context()).rules}
    cfg.diagnosis.enabled = False
    assert build_diagnoser(cfg.diagnosis, Context()) is None
