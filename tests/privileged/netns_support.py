"""What the privileged network tests share: two network namespaces of a test's own, joined through
TUN devices by a relay process that can delay and drop packets (for kernels without netem), and a
veth whose XDP program drops every frame."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import struct
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest

# A relay between two TUN devices (argv 1 and 2) that holds each packet argv[3] seconds; stdin lines
# "delay SECONDS" / "drop FRACTION" change it (answered "set WHAT VALUE"), EOF ends it.
RELAY = """
import fcntl, heapq, os, random, select, struct, sys, time
def tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, 0x400454ca, struct.pack("16sH", name.encode(), 0x0001 | 0x1000))  # TUNSETIFF: IFF_TUN|IFF_NO_PI
    return fd
a, b = tun(sys.argv[1]), tun(sys.argv[2])
peer = {a: b, b: a}
delay, drop, n, queue, pending = float(sys.argv[3]), 0.0, 0, [], b""
print("ready", flush=True)
while True:
    timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else None
    ready, _, _ = select.select([a, b, 0], [], [], timeout)
    if 0 in ready:
        got = os.read(0, 4096)
        if not got:
            break
        pending += got
        while b"\\n" in pending:
            line, pending = pending.split(b"\\n", 1)
            what, value = line.decode().split()
            if what == "delay":
                delay = float(value)
            else:
                drop = float(value)
            print("set", what, value, flush=True)
    for fd in ready:
        if fd == 0:
            continue
        try:
            pkt = os.read(fd, 65536)
        except OSError:         # EIO while a device is down
            continue
        if random.random() >= drop:
            heapq.heappush(queue, (time.monotonic() + delay, n, peer[fd], pkt))
            n += 1
    now = time.monotonic()
    while queue and queue[0][0] <= now:
        _, _, fd, pkt = heapq.heappop(queue)
        try:
            os.write(fd, pkt)
        except OSError:         # the other side not up yet: the packet is lost, as on a wire
            pass
"""


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


@contextlib.contextmanager
def namespace_pair(prefix: str) -> Iterator[tuple[str, str, str, str, str]]:
    """(ns_a, addr_a, ns_b, addr_b, tag): two new namespaces (xps-PREFIXa-TAG, xps-PREFIXb-TAG) with
    loopback up, and two addresses of a /30 for the test to put on the link it makes between them
    (`tag` names its devices); the namespaces are deleted on leaving."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, eBPF); CI runs tests/privileged as root")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"xps-{prefix}a-{tag}", f"xps-{prefix}b-{tag}"
    # addresses of this test only: conftest's veth_pair uses 10.231.0.0/30
    net = f"10.{random.randint(232, 250)}.{random.randint(0, 255)}"
    host = 4 * random.randint(0, 62) + 1
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        for ns in (ns_a, ns_b):
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns_a, f"{net}.{host}", ns_b, f"{net}.{host + 1}", tag
    finally:
        sh("ip", "netns", "del", ns_a, check=False)
        sh("ip", "netns", "del", ns_b, check=False)


@contextlib.contextmanager
def tun_relay(ns_a: str, addr_a: str, ns_b: str, addr_b: str, tun_a: str, tun_b: str,
              delay_s: float = 0.0) -> Iterator[Callable[[str, float], None]]:
    """TUN devices tun_a (addr_a, in ns_a) and tun_b (addr_b, in ns_b) joined by the RELAY process,
    holding each packet delay_s each way; yields setting(what, value) ("delay" seconds, "drop"
    fraction), which returns once the relay applies it. The relay ends on leaving."""
    relay = subprocess.Popen([sys.executable, "-c", RELAY, tun_a, tun_b, str(delay_s)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    def setting(what: str, value: float) -> None:
        relay.stdin.write(f"{what} {value}\n")
        relay.stdin.flush()
        assert relay.stdout.readline().split() == ["set", what, str(value)]

    try:
        assert relay.stdout.readline().strip() == "ready"
        for ns, ifname, addr, peer in ((ns_a, tun_a, addr_a, addr_b), (ns_b, tun_b, addr_b, addr_a)):
            sh("ip", "link", "set", ifname, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", addr, "peer", peer, "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")
        yield setting
    finally:
        relay.stdin.close()
        relay.kill()
        relay.wait()


def xdp_drop_program() -> int:
    """fd of a two-instruction XDP program that drops every frame (r0 = XDP_DROP; exit)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    insns = ctypes.create_string_buffer(struct.pack("<BBhi", 0xB7, 0, 0, 1) + struct.pack("<BBhi", 0x95, 0, 0, 0))
    lic = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("<IIQQ", attr, 0, 6, 2, ctypes.addressof(insns), ctypes.addressof(lic))  # BPF_PROG_TYPE_XDP
    fd = libc.syscall(321 if os.uname().machine == "x86_64" else 280, 5, attr, 128)            # bpf(BPF_PROG_LOAD)
    if fd < 0:
        pytest.skip(f"cannot load an XDP program here: {os.strerror(ctypes.get_errno())}")
    return int(fd)


def drop_every_frame(veth_pair) -> tuple[str, str, str, str]:
    """(ns_a, ns_b, if_b, addr_b) of conftest's veth_pair, its receiving end (if_b) now dropping every
    frame in XDP; ns_a knows if_b's MAC for good, so every datagram sent to addr_b is one frame
    dropped (no ARP, no IPv6 chatter)."""
    from pyroute2 import IPRoute
    ns_a, if_a, _addr_a, ns_b, if_b, addr_b = veth_pair
    for ns in (ns_a, ns_b):
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    fd = xdp_drop_program()
    try:
        with IPRoute(netns=ns_b) as ipr:
            [link] = ipr.get_links(ifname=if_b)
            mac = link.get_attr("IFLA_ADDRESS")
            ipr.link("set", index=link["index"], xdp_fd=fd)
    finally:
        os.close(fd)            # the link holds the program now
    sh("ip", "-n", ns_a, "neigh", "replace", addr_b, "lladdr", mac, "dev", if_a, "nud", "permanent")
    return ns_a, ns_b, if_b, addr_b
