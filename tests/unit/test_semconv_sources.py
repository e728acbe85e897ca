"""The readings added for the semantic conventions' host and process metrics (agent/sources/host.py,
agent_self.py), from recorded values."""

from __future__ import annotations

import collections

import pytest

from xpusense.agent.sources.agent_self import cpu_samples, process_labels
from xpusense.agent.sources.base import COUNTER
from xpusense.agent.sources.host import (
    cpu_frequency_samples,
    filesystem_samples,
    host_inventory,
    paging_samples,
    parse_vmstat,
    read_machine_id,
    uptime_samples,
)

Freq = collections.namedtuple("Freq", "current min max")
Part = collections.namedtuple("Part", "device mountpoint fstype opts")
Usage = collections.namedtuple("Usage", "total used free percent")
Swap = collections.namedtuple("Swap", "total used free percent sin sout")

VMSTAT = """nr_free_pages 123
pgpgin 4135113
pgpgout 14736136
pswpin 12
pswpout 34
pgfault 53966650
pgmajfault 4738
"""


def test_cpu_frequency_per_logical_cpu_in_hz_and_none_without_cpufreq():
    out = cpu_frequency_samples([Freq(2596.1, 0, 0), Freq(0.0, 0, 0), Freq(3000.0, 800, 3500)])
    assert [(s.labels, s.value, s.unit) for s in out] == [({"cpu": "0"}, 2596.1e6, "Hz"), ({"cpu": "2"}, 3000e6, "Hz")]
    assert cpu_frequency_samples([]) == []


def test_uptime():
    assert [(s.name, s.value, s.unit) for s in uptime_samples(1000.5, 400.0)] == [("system.uptime", 600.5, "s")]
    assert uptime_samples(1000.0, 0.0) == []


def test_filesystems_once_per_device_with_reserved_blocks_and_pseudo_mounts_left_out():
    parts = [Part("/dev/vda", "/run/netns", "ext4", "rw,relatime"), Part("/dev/vda", "/", "ext4", "rw,relatime"),
             Part("/dev/vdb", "/data", "xfs", "ro,noatime"), Part("/dev/sdz", "/var/lib/docker/overlay2/x", "xfs", "rw"),
             Part("/dev/gone", "/gone", "ext4", "rw")]
    usage = {"/": Usage(1000, 600, 350, 63.2), "/data": Usage(200, 50, 150, 25.0)}

    def disk_usage(path):
        if path not in usage:
            raise FileNotFoundError(path)
        return usage[path]
    out = filesystem_samples(parts, disk_usage)
    use = {(s.labels["device"], s.labels["state"]): s.value for s in out if s.name == "system.filesystem.usage"}
    assert use == {("/dev/vda", "used"): 600, ("/dev/vda", "free"): 350, ("/dev/vda", "reserved"): 50,
                   ("/dev/vdb", "used"): 50, ("/dev/vdb", "free"): 150, ("/dev/vdb", "reserved"): 0}
    lim = {s.labels["mountpoint"]: (s.value, s.labels["mode"], s.labels["type"]) for s in out if s.name == "system.filesystem.limit"}
    assert lim == {"/": (1000, "rw", "ext4"), "/data": (200, "ro", "xfs")}
    util = {s.labels["device"]: s.value for s in out if s.name == "system.filesystem.utilization"}
    assert util == {"/dev/vda": pytest.approx(0.6), "/dev/vdb": pytest.approx(0.25)}


def test_paging_usage_faults_and_swap_operations():
    out = paging_samples(Swap(1000, 250, 750, 25.0, 0, 0), parse_vmstat(VMSTAT))
    got = {(s.name, tuple(sorted(s.labels.items()))): (s.value, s.kind) for s in out}
    assert got[("system.paging.usage", (("state", "used"),))][0] == 250
    assert got[("system.paging.utilization", (("state", "free"),))][0] == pytest.approx(0.75)
    assert got[("system.paging.faults", (("type", "major"),))] == (4738, COUNTER)
    assert got[("system.paging.faults", (("type", "minor"),))] == (53966650 - 4738, COUNTER)
    assert got[("system.paging.operations", (("direction", "in"),))] == (12, COUNTER)
    assert got[("system.paging.operations", (("direction", "out"),))] == (34, COUNTER)
    # No swap: usage 0, no utilisation (0 / 0).
    none = paging_samples(Swap(0, 0, 0, 0.0, 0, 0), {})
    assert {s.name for s in none} == {"system.paging.usage"}


def test_host_inventory_resource(tmp_path):
    (tmp_path / "machine-id").write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    mid = read_machine_id([str(tmp_path / "missing"), str(tmp_path / "machine-id")])
    assert mid == "3d1219c7c4c5404aaa1f6d2a48adfda4"
    r = host_inventory(mid, "x86_64")
    assert r["type"] == "HOST" and r["id"] == "host"
    assert r["attributes"] == {"host_id": mid, "arch": "x86_64", "os_type": "linux"}
    assert read_machine_id([str(tmp_path / "missing")]) == ""


def test_agent_process_cpu_time_per_mode_and_utilisation():
    labels = process_labels(4242, "/usr/bin/python3.11", 1_700_000_000.25)
    assert labels == {"process": "xpusense-agent", "pid": "4242", "executable": "python3.11",
                      "started": "2023-11-14T22:13:20.250Z"}
    first = cpu_samples(labels, {"user": 1.0, "system": 0.5}, None, 100.0, 4)
    assert [(s.name, s.labels["state"], s.value) for s in first] == [("process.cpu.time", "user", 1.0),
                                                                     ("process.cpu.time", "system", 0.5)]
    nxt = cpu_samples(labels, {"user": 3.0, "system": 1.0}, (100.0, {"user": 1.0, "system": 0.5}), 110.0, 4)
    util = {s.labels["state"]: s.value for s in nxt if s.name == "process.cpu.utilization"}
    assert util == {"user": pytest.approx(2.0 / 40), "system": pytest.approx(0.5 / 40)}
