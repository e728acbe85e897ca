"""The tcp_rtt probe loaded into the real kernel, its RTT figure checked against `ss -ti`.

Two network namespaces of the test's own, with a link that delays every packet: a veth pair with
`netem delay 20ms` on one side where the kernel has netem, else two TUN devices joined by a relay
process of the test's that holds each packet 10 ms each way (a kernel without sch_netem, like this
project's CI VM). A TCP connection between them ping-pongs small messages; the probe's mean smoothed
RTT for the remote region of the server's address must agree with the srtt `ss -ti` shows for that
connection within 20%.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from ebpf_support import probe_sources
from helpers import record_figure, wait_until
from netns_support import namespace_pair, sh, tun_relay

from xpusense.agent.sources.base import HISTOGRAM, NEARLINE, REALTIME

pytestmark = pytest.mark.privileged

RTT = "xpusense.network.tcp.rtt"

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
c.settimeout(30)
while True:
    m = c.recv(100)
    if not m:
        break
    c.sendall(m)                # echo: data flows both ways, both ends take RTT samples
"""

CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    c.sendall(b"p" * 100)
    got = 0
    while got < 100:
        got += len(c.recv(100 - got))
print(c.getsockname()[1], flush=True)
sys.stdin.readline()            # hold the connection open while ss looks at it
"""


def parse_ss_rtt(text: str) -> float:
    """`ss -ti` output for one connection -> its smoothed RTT in seconds (the X of rtt:X/Y, in ms)."""
    m = re.search(r"\brtt:([0-9.]+)/([0-9.]+)", text)
    if not m:
        raise ValueError(f"no rtt:X/Y in {text!r}")
    return float(m.group(1)) / 1000


def test_parse_ss_rtt():
    line = "cubic wscale:7,7 rto:224 rtt:20.512/3.1 ato:40 mss:1448 cwnd:10 bytes_sent:20000"
    assert parse_ss_rtt(line) == pytest.approx(0.020512)
    with pytest.raises(ValueError):
        parse_ss_rtt("no estimate here")


@pytest.fixture
def delayed_link():
    """Two namespaces joined by a link that delays packets 20 ms per round trip:
    (ns_a, addr_a, ns_b, addr_b, how)."""
    with namespace_pair("r") as (ns_a, addr_a, ns_b, addr_b, tag):
        if_a, if_b = f"xra{tag}", f"xrb{tag}"
        sh("ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        netem = sh("tc", "-n", ns_a, "qdisc", "add", "dev", if_a, "root", "netem", "delay", "20ms", check=False)
        if netem.returncode == 0:
            for ns, ifname, addr in ((ns_a, if_a, addr_a), (ns_b, if_b, addr_b)):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", ifname)
                sh("ip", "-n", ns, "link", "set", ifname, "up")
            yield ns_a, addr_a, ns_b, addr_b, "veth + netem delay 20ms"
            return
        # no sch_netem in this kernel: a TUN relay that holds each packet 10 ms each way
        how = "tun relay 10ms each way (no netem: " + netem.stderr.strip()[:60] + ")"
        sh("ip", "-n", ns_a, "link", "del", if_a)
        with tun_relay(ns_a, addr_a, ns_b, addr_b, f"xta{tag}", f"xtb{tag}", delay_s=0.010):
            yield ns_a, addr_a, ns_b, addr_b, how


def in_ns(ns, code, *args, **kw):
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code, *map(str, args)],
                            stdout=subprocess.PIPE, text=True, **kw)


def region_hist(src, region):
    got = [s for s in src.collect(NEARLINE) if s.name == RTT and s.labels.get("remote_region") == region]
    assert len(got) <= 1, got
    return got[0] if got else None


def test_tcp_rtt_agrees_with_ss_for_a_delayed_connection_between_namespaces(delayed_link):
    ns_a, addr_a, ns_b, addr_b, how = delayed_link
    regions = {f"{addr_b}/32": "test-server", f"{addr_a}/32": "test-client", "127.0.0.0/8": "loopback"}
    with probe_sources({"probes": ["tcp_rtt"], "tcp_rtt": {"regions": regions}}) as [src]:
        server = client = None
        try:
            port, rounds = 9300, 60
            server = in_ns(ns_b, SERVER, addr_b, port)
            assert server.stdout.readline().strip() == "ready"
            client = in_ns(ns_a, CLIENT, addr_b, port, rounds, stdin=subprocess.PIPE)
            local_port = int(client.stdout.readline())       # the ping-pong is over, the connection open
            ss_out = sh("ip", "netns", "exec", ns_a, "ss", "-tin", "state", "established",
                        "dst", f"{addr_b}:{port}", "src", f"{addr_a}:{local_port}").stdout
            ss_s = parse_ss_rtt(ss_out)

            # every echo the client received is one tcp_probe event with the client's srtt (plus ACKs)
            h = wait_until(lambda: (x := region_hist(src, "test-server")) and x.counts[-1] >= rounds and x,
                           what=f"{rounds} RTT samples towards the server's region")
            assert h.kind == HISTOGRAM and h.unit == "s"
            assert h.labels == {"remote_region": "test-server"}
            probe_s = h.value / h.counts[-1]
            record_figure("tcp_rtt_vs_ss", link=how, probe_mean_ms=round(probe_s * 1e3, 3), ss_srtt_ms=round(ss_s * 1e3, 3),
                          samples=h.counts[-1])
            assert 0.018 <= ss_s, f"ss sees {ss_s * 1e3:.1f} ms over a link delayed 20 ms ({how})"
            assert probe_s == pytest.approx(ss_s, rel=0.20), (probe_s, ss_s, ss_out)
            # the bucket holding most samples is the one 20 ms falls in: [2^24, 2^25) ns = 16.8..33.6 ms
            per_bucket = [b - a for a, b in zip((0, *h.counts), h.counts)]
            assert per_bucket.index(max(per_bucket)) == 25, per_bucket

            # the server's view of the same connection is labelled with the client's region
            back = wait_until(lambda: region_hist(src, "test-client"), what="RTT samples towards the client's region")
            assert back.value / back.counts[-1] == pytest.approx(ss_s, rel=0.5)
            # loopback peers are never counted, whatever the table says
            lo = sh("ip", "netns", "exec", ns_a, sys.executable, "-c",
                    "import socket; s = socket.create_server(('127.0.0.1', 0)); "
                    "c = socket.create_connection(s.getsockname()); a, _ = s.accept(); "
                    "[(c.sendall(b'x'), a.recv(1), a.sendall(b'y'), c.recv(1)) for _ in range(50)]")
            assert lo.returncode == 0
            assert region_hist(src, "loopback") is None
            assert sum(s.value for s in src.collect(REALTIME) if s.name == "xpusense.network.tcp.rtt.untracked") == 0
        finally:
            for p in (client, server):
                if p:
                    p.kill()
                    p.wait()
