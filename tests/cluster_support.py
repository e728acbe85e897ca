"""Cluster-mode test support: a real 3-server JetStream cluster on loopback (fixture `nats_cluster`),
the gateway, worker and scheduler as real processes, and reading the streams back by message id.

Import the fixtures into a test module with `from cluster_support import nats_cluster  # noqa: F401`.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import nats
import nats.js.errors
import pytest
from helpers import BIN, free_port, wait_until

from xpusense.collector.cluster.localnats import LocalCluster
from xpusense.collector.cluster.subjects import MSG_ID, long_msg_id, msg_id, stream_name
from xpusense.v1 import telemetry_pb2 as pb

PREFIX = "xpusense"


@pytest.fixture
def nats_cluster(tmp_path):
    """Three nats-servers clustered on loopback (random free ports, a store dir each), formed and
    with a meta leader; torn down whatever the test did."""
    cluster = LocalCluster(3, tmp_path / "nats")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def cluster_config(tmp_path: Path, cluster: LocalCluster, extra: str = "", name: str = "collector.toml") -> Path:
    """A collector config for cluster mode with test-sized timings; every process it is given to
    connects with its own role's certificate (`{role}` in the path)."""
    path = tmp_path / name
    path.write_text(f"""stale_s = 10.0
[nats]
{cluster.nats_toml()}partitions = 6
streams = 3
replicas = 3
summary_s = 0.5
lease_s = 3.0
snapshot_s = 0.2
publish_timeout_s = 2.0
publish_give_up_s = 60.0
marks_flush_s = 0.5
{extra}""")
    return path


def module_cmd(*args: str) -> list[str]:
    """`xpusense-collector serve|worker|scheduler ...`: cluster mode's commands."""
    return [str(BIN / "xpusense-collector"), *args]


def start_gateway(procs, cfg: Path, name: str = "gateway", port: int | None = None):
    addr = f"127.0.0.1:{port or free_port()}"
    p = procs(module_cmd("serve", "--config", str(cfg), "--listen", addr), name)
    wait_until(lambda: _serving(addr) or p.p.poll() is not None, 60, what=f"{name} serving")
    assert p.p.poll() is None, p.output()
    return p, addr


def _serving(addr: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def connect_as(cluster: LocalCluster, role: str, **kw):
    """A plain nats-py connection to the cluster with a role's identity (nats_auth.ROLES)."""
    return await nats.connect(**cluster.connect_options(role), connect_timeout=2, max_reconnect_attempts=-1,
                              reconnect_time_wait=0.25, **kw)


async def fetch_ready(sub, batch: int, deadline_s: float = 30.0) -> list:
    """One pull of up to `batch` messages; a consumer just created answers "service unavailable"
    until its group is ready, so that answer is asked again until `deadline_s` has passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        try:
            return await sub.fetch(batch=batch, timeout=5)
        except nats.js.errors.ServiceUnavailableError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _read_ids(cluster: LocalCluster, streams: int, prefix: str = PREFIX) -> collections.Counter:
    """Every batch in the cluster's streams as `node:boot:seq` (read from the batch; control messages
    have no message id), with counts, each checked to carry its message id (subjects.msg_id); read
    with the exporter's identity (a reader of the streams)."""
    from nats.js import api
    nc = await connect_as(cluster, "exporter")
    ids: collections.Counter = collections.Counter()
    try:
        js = nc.jetstream(timeout=10)
        for i in range(streams):
            name = stream_name(prefix, i)
            info = await js.stream_info(name)
            if not info.state.messages:
                continue
            sub = await js.pull_subscribe("", durable=None, stream=name, config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=30,
                mem_storage=True, num_replicas=1))
            got = 0
            while got < info.state.messages:
                msgs = await fetch_ready(sub, 2000)
                for m in msgs:
                    got += 1
                    mid = (m.headers or {}).get(MSG_ID)
                    if mid:
                        b = pb.Batch.FromString(m.data)
                        assert mid == msg_id(b.node_id, b.boot_id, b.seq), (mid, b.node_id, b.boot_id, b.seq)
                        ids[long_msg_id(b.node_id, b.boot_id, b.seq)] += 1
            await sub.unsubscribe()
    finally:
        await nc.close()
    return ids


def stream_ids(cluster: LocalCluster, streams: int = 3) -> collections.Counter:
    return run(_read_ids(cluster, streams))


