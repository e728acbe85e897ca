"""Each diagnosis rule on simulated time: it opens with the evidence expected and closes once its
condition ends; and no registered rule fires on a healthy node over 10 minutes."""

from __future__ import annotations

import json
from collections.abc import Callable

from xpusense.agent.config import load_agent
from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.jobs import parse_cgroup_v2
from xpusense.agent.diagnosis.registry import FAMILIES, build_diagnoser
from xpusense.agent.diagnosis.rules.clocks import REASONS, ClocksHeldDown
from xpusense.agent.diagnosis.rules.cpu_starvation import CpuStarvation
from xpusense.agent.sources.base import COUNTER, HISTOGRAM, Sample
from xpusense.probes.specs import log2_bounds_s

S = 1_000_000_000
T0 = 1_800_000_000 * S
BOUNDS = log2_bounds_s(32)          # as the runqlat probe reports them: 1 ns, 2 ns, 4 ns ... (seconds)
JOB_CGROUP = "/kubepods.slice/pod-abc/cri-job"


def at(t: float) -> int:
    return T0 + int(t * S)


def gpu_samples(t: int, util: float, reasons: int = 0, device: str = "gpu0", mem: float = 0.5) -> list[Sample]:
    """One second of an NVIDIA GPU as the NVML source reports it: utilisation and memory every second,
    throttle reasons (bits as in readings.THROTTLE_REASONS order of REASONS) and SM clock every 15 s."""
    lab = {"device": device}
    out = [Sample("hw.gpu.utilization", util, "1", lab, time_ns=at(t)),
           Sample("hw.gpu.memory.utilization", mem, "1", lab, time_ns=at(t))]
    if t % 15 == 0:
        out += [Sample("xpusense.accelerator.throttle", 1.0 if reasons & (1 << i) else 0.0, "1",
                       {**lab, "reason": r}, time_ns=at(t)) for i, r in enumerate(REASONS)]
        out.append(Sample("xpusense.accelerator.clock.frequency", 1980e6 if not reasons else 1410e6, "Hz",
                          {**lab, "clock": "sm"}, time_ns=at(t)))
    return out


THERMAL = 1 << list(REASONS).index("hw_thermal_slowdown")
POWER_CAP = 1 << list(REASONS).index("sw_power_cap")


def npu_samples(t: int, util: float, aicore_mhz: float, device: str = "npu0") -> list[Sample]:
    lab = {"device": device}
    out = [Sample("hw.gpu.utilization", util, "1", lab, time_ns=at(t))]
    if t % 15 == 0:
        out += [Sample("xpusense.accelerator.clock.frequency", aicore_mhz * 1e6, "Hz", {**lab, "clock": "aicore"},
                       time_ns=at(t)),
                Sample("xpusense.accelerator.clock.frequency", 1000e6, "Hz", {**lab, "clock": "aicore_rated"},
                       time_ns=at(t))]
    return out


class RunQueue:
    """A cgroup's cumulative run-queue latency histogram (log2 buckets), as the runqlat probe reports it."""

    def __init__(self, cgroup: str):
        self.cgroup = cgroup
        self.slots = [0] * (len(BOUNDS) + 1)

    def add(self, waits: int, latency_s: float) -> None:
        i = next(i for i, b in enumerate(BOUNDS) if latency_s <= b)
        self.slots[i] += waits

    def sample(self, t: float) -> Sample:
        counts, total = [], 0
        for c in self.slots:
            total += c
            counts.append(total)
        return Sample("xpusense.sched.runqueue.latency", 0.0, "s", {"cgroup": self.cgroup}, HISTOGRAM,
                      time_ns=at(t), bounds=BOUNDS, counts=tuple(counts))


def tick(t: int) -> Sample:
    """Some sample every simulated second (the engine's clock is the newest sample's time)."""
    return Sample("system.cpu.utilization", 0.5, "1", time_ns=at(t))


