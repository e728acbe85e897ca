"""A real agent retires the series references of series gone idle, so its table of references does
not only grow, and a series that comes back is stored as itself. The series that come and go are
network interfaces (veth pairs) made and deleted in a namespace of the test's own, which the
agent's host source reads; a real collector stores what the agent sends, its own figures included
(`xpusense.agent.stream.series`: references held; `.series_retired`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import grpc
import pytest
from helpers import BIN, HOST_SOURCES_ONLY, free_port, nodes_json, wait_until

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

pytestmark = pytest.mark.privileged

PAIRS = 4
UP = "xpusense.network.interface.up"
IDLE_S = 2.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def netns():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2's `ip` (network namespaces)")
    tag = uuid.uuid4().hex[:6]
    ns = f"xps-refs-{tag}"
    ip("netns", "add", ns)
    try:
        ip("-n", ns, "link", "set", "lo", "up")
        yield ns, tag
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def add_pair(ns: str, a: str, b: str, b_up: bool = True) -> None:
    ip("-n", ns, "link", "add", a, "type", "veth", "peer", "name", b)
    ip("-n", ns, "link", "set", a, "up")
    if b_up:
        ip("-n", ns, "link", "set", b, "up")


def test_agent_retires_references_of_idle_series_and_stores_a_returning_one(netns, procs, tmp_path):
    ns, tag = netns
    names = [(f"xa{i}{tag}", f"xb{i}{tag}") for i in range(PAIRS)]   # within IFNAMSIZ
    for a, b in names:
        add_pair(ns, a, b)
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    # Answering before the agent and the query channel start: a channel that finds no server backs
    # off (gRPC's 1 s doubling by 1.6 to 120 s) and might not try again within the waits below.
    wait_until(lambda: nodes_json(addr) is not None, 60, what="the collector to answer")
    cfg = tmp_path / "agent.toml"
    # Every tier within the idle bound, so a live series is never retired; 2 s of no sample is.
    cfg.write_text(f"""[tiers]
realtime_s = 0.2
nearline_s = 0.5
offline_s = 1.0
[stream]
flush_s = 0.05
series_idle_s = {IDLE_S}
[sources.host]
netns = "{ns}"
""" + HOST_SOURCES_ONLY)
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr, "--node-id", "refs"],
                  "agent")
    query = pb_grpc.QueryStub(grpc.insecure_channel(addr))

    def series() -> list:
        nodes = query.ListNodes(pb.ListNodesRequest(node_id="refs"), timeout=5).nodes
        return list(nodes[0].series) if nodes else []

    def value(name: str, **labels):
        got = [s for s in series() if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return got[0] if got else None

    wait_until(lambda: all(value(UP, device=n) for pair in names for n in pair) and value("xpusense.agent.stream.series"),
               60, what="every interface's series and the agent's figures stored")
    per_interface = sum(1 for s in series() if s.labels.get("device") == names[0][0])
    assert per_interface >= 2   # its counters and `up`
    deleted = {a for a, _ in names[1:]} | {b for _, b in names[1:]}
    gone = sum(1 for s in series() if s.labels.get("device") in deleted)
    assert gone >= 2 * (PAIRS - 1) * 2

    for a, _ in names[1:]:   # deleting one end deletes its peer: 6 interfaces and their series gone
        ip("-n", ns, "link", "del", a)

    def references_only_of_live_series() -> bool:
        """A reading of the references held at most the series stored with a sample within two idle
        turns before it (a reference lives between one and two turns past its series' last sample;
        half a second more for the clocks of the rounds), and at least the deleted ones retired.
        Series that appear or flap meanwhile (a busy machine) move both sides alike."""
        listed = series()
        held = next(s for s in listed if s.name == "xpusense.agent.stream.series")
        retired = next(s for s in listed if s.name == "xpusense.agent.stream.series_retired")
        since = held.time_unix_nano - int((2 * IDLE_S + 0.5) * 1e9)
        live = sum(1 for s in listed if s.time_unix_nano >= since)
        state[:] = [held.value, live, retired.value]
        return held.value <= live and retired.value >= gone and not any(
            s.labels.get("device") in deleted for s in listed if s.time_unix_nano >= since)

    state: list = []
    wait_until(references_only_of_live_series, 60,
               what=lambda: f"references held, live series, retired: {state}; {gone} series gone")

    # A series that comes back (new references) is stored as itself: pair 1 again, its peer down
    # (so `up` reads 0 where it was 1), then the peer up.
    a, b = names[1]
    assert value(UP, device=a).value == 1.0
    back_at = time.time_ns()
    add_pair(ns, a, b, b_up=False)
    wait_until(lambda: (s := value(UP, device=a)) and s.time_unix_nano > back_at and s.value == 0.0, 30,
               what=f"{a} back, stored down")
    ip("-n", ns, "link", "set", b, "up")
    wait_until(lambda: (s := value(UP, device=a)) and s.value == 1.0 and (p := value(UP, device=b)) and p.value == 1.0,
               30, what=f"{a} and {b} stored up")
    assert sum(1 for s in series() if s.name == UP and s.labels.get("device") == a) == 1
    assert value(UP, device=names[0][0]).value == 1.0   # the pair never gone, still stored
    # The host source's netns helper (a child pyroute2 forks) is stopped with SIGTERM: it dies as
    # told, and the agent's log does not say the agent was told to stop.
    assert "received SIGTERM" not in agent.output()
