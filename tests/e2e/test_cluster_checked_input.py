"""Cluster mode checks what it takes, on the real 3-server JetStream cluster with its role identities:
a gateway refuses a forged sequence number as one collector does (collector/limits.py, the same
code) and never raises the boot's mark; a worker counts and skips what a gateway identity publishes
that is not sane (a batch on another node's subject, a seq far ahead, a receive time a year ahead);
meanwhile the real nodes keep being stored and placed."""

from __future__ import annotations

import signal
import time

import grpc
from cluster_support import SimAgent, cluster_config, connect_as, module_cmd, nats_cluster, run, start_gateway  # noqa: F401
from helpers import nodes_json, wait_until
from test_cluster_scheduler import place, start_scheduler

from xpusense.collector.cluster.subjects import MSG_ID, RECEIVED, msg_id, node_subject, partition
from xpusense.collector.config import load_collector
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

HUGE = 2**64 - 1


def _node(addr: str, node_id: str) -> dict:
    return next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == node_id), {})


def _stored(addr: str, node_id: str) -> int:
    return int(_node(addr, node_id).get("batches_stored", 0))


def _placed(addr: str) -> set[str]:
    return {c["node_id"] for c in place(addr)["candidates"]}


def _raw_stream(addr: str, node_id: str, boot_id: str, batches=()):
    """An Ingest stream from a client that is not the node's agent: its Welcome, then what the
    gateway answered to `batches` (the acks, or the error that ended the stream)."""
    msgs = [pb.AgentMessage(hello=pb.Hello(node_id=node_id, boot_id=boot_id, inventory=pb.Inventory(hostname=node_id),
                                           time_unix_nano=time.time_ns()))]
    msgs += [pb.AgentMessage(batch=b) for b in batches]
    with grpc.insecure_channel(addr) as ch:
        replies = pb_grpc.IngestStub(ch).Stream(iter(msgs), timeout=30)
        welcome = next(replies).welcome
        try:
            return welcome, [r.ack for r in replies]
        except grpc.RpcError as e:
            return welcome, e


def test_a_gateway_refuses_a_forged_seq_and_the_real_node_goes_on(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    gw_proc, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    _, sched = start_scheduler(procs, cfg, "scheduler")
    real = SimAgent(gw, "real-1", {"region": "r1"})
    wait_until(lambda: real.send() and _placed(sched) == {"real-1"}, 90, interval_s=0.5, what="the real node placed")
    forged = pb.Batch(node_id="real-1", boot_id=real.boot, seq=HUGE, sent_unix_nano=time.time_ns())
    welcome, answer = _raw_stream(gw, "real-1", real.boot, [forged])
    assert 0 < welcome.stored_up_to < HUGE
    assert isinstance(answer, grpc.RpcError), answer                       # not acknowledged
    assert answer.code() == grpc.StatusCode.FAILED_PRECONDITION and "max_seq_jump" in answer.details()
    # The real agent goes on; then the gateway restarts and it says Hello again.
    stored = _stored(gw, "real-1")
    wait_until(lambda: real.send() and _stored(gw, "real-1") >= stored + 3, 60, interval_s=0.3,
               what="the real node's batches stored")
    real.close()
    assert gw_proc.kill(signal.SIGTERM) == 0   # stopped as a pod is: its marks written
    _, gw2 = start_gateway(procs, cfg, "gateway-2")
    welcome, _ = _raw_stream(gw2, "real-1", real.boot)
    assert 0 < welcome.stored_up_to <= real.seq, welcome                  # what the agent sent, not 2**64-1
    again = SimAgent(gw2, "real-1", {"region": "r1"})
    again.seq = welcome.stored_up_to                                       # the agent's spool goes on from there
    stored = _stored(gw2, "real-1")
    wait_until(lambda: again.send() and _stored(gw2, "real-1") >= stored + 3, 60, interval_s=0.3,
               what="the real node stored after the restart")
    wait_until(lambda: again.send() and _placed(sched) == {"real-1"}, 30, interval_s=0.3, what="the real node placed")
    again.close()


def test_a_worker_counts_and_skips_what_a_gateway_identity_forges(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    _, sched = start_scheduler(procs, cfg, "scheduler")
    a, b = SimAgent(gw, "node-a", {"region": "r1"}), SimAgent(gw, "node-b", {"region": "r1"})
    wait_until(lambda: a.send() and b.send() and _placed(sched) == {"node-a", "node-b"}, 90, interval_s=0.5,
               what="both nodes placed")
    n = load_collector(str(cfg), env={}).nats
    subject = {x: node_subject(n.prefix, "r1", partition(x, n.partitions), x) for x in ("node-a", "node-b")}
    year_ns = 365 * 86400 * 10**9

    def forged(seq: int, received: int | None = None) -> tuple[bytes, dict]:
        batch = pb.Batch(node_id="node-a", boot_id=a.boot, seq=seq, sent_unix_nano=time.time_ns())
        batch.samples.add(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, value=0.99, time_unix_nano=time.time_ns(),
                          labels={"device": "gpu0", "vendor": "nvidia"})
        return batch.SerializeToString(), {MSG_ID: msg_id("node-a", a.boot, seq),
                                           RECEIVED: str(time.time_ns() if received is None else received)}

    async def publish_as_a_gateway():
        nc = await connect_as(nats_cluster, "gateway")   # the one identity allowed to publish batches
        try:
            js = nc.jetstream(timeout=10)
            for subj, (data, headers) in ((subject["node-b"], forged(a.seq + 1)),             # a's batch on b's subject
                                          (subject["node-a"], forged(HUGE)),                  # far ahead
                                          (subject["node-a"], forged(a.seq + 2, time.time_ns() + year_ns))):
                await js.publish(subj, data, headers=headers)
        finally:
            await nc.close()
    run(publish_as_a_gateway(), 60)
    skipped = {"worker.skipped.node": 1, "worker.skipped.limits.max_seq_jump": 1, "worker.skipped.received": 1}

    def counted() -> bool:
        a.send()
        b.send()
        counters = nodes_json(gw)["counters"]
        return all(counters.get(k, 0) >= v for k, v in skipped.items())
    wait_until(counted, 60, interval_s=0.3, what=lambda: f"the forged messages counted: {nodes_json(gw)['counters']}")
    # The real nodes go on: node-a's newest real batches are applied after the forged ones.
    sent_after = a.seq
    wait_until(lambda: a.send() and b.send() and int(_node(gw, "node-a").get("stored_up_to", 0)) > sent_after, 60,
               interval_s=0.3, what=lambda: f"node-a's batches after the forged ones: {_node(gw, 'node-a')}")
    assert int(_node(gw, "node-a")["stored_up_to"]) <= a.seq                # what the agent sent, not 2**64-1
    wait_until(lambda: a.send() and b.send() and _placed(sched) == {"node-a", "node-b"}, 30, interval_s=0.3,
               what="both nodes placed")
    a.close()
    b.close()
