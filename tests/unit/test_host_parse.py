from __future__ import annotations

import collections

import pytest

from xpusense.agent.sources.base import COUNTER
from xpusense.agent.sources.host import cpu_utilization, disk_samples, link_samples, load_samples, memory_samples


def by(samples, name, **labels):
    return {tuple(sorted(s.labels.items())): s for s in samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())}


def test_cpu_utilization_is_the_share_of_time_per_state():
    prev = {"user": 100.0, "nice": 0.0, "system": 50.0, "idle": 800.0, "iowait": 10.0, "irq": 0.0,
            "softirq": 0.0, "steal": 0.0, "guest": 5.0, "guest_nice": 0.0}
    cur = dict(prev, user=130.0, system=40.0 + 20.0, idle=850.0, iowait=20.0, guest=8.0)
    out = {s.labels["state"]: s.value for s in cpu_utilization(prev, cur)}
    # deltas: user 30, system 10, idle 50, iowait 10 -> total 100 (guest is inside user)
    assert out["user"] == pytest.approx(0.30)
    assert out["system"] == pytest.approx(0.10)
    assert out["idle"] == pytest.approx(0.50)
    assert out["iowait"] == pytest.approx(0.10)
    assert out["guest"] == pytest.approx(0.03)
    assert all(s.unit == "1" for s in cpu_utilization(prev, cur))


def test_cpu_utilization_with_no_time_passed_is_empty():
    t = {"user": 1.0, "idle": 1.0}
    assert cpu_utilization(t, t) == []


def test_memory():
    vm = {"total": 1000, "available": 250, "used": 700, "free": 100, "buffers": 50, "cached": 150}
    out = memory_samples(vm)
    assert by(out, "system.memory.usage", state="used")[(("state", "used"),)].value == 700
    util = [s for s in out if s.name == "system.memory.utilization"][0]
    assert util.value == pytest.approx(0.75) and util.unit == "1"
    assert [s.value for s in out if s.name == "system.memory.limit"] == [1000]


def test_load():
    out = load_samples((0.5, 1.5, 2.5))
    assert [(s.name, s.value) for s in out] == [("system.cpu.load_average.1m", 0.5),
                                                ("system.cpu.load_average.5m", 1.5),
                                                ("system.cpu.load_average.15m", 2.5)]


Disk = collections.namedtuple("Disk", "read_count write_count read_bytes write_bytes read_time write_time busy_time")


def test_disks_skip_partitions_and_loops_and_convert_ms_to_s():
    perdisk = {"vda": Disk(10, 20, 4096, 8192, 1500, 2500, 3000), "vda1": Disk(1, 1, 1, 1, 1, 1, 1),
               "loop0": Disk(1, 1, 1, 1, 1, 1, 1), "nvme0n1": Disk(1, 2, 3, 4, 5, 6, 7),
               "nvme0n1p1": Disk(1, 1, 1, 1, 1, 1, 1)}
    out = disk_samples(perdisk)
    assert {s.labels["device"] for s in out} == {"vda", "nvme0n1"}
    ops = {(s.labels["device"], s.labels["direction"]): s.value for s in out if s.name == "system.disk.operations"}
    assert ops[("vda", "read")] == 10 and ops[("vda", "write")] == 20
    t = {(s.labels["device"], s.labels["direction"]): s.value for s in out if s.name == "system.disk.operation_time"}
    assert t[("vda", "write")] == pytest.approx(2.5)
    busy = [s for s in out if s.name == "system.disk.io_time" and s.labels["device"] == "vda"][0]
    assert busy.value == pytest.approx(3.0) and busy.kind == COUNTER and busy.unit == "s"
    assert all(s.kind == COUNTER for s in out)


def test_links_counters_errors_drops_and_filters():
    links = [
        {"ifname": "eth0", "operstate": "UP", "stats": {"rx_bytes": 1000, "tx_bytes": 2000, "rx_packets": 10,
                                                       "tx_packets": 20, "rx_errors": 1, "tx_errors": 2,
                                                       "rx_dropped": 3, "tx_dropped": 4}},
        {"ifname": "veth9", "operstate": "DOWN", "stats": {"rx_bytes": 5}},
    ]
    out = link_samples(links)
    io = {(s.labels["device"], s.labels["direction"]): s.value for s in out if s.name == "system.network.io"}
    assert io == {("eth0", "receive"): 1000, ("eth0", "transmit"): 2000, ("veth9", "receive"): 5}
    errs = {s.labels["direction"]: s.value for s in out if s.name == "system.network.errors"}
    assert errs == {"receive": 1, "transmit": 2}
    drops = {s.labels["direction"]: s.value for s in out if s.name == "system.network.packet.dropped"}
    assert drops == {"receive": 3, "transmit": 4}
    up = {s.labels["device"]: s.value for s in out if s.name == "xpusense.network.interface.up"}
    assert up == {"eth0": 1.0, "veth9": 0.0}
    assert {s.labels["device"] for s in link_samples(links, exclude="^veth")} == {"eth0"}
    assert {s.labels["device"] for s in link_samples(links, include="^veth")} == {"veth9"}
