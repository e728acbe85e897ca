"""NIC driver error/drop counters (ethtool statistics) read by the host source inside a namespace of
the test's own: a veth whose XDP program drops every frame counts them in its driver statistics
(`rx_queue_0_xdp_drops`), and the host source reports exactly that many."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import wait_until
from netns_support import drop_every_frame

from xpusense.agent.sources.base import NEARLINE
from xpusense.agent.sources.driver_stats import DRIVER_ERRORS, DRIVER_ERRORS_OMITTED
from xpusense.agent.sources.host import HostSource

pytestmark = pytest.mark.privileged

SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    s.sendto(b"x" * 100, (sys.argv[1], 9))
"""


def sh(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True)


def driver_counters(src, device):
    out, omitted = {}, None
    for s in src.collect(NEARLINE):
        if s.labels.get("device") != device:
            continue
        if s.name == DRIVER_ERRORS:
            out[s.labels["counter"]] = s.value
        elif s.name == DRIVER_ERRORS_OMITTED:
            omitted = s.value
    return out, omitted


@pytest.fixture
def dropping_veth(veth_pair):
    """(ns_a, ns_b, if_b, addr_b): veth_pair whose receiving end drops every frame in XDP."""
    return drop_every_frame(veth_pair)


def test_driver_drop_counter_of_a_veth_follows_frames_its_xdp_program_dropped(dropping_veth):
    ns_a, ns_b, if_b, addr_b = dropping_veth
    src = HostSource(netns=ns_b, driver_errors_per_interface=16)
    src.setup()
    try:
        before, omitted = driver_counters(src, if_b)
        assert "rx_queue_0_xdp_drops" in before, before
        assert "peer_ifindex" not in before and "rx_queue_0_xdp_packets" not in before   # not error counters
        assert all(any(w in name for w in ("err", "drop", "discard", "miss", "fifo", "crc")) for name in before)
        assert omitted == 0
        n = 50
        sh("ip", "netns", "exec", ns_a, sys.executable, "-c", SEND, addr_b, str(n))
        after = wait_until(lambda: (c := driver_counters(src, if_b)[0]) and
                           c["rx_queue_0_xdp_drops"] - before["rx_queue_0_xdp_drops"] >= n and c,
                           what=f"{n} XDP drops in {if_b}'s driver statistics")
        assert after["rx_queue_0_xdp_drops"] - before["rx_queue_0_xdp_drops"] == n
        # loopback has no driver statistics: nothing reported for it
        assert not any(s.labels.get("device") == "lo" for s in src.collect(NEARLINE) if s.name.startswith(DRIVER_ERRORS))
    finally:
        src.close()


def test_driver_counters_beyond_the_limit_are_left_out_and_counted(dropping_veth):
    _ns_a, ns_b, if_b, _addr_b = dropping_veth
    full = HostSource(netns=ns_b, driver_errors_per_interface=64)
    cut = HostSource(netns=ns_b, driver_errors_per_interface=1)
    full.setup()
    cut.setup()
    try:
        everything, _ = driver_counters(full, if_b)
        kept, omitted = driver_counters(cut, if_b)
        assert len(everything) >= 2, everything
        assert len(kept) == 1 and set(kept) <= set(everything)
        assert omitted == len(everything) - 1
    finally:
        full.close()
        cut.close()
