"""Cluster mode, fleet state: workers own partitions by lease, keep the
latest values and write per-node summaries to the `fleet` bucket; `nodes`, `top` and the Query
API pointed at any gateway show the whole fleet; a dead worker's partitions are taken over; the
stream is the history GetHistory reads back."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import grpc
from cluster_support import cluster_config, module_cmd, nats_cluster, start_gateway  # noqa: F401
from helpers import BIN, FAST_HOST_ONLY, nodes_json, wait_until

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

NODES = ["fleet-a", "fleet-b.example", "fleet-c"]


def _agents(procs, tmp_path, addrs):
    out = []
    for i, node in enumerate(NODES):
        cfg = tmp_path / f"agent-{i}.toml"
        cfg.write_text(FAST_HOST_ONLY + f'[labels]\nregion = "{"eu-1" if i % 2 else "us-2"}"\nzone = "z{i}"\n')
        out.append(procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addrs[i % len(addrs)],
                          "--node-id", node], f"agent-{node}"))
    return out


def _owned(log: str) -> set[int]:
    owned: set[int] = set()
    for m in re.finditer(r"(took|let go of) partition (\d+)", log):
        (owned.add if m.group(1) == "took" else owned.discard)(int(m.group(2)))
    return owned


def _fleet(addr):
    return {n["node_id"]: n for n in nodes_json(addr)["nodes"]}


def _fresh(addr, max_age_s=5.0):
    nodes = _fleet(addr)
    return set(NODES) <= set(nodes) and all(
        nodes[n]["connected"] and nodes[n]["last_seen_age_s"] is not None and nodes[n]["last_seen_age_s"] < max_age_s
        and any(s["name"] == "system.cpu.utilization" for s in nodes[n]["series"]) for n in NODES) and nodes


def test_any_gateway_shows_the_whole_fleet(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, a = start_gateway(procs, cfg, "gateway-a")
    _, b = start_gateway(procs, cfg, "gateway-b")
    procs(module_cmd("worker", "--config", str(cfg)), "worker-1")
    _agents(procs, tmp_path, [a, b])
    for addr in (a, b):   # each gateway has only some of the agents; both show all three
        nodes = wait_until(lambda addr=addr: _fresh(addr), 90, what=f"the whole fleet through {addr}")
    n = nodes["fleet-b.example"]
    assert n["inventory"]["labels"]["region"] == "eu-1" and n["inventory"]["hostname"]
    assert n["batches_stored"] > 0 and n["stored_up_to"] > 0
    wait_until(lambda: any(s["name"] == "system.network.io" and s.get("rate") is not None
                           for s in _fleet(b)["fleet-b.example"]["series"]), 30, what="counter rates")
    # one node, and a prefix, as with one collector
    one = nodes_json(a)
    out = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", a, "--node", "fleet-c", "--format",
                          "json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert [x["node_id"] for x in __import__("json").loads(out.stdout)["nodes"]] == ["fleet-c"]
    assert len(one["nodes"]) == 3
    # top: one refresh of the live view through a gateway
    top = subprocess.Popen([str(BIN / "xpusense-collector"), "top", "--collector", b, "--interval-s", "0.5"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3.0)
    top.send_signal(signal.SIGINT)
    screen = top.communicate(timeout=20)[0]
    assert all(node[:22] in screen for node in NODES), screen[-2000:]


def test_worker_takeover_and_history(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, a = start_gateway(procs, cfg, "gateway-a")
    w1 = procs(module_cmd("worker", "--config", str(cfg)), "worker-1")
    _agents(procs, tmp_path, [a])
    wait_until(lambda: _fresh(a), 90, what="summaries from worker 1")
    w2 = procs(module_cmd("worker", "--config", str(cfg)), "worker-2")
    # the partitions are shared out: worker 2 takes some (worker 1 lets them go)
    wait_until(lambda: "took partition" in w2.output(), 60, what="worker 2 taking partitions")
    w1.kill(signal.SIGKILL)
    killed = time.time()
    # within lease_s (3 s) + a round, worker 2 owns every partition and the fleet stays fresh
    wait_until(lambda: _owned(w2.output()) == set(range(6)) and _fresh(a, 3.0), 60,
               what="worker 2 owning every partition")
    took_s = time.time() - killed
    assert took_s < 30, took_s
    before = {n: x["batches_stored"] for n, x in _fleet(a).items()}
    wait_until(lambda: all(_fleet(a)[n]["batches_stored"] > before[n] for n in NODES), 30, what="counts going on")
    # the stream is the history: GetHistory through the gateway reads it back
    with grpc.insecure_channel(a) as ch:
        q = pb_grpc.QueryStub(ch)
        node = _fleet(a)["fleet-a"]
        ser = next(s for s in node["series"] if s["name"] == "system.memory.utilization")
        h = q.GetHistory(pb.HistoryRequest(node_id="fleet-a", name=ser["name"], labels=ser["labels"]), timeout=30)
        assert len(h.points) >= 5 and h.unit == ser["unit"]
        ts = [p.time_unix_nano for p in h.points]
        assert ts == sorted(ts) and len(set(ts)) == len(ts)   # each point once
        try:
            q.GetHistory(pb.HistoryRequest(node_id="fleet-a", name="no.such.series"), timeout=30)
            raise AssertionError("expected NOT_FOUND")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND
