"""Cluster mode under failures: a real 3-server JetStream cluster on loopback, 2 gateways, workers, a
scheduler and 20 real agents (the fake NVML, 8 GPUs each), each agent given both gateways. The
leader of a stream, then a gateway, then a worker are SIGKILLed mid-stream: every (node, boot, seq)
is in the streams exactly once (by message id) or still in its agent's spool, never acknowledged;
the killed gateway's agents stream again through the other within 3 s; `nodes` through the
survivor shows every node; Place answers all along. The figures (failover seconds per agent, leader
election pause, Place calls) are recorded."""

from __future__ import annotations

import collections
import datetime
import re
import signal
import subprocess
import threading
import time

import grpc
from cluster_support import (  # noqa: F401
    check_exactly_once,
    cluster_config,
    module_cmd,
    nats_cluster,
    start_gateway,
    stream_ids,
)
from fakes.nvml import fakenvml
from helpers import BIN, free_port, nodes_json, wait_until
from helpers import record_figure as record

from xpusense.agent.spool.peek import unacked
from xpusense.collector.cluster.subjects import stream_name
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import scheduler_pb2_grpc as spb_grpc

AGENTS = 20
AGENT_CFG = """
[tiers]
realtime_s = 1.0
nearline_s = 2.0
offline_s = 30.0
[stream]
flush_s = 0.25
backoff_initial_s = 0.2
backoff_max_s = 5.0
reconnect_max_s = 1.0
[labels]
region = "r1"
price = "2.0"
[sources.ebpf]
enabled = false
[sources.npu_smi]
enabled = false
[hbm_watch]
enabled = false
"""
# The goal for a gateway failover, recorded beside the measured figure. The test asserts only
# that every agent moved within FAILOVER_BOUND_S: a loaded machine stretches the seconds (tests never
# assert wall-clock goals), an agent that does not fail over misses any bound.
FAILOVER_S = 3.0
FAILOVER_BOUND_S = 20.0


class PlaceProbe(threading.Thread):
    """Calls Place every 0.25 s until stopped; records every answer and every error."""

    def __init__(self, addr: str):
        super().__init__(daemon=True)
        self.addr, self.stop_ev = addr, threading.Event()
        self.answers: list[tuple[float, int, int]] = []
        self.errors: list[str] = []
        self.excluded = ""   # the last answer's excluded nodes and counts, for a failure's message

    def run(self):
        req = spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=10 * 2**30, count=2, limit=3)
        with grpc.insecure_channel(self.addr) as ch:
            stub = spb_grpc.SchedulerStub(ch)
            while not self.stop_ev.wait(0.25):
                try:
                    r = stub.Place(req, timeout=15)
                    self.answers.append((time.monotonic(), r.nodes_total, r.nodes_feasible))
                    if r.nodes_feasible < r.nodes_total:
                        self.excluded = (f"{dict(r.excluded_counts)}: "
                                         + "; ".join(f"{x.node_id} {x.reason} {x.detail}" for x in r.excluded))
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code().name}: {e.details()}")


def _owned(log: str) -> set[int]:
    owned: set[int] = set()
    for m in re.finditer(r"(took|let go of) partition (\d+)", log):
        (owned.add if m.group(1) == "took" else owned.discard)(int(m.group(2)))
    return owned


def _connected_to(log: str, addr: str) -> list[float]:
    """Times (unix) the agent logged `connected to collector ADDR`."""
    out = []
    for m in re.finditer(r"^(\S+ \S+) INFO \S+: connected to collector (\S+) ", log, re.M):
        if m.group(2) == addr:
            out.append(time.mktime(time.strptime(m.group(1).split(",")[0], "%Y-%m-%d %H:%M:%S"))
                       + int(m.group(1).split(",")[1]) / 1000)
    return out


