"""Host CPU, memory, load, disks, filesystems and paging from psutil and /proc, and per-interface
counters over netlink.

Network counters (bytes, packets, errors, drops per interface and direction) are read with
pyroute2's rtnetlink `get_links()` (IFLA_STATS64), not by parsing /proc/net/dev. Everything here
is at the nearline tier. Converting readings to samples is done by pure functions so tests can
feed them recorded readings.
"""

from __future__ import annotations

import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import psutil

from xpusense.common.config import Key, non_negative

from .base import COUNTER, NEARLINE, Sample, Source, SourceError, SourceFamily, Unavailable
from .driver_stats import DriverStats, driver_error_samples

if TYPE_CHECKING:
    from pyroute2 import IPRoute

# Partitions, RAM disks and loop devices would count the same I/O twice or not be disks at all
# (the same default as node_exporter's diskstats collector).
DEFAULT_DISK_EXCLUDE = r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p|mmcblk\d+p)\d+$"

CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")

# IFLA_STATS64 field -> (metric, direction)
LINK_COUNTERS = {
    "rx_bytes": ("system.network.io", "receive", "By"),
    "tx_bytes": ("system.network.io", "transmit", "By"),
    "rx_packets": ("system.network.packet.count", "receive", "{packet}"),
    "tx_packets": ("system.network.packet.count", "transmit", "{packet}"),
    "rx_errors": ("system.network.errors", "receive", "{error}"),
    "tx_errors": ("system.network.errors", "transmit", "{error}"),
    "rx_dropped": ("system.network.packet.dropped", "receive", "{packet}"),
    "tx_dropped": ("system.network.packet.dropped", "transmit", "{packet}"),
}


def cpu_utilization(prev: Mapping[str, float], cur: Mapping[str, float]) -> list[Sample]:
    """Ratio 0..1 of CPU time per state between two readings of cumulative CPU seconds."""
    deltas = {k: max(cur.get(k, 0.0) - prev.get(k, 0.0), 0.0) for k in CPU_STATES if k in cur}
    # guest time is already included in user (and guest_nice in nice) on Linux.
    total = sum(v for k, v in deltas.items() if k not in ("guest", "guest_nice"))
    if total <= 0:
        return []
    return [
        Sample("system.cpu.utilization", deltas[k] / total, "1", {"state": k})
        for k in deltas
    ]


def cpu_time_samples(cur: Mapping[str, float], logical_count: int) -> list[Sample]:
    out = [Sample("system.cpu.time", v, "s", {"state": k}, COUNTER) for k, v in cur.items() if k in CPU_STATES]
    out.append(Sample("system.cpu.logical.count", logical_count, "{cpu}"))
    return out


def memory_samples(vm: Mapping[str, int]) -> list[Sample]:
    """psutil.virtual_memory() fields -> system.memory.usage by state and utilisation."""
    out = []
    for state in ("used", "free", "buffers", "cached"):
        if state in vm:
            out.append(Sample("system.memory.usage", float(vm[state]), "By", {"state": state}))
    total = vm.get("total", 0)
    if total:
        out.append(Sample("system.memory.limit", float(total), "By"))
        avail = vm.get("available", vm.get("free", 0))
        out.append(Sample("system.memory.utilization", (total - avail) / total, "1"))
    return out


def load_samples(load: tuple[float, float, float]) -> list[Sample]:
    return [
        Sample(f"system.cpu.load_average.{w}", v, "{thread}")
        for w, v in zip(("1m", "5m", "15m"), load)
    ]


def disk_samples(perdisk: Mapping[str, Any], exclude: str = DEFAULT_DISK_EXCLUDE) -> list[Sample]:
    """psutil.disk_io_counters(perdisk=True) -> operations, bytes and time per disk and direction."""
    skip = re.compile(exclude) if exclude else None
    out = []
    for dev, c in sorted(perdisk.items()):
        if skip and skip.match(dev):
            continue
        for direction, ops, nbytes, ms in (
            ("read", c.read_count, c.read_bytes, c.read_time),
            ("write", c.write_count, c.write_bytes, c.write_time),
        ):
            labels = {"device": dev, "direction": direction}
            out.append(Sample("system.disk.operations", float(ops), "{operation}", labels, COUNTER))
            out.append(Sample("system.disk.io", float(nbytes), "By", dict(labels), COUNTER))
            out.append(Sample("system.disk.operation_time", ms / 1000.0, "s", dict(labels), COUNTER))
        busy = getattr(c, "busy_time", None)
        if busy is not None:
            out.append(Sample("system.disk.io_time", busy / 1000.0, "s", {"device": dev}, COUNTER))
    return out


