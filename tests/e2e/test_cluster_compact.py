"""Cluster mode takes the compact encoding end to end: a gateway chooses it in the Welcome, writes
each SeriesTable to the series bucket before it publishes the batches after it, and publishes the
compact batches as received; the workers' summaries, a scheduler replica's ListNodes and
GetHistory and the OTLP exporter show exactly what the same samples sent as Sample messages show,
through a move to a second gateway and a worker that takes over mid-stream with nothing in memory
(the definitions from the bucket). A batch the gateway cannot decode is refused, not acknowledged."""

from __future__ import annotations

import queue
import signal
import threading
import time

import grpc
from cluster_support import PREFIX, cluster_config, connect_as, fetch_ready, module_cmd, nats_cluster, run, start_gateway  # noqa: F401
from helpers import free_port, record_figure, wait_until
from test_cluster_export import Receiver
from test_cluster_scheduler import start_scheduler

from xpusense.collector.cluster.subjects import MSG_ID, RECEIVED, msg_id, node_filter, node_subject, partition
from xpusense.common import compact
from xpusense.common.compact_chain import Chain
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

DEVICES = ("gpu0", "gpu1")
T0 = time.time_ns() - 120 * 10**9   # the samples' stamps: one second apart from here


def definitions() -> list[pb.Sample]:
    """Series 1-5: per device utilisation and memory (kept in the summaries), a histogram; 6: a
    series that appears after the move to the second gateway."""
    out = []
    for d in DEVICES:
        lab = {"device": d, "vendor": "nvidia"}
        out.append(pb.Sample(name="hw.gpu.utilization", unit="1", kind=pb.GAUGE, labels=lab))
        out.append(pb.Sample(name="hw.gpu.memory.usage", unit="By", kind=pb.GAUGE, labels=lab))
    out.append(pb.Sample(name="xpusense.test.latency", unit="s", kind=pb.HISTOGRAM, labels={"op": "read"}))
    out.append(pb.Sample(name="hw.power", unit="W", kind=pb.GAUGE, labels={"device": "gpu0", "vendor": "nvidia"}))
    for ref, d in enumerate(out, 1):
        d.series_ref = ref
    return out


DEFS = definitions()


def round_of(seq: int) -> tuple[list[compact.Row], dict[int, compact.Histogram], list[pb.Sample]]:
    """Batch `seq`'s rows (by ref), histograms by row, and one sample without a ref (sent whole)."""
    t = T0 + seq * 10**9
    refs = [1, 2, 3, 4, 5] + ([6] if seq > 10 else [])
    rows = [(r, t, (seq * 7 + r) % 100 / 100 if DEFS[r - 1].name.endswith("utilization") else seq * 1e9 + r)
            for r in refs]
    hists = {4: ([0.1, 1.0], [seq, seq + 2, seq + 3])}
    whole = pb.Sample(name="hw.gpu.memory.limit", unit="By", kind=pb.GAUGE,
                      labels={"device": "gpu0", "vendor": "nvidia"}, value=80e9, time_unix_nano=t)
    return rows, hists, [whole]


class Client:
    """An agent's Ingest stream spoken by hand: compact batches after their SeriesTables, or the
    same samples as Sample messages."""

    def __init__(self, addr: str, node_id: str, offer: bool):
        self.node_id, self.boot, self.offer = node_id, f"boot-{node_id}", offer
        self.channel = grpc.insecure_channel(addr)
        self.out: queue.Queue = queue.Queue()
        self.acks: list[pb.Ack] = []
        self.sent: dict[int, bytes] = {}   # seq -> the Batch's bytes as sent
        self.error: grpc.RpcError | None = None
        inv = pb.Inventory(hostname=node_id, labels={"region": "r1"})
        inv.resources.add(type="GPU", vendor="nvidia", model="H100", id="gpu0", attributes={"memory": "80GB"})
        hello = pb.Hello(node_id=node_id, boot_id=self.boot, inventory=inv, time_unix_nano=time.time_ns(),
                         batch_encodings=compact.offered(compact.CHAINED) if offer else [])
        self.out.put(pb.AgentMessage(hello=hello))
        self.calls = pb_grpc.IngestStub(self.channel).Stream(iter(self.out.get, None))
        self.welcome = next(self.calls).welcome
        # chained (as the agent sends): each block after the stream's first deflated on the one before
        self.chain = Chain(10_000) if self.welcome.batch_encoding == compact.CHAINED else None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self.calls:
                self.acks.append(msg.ack)
        except grpc.RpcError as e:
            self.error = e

    def table(self, refs) -> None:
        self.out.put(pb.AgentMessage(series=pb.SeriesTable(boot_id=self.boot,
                                                           defs=compact.encode_defs(DEFS[r - 1] for r in refs))))

    def send(self, seq: int) -> None:
        rows, hists, whole = round_of(seq)
        msg = pb.AgentMessage(batch=pb.Batch(node_id=self.node_id, boot_id=self.boot, seq=seq,
                                             sent_unix_nano=time.time_ns()))
        b = msg.batch   # built in place: a copy's label maps may serialize in another order
        if self.offer:
            b.columns = compact.encode_columns(rows, hists)
            b.samples.extend(whole)
        else:
            b.samples.extend(compact.sample(DEFS[r[0] - 1], r, hists.get(i)) for i, r in enumerate(rows))
            b.samples.extend(whole)
        self.sent[seq] = b.SerializeToString()   # as the stream keeps it: its block deflated alone
        if self.chain is not None:
            b.columns = self.chain.send(b.columns)
        self.out.put(msg)

    def acked(self, seq: int) -> bool:
        return any(a.seq == seq for a in self.acks)

    def close(self) -> None:
        self.out.put(None)
        self.channel.close()


