"""The agent fails over, with real processes: given several collector addresses (`--collector A,B`)
it streams through the next within 3 s when its collector goes, and after an outage it finds a
collector within 3 s of it answering again (while none answers, each is tried again at least
every `reconnect_max_s`), while failures after a connection still back off as usual."""

from __future__ import annotations

import re
import signal
import time

from helpers import BIN, HOST_SOURCES_ONLY, free_port, record_figure, wait_until

AGENT_CFG = """
[tiers]
realtime_s = 0.5
nearline_s = 0.5
offline_s = 30.0
[stream]
flush_s = 0.1
""" + HOST_SOURCES_ONLY


def _collector(procs, addr, name):
    p = procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], name)
    wait_until(lambda: _answers(addr), 60, what=f"{name} answering")
    return p


def _answers(addr) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(addr) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1
        except grpc.RpcError:
            return False


def _connects(log: str, addr: str) -> list[float]:
    out = []
    for m in re.finditer(r"^(\S+) (\S+),(\d+) INFO \S+: connected to collector (\S+) ", log, re.M):
        if m.group(4) == addr:
            out.append(time.mktime(time.strptime(f"{m.group(1)} {m.group(2)}", "%Y-%m-%d %H:%M:%S"))
                       + int(m.group(3)) / 1000)
    return out


def _agent(procs, tmp_path, collectors: str, node: str):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(AGENT_CFG)
    return procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", collectors,
                  "--node-id", node], "agent")


def test_next_collector_within_3_s(procs, tmp_path):
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    ca = _collector(procs, a, "collector-a")
    _collector(procs, b, "collector-b")
    agent = _agent(procs, tmp_path, f"{a},{b}", "failover-node")
    wait_until(lambda: _connects(agent.output(), a), 60, what="connected to a")
    time.sleep(12.0)          # long enough up that the backoff starts again from its initial delay
    t = time.time()
    ca.kill(signal.SIGKILL)
    at = wait_until(lambda: [x for x in _connects(agent.output(), b) if x >= t], 30, what="streaming through b")[0]
    record_figure("agent failover to the next address", seconds=round(at - t, 3))
    assert at - t <= 3.0


def test_back_within_3_s_of_the_collector_answering(procs, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    c = _collector(procs, addr, "collector")
    agent = _agent(procs, tmp_path, addr, "outage-node")
    wait_until(lambda: _connects(agent.output(), addr), 60, what="connected")
    c.kill(signal.SIGKILL)
    time.sleep(20.0)          # an outage long enough for an exponential backoff to reach its 10 s cap
    before = len(_connects(agent.output(), addr))
    _collector(procs, addr, "collector-back")   # returns once it answers health checks
    answering = time.time()
    back = wait_until(lambda: _connects(agent.output(), addr)[before:], 30, what="the agent back")[0]
    record_figure("agent back after an outage", seconds_after_answering=round(back - answering, 3))
    assert back - answering <= 3.0