def test_done_when_leader_gateway_and_worker_die_mid_stream(nats_cluster, procs, tmp_path, libdir, own_spool_dir):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster, extra="duplicate_window_s = 300.0\n")
    gw_a, a = start_gateway(procs, cfg, "gateway-a")
    gw_b, b = start_gateway(procs, cfg, "gateway-b")
    workers = [procs(module_cmd("worker", "--config", str(cfg)), f"worker-{i}") for i in (1, 2)]
    sched_addr = f"127.0.0.1:{free_port()}"
    sched = procs(module_cmd("scheduler", "--config", str(cfg), "--listen", sched_addr), "scheduler")
    wait_until(lambda: "scheduler listening" in sched.output(), 60, what="the scheduler")
    acfg = tmp_path / "agent.toml"
    acfg.write_text(AGENT_CFG)
    env = fakenvml.env(libdir, fakenvml.scenario("h100x8"), t0=fakenvml.t0_at(5.0))
    nodes = [f"node-{i:02d}" for i in range(AGENTS)]
    agents = {}
    for i, node in enumerate(nodes):   # half start on a, half on b; each knows both
        order = f"{a},{b}" if i % 2 == 0 else f"{b},{a}"
        agents[node] = procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", order,
                              "--node-id", node], f"agent-{node}", env=env)

    def fleet(addr):
        return {n["node_id"]: n for n in nodes_json(addr)["nodes"]}

    def all_fresh(addr, age_s=6.0):
        f = fleet(addr)
        return len(f) == AGENTS and all(n["last_seen_age_s"] is not None and n["last_seen_age_s"] < age_s
                                        for n in f.values()) and f
    wait_until(lambda: all_fresh(a), 180, interval_s=0.5, what="all 20 nodes in the fleet")
    probe = PlaceProbe(sched_addr)
    probe.start()
    # At some moment every node is fresh in the replica's index (one may lag a round on a loaded machine).
    wait_until(lambda: any(feasible == AGENTS for _, _, feasible in probe.answers), 180,
               what=lambda: f"Place: 20 feasible nodes (last answers (t, total, feasible): {probe.answers[-5:]}, "
                            f"{len(probe.errors)} errors, last: {probe.errors[-3:]}; excluded: {probe.excluded}; "
                            f"scheduler log tail: "
                            f"{sched.output()[-3000:]})")

    # 1. The leader of a stream dies: a new one is elected, writes go on, nothing acked is lost.
    stream = stream_name("xpusense", 0)
    leader = nats_cluster.stream_leader(stream)
    assert leader
    before = stream_ids(nats_cluster)
    nats_cluster.kill(leader)
    t_kill = time.monotonic()
    wait_until(lambda: nats_cluster.stream_leader(stream) not in ("", leader), 60, what="a new stream leader")
    elected_s = time.monotonic() - t_kill
    wait_until(lambda: len(stream_ids(nats_cluster)) > len(before) + 3 * AGENTS, 60, interval_s=0.5,
               what="writes going on after the election")
    nats_cluster.start(leader)   # it comes back and catches up, as a restarted pod would

    # 2. Gateway a dies mid-stream: its agents stream through b within 3 s.
    on_a = [n for n in nodes if agents[n].output().count(f"connected to collector {a} ")
            > agents[n].output().count(f"connected to collector {b} ")]
    assert on_a, "some agents are on gateway a"
    t_gw = time.time()
    gw_a.kill(signal.SIGKILL)
    failover = {}
    for n in on_a:
        times = wait_until(lambda n=n: [t for t in _connected_to(agents[n].output(), b) if t >= t_gw], 30,
                           what=f"{n} streaming through gateway b")
        failover[n] = round(times[0] - t_gw, 3)
    assert max(failover.values()) <= FAILOVER_BOUND_S, failover

    # 3. A worker dies: the other takes its partitions over; nodes shows every node, fresh again.
    wait_until(lambda: _owned(workers[0].output()) and _owned(workers[1].output()), 60,
               what="both workers owning partitions")
    workers[0].kill(signal.SIGKILL)
    t_w, t_w_wall = time.monotonic(), time.time()
    wait_until(lambda: _owned(workers[1].output()) == set(range(6)), 60, what="worker 2 owning every partition")

    def seen_after_kill():
        f = fleet(b)
        return len(f) == AGENTS and all(datetime.datetime.fromisoformat(n["last_seen"]).timestamp() > t_w_wall
                                        for n in f.values())
    wait_until(seen_after_kill, 90, interval_s=0.5, what="every node's summary written again after the worker died")
    worker_s = time.monotonic() - t_w
    out = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", b], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and all(n in out.stdout for n in nodes), out.stdout[-2000:]

    # Place answered from the scheduler's index all along, with the whole fleet.
    time.sleep(2.0)
    probe.stop_ev.set()
    probe.join(10)
    assert not probe.errors, probe.errors[:5]
    assert probe.answers and all(total == AGENTS for _, total, _ in probe.answers)
    gaps = [t2 - t1 for (t1, _, _), (t2, _, _) in zip(probe.answers, probe.answers[1:])]
    assert max(gaps) < 20.0, max(gaps)   # Place kept answering (each call's deadline is 15 s)

    # Every (node, boot, seq) produced: in the stream once, or still in the agent's spool.
    for n in nodes:
        agents[n].kill(signal.SIGTERM)
    ids = stream_ids(nats_cluster)
    highs = check_exactly_once(ids, contiguous=False)
    per_node = collections.defaultdict(set)
    for mid in ids:
        node, boot, seq = mid.rsplit(":", 2)
        per_node[(node, boot)].add(int(seq))
    gaps_total = 0
    for n in nodes:
        left = collections.defaultdict(set)
        for boot, seq in unacked(str(own_spool_dir / n)):
            left[boot].add(seq)
        boots = [k for k in per_node if k[0] == n]
        assert len(boots) == 1, boots
        (_, boot), = boots
        stored = per_node[(n, boot)]
        last = max(max(stored), max(left[boot], default=0))
        missing = set(range(1, last + 1)) - stored - left[boot]
        gaps_total += len(missing)
        assert not missing, f"{n}: produced but neither stored nor in the spool: {sorted(missing)[:10]}"
    record("cluster done-when", agents=AGENTS, batches_in_stream=len(ids), duplicates=0,
           stream_leader_elected_s=round(elected_s, 2), gateway_failover_s_max=max(failover.values()),
           gateway_failover_goal_s=FAILOVER_S,
           gateway_failover_s=sorted(failover.values()), worker_takeover_fresh_s=round(worker_s, 1),
           place_calls=len(probe.answers), place_errors=len(probe.errors), highest_seq=max(highs.values()))
    assert gw_b.p.poll() is None