def _query(addr: str):
    return pb_grpc.QueryStub(grpc.insecure_channel(addr))


def _summary(q, node_id: str) -> dict:
    nodes = q.ListNodes(pb.ListNodesRequest(node_id=node_id), timeout=10).nodes
    return {(s.name, tuple(sorted(s.labels.items()))): (s.value, s.time_unix_nano)
            for n in nodes for s in n.series}


def _history(q, node_id: str, s: pb.Sample) -> list[tuple[int, float]]:
    try:
        reply = q.GetHistory(pb.HistoryRequest(node_id=node_id, name=s.name, labels=s.labels), timeout=20)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return []
        raise
    return [(p.time_unix_nano, p.value) for p in reply.points]


def _exported(receiver: Receiver, node_id: str) -> set:
    """Every data point exported for the node: (metric, attributes, time, value or histogram)."""
    with receiver.lock:
        reqs = list(receiver.requests)
    out = set()
    for req in reqs:
        for rm in req.resource_metrics:
            if not any(a.key == "xpusense.node.id" and a.value.string_value == node_id for a in rm.resource.attributes):
                continue
            for m in (m for sm in rm.scope_metrics for m in sm.metrics):
                for kind in ("gauge", "sum", "histogram"):
                    if m.HasField(kind):
                        for dp in getattr(m, kind).data_points:
                            attrs = tuple(sorted((a.key, a.value.string_value) for a in dp.attributes))
                            value = (dp.sum, tuple(dp.bucket_counts)) if kind == "histogram" else dp.as_double
                            out.add((m.name, attrs, dp.time_unix_nano, value))
    return out


def test_compact_batches_through_gateways_workers_and_readers(nats_cluster, procs, tmp_path):  # noqa: F811
    otlp = free_port()
    cfg = cluster_config(tmp_path, nats_cluster, extra=f"""[export.otlp]
enabled = true
endpoint = "127.0.0.1:{otlp}"
insecure = true
interval_s = 0.2
timeout_s = 2.0
backoff_max_s = 0.5
""")
    _, gw1 = start_gateway(procs, cfg, "gateway-1")
    _, gw2 = start_gateway(procs, cfg, "gateway-2")
    worker = procs(module_cmd("worker", "--config", str(cfg)), "worker-1")
    receiver = Receiver()
    server = receiver.serve(otlp)
    procs(module_cmd("exporter", "--config", str(cfg)), "exporter")
    _, sched = start_scheduler(procs, cfg, "scheduler")
    q = _query(sched)
    clients = []
    try:
        # Through gateway 1: series 1-5 defined, then ten batches; the twin sends Sample messages.
        compact_1, twin = Client(gw1, "compact-n", offer=True), Client(gw1, "sample-n", offer=False)
        clients += [compact_1, twin]
        assert compact_1.welcome.batch_encoding == compact.CHAINED and twin.welcome.batch_encoding == ""
        compact_1.table([1, 2, 3, 4, 5])
        for seq in range(1, 11):
            compact_1.send(seq)
            twin.send(seq)
        wait_until(lambda: compact_1.acked(10) and twin.acked(10), 60, what="ten batches of each acknowledged")
        wait_until(lambda: _summary(q, "compact-n") and _summary(q, "compact-n") == _summary(q, "sample-n"), 60,
                   what="the same summary for both nodes")
        # The agent moves to gateway 2 (a new stream: every definition again, then series 6 on its
        # own); the worker is killed meanwhile, so a new one takes its partitions over mid-stream.
        compact_1.close()
        worker.kill(signal.SIGKILL)
        compact_2 = Client(gw2, "compact-n", offer=True)
        clients.append(compact_2)
        assert compact_2.welcome.stored_up_to == 10
        compact_2.table([1, 2, 3, 4, 5])
        compact_2.table([6])
        for seq in range(11, 21):
            compact_2.send(seq)
            twin.send(seq)
        wait_until(lambda: compact_2.acked(20) and twin.acked(20), 60, what="twenty batches of each acknowledged")
        procs(module_cmd("worker", "--config", str(cfg)), "worker-2")
        last = T0 + 20 * 10**9
        got = wait_until(lambda: (s := _summary(q, "compact-n")) and all(t == last for _, t in s.values()) and s,
                         90, what="the new worker's summary up to batch 20")
        assert got == _summary(q, "sample-n")
        assert len(got) == 2 * len(DEVICES) + 2    # kept: utilisation, memory per device, power, memory limit
        nodes = q.ListNodes(pb.ListNodesRequest(), timeout=10)
        assert not [k for k in nodes.counters if k.startswith("worker.skipped")], dict(nodes.counters)
        # JetStream keeps the compact batches as they were sent, their blocks deflated alone again.
        stored = run(_stored(nats_cluster, "compact-n"))
        assert stored == {seq: data for c in (compact_1, compact_2) for seq, data in c.sent.items()}
        sample_bytes = sum(map(len, run(_stored(nats_cluster, "sample-n")).values()))
        record_figure("cluster compact", stream_batch_bytes_compact=sum(map(len, stored.values())),
                      stream_batch_bytes_sample=sample_bytes)
        assert sum(map(len, stored.values())) * 2 < sample_bytes
        # GetHistory from the stream: the same points, every one.
        for s in [*DEFS, round_of(1)[2][0]]:
            points = _history(q, "compact-n", s)
            assert points == _history(q, "sample-n", s), s.name
            assert len(points) == (10 if s.series_ref == 6 else 20), (s.name, len(points))
        # The exporter: the same data points for both nodes (histograms included).
        want = wait_until(lambda: len(e := _exported(receiver, "sample-n")) >= 20 * 7 - 10 and e, 60,
                          what="the Sample node's points exported")
        wait_until(lambda: _exported(receiver, "compact-n") == want, 60, what="the compact node's points exported alike")
        assert any(isinstance(v, tuple) for *_, v in want)
        # A compact batch on the stream whose ref 7 no table defines (published past the gateways'
        # checks): the worker skips and counts it, and applies none of it.
        run(_publish_undefined(nats_cluster, "compact-n", "boot-compact-n", 21))
        wait_until(lambda: q.ListNodes(pb.ListNodesRequest(), timeout=10).counters.get(
            "worker.skipped.series_definition"), 60, what="the undefined batch skipped and counted")
        assert _summary(q, "compact-n") == got
        _refusals(gw1)
    finally:
        for c in clients:
            c.close()
        server.stop(0)