def check_exactly_once(ids: collections.Counter, acked: dict[tuple[str, str], int] | None = None,
                       contiguous: bool = True) -> dict:
    """Every id once; per (node, boot) the seqs are 1..max without a gap (unless not `contiguous`:
    batches not yet acknowledged may still be on their way). Returns {(node, boot): max}."""
    dups = {k: v for k, v in ids.items() if v > 1}
    assert not dups, f"stored more than once: {list(dups.items())[:5]}"
    seqs: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for mid in ids:
        node, boot, seq = mid.rsplit(":", 2)
        seqs[(node, boot)].append(int(seq))
    highs = {}
    for key, s in seqs.items():
        s.sort()
        assert not contiguous or s == list(range(1, len(s) + 1)), f"{key}: gaps in {s[:3]}..{s[-3:]} ({len(s)} of {s[-1]})"
        highs[key] = s[-1]
    for key, high in (acked or {}).items():
        assert highs.get(key, 0) >= high, f"{key}: acknowledged up to {high}, stream has {highs.get(key, 0)}"
    return highs


class SimAgent:
    """An agent speaking the real Ingest protocol to a gateway (8 accelerators of one model), for
    tests that need many nodes or accelerators without agent processes. `clock`: the agent's own
    (ns), which stamps its Hello, batches and samples."""

    def __init__(self, addr: str, node_id: str, labels: dict, model=("GPU", "nvidia", "A100-SXM4-80GB", "80GB"),
                 hbm: float = 80 * 2**30, clock=None):
        import queue
        import threading
        import time

        import grpc

        from xpusense.v1 import telemetry_pb2 as pb
        from xpusense.v1 import telemetry_pb2_grpc as pb_grpc
        self.pb, self.node_id, self.hbm = pb, node_id, hbm
        self.clock = clock or time.time_ns
        self.boot, self.seq, self.lock = f"boot-{node_id}", 0, threading.Lock()
        self.rtype, self.vendor = model[0], model[1]
        inv = pb.Inventory(hostname=node_id, labels=labels)
        for i in range(8):
            r = inv.resources.add(type=model[0], vendor=model[1], model=model[2], id=f"gpu{i}",
                                  attributes={"memory": model[3]})
            r.interconnects.add(type="NVLink")
        self.channel = grpc.insecure_channel(addr)
        self.acks: queue.Queue = queue.Queue()
        hello = pb.AgentMessage(hello=pb.Hello(node_id=node_id, boot_id=self.boot, inventory=inv,
                                               time_unix_nano=self.clock()))
        stub = pb_grpc.IngestStub(self.channel)

        def welcomed() -> bool:
            """A stream whose Hello got its Welcome. A gateway answers UNAVAILABLE while JetStream does
            not answer yet (a cluster just started: "no responders"); an agent then tries again."""
            self.out: queue.Queue = queue.Queue()
            self.out.put(hello)
            self.calls = stub.Stream(iter(self.out.get, None))
            try:
                return next(self.calls).HasField("welcome")
            except grpc.RpcError as e:
                self.out.put(None)   # the failed stream's request iterator ends
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                return False
        wait_until(welcomed, 60, interval_s=0.2, what=f"{node_id}: a Welcome from {addr}")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        import grpc
        try:
            for msg in self.calls:
                self.acks.put(msg.ack)
        except grpc.RpcError:
            pass

    def send(self, util: float = 0.1, used: float = 2 * 2**30, events=()):
        pb = self.pb
        with self.lock:
            self.seq += 1
            t = self.clock()
            b = pb.Batch(node_id=self.node_id, boot_id=self.boot, seq=self.seq, sent_unix_nano=t, events=list(events))
            for i in range(8):
                lab = {"device": f"gpu{i}", "vendor": self.vendor}
                for name, value in (("hw.gpu.utilization", util), ("hw.gpu.memory.usage", used),
                                    ("hw.gpu.memory.limit", self.hbm),
                                    ("xpusense.accelerator.hbm.bandwidth.utilization", 0.2)):
                    b.samples.add(name=name, unit="1", kind=pb.GAUGE, labels=lab, value=value, time_unix_nano=t)
            self.out.put(pb.AgentMessage(batch=b))
            return self.seq

    def close(self):
        self.out.put(None)
        self.channel.close()