def link_samples(links: Iterable[Mapping[str, Any]], include: str = "", exclude: str = "") -> list[Sample]:
    """Links as {"ifname": str, "stats": {rx_bytes: ...}, "operstate": str} -> network samples."""
    inc = re.compile(include) if include else None
    exc = re.compile(exclude) if exclude else None
    out = []
    for link in links:
        name = link["ifname"]
        if (inc and not inc.search(name)) or (exc and exc.search(name)):
            continue
        stats = link.get("stats") or {}
        for field, (metric, direction, unit) in LINK_COUNTERS.items():
            if field in stats:
                out.append(Sample(metric, float(stats[field]), unit, {"device": name, "direction": direction}, COUNTER))
        up = 1.0 if link.get("operstate") in ("UP", "UNKNOWN") else 0.0
        out.append(Sample("xpusense.network.interface.up", up, "1", {"device": name}))
    return out


def cpu_frequency_samples(freqs: Iterable[Any]) -> list[Sample]:
    """psutil.cpu_freq(percpu=True) (MHz) -> system.cpu.frequency (Hz) per logical CPU; none where the
    kernel has no cpufreq (many VMs)."""
    return [Sample("system.cpu.frequency", f.current * 1e6, "Hz", {"cpu": str(i)})
            for i, f in enumerate(freqs) if f is not None and f.current and f.current > 0]


def uptime_samples(now_s: float, boot_time_s: float) -> list[Sample]:
    up = now_s - boot_time_s
    return [Sample("system.uptime", up, "s")] if boot_time_s > 0 and up >= 0 else []


# Pseudo and container mounts left out (node_exporter's default mount-points-exclude).
FILESYSTEM_EXCLUDE = r"^/(dev|proc|run/credentials/.+|sys|var/lib/docker/.+|var/lib/containers/storage/.+)($|/)"


def filesystem_samples(partitions: Iterable[Any], usage: Callable[[str], Any],
                       exclude: str = FILESYSTEM_EXCLUDE) -> list[Sample]:
    """psutil.disk_partitions() and disk_usage(mountpoint) -> system.filesystem.usage by state (used,
    free, reserved: root's blocks, total - used - free), .limit and .utilization (used / total). A
    device mounted several times (bind mounts) is reported once, at its shortest mountpoint; a mount
    whose usage cannot be read is left out."""
    skip = re.compile(exclude) if exclude else None
    first: dict[str, Any] = {}
    for p in sorted(partitions, key=lambda p: (len(p.mountpoint), p.mountpoint)):
        if (skip and skip.match(p.mountpoint)) or p.device in first:
            continue
        first[p.device] = p
    out = []
    for dev, p in first.items():
        try:
            u = usage(p.mountpoint)
        except OSError:
            continue
        opts = p.opts.split(",") if p.opts else []
        labels = {"device": dev, "type": p.fstype, "mode": "ro" if "ro" in opts else "rw", "mountpoint": p.mountpoint}
        reserved = max(u.total - u.used - u.free, 0)
        for state, v in (("used", u.used), ("free", u.free), ("reserved", reserved)):
            out.append(Sample("system.filesystem.usage", float(v), "By", {**labels, "state": state}))
        out.append(Sample("system.filesystem.limit", float(u.total), "By", dict(labels)))
        if u.total:
            out.append(Sample("system.filesystem.utilization", u.used / u.total, "1", dict(labels)))
    return out


