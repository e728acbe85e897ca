"""network_stack end to end (issue 18): two network namespaces of the test's own joined by two TUN
devices and a relay process of the test's that can delay and drop packets (this kernel has no
netem), a paced TCP sender in a cgroup of the test's own, the netio and tcp_rtt probes loaded for
real. Their samples, stamped with the time they were read, go to the Diagnoser (windows of seconds
instead of minutes): with 15 ms each way and 10% of the packets dropped, the sender's cgroup opens a
retransmit diagnosis on the accelerator its process is said to use and the server's region an RTT
one; both close once the relay passes packets straight on again."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import record_figure, wait_until

from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.rules.network import NetworkStack
from xpusense.agent.sources.base import NEARLINE, REALTIME, Unavailable
from xpusense.agent.sources.ebpf import family
from xpusense.agent.sources.ebpf.loader import EbpfLoader
from xpusense.agent.sources.ebpf.procfs import cgroup2_root

pytestmark = pytest.mark.privileged

# A relay between two TUN devices; stdin lines "delay SECONDS" / "drop FRACTION" change it, EOF ends it.
RELAY = """
import fcntl, heapq, os, random, select, struct, sys, time
def tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, 0x400454ca, struct.pack("16sH", name.encode(), 0x0001 | 0x1000))  # TUNSETIFF: IFF_TUN|IFF_NO_PI
    return fd
a, b = tun(sys.argv[1]), tun(sys.argv[2])
peer = {a: b, b: a}
delay, drop, n, queue, pending = 0.0, 0.0, 0, [], b""
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
        except OSError:
            pass
"""

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
while c.recv(65536):
    pass
"""

# 4 KiB every 10 ms (about 300 segments/s): far below what the relay passes, so no queue builds up.
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
print("connected", flush=True)
while True:
    c.sendall(b"x" * 4096)
    time.sleep(0.01)
"""


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


@pytest.fixture
def relay_link():
    """(ns_a, addr_a, ns_b, addr_b, set(what, value)): namespaces joined through the relay."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, eBPF); CI runs tests/privileged as root")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"xps-na-{tag}", f"xps-nb-{tag}"
    net = f"10.{random.randint(232, 250)}.{random.randint(0, 255)}"   # not 10.231.0.0/30 (conftest's veth pair)
    host = 4 * random.randint(0, 62) + 1
    addr_a, addr_b = f"{net}.{host}", f"{net}.{host + 1}"
    tun_a, tun_b = f"xna{tag}", f"xnb{tag}"
    relay = subprocess.Popen([sys.executable, "-c", RELAY, tun_a, tun_b], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    def setting(what: str, value: float) -> None:
        relay.stdin.write(f"{what} {value}\n")
        relay.stdin.flush()
        assert relay.stdout.readline().split() == ["set", what, str(value)]

    try:
        assert relay.stdout.readline().strip() == "ready"
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        for ns, ifname, addr, peer in ((ns_a, tun_a, addr_a, addr_b), (ns_b, tun_b, addr_b, addr_a)):
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "set", ifname, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", addr, "peer", peer, "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")
        yield ns_a, addr_a, ns_b, addr_b, setting
    finally:
        relay.stdin.close()
        relay.kill()
        relay.wait()
        sh("ip", "netns", "del", ns_a, check=False)
        sh("ip", "netns", "del", ns_b, check=False)


@pytest.fixture
def probes(relay_link):
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.skip("bcc's Python module is not importable: run scripts/setup.sh (links python3-bpfcc)")
    try:
        EbpfLoader(family.table_from()).check_environment()
    except Unavailable as e:
        pytest.skip(f"eBPF unavailable here: {e}")
    _, _, _, addr_b, _ = relay_link
    srcs = family.build(family.table_from({"probes": ["netio", "tcp_rtt"],
                                           "tcp_rtt": {"regions": {f"{addr_b}/32": "peer-cloud"}}}))
    try:
        for src in srcs:
            try:
                src.loader.plan(src.probe)
            except Unavailable as e:
                pytest.skip(f"{src.probe} cannot run on this kernel: {e}")
        for src in srcs:
            src.setup()
        yield srcs
    finally:
        for src in srcs:
            src.close()


@pytest.fixture
def sender_cgroup():
    root = cgroup2_root("/proc")
    if not root:
        pytest.skip("no cgroup2 mount (netio keys by cgroup v2 id)")
    path = Path(root) / f"xps-test-net-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    try:
        yield path
    finally:
        wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), what=f"{path} to empty")
        path.rmdir()


