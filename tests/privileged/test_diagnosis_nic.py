"""network_stack's NIC finding end to end: a veth of the test's own whose XDP program drops
every frame, a paced UDP sender on the other side, the host source reading the namespace's interface
and driver counters for real; its samples, stamped with the time they were read, go to the Diagnoser
(windows of seconds): the interface opens a diagnosis naming the driver's drop counter, and it closes
once the program is detached."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from helpers import wait_until
from netns_support import drop_every_frame

from xpusense.agent.diagnosis.base import Context
from xpusense.agent.diagnosis.engine import Diagnoser
from xpusense.agent.diagnosis.rules.network import NetworkStack
from xpusense.agent.sources.base import NEARLINE
from xpusense.agent.sources.host import HostSource

pytestmark = pytest.mark.privileged

SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
while True:
    s.sendto(b"x" * 100, (sys.argv[1], 9))
    time.sleep(0.01)             # about 100 datagrams a second
"""


def sh(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True)


def test_frames_dropped_by_a_veths_driver_open_network_stack_for_the_interface_and_detaching_closes(veth_pair):
    ns_a, ns_b, if_b, addr_b = drop_every_frame(veth_pair)
    src = HostSource(netns=ns_b, driver_errors_per_interface=16)
    src.setup()
    sender = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-c", SEND, addr_b])
    d = Diagnoser([NetworkStack(Context(), window_s=10, nic_errors_per_s_above=20, nic_error_ratio_above=0.001,
                                clear_ratio=0.5)], open_after_s=5, close_after_s=10, check_every_s=1)
    events: list = []

    def step(state: str) -> list:
        now = time.time_ns()
        samples = src.collect(NEARLINE)
        for s in samples:
            s.time_ns = now
        events.extend(e for e in d.observe(samples) if e.attributes.get("network.interface.name") == if_b)
        return [e for e in events if e.attributes["diagnosis.state"] == state]

    try:
        [opened] = wait_until(lambda: step("open"), 120, interval_s=0.5, what=f"network_stack to open for {if_b}")
        a = opened.attributes
        assert opened.device == "" and a["diagnosis.rule"] == "network_stack"
        assert a["diagnosis.symptom"] == "cross-node gradient sync slow" and "ethtool -S" in a["diagnosis.remedy"]
        assert a["diagnosis.cause"].startswith(f"interface {if_b} losing ") and "rx_queue_0_xdp_drops" in a["diagnosis.cause"]
        rate = float(a["diagnosis.cause"].split(" losing ")[1].split(" packets/s")[0])
        assert 20 < rate <= 110, a["diagnosis.cause"]      # at most 100 datagrams a second, each one frame
        ev = json.loads(a["diagnosis.evidence"])
        drops = [x for x in ev if x["labels"].get("counter") == "rx_queue_0_xdp_drops"]
        assert drops and drops[0]["series"] == "xpusense.network.interface.driver_errors"
        assert drops[0]["labels"] == {"device": if_b, "counter": "rx_queue_0_xdp_drops"}
        assert drops[0]["values"][-1] > drops[0]["values"][0]
        sh("ip", "-n", ns_b, "link", "set", "dev", if_b, "xdp", "off")     # frames reach the stack again
        [closed] = wait_until(lambda: step("closed"), 120, interval_s=0.5, what=f"network_stack for {if_b} to close")
        assert closed.attributes["diagnosis.id"] == a["diagnosis.id"] and len(events) == 2
    finally:
        sender.kill()
        sender.wait()
        src.close()