def parse_vmstat(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def paging_samples(swap: Any, vmstat: Mapping[str, int]) -> list[Sample]:
    """psutil.swap_memory() -> system.paging.usage / .utilization by state; /proc/vmstat -> page
    faults (major = pgmajfault, minor = pgfault - pgmajfault) and pages swapped in / out (pswpin,
    pswpout) as system.paging.operations."""
    out = []
    if swap is not None:
        for state, v in (("used", swap.used), ("free", swap.free)):
            out.append(Sample("system.paging.usage", float(v), "By", {"state": state}))
            if swap.total:
                out.append(Sample("system.paging.utilization", v / swap.total, "1", {"state": state}))
    if "pgfault" in vmstat and "pgmajfault" in vmstat:
        major = vmstat["pgmajfault"]
        out.append(Sample("system.paging.faults", float(major), "{fault}", {"type": "major"}, COUNTER))
        out.append(Sample("system.paging.faults", float(max(vmstat["pgfault"] - major, 0)), "{fault}",
                          {"type": "minor"}, COUNTER))
    for key, direction in (("pswpin", "in"), ("pswpout", "out")):
        if key in vmstat:
            out.append(Sample("system.paging.operations", float(vmstat[key]), "{operation}",
                              {"direction": direction}, COUNTER))
    return out


def read_machine_id(paths: Iterable[str] = ("/etc/machine-id", "/var/lib/dbus/machine-id")) -> str:
    for p in paths:
        try:
            with open(p, encoding="ascii") as f:
                got = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if got:
            return got
    return ""


def host_inventory(machine_id: str, machine: str, os_type: str = "linux") -> dict:
    """The HOST inventory resource: what OTLP export puts in the node's resource (host.id, host.arch,
    os.type: common/otlp.py)."""
    attrs = {"host_id": machine_id, "arch": machine, "os_type": os_type}
    return {"type": "HOST", "vendor": "", "model": "", "id": "host",
            "attributes": {k: v for k, v in attrs.items() if v}, "interconnects": []}


def netlink_links(msgs: Iterable[Any]) -> list[dict]:
    """pyroute2 ifinfmsg objects -> plain dicts for link_samples()."""
    out = []
    for m in msgs:
        name = m.get("IFLA_IFNAME")
        stats = m.get("IFLA_STATS64") or m.get("IFLA_STATS")
        if not name:
            continue
        out.append({
            "ifname": name,
            "operstate": m.get("IFLA_OPERSTATE"),
            "stats": {k: stats.get(k) for k in LINK_COUNTERS} if stats is not None else {},
        })
    return out


class HostSource(Source):
    """CPU, memory, load, disks (psutil) and interfaces (rtnetlink) of this host."""

    name = "host"
    tiers = (NEARLINE,)

    def __init__(self, procfs: str = "/proc", netns: str = "", disk_exclude: str = DEFAULT_DISK_EXCLUDE,
                 interface_include: str = "", interface_exclude: str = "", driver_errors_per_interface: int = 16):
        self.procfs = procfs
        self.driver_errors_per_interface = driver_errors_per_interface
        self._driver: DriverStats | None = None
        self._driver_why = ""
        self.netns = netns
        self.disk_exclude = disk_exclude
        self.interface_include = interface_include
        self.interface_exclude = interface_exclude
        self._prev_cpu: dict[str, float] | None = None
        self._ipr: IPRoute | None = None
        self._machine_id = ""

    def setup(self) -> None:
        if not os.path.isdir(self.procfs):
            raise Unavailable(f"procfs {self.procfs!r} does not exist; set [sources.host] procfs")
        psutil.PROCFS_PATH = self.procfs
        from pyroute2 import IPRoute
        # pyroute2 would create a missing namespace; one that does not exist is a config error.
        if self.netns:
            path = self.netns if "/" in self.netns else os.path.join("/run/netns", self.netns)
            if not os.path.exists(path):
                raise Unavailable(f"network namespace {self.netns!r} does not exist (no {path}); "
                                  f"fix [sources.host] netns")
        try:
            self._ipr = IPRoute(netns=self.netns) if self.netns else IPRoute()
        except Exception as e:  # pyroute2 raises plain OSError/NetlinkError subclasses
            where = f"network namespace {self.netns!r}" if self.netns else "this host"
            raise Unavailable(f"cannot open rtnetlink in {where}: {e}") from e
        self._prev_cpu = psutil.cpu_times()._asdict()
        self._machine_id = read_machine_id()
        if self.driver_errors_per_interface > 0:
            try:
                self._driver = DriverStats(self.netns)
            except OSError as e:    # the other host readings run; describe() says why
                self._driver_why = f"no ethtool socket in the namespace: {e}"

    def inventory(self) -> list[dict]:
        return [host_inventory(self._machine_id, platform.machine(), platform.system().lower())]

    def _vmstat(self) -> dict[str, int]:
        try:
            with open(os.path.join(self.procfs, "vmstat"), encoding="ascii") as f:
                return parse_vmstat(f.read())
        except OSError:
            return {}

    def _more(self) -> list[Sample]:
        """CPU frequency, uptime, filesystems and paging: each reading on its own (a failing one costs itself)."""
        out: list[Sample] = []
        for read in (lambda: cpu_frequency_samples(psutil.cpu_freq(percpu=True) or []),
                     lambda: uptime_samples(time.time(), psutil.boot_time()),
                     lambda: filesystem_samples(psutil.disk_partitions(all=False), psutil.disk_usage),
                     lambda: paging_samples(psutil.swap_memory(), self._vmstat())):
            try:
                out += read()
            except (OSError, RuntimeError, ValueError, AttributeError):
                continue
        return out

    def collect(self, tier: str) -> list[Sample]:
        cur = psutil.cpu_times()._asdict()
        out = cpu_utilization(self._prev_cpu or {}, cur) + cpu_time_samples(cur, psutil.cpu_count() or 0)
        self._prev_cpu = cur
        out += memory_samples(psutil.virtual_memory()._asdict())
        out += load_samples(psutil.getloadavg())
        out += disk_samples(psutil.disk_io_counters(perdisk=True) or {}, self.disk_exclude)
        out += self._more()
        try:
            assert self._ipr is not None, "collect() before setup() or after close()"
            msgs = self._ipr.get_links()
        except Exception as e:
            raise SourceError(f"rtnetlink get_links failed: {e}", out) from e
        links = link_samples(netlink_links(msgs), self.interface_include, self.interface_exclude)
        out += links
        out += self._driver_errors({s.labels["device"] for s in links})
        return out

    def _driver_errors(self, devices: set[str]) -> list[Sample]:
        """NIC driver error/drop counters (ethtool statistics) of the interfaces reported."""
        if self._driver is None:
            return []
        out: list[Sample] = []
        for dev in sorted(devices):
            try:
                out += driver_error_samples(dev, self._driver.read(dev), self.driver_errors_per_interface)
            except OSError:
                continue
        self._driver.forget(devices)
        return out

    def describe(self) -> dict:
        return {"procfs": self.procfs, "netns": self.netns or "(host)",
                "driver_errors_per_interface": self.driver_errors_per_interface,
                **({"driver_errors": self._driver_why} if self._driver_why else {})}

    def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None
        if self._driver is not None:
            self._driver.close()
            self._driver = None


SCHEMA = {
    "enabled": Key(bool, True),
    "procfs": Key(str, "/proc"),
    "netns": Key(str, "", help="read interfaces of this network namespace (default: the agent's)"),
    "disk_exclude": Key(str, DEFAULT_DISK_EXCLUDE, help="regular expression of disks left out"),
    "interface_include": Key(str, "", help="regular expression; empty: every interface"),
    "interface_exclude": Key(str, ""),
    "driver_errors_per_interface": Key(int, 16, non_negative,
                                       help="NIC driver error/drop counters (ethtool -S) reported per interface; "
                                            "0: none"),
}


def build(table: Any) -> list[Source]:
    return [HostSource(procfs=table.procfs, netns=table.netns, disk_exclude=table.disk_exclude,
                       interface_include=table.interface_include, interface_exclude=table.interface_exclude,
                       driver_errors_per_interface=table.driver_errors_per_interface)]


FAMILY = SourceFamily("host", SCHEMA, build)
