"""The host source reads real interface counters over rtnetlink, inside namespaces the test made."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xpusense.agent.sources.base import NEARLINE, Unavailable
from xpusense.agent.sources.host import HostSource

pytestmark = pytest.mark.privileged

SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    s.sendto(b"x" * 1000, (sys.argv[1], 9))
"""


def counters(src, ifname):
    out = {}
    for s in src.collect(NEARLINE):
        if s.labels.get("device") == ifname and s.name.startswith("system.network"):
            out[(s.name, s.labels["direction"])] = s.value
    return out


def test_interface_counters_follow_real_traffic(veth_pair):
    ns_a, if_a, _, ns_b, if_b, addr_b = veth_pair
    a, b = HostSource(netns=ns_a), HostSource(netns=ns_b)
    a.setup()
    b.setup()
    try:
        before_a, before_b = counters(a, if_a), counters(b, if_b)
        assert ("system.network.io", "transmit") in before_a, f"{if_a} missing from {ns_a}'s links"
        subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", SEND, addr_b, "200"], check=True)
        after_a, after_b = counters(a, if_a), counters(b, if_b)
        sent = after_a[("system.network.io", "transmit")] - before_a[("system.network.io", "transmit")]
        got = after_b[("system.network.io", "receive")] - before_b[("system.network.io", "receive")]
        pkts = after_a[("system.network.packet.count", "transmit")] - before_a[("system.network.packet.count", "transmit")]
        # 200 datagrams of 1000 bytes of payload (+ UDP/IP/Ethernet headers), plus maybe an ARP.
        assert 200 * 1042 <= sent <= 200 * 1042 + 2000
        assert 200 * 1042 <= got <= 200 * 1042 + 2000
        assert 200 <= pkts <= 203
        # Only the namespace's own interfaces are seen: not the host's.
        assert {s.labels.get("device") for s in a.collect(NEARLINE) if s.name == "system.network.io"} == {"lo", if_a}
    finally:
        a.close()
        b.close()


def test_missing_namespace_is_unavailable_with_reason():
    import os
    if os.geteuid() != 0:
        pytest.skip("needs root to open another network namespace")
    src = HostSource(netns="xps-does-not-exist")
    with pytest.raises(Unavailable, match="xps-does-not-exist"):
        src.setup()
