"""sd_notify over $NOTIFY_SOCKET (agent/sdnotify.py): READY=1, then WATCHDOG=1 only while the tier
loop's progress moves; and the real agent process notifying a socket the test listens on."""

from __future__ import annotations

import socket
import threading

import pytest
from helpers import BIN, wait_until

from xpusense.agent import sdnotify


@pytest.fixture
def notify_socket(tmp_path):
    path = str(tmp_path / "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(0.05)
    got: list[str] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                got.append(s.recv(4096).decode())
            except TimeoutError:
                pass
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    yield path, got
    stop.set()
    t.join()
    s.close()


def test_no_socket_no_watchdog():
    assert sdnotify.notify("READY=1", env={}) is False
    assert sdnotify.watchdog_interval_s({}) == 0.0
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) == 0.0
    w = sdnotify.Watchdog(lambda: 0, env={})
    w.start()
    w.stop()
    assert w.pings == 0


def test_pings_follow_progress_and_stop_when_the_loop_is_wedged(notify_socket):
    path, got = notify_socket
    progress = [0]
    w = sdnotify.Watchdog(lambda: progress[0], stall_s=0.3, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
    w.start()
    try:
        wait_until(lambda: any(m.startswith("READY=1") for m in got), what="READY=1")
        for _ in range(3):   # the loop makes progress: a ping per interval
            seen = w.pings
            progress[0] += 1
            wait_until(lambda seen=seen: w.pings > seen, what="a WATCHDOG=1 after progress")
        sent = w.pings
        wait_until(lambda: got.count("WATCHDOG=1") >= sent >= 3, what="the pings at the socket")
        # Wedged: once no round has started for stall_s, no pings, however long it lasts.
        wait_until(lambda: w.missed >= 1, what="the stall to be noticed")
        stalled = w.pings
        wait_until(lambda: w.missed >= 5, what="more intervals without progress")
        assert w.pings == stalled
        progress[0] += 1   # the loop moves again: pings again
        wait_until(lambda: w.pings > stalled, what="pings after progress resumed")
    finally:
        w.stop()
    wait_until(lambda: "STOPPING=1" in got, what="STOPPING=1")


def test_abstract_socket_address(tmp_path):
    name = f"xpusense-test-{id(tmp_path)}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(5)
    try:
        assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "@" + name})
        assert s.recv(100) == b"READY=1"
    finally:
        s.close()


def test_the_agent_says_ready_and_pings_while_running(procs, tmp_path, notify_socket):
    path, got = notify_socket
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[tiers]\nrealtime_s = 0.1\n[sources.ebpf]\nenabled = false\n[sources.nvml]\nenabled = false\n"
                   "[sources.npu_smi]\nenabled = false\n[spool]\nenabled = false\n")
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", "127.0.0.1:9"],
                  "agent", env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    wait_until(lambda: any(m.startswith("READY=1") for m in got), timeout_s=90, what="READY=1 from the agent")
    ready = next(m for m in got if m.startswith("READY=1"))
    assert f"MAINPID={agent.p.pid}" in ready
    wait_until(lambda: got.count("WATCHDOG=1") >= 3, timeout_s=90, what="WATCHDOG=1 pings from the agent")


def test_pings_stop_when_delivery_stops_while_the_tier_loop_runs(notify_socket, tmp_path):
    """A watchdog fed by the tier loop alone would say the agent is healthy while delivery is dead.
    Here the stream's batcher is stuck in a spool write that does
    not return (a hung disk), the tier loop keeps going: no pings until the write returns."""
    from xpusense.agent.sources.base import Sample
    from xpusense.agent.spool import Spool
    from xpusense.agent.stream import StreamClient
    from xpusense.v1 import telemetry_pb2 as pb

    class HungDisk(Spool):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.release = threading.Event()
            self.entered = threading.Event()

        def append(self, *a):
            self.entered.set()
            self.release.wait()
            return super().append(*a)

    path, got = notify_socket
    sp = HungDisk(str(tmp_path / "spool"))
    sp.open()
    client = StreamClient("127.0.0.1:9", "n", "b", lambda: pb.Inventory(), flush_s=0.02, spool=sp,
                          backoff_initial_s=0.05, backoff_max_s=0.1)
    rounds = [0]

    def tier_loop():
        rounds[0] += 1
        return rounds[0]

    w = sdnotify.Watchdog(tier_loop, stall_s=0.3, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"},
                          status=client.health)
    w.watch("delivery", client.progress, stall_s=0.3)
    client.start()
    w.start()
    try:
        wait_until(lambda: w.pings >= 2, what="pings while both move")
        client.put([Sample("x", 1.0, "1", {})])
        wait_until(lambda: sp.entered.is_set(), what="the batcher to enter the hung write")
        wait_until(lambda: w.missed >= 1, what="the stopped delivery to be noticed")
        stalled = w.pings
        wait_until(lambda: w.missed >= 5, what="more intervals with delivery stuck")
        assert w.pings == stalled and rounds[0] > 5, "the tier loop moved, delivery did not: no pings"
        sp.release.set()
        wait_until(lambda: w.pings > stalled, what="pings once the write returned")
        wait_until(lambda: any(m.startswith("STATUS=measuring; collector 127.0.0.1:9 unreachable") for m in got),
                   what="STATUS= saying why nothing is delivered")
    finally:
        sp.release.set()
        w.stop()
        client.stop(drain_s=0)
        sp.close()


def test_progress_that_cannot_be_read_is_no_progress(notify_socket):
    path, _ = notify_socket
    w = sdnotify.Watchdog(lambda: 1 / 0, stall_s=0.2, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
    w.start()
    try:
        wait_until(lambda: w.missed >= 3, what="intervals without readable progress")
        assert w.pings == 0
    finally:
        w.stop()
