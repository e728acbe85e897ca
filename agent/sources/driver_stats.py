"""NIC driver error and drop counters (what `ethtool -S` shows), read through pyroute2's ethtool ioctl
(DriverStats), as `xpusense.network.interface.driver_errors{device, counter}`. Interfaces without
driver statistics (loopback, most virtual links) report nothing."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import socket
import threading
from collections.abc import Iterable

from .base import COUNTER, GAUGE, Sample

DRIVER_ERRORS = "xpusense.network.interface.driver_errors"
DRIVER_ERRORS_OMITTED = "xpusense.network.interface.driver_errors.omitted"
ERROR_WORDS = re.compile(r"err|drop|discard|miss|fifo|crc", re.IGNORECASE)
CLONE_NEWNET = 0x40000000


def error_counters(stats: Iterable[tuple[str, int]], limit: int) -> tuple[list[tuple[str, int]], int]:
    """(name, value) of a driver's statistics -> (the first `limit` whose names say error/drop/..., how
    many more matched and were left out)."""
    matching = [(name, int(value)) for name, value in stats if ERROR_WORDS.search(name)]
    return matching[:limit], max(0, len(matching) - limit)


def driver_error_samples(device: str, stats: Iterable[tuple[str, int]], limit: int) -> list[Sample]:
    kept, omitted = error_counters(stats, limit)
    out = [Sample(DRIVER_ERRORS, float(v), "{event}", {"device": device, "counter": name}, COUNTER) for name, v in kept]
    if kept or omitted:
        out.append(Sample(DRIVER_ERRORS_OMITTED, float(omitted), "{counter}", {"device": device}, GAUGE))
    return out


def socket_in_netns(netns: str) -> socket.socket:
    """A datagram socket of network namespace `netns` (a name under /run/netns or a path; "" = ours)."""
    if not netns:
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    path = netns if "/" in netns else os.path.join("/run/netns", netns)
    got: dict[str, object] = {}

    def join_and_open() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({path}): {os.strerror(err)}")
                got["sock"] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            finally:
                os.close(fd)
        except OSError as e:
            got["error"] = e

    t = threading.Thread(target=join_and_open, name="xpusense-netns-socket")
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]          # type: ignore[misc]
    return got["sock"]              # type: ignore[return-value]


class DriverStats:
    """Driver statistics of the interfaces of one network namespace, names cached per interface.

    Drivers name their statistics freely (`rx_crc_errors`, `rx_queue_0_drops`...): only counters
    whose name says error, drop, discard, miss, fifo or crc are reported, at most `limit` per
    interface (the first in the driver's order); how many were left out is reported as
    `xpusense.network.interface.driver_errors.omitted{device}`. The ioctl goes through a socket made
    inside the namespace (socket_in_netns: a short-lived thread joins it, the agent's threads stay
    where they are), so the counters are those of that namespace's interfaces."""

    def __init__(self, netns: str = ""):
        from pyroute2.ethtool.ioctl import IoctlEthtool
        self._eth = IoctlEthtool()
        self._eth.sock.close()
        self._eth.sock = socket_in_netns(netns)
        self._names: dict[str, list[str] | None] = {}     # ifname -> stat names; None: none offered

    def read(self, ifname: str) -> list[tuple[str, int]]:
        """[(name, value)] of the interface's driver statistics; [] when its driver offers none."""
        from pyroute2.ethtool.ioctl import NoSuchDevice, NotSupportedError
        if self._names.get(ifname, []) is None:
            return []
        self._eth.change_ifname(ifname)
        names = self._names.get(ifname)
        if names:
            self._eth.stat_names = names
        try:
            stats = self._eth.get_statistics()
        except (NotSupportedError, NoSuchDevice):
            self._names[ifname] = None
            return []
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENODEV, errno.EINVAL):
                self._names[ifname] = None
                return []
            raise
        except AssertionError:          # the driver's number of statistics changed: names read again
            self._names.pop(ifname, None)
            return []
        self._names[ifname] = self._eth.stat_names if stats else None
        return [(str(n), int(v)) for n, v in stats]

    def forget(self, present: set[str]) -> None:
        for name in set(self._names) - present:
            del self._names[name]

    def close(self) -> None:
        self._eth.close()
