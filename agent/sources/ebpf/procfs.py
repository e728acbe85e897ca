"""What the eBPF sources read from /proc, /sys and the kernel headers, as pure functions and caches.

Nothing here loads BPF or needs root: parsing fdinfo and mountinfo, capability bits, the release of
a header tree, dev_t and cgroup id -> names, and the device path prefixes accel_ioctl matches in the
kernel.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable

from xpusense.probes import specs


def parse_fdinfo(text: str) -> dict[str, int]:
    """/proc/<pid>/fdinfo/<fd> of a BPF program -> its integer fields (prog_id, run_time_ns, run_cnt...)."""
    out = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        val = val.strip()
        if re.fullmatch(r"-?\d+", val):
            out[key.strip()] = int(val)
    return out


def parse_schedstat(text: str) -> tuple[int, int, int]:
    """/proc/<pid>/schedstat -> (ns on CPU, ns waited on a run queue, times run)."""
    a, b, c = (int(x) for x in text.split()[:3])
    return a, b, c


def sched_info_off(procfs: str = "/proc") -> str:
    """Why the scheduler's per-task run-queue accounting (CONFIG_SCHED_INFO: sched_info.run_delay and
    pcount, which /proc/<pid>/schedstat shows) is not there to read; "" when it is."""
    path = f"{procfs}/self/schedstat"
    try:
        with open(path) as f:
            _on_cpu, _waited, runs = parse_schedstat(f.read())
    except OSError:
        return f"no {path}: the kernel has no CONFIG_SCHED_INFO"
    except ValueError:
        return f"{path} is not in the format of Linux's schedstat"
    if runs == 0:       # compiled in but not accounting (before Linux 5.14: schedstats and delayacct off)
        return f"the scheduler does not account run-queue time here ({path} shows 0 runs)"
    return ""


def device_prefixes(globs: Iterable[str]) -> list[str]:
    """Device globs -> the literal prefixes matched in the kernel (the part before the first wildcard)."""
    out: list[str] = []
    for g in globs:
        prefix = re.split(r"[*?\[]", g, maxsplit=1)[0]
        if not prefix.startswith("/"):
            raise ValueError(f"{g!r} is not an absolute path glob")
        if len(prefix) >= specs.ACCEL_PREFIX_LEN:
            raise ValueError(f"{g!r}: the part before the first wildcard must be under "
                             f"{specs.ACCEL_PREFIX_LEN} characters")
        if prefix not in out:
            out.append(prefix)
    if len(out) > specs.ACCEL_MAX_PREFIXES:
        raise ValueError(f"at most {specs.ACCEL_MAX_PREFIXES} distinct device path prefixes, got {out}")
    return out


def prefix_words(prefix: str) -> tuple[list[int], list[int]]:
    """A path prefix -> (little-endian 8-byte words, byte masks) as accel_ioctl.bpf.c compares them."""
    raw = prefix.encode().ljust(specs.ACCEL_PREFIX_LEN, b"\0")
    mask = (b"\xff" * len(prefix.encode())).ljust(specs.ACCEL_PREFIX_LEN, b"\0")
    n = specs.ACCEL_PREFIX_LEN // 8
    return ([int.from_bytes(raw[8 * i:8 * i + 8], sys.byteorder) for i in range(n)],
            [int.from_bytes(mask[8 * i:8 * i + 8], sys.byteorder) for i in range(n)])


def decode_dev(dev: int) -> tuple[int, int]:
    """A kernel-internal dev_t (as in block tracepoints: major << 20 | minor) -> (major, minor)."""
    return dev >> 20, dev & 0xFFFFF


def cgroup2_mount(mountinfo: str) -> str:
    """The first cgroup2 mount point in /proc/self/mountinfo text ('' if none)."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return left.split(" ")[4].replace("\\040", " ")
    return ""


def cgroup2_root(procfs: str) -> str:
    """The cgroup2 mount point from <procfs>/self/mountinfo ('' if none or unreadable)."""
    try:
        with open(f"{procfs}/self/mountinfo") as f:
            return cgroup2_mount(f.read())
    except OSError:
        return ""


def physical_links(links: Iterable[dict]) -> list[str]:
    """Links as {"ifname", "kind", "loopback"} -> names of physical ones (no link kind, not loopback)."""
    return [link["ifname"] for link in links if not link.get("kind") and not link.get("loopback")]


def headers_release(build_dir: str) -> str:
    """The kernel release a header tree was made for (UTS_RELEASE in utsrelease.h; '' if unknown)."""
    try:
        with open(os.path.join(build_dir, "include/generated/utsrelease.h")) as f:
            m = re.search(r'UTS_RELEASE "([^"]+)"', f.read())
            return m.group(1) if m else ""
    except OSError:
        return ""


class CgroupNames:
    """cgroup v2 id (kernfs inode number) -> path below the cgroup2 mount, '/' for the root.

    An unknown id triggers a rescan (at most one per `min_rescan_s`); ids still unknown after a scan
    (removed cgroups) are remembered, so they do not cause a rescan every round.
    """

    def __init__(self, root: str, min_rescan_s: float = 1.0):
        self.root = root
        self.min_rescan_s = min_rescan_s
        self._names: dict[int, str] = {}
        self._missing: set[int] = set()
        self._last_scan = -1e9

    def scan(self) -> None:
        names = {}
        for dirpath, _dirnames, _ in os.walk(self.root):
            try:
                ino = os.stat(dirpath).st_ino
            except OSError:
                continue
            rel = os.path.relpath(dirpath, self.root)
            names[ino] = "/" if rel == "." else "/" + rel
        self._names = names
        self._missing.clear()
        self._last_scan = time.monotonic()

    def name(self, cgid: int) -> str | None:
        if cgid not in self._names and cgid not in self._missing and self.root:
            if time.monotonic() - self._last_scan >= self.min_rescan_s:
                self.scan()
            if cgid not in self._names:
                self._missing.add(cgid)
        return self._names.get(cgid)

    def gone(self, cgid: int) -> bool:
        """True when the cgroup no longer exists (its directory is gone, or a fresh scan lacks it)."""
        name = self._names.get(cgid)
        if name is not None:
            try:
                if os.stat(os.path.join(self.root, name.lstrip("/"))).st_ino == cgid:
                    return False
            except OSError:
                pass
            del self._names[cgid]
            return True
        if time.monotonic() - self._last_scan >= self.min_rescan_s:
            self.scan()
        return cgid not in self._names

    def label(self, cgid: int) -> str:
        return self.name(cgid) or f"id:{cgid}"


class DiskNames:
    """dev_t -> disk name from <sysfs>/dev/block/MAJ:MIN/uevent (DEVNAME)."""

    def __init__(self, sysfs: str = "/sys"):
        self.sysfs = sysfs
        self._names: dict[int, str] = {}

    def name(self, dev: int) -> str:
        if dev not in self._names:
            major, minor = decode_dev(dev)
            name = f"{major}:{minor}"
            try:
                with open(f"{self.sysfs}/dev/block/{major}:{minor}/uevent") as f:
                    for line in f:
                        if line.startswith("DEVNAME="):
                            name = line.strip().split("=", 1)[1]
            except OSError:
                return name     # not cached: the disk may appear later
            self._names[dev] = name
        return self._names[dev]