def job_context(tmp_path, pid: int = 4242, cgroup: str = JOB_CGROUP, device: str = "gpu0") -> Context:
    (tmp_path / str(pid)).mkdir(parents=True)
    (tmp_path / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
    return Context(processes=lambda: {pid: {device}, 999999: {device}}, procfs=str(tmp_path))   # 999999: ended


def states(events) -> list[tuple[str, str]]:
    return [(e.device, e.attributes["diagnosis.state"]) for e in events]


def feed(d: Diagnoser, start: int, end: int, make: Callable[[int], list[Sample]]) -> list:
    events = []
    for t in range(start, end):
        events += d.observe(make(t))
    return events


# ------------------------------------------------------------------------------------------ clocks_held_down

def test_clocks_held_down_by_a_thermal_slowdown_while_busy_opens_and_closes():
    d = Diagnoser([ClocksHeldDown(window_s=60, busy_above=0.5)], open_after_s=30, close_after_s=60, check_every_s=5)
    assert feed(d, 0, 600, lambda t: gpu_samples(t, 0.9)) == []
    # The thermal slowdown from t = 600 to 900 (readings every 15 s), the GPU busy throughout.
    events = feed(d, 600, 900, lambda t: gpu_samples(t, 0.9, THERMAL))
    assert states(events) == [("gpu0", "open")]
    e = events[0]
    # readings at 600..645 cover the 60 s window (45 s span + one interval): found at 645, open 30 s later
    assert 675 * S <= e.time_ns - T0 <= 680 * S
    assert e.attributes["diagnosis.rule"] == "clocks_held_down"
    assert "hw_thermal_slowdown" in e.attributes["diagnosis.cause"] and "sw_power_cap" not in e.attributes["diagnosis.cause"]
    assert "cooling" in e.attributes["diagnosis.remedy"] and "nvidia-smi -rac" in e.attributes["diagnosis.remedy"]
    assert e.attributes["throttle.reasons"] == "hw_thermal_slowdown" and "SM clock 1410 MHz" in e.message
    evidence = json.loads(e.attributes["diagnosis.evidence"])
    assert evidence[0]["series"] == "xpusense.accelerator.throttle"
    assert evidence[0]["labels"] == {"device": "gpu0", "reason": "hw_thermal_slowdown"}
    assert set(evidence[0]["values"]) == {1.0} and len(evidence[0]["values"]) >= 4
    assert evidence[1]["series"] == "hw.gpu.utilization" and set(evidence[1]["values"]) == {0.9}
    # Cleared at the reading of t = 900: last found at 895, closed 60 s later.
    events = feed(d, 900, 1100, lambda t: gpu_samples(t, 0.9))
    assert states(events) == [("gpu0", "closed")]
    assert 955 * S <= events[0].time_ns - T0 <= 960 * S
    assert events[0].attributes["diagnosis.id"] == e.attributes["diagnosis.id"]


def test_clocks_held_down_needs_the_device_busy_and_the_reason_sustained():
    d = Diagnoser([ClocksHeldDown(window_s=60, busy_above=0.5)], open_after_s=30, close_after_s=60, check_every_s=5)
    # An idle GPU at its power cap for 10 minutes, then a busy one capped 5 s of every 30: nothing.
    assert feed(d, 0, 600, lambda t: gpu_samples(t, 0.1, POWER_CAP)) == []
    assert feed(d, 600, 1200, lambda t: gpu_samples(t, 0.95, POWER_CAP if t % 30 < 5 else 0)) == []
    # A reason the config leaves out does not count.
    d2 = Diagnoser([ClocksHeldDown(reasons=("hw_thermal_slowdown",))], open_after_s=30, check_every_s=5)
    assert feed(d2, 0, 600, lambda t: gpu_samples(t, 0.95, POWER_CAP)) == []
    assert states(feed(d2, 600, 800, lambda t: gpu_samples(t, 0.95, POWER_CAP | THERMAL))) == [("gpu0", "open")]


def test_ascend_aicore_below_its_rated_frequency_while_busy_opens_and_closes():
    d = Diagnoser([ClocksHeldDown(window_s=60, busy_above=0.5, min_clock_ratio=0.95)], open_after_s=30,
                  close_after_s=60, check_every_s=5)
    assert feed(d, 0, 600, lambda t: npu_samples(t, 0.9, 1000)) == []
    assert feed(d, 600, 900, lambda t: npu_samples(t, 0.2, 800)) == [], "idle at a low clock is no finding"
    events = feed(d, 900, 1200, lambda t: npu_samples(t, 0.9, 800))
    assert states(events) == [("npu0", "open")]
    e = events[0]
    assert "AI Core at 800 MHz, 80% of its rated 1000 MHz" in e.attributes["diagnosis.cause"]
    ev = json.loads(e.attributes["diagnosis.evidence"])
    assert ev[0]["labels"] == {"device": "npu0", "clock": "aicore"} and set(ev[0]["values"]) == {800e6}
    assert ev[1]["labels"]["clock"] == "aicore_rated"
    events = feed(d, 1200, 1400, lambda t: npu_samples(t, 0.9, 1000))
    assert states(events) == [("npu0", "closed")]
    assert 1245 * S <= events[0].time_ns - T0 <= 1260 * S


# ------------------------------------------------------------------------------------------ cpu_starvation

def test_cpu_starvation_of_a_jobs_cgroup_opens_per_device_and_cgroup_and_closes(tmp_path):
    job, neighbour = RunQueue(JOB_CGROUP), RunQueue("/system.slice/backup.service")

    def node(t: int, starved: bool) -> list[Sample]:
        if t % 15:
            return [tick(t)]
        job.add(3000, 20e-6)
        if starved:
            job.add(40, 12e-3)      # 40 of 3040 waits (1.3%) at 12 ms: the p99 is there once every reading is so
        neighbour.add(500, 30e-3)    # not a job's cgroup: never a finding
        return [job.sample(t), neighbour.sample(t)]

    d = Diagnoser([CpuStarvation(job_context(tmp_path), p99_above_ms=5, clear_below_ms=2.5, window_s=60)],
                  open_after_s=30, close_after_s=60, check_every_s=5)
    assert feed(d, 0, 600, lambda t: node(t, False)) == []
    events = feed(d, 600, 900, lambda t: node(t, True))
    assert states(events) == [("gpu0", "open")]
    e = events[0]
    # the increments at 600, 615 and 630 all starved (1.3%): found at 635, opened 30 s later
    assert 665 * S <= e.time_ns - T0 <= 670 * S
    assert e.attributes["cgroup"] == JOB_CGROUP and e.attributes["process.pid"] == "4242"
    assert "p99 10.4 ms" in e.attributes["diagnosis.cause"]   # interpolated in (8.4, 16.8] ms and "cpuset" in e.attributes["diagnosis.remedy"]
    [ev] = json.loads(e.attributes["diagnosis.evidence"])
    assert ev["series"] == "xpusense.sched.runqueue.latency" and ev["labels"] == {"cgroup": JOB_CGROUP}
    assert "over 9120 waits" in ev["summary"] or "over 12160 waits" in ev["summary"]   # 3 or 4 readings' worth
    events = feed(d, 900, 1100, lambda t: node(t, False))
    assert states(events) == [("gpu0", "closed")]
    assert events[0].attributes["cgroup"] == JOB_CGROUP


def test_cpu_starvation_needs_enough_waits_and_reads_the_cgroup_v2_line(tmp_path):
    assert parse_cgroup_v2("12:cpu,cpuacct:/old\n0::/a/b c\n") == "/a/b c"
    assert parse_cgroup_v2("12:cpu,cpuacct:/old\n") == ""
    job = RunQueue(JOB_CGROUP)

    def few(t: int) -> list[Sample]:
        if t % 15:
            return [tick(t)]
        job.add(5, 50e-3)           # 5 waits a reading, all long: too few to judge (min_waits 50 per window)
        return [job.sample(t)]
    d = Diagnoser([CpuStarvation(job_context(tmp_path), min_waits=50)], open_after_s=30, check_every_s=5)
    assert feed(d, 0, 600, few) == []


# ------------------------------------------------------------------------------------------ all rules, healthy

def test_no_registered_rule_fires_on_a_healthy_node_over_ten_minutes(tmp_path):
    cfg = load_agent(None, env={})
    d = build_diagnoser(cfg.diagnosis, job_context(tmp_path))
    assert d is not None and {r.name for r in d.rules} == {f.name for f in FAMILIES}
    d.open_after_ns, d.check_every_ns = 0, S      # the strictest: any finding at all opens at once
    job = RunQueue(JOB_CGROUP)

    def healthy(t: int) -> list[Sample]:
        out = []
        for i in range(2):   # utilisation swinging with a training step, memory 40-90%, a power cap 5 s a minute
            out += gpu_samples(t, 0.55 + 0.4 * ((t + 7 * i) % 11) / 10, POWER_CAP if t % 60 < 5 else 0,
                               device=f"gpu{i}", mem=0.4 + 0.5 * ((t % 37) / 36))
        out += npu_samples(t, 0.9, 1000)
        if t % 15 == 0:
            job.add(2000, 30e-6)
            job.add(10, 1e-3)
            out.append(job.sample(t))
            rtt = [0] * 21 + [100 * t] * (len(BOUNDS) - 20)     # 100 TCP RTT samples a reading, 1-2 ms
            out.append(Sample("xpusense.network.tcp.rtt", 1.5e-3 * 100 * t, "s", {"remote_region": "peer-dc"},
                              HISTOGRAM, time_ns=at(t), bounds=BOUNDS, counts=tuple(rtt)))
        net = [("xpusense.network.tcp.retransmits", t // 20, {"cgroup": JOB_CGROUP, "family": "ipv4"}),
               ("xpusense.cgroup.network.calls", 2000 * t, {"cgroup": JOB_CGROUP, "direction": "transmit"}),
               ("system.network.packet.count", 40000 * t, {"device": "eth0", "direction": "receive"}),
               ("system.network.packet.dropped", t // 30, {"device": "eth0", "direction": "receive"}),
               ("xpusense.network.interface.driver_errors", t // 60, {"device": "eth0", "counter": "rx_missed_errors"})]
        return out + [Sample(n, float(v), "1", lab, COUNTER, time_ns=at(t)) for n, v, lab in net]

    events = feed(d, 0, 600, healthy)
    assert events == [] and d.opened == 0 and d.rule_errors == 0