def test_loss_and_delay_between_namespaces_open_network_stack_and_a_clean_link_closes_it(relay_link, probes,
                                                                                          sender_cgroup):
    ns_a, _addr_a, ns_b, addr_b, setting = relay_link
    label = "/" + sender_cgroup.name
    server = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c", SERVER, addr_b, "9400"],
                              stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c", CLIENT, addr_b, "9400"],
                                  stdout=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: (sender_cgroup / "cgroup.procs").write_text(str(os.getpid())))
        assert client.stdout.readline().strip() == "connected"
        cgroup_probe = probes[0].plan_.variant.name == "sock_cgroup"
        d = Diagnoser([NetworkStack(Context(processes=lambda: {client.pid: {"gpu0"}}), window_s=10,
                                    retransmits_per_s_above=2, retransmit_ratio_above=0.01,
                                    rtt_median_above_ms=10, rtt_min_samples=10, clear_ratio=0.5)],
                      open_after_s=5, close_after_s=10, check_every_s=1)
        events: list = []

        def ours(e) -> bool:
            """The host's own connections are seen by the probes too: only this test's findings count."""
            a = e.attributes
            if "network.remote_region" in a:
                return a["network.remote_region"] == "peer-cloud"
            return a.get("cgroup") == label if cgroup_probe else "cgroup" not in a and "network.interface.name" not in a

        def step(state: str) -> list:
            """One collection of both probes, stamped now; this test's events of `state` so far."""
            now = time.time_ns()
            samples = [s for src in probes for tier in (REALTIME, NEARLINE) for s in src.collect(tier)]
            for s in samples:
                s.time_ns = now
            events.extend(e for e in d.observe(samples) if ours(e))
            return [e for e in events if e.attributes["diagnosis.state"] == state]

        # a clean link first: nothing opens over two windows' worth of readings
        first = time.monotonic()
        wait_until(lambda: step("open") or time.monotonic() - first > 20, 120, interval_s=0.5,
                   what="20 s of a clean link")
        assert events == [] and d.rule_errors == 0, [e.message for e in events]

        setting("delay", 0.015)          # 30 ms round trip
        setting("drop", 0.1)
        opened = wait_until(lambda: len(o := step("open")) >= 2 and o, 180, interval_s=0.5,
                            what="network_stack to open for the retransmits and the RTT")
        by_kind = {e.attributes.get("network.remote_region") or "retransmits": e for e in opened}
        assert set(by_kind) == {"peer-cloud", "retransmits"}, [e.message for e in opened]

        rt = by_kind["retransmits"]
        a = rt.attributes
        assert a["diagnosis.rule"] == "network_stack" and a["diagnosis.symptom"] == "cross-node gradient sync slow"
        ev = json.loads(a["diagnosis.evidence"])
        assert ev[0]["series"] == "xpusense.network.tcp.retransmits"
        rate = float(ev[0]["summary"].split(" retransmitted")[0])
        assert rate > 2, ev[0]["summary"]
        if cgroup_probe:
            assert rt.device == "gpu0" and a["cgroup"] == label and a["process.pid"] == str(client.pid)
            assert ev[0]["labels"] == {"cgroup": label, "family": "ipv4"}
            [calls] = [x for x in ev if x["series"] == "xpusense.cgroup.network.calls"]
            assert calls["labels"] == {"cgroup": label, "direction": "transmit"}
            sends = float(calls["summary"].split(" send calls/s")[0])
            assert 10 < sends < 120, calls["summary"]    # at most 100 a second, fewer while the window stalls
        else:                            # netio without sock_cgroup: one node-wide finding
            assert rt.device == "" and "cgroup" not in a and ev[0]["labels"] == {"family": "ipv4"}

        rtt = by_kind["peer-cloud"]
        assert rtt.device == "" and rtt.attributes["diagnosis.symptom"] == "cross-cloud gradient sync slow"
        median_ms = float(rtt.attributes["diagnosis.cause"].split("median ")[1].split(" ms")[0])
        assert 20 <= median_ms < 120, rtt.attributes["diagnosis.cause"]       # 30 ms a round trip, and queueing
        [rev] = json.loads(rtt.attributes["diagnosis.evidence"])
        assert rev["series"] == "xpusense.network.tcp.rtt" and rev["labels"] == {"remote_region": "peer-cloud"}
        assert "larger microbatches" in rtt.attributes["diagnosis.remedy"]

        record_figure("network_stack_e2e", variant=probes[0].plan_.variant.name, retransmits_per_s=rate,
                      rtt_median_ms=median_ms, rtt=rev["summary"], opened_after_s=round(time.monotonic() - first, 1))
        setting("drop", 0.0)
        setting("delay", 0.0)
        closed = wait_until(lambda: len(c := step("closed")) >= 2 and c, 180, interval_s=0.5,
                            what="network_stack to close once the link is clean")
        assert {e.attributes["diagnosis.id"] for e in closed} == {e.attributes["diagnosis.id"] for e in opened}
        assert len(events) == 4 and d.rule_errors == 0
        assert not [f for f in d.open_now() if f.subject in (label, "peer-cloud")]
    finally:
        for p in (client, server):
            if p:
                p.kill()
                p.wait()
