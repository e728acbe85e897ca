"""network_stack end to end: two network namespaces of the test's own joined by two TUN
devices and a relay process of the test's that can delay and drop packets (this kernel has no
netem), a paced TCP sender in a cgroup of the test's own, the netio and tcp_rtt probes loaded for
real. Their samples, stamped with the time they were read, go to the Diagnoser (windows of seconds
instead of minutes): with 15 ms each way and 10% of the packets dropped, the sender's cgroup opens a
retransmit diagnosis on the accelerator its process is said to use and the server's region an RTT
one; both close once the relay passes packets straight on again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from ebpf_support import own_cgroup, probe_sources
from helpers import record_figure, wait_until
from netns_support import namespace_pair, tun_relay

from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.rules.network import NetworkStack
from xpusense.agent.sources.base import NEARLINE, REALTIME

pytestmark = pytest.mark.privileged

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


@pytest.fixture
def relay_link():
    """(ns_a, addr_a, ns_b, addr_b, set(what, value)): namespaces joined through the relay."""
    with namespace_pair("n") as (ns_a, addr_a, ns_b, addr_b, tag), \
            tun_relay(ns_a, addr_a, ns_b, addr_b, f"xna{tag}", f"xnb{tag}") as setting:
        yield ns_a, addr_a, ns_b, addr_b, setting


@pytest.fixture
def probes(relay_link):
    _, _, _, addr_b, _ = relay_link
    with probe_sources({"probes": ["netio", "tcp_rtt"],
                        "tcp_rtt": {"regions": {f"{addr_b}/32": "peer-cloud"}}}) as srcs:
        yield srcs


@pytest.fixture
def sender_cgroup():
    with own_cgroup("net", "netio keys by cgroup v2 id") as path:
        yield path


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
