"""network_stack on simulated time: TCP retransmits per cgroup, NIC errors and drops per interface and
the TCP round-trip time per remote region each open with their evidence and close once the
condition ends (with a lower bar to close), and a healthy node over 10 minutes opens nothing."""

from __future__ import annotations

import json

import pytest

from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.recent import Series, histogram_quantile
from xpusense.agent.diagnosis.rules.network import NetworkStack
from xpusense.agent.sources.base import COUNTER, HISTOGRAM, Sample
from xpusense.probes.specs import log2_bounds_s

S = 1_000_000_000
T0 = 1_800_000_000 * S
BOUNDS = log2_bounds_s(64)          # as the tcp_rtt probe reports them (ns -> s, log2)
JOB = "/kubepods.slice/pod-abc/cri-job"
BACKUP = "/system.slice/backup.service"
BULK = "/system.slice/bulk.service"


def at(t: float) -> int:
    return T0 + int(t * S)


class Counters:
    """Cumulative counters by (name, labels): add a rate for one second, sample them all."""

    def __init__(self):
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def add(self, name: str, per_s: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self.values[key] = self.values.get(key, 0.0) + per_s

    def samples(self, t: int) -> list[Sample]:
        return [Sample(n, v, "1", dict(lab), COUNTER, time_ns=at(t)) for (n, lab), v in self.values.items()]


class Rtt:
    """A region's cumulative RTT histogram, as the tcp_rtt probe reports it every 15 s."""

    def __init__(self, region: str):
        self.region, self.slots, self.sum = region, [0] * (len(BOUNDS) + 1), 0.0

    def add(self, n: int, rtt_s: float) -> None:
        self.slots[next(i for i, b in enumerate(BOUNDS) if rtt_s <= b)] += n
        self.sum += n * rtt_s

    def sample(self, t: int) -> Sample:
        counts, total = [], 0
        for c in self.slots:
            total += c
            counts.append(total)
        return Sample("xpusense.network.tcp.rtt", self.sum, "s", {"remote_region": self.region}, HISTOGRAM,
                      time_ns=at(t), bounds=BOUNDS, counts=tuple(counts))


def job_context(tmp_path, pid: int = 4242, cgroup: str = JOB, device: str = "gpu3") -> Context:
    (tmp_path / str(pid)).mkdir(parents=True)
    (tmp_path / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
    return Context(processes=lambda: {pid: {device}, 999999: {device}}, procfs=str(tmp_path))   # 999999: ended


def feed(d: Diagnoser, start: int, end: int, make) -> list:
    events = []
    for t in range(start, end):
        events += d.observe(make(t))
    return events


def states(events) -> list[tuple[str, str, str]]:
    return [(e.device, e.attributes.get("cgroup") or e.attributes.get("network.interface.name")
             or e.attributes.get("network.remote_region", ""), e.attributes["diagnosis.state"]) for e in events]


def diagnoser(ctx: Context, **kw) -> Diagnoser:
    return Diagnoser([NetworkStack(ctx, **kw)], open_after_s=30, close_after_s=60, check_every_s=5)


# ------------------------------------------------------------------------------------------ retransmits

def test_tcp_retransmits_of_a_jobs_cgroup_open_on_its_device_stay_above_the_lower_bar_and_close(tmp_path):
    c = Counters()
    rate = {"job": 0.1, "backup": 0.0}

    def node(t: int) -> list[Sample]:
        c.add("xpusense.network.tcp.retransmits", rate["job"], cgroup=JOB, family="ipv4")
        c.add("xpusense.network.tcp.retransmits", 0.0, cgroup=JOB, family="ipv6")
        c.add("xpusense.cgroup.network.calls", 200, cgroup=JOB, direction="transmit")
        c.add("xpusense.cgroup.network.calls", 5000, cgroup=JOB, direction="receive")
        # a bulk transfer retransmitting 20/s of 10,000 sends/s (0.002 per call): no finding
        c.add("xpusense.network.tcp.retransmits", 20, cgroup=BULK, family="ipv4")
        c.add("xpusense.cgroup.network.calls", 10000, cgroup=BULK, direction="transmit")
        # a cgroup with no accelerator job, no send calls counted: judged on its rate alone
        c.add("xpusense.network.tcp.retransmits", rate["backup"], cgroup=BACKUP, family="ipv4")
        return c.samples(t)

    d = diagnoser(job_context(tmp_path), retransmits_per_s_above=5, retransmit_ratio_above=0.01, clear_ratio=0.5)
    assert feed(d, 0, 600, node) == []
    rate["job"] = 20.0
    events = feed(d, 600, 900, node)
    assert states(events) == [("gpu3", JOB, "open")]
    e = events[0]
    # the 60 s rate passes 5/s once 16 readings of 20/s are in the window: found at 615, opened at 645
    assert e.time_ns - T0 == 645 * S
    a = e.attributes
    assert a["diagnosis.rule"] == "network_stack" and a["process.pid"] == "4242"
    assert a["diagnosis.symptom"] == "cross-node gradient sync slow"
    # the window's rate when it opened: 46 s of 20/s and 14 s of 0.1/s
    assert "TCP retransmitting 15.4 segments/s, 0.08 per send call (200.0 sends/s) in cgroup " + JOB in a["diagnosis.cause"]
    assert "4242 on gpu3" in a["diagnosis.cause"]
    assert "GPUDirect RDMA" in a["diagnosis.remedy"] and "MTU" in a["diagnosis.remedy"]
    ev = json.loads(a["diagnosis.evidence"])
    assert ev[0]["series"] == "xpusense.network.tcp.retransmits"
    assert ev[0]["labels"] == {"cgroup": JOB, "family": "ipv4"} and ev[0]["summary"].startswith("15.36 retransmitted")
    assert ev[0]["values"][-1] - ev[0]["values"][-2] == pytest.approx(20.0)
    assert [x["labels"] for x in ev if x["series"] == "xpusense.cgroup.network.calls"] == [
        {"cgroup": JOB, "direction": "transmit"}]
    # 4/s: below the bar to open, above the bar to stay open (2.5/s): stays open
    rate["job"] = 4.0
    assert feed(d, 900, 1100, node) == []
    rate["job"] = 0.0
    events = feed(d, 1100, 1300, node)
    assert states(events) == [("gpu3", JOB, "closed")]
    assert events[0].attributes["diagnosis.id"] == a["diagnosis.id"]
    # the window's rate falls to 2.5/s at about 1124; closed 60 s later
    assert 1180 * S <= events[0].time_ns - T0 <= 1195 * S
    # a cgroup no job runs in: a node-wide finding (no device) for its cgroup
    rate["backup"] = 8.0
    events = feed(d, 1300, 1500, node)
    assert states(events) == [("", BACKUP, "open")]
    assert "process.pid" not in events[0].attributes and "sends/s" not in events[0].attributes["diagnosis.cause"]


def test_retransmits_counted_per_family_only_make_one_node_wide_finding():
    c = Counters()
    d = diagnoser(Context(), retransmits_per_s_above=5)
    assert feed(d, 0, 300, lambda t: (c.add("xpusense.network.tcp.retransmits", 1, family="ipv4"), c.samples(t))[1]) == []
    events = feed(d, 300, 500, lambda t: (c.add("xpusense.network.tcp.retransmits", 30, family="ipv4"),
                                          c.samples(t))[1])
    assert states(events) == [("", "", "open")]
    assert "per family only" in events[0].attributes["diagnosis.cause"] and "cgroup" not in events[0].attributes


# ------------------------------------------------------------------------------------------ NIC errors

def test_nic_errors_and_drops_open_per_interface_counted_once_and_close():
    c = Counters()
    bad = {"on": False}

    def node(t: int) -> list[Sample]:
        for dev, pps in (("eth0", 10000), ("eth1", 1_000_000)):
            for direction in ("receive", "transmit"):
                c.add("system.network.packet.count", pps / 2, device=dev, direction=direction)
                c.add("system.network.packet.dropped", 0.02, device=dev, direction=direction)
                c.add("system.network.errors", 30 if bad["on"] and direction == "receive" and dev == "eth0" else 0,
                      device=dev, direction=direction)
        # the driver counts the same CRC errors the kernel counts as rx_errors
        c.add("xpusense.network.interface.driver_errors", 30 if bad["on"] else 0, device="eth0", counter="rx_crc_errors")
        c.add("xpusense.network.interface.driver_errors", 0, device="eth0", counter="tx_fifo_errors")
        # eth1 drops 20/s of a million packets/s: 0.002%, no finding
        c.add("xpusense.network.interface.driver_errors", 20, device="eth1", counter="rx_queue_3_drops")
        return c.samples(t)

    d = diagnoser(Context(), nic_errors_per_s_above=5, nic_error_ratio_above=0.001)
    assert feed(d, 0, 600, node) == []
    bad["on"] = True
    events = feed(d, 600, 900, node)
    assert states(events) == [("", "eth0", "open")]
    a = events[0].attributes
    assert a["network.interface.name"] == "eth0" and a["diagnosis.symptom"] == "cross-node gradient sync slow"
    # the window's rate when it opened (51 of 60 s at 30/s: 0.1% of the packets is 10/s, passed with 21 s of them), counted once, not twice: the driver's and the
    # kernel's counters count the same packets
    assert a["diagnosis.cause"].startswith("interface eth0 losing 25.5 packets/s to errors and drops (0.26% of its "
                                           "10000 packets/s)"), a["diagnosis.cause"]
    assert "rx_crc_errors 25.5/s" in a["diagnosis.cause"] and "errors receive 25.5/s" in a["diagnosis.cause"]
    assert "tx_fifo_errors" not in a["diagnosis.cause"] and "dropped" not in a["diagnosis.cause"]   # 0.02/s: noise
    ev = json.loads(a["diagnosis.evidence"])
    assert {(x["series"], x["labels"].get("counter") or x["labels"].get("direction")) for x in ev} >= {
        ("xpusense.network.interface.driver_errors", "rx_crc_errors"), ("system.network.errors", "receive"),
        ("system.network.packet.count", "receive")}
    assert "ethtool -S" in a["diagnosis.remedy"]
    bad["on"] = False
    events = feed(d, 900, 1100, node)
    assert states(events) == [("", "eth0", "closed")]
    assert events[0].attributes["diagnosis.id"] == a["diagnosis.id"]


# ------------------------------------------------------------------------------------------ round-trip time

def test_rtt_median_to_a_remote_region_above_3ms_opens_with_the_microbatch_remedy_and_closes():
    local, remote = Rtt("dc-local"), Rtt("peer-cloud")
    rtt = {"remote": 1.5e-3}

    def node(t: int) -> list[Sample]:
        out = [Sample("system.cpu.utilization", 0.5, "1", time_ns=at(t))]   # a sample every second
        if t % 15 == 0:
            local.add(3000, 150e-6)
            local.add(30, 20e-3)             # a few slow ones do not move the median
            remote.add(400, rtt["remote"])
            out += [local.sample(t), remote.sample(t)]
        return out

    d = diagnoser(Context())               # the default: 3 ms
    assert feed(d, 0, 600, node) == []
    rtt["remote"] = 12e-3
    events = feed(d, 600, 900, node)
    assert states(events) == [("", "peer-cloud", "open")]
    a = events[0].attributes
    assert a["diagnosis.symptom"] == "cross-cloud gradient sync slow"
    median_ms = float(a["diagnosis.cause"].split("median ")[1].split(" ms")[0])
    assert 8.4 <= median_ms <= 16.8, a["diagnosis.cause"]        # inside the log2 bucket 12 ms falls in
    assert "(above 3 ms)" in a["diagnosis.cause"]
    assert "larger microbatches" in a["diagnosis.remedy"] and "past 3 ms" in a["diagnosis.remedy"]
    assert "GPUDirect RDMA" in a["diagnosis.remedy"]
    [ev] = json.loads(a["diagnosis.evidence"])
    assert ev["series"] == "xpusense.network.tcp.rtt" and ev["labels"] == {"remote_region": "peer-cloud"}
    assert "(mean 12.0 ms)" in ev["summary"] and "threshold 3 ms" in ev["summary"]
    rtt["remote"] = 0.8e-3
    events = feed(d, 900, 1100, node)
    assert states(events) == [("", "peer-cloud", "closed")]


def test_rtt_needs_enough_samples_and_the_median_interpolates_inside_its_bucket():
    few = Rtt("far")
    d = diagnoser(Context(), rtt_min_samples=10)

    def node(t: int) -> list[Sample]:
        out = [Sample("system.cpu.utilization", 0.5, "1", time_ns=at(t))]
        if t % 15 == 0:
            few.add(2, 50e-3)         # 2 samples a reading, 8 a minute: too few to judge
            out.append(few.sample(t))
        return out
    assert feed(d, 0, 600, node) == []
    h = Rtt("x")
    h.add(10, 1e-3)
    first = h.sample(0)
    h.add(30, 5e-3)
    h.add(10, 100e-3)
    median, n = histogram_quantile(Series("xpusense.network.tcp.rtt", {}, [first, h.sample(15)]), 0.5)
    assert n == 40
    # 20 of the 30 samples in (4.19, 8.39] ms: two thirds of the way up the bucket
    assert median == pytest.approx(BOUNDS[22] + (BOUNDS[23] - BOUNDS[22]) * 20 / 30)


# ------------------------------------------------------------------------------------------ healthy

def test_a_healthy_node_opens_nothing_over_ten_minutes(tmp_path):
    c, local, remote = Counters(), Rtt("dc-local"), Rtt("peer-dc")
    d = Diagnoser([NetworkStack(job_context(tmp_path))], open_after_s=0, check_every_s=1)

    def node(t: int) -> list[Sample]:
        c.add("xpusense.network.tcp.retransmits", 0.5 if t % 20 < 2 else 0, cgroup=JOB, family="ipv4")
        c.add("xpusense.cgroup.network.calls", 3000, cgroup=JOB, direction="transmit")
        for direction in ("receive", "transmit"):
            c.add("system.network.packet.count", 50000, device="eth0", direction=direction)
            c.add("system.network.packet.dropped", 1 if t % 30 == 0 else 0, device="eth0", direction=direction)
            c.add("system.network.errors", 0, device="eth0", direction=direction)
        c.add("xpusense.network.interface.driver_errors", 0.1, device="eth0", counter="rx_missed_errors")
        out = c.samples(t)
        if t % 15 == 0:
            local.add(5000, 80e-6)
            remote.add(800, 1.2e-3)
            remote.add(20, 40e-3)
            out += [local.sample(t), remote.sample(t)]
        return out

    assert feed(d, 0, 600, node) == [] and d.opened == 0 and d.rule_errors == 0