async def _stored(cluster, node_id: str) -> dict[int, bytes]:
    """The node's batches in the stream, by seq, as stored."""
    from nats.js import api

    from xpusense.collector.cluster.subjects import stream_of
    nc = await connect_as(cluster, "exporter")
    try:
        js, part = nc.jetstream(timeout=10), partition(node_id, 6)
        sub = await js.pull_subscribe(node_filter(PREFIX, part, node_id), durable=None, stream=stream_of(PREFIX, part, 3),
                                      config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, mem_storage=True,
                                                                num_replicas=1, inactive_threshold=30))
        out: dict[int, bytes] = {}
        while True:
            msgs = await fetch_ready(sub, 100)
            out.update((pb.Batch.FromString(m.data).seq, m.data) for m in msgs if not (m.headers or {}).get("Xps-Kind"))
            if msgs[-1].metadata.num_pending == 0:
                return out
    finally:
        await nc.close()


async def _publish_undefined(cluster, node_id: str, boot: str, seq: int) -> None:
    nc = await connect_as(cluster, "gateway")
    try:
        rows = [(1, T0 + seq * 10**9, 0.5), (7, T0 + seq * 10**9, 0.5)]
        b = pb.Batch(node_id=node_id, boot_id=boot, seq=seq, sent_unix_nano=time.time_ns(),
                     columns=compact.encode_columns(rows))
        await nc.jetstream(timeout=10).publish(node_subject(PREFIX, "r1", partition(node_id, 6), node_id),
                                               b.SerializeToString(), headers={
                                                   MSG_ID: msg_id(node_id, boot, seq), RECEIVED: str(time.time_ns())})
    finally:
        await nc.close()


def _refusals(gw: str) -> None:
    """A batch using a ref its stream did not define, and columns that do not inflate: each ends
    the stream with the single collector's status, nothing acknowledged."""
    undefined, undecodable = Client(gw, "bad-undefined", offer=True), Client(gw, "bad-undecodable", offer=True)
    try:
        undefined.table([1, 2, 3])    # batch 1 uses 4 and 5 too
        undefined.send(1)
        undecodable.table([1, 2, 3, 4, 5])
        undecodable.out.put(pb.AgentMessage(batch=pb.Batch(node_id=undecodable.node_id, boot_id=undecodable.boot,
                                                           seq=1, sent_unix_nano=time.time_ns(), columns=b"not zlib")))
        wait_until(lambda: undefined.error is not None and undecodable.error is not None, 30, what="both refused")
        assert not undefined.acks and not undecodable.acks
        assert undefined.error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no definition for series_ref 4" in undefined.error.details()
        assert undecodable.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "columns" in undecodable.error.details()
    finally:
        undefined.close()
        undecodable.close()
