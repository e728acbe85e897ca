"""Series that come and go (process series carry pids), against real processes: a real collector,
and a real gateway and worker on a real 3-server JetStream cluster, fed by a raw Ingest client
that introduces new series, each under a new series_ref, round after round. The limits are small
and `[state] series_idle_s` is 1 s, so each round of churn takes about a second: a round's series
must be let go before the next round ends, and no batch may be refused (a node past
`max_series_per_boot` references must not be silenced until its agent restarts)."""

from __future__ import annotations

import queue
import threading
import time

import grpc
from cluster_support import cluster_config, nats_cluster, start_gateway  # noqa: F401
from helpers import BIN, free_port, wait_until

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

ROUNDS = 6
PER_ROUND = 100          # new series a round; past max_series_per_boot by the third round
REF_LIMIT = 250
STEADY = ("hw.gpu.utilization", {"device": "gpu0"})


class ChurnClient:
    """One node's boot over the Ingest protocol: `send` a batch of the steady series plus any new
    ones, each new series under a series_ref never used before in the boot (as an agent does);
    `reconnect` opens another stream for the same boot. Every reply and the stream's end are kept."""

    def __init__(self, addr: str, node: str):
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.IngestStub(self.channel)
        self.node, self.boot = node, f"boot-{node}"
        self.seq, self.next_ref = 0, 2          # ref 1: the steady series
        self.acked: set[int] = set()
        self.errors: list[grpc.RpcError] = []
        self.welcomes: list[int] = []
        self._open()

    def _open(self) -> None:
        def opened() -> bool:
            self.out: queue.Queue = queue.Queue()
            self.out.put(pb.AgentMessage(hello=pb.Hello(node_id=self.node, boot_id=self.boot,
                                                        time_unix_nano=time.time_ns())))
            self.calls = self.stub.Stream(iter(self.out.get, None))
            try:
                first = next(self.calls)
            except grpc.RpcError as e:   # a gateway whose cluster is not answering yet: UNAVAILABLE
                self.out.put(None)
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                return False
            self.welcomes.append(first.welcome.stored_up_to)
            return True
        wait_until(opened, 60, interval_s=0.2, what=f"{self.node}: a Welcome")
        threading.Thread(target=self._read, args=(self.calls,), daemon=True).start()

    def _read(self, calls) -> None:
        try:
            for msg in calls:
                self.acked.add(msg.ack.seq)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(e)

    def send(self, new: list[tuple[str, dict]] = ()) -> int:
        self.seq += 1
        t = time.time_ns()
        b = pb.Batch(node_id=self.node, boot_id=self.boot, seq=self.seq, sent_unix_nano=t)
        b.samples.add(name=STEADY[0], unit="1", kind=pb.GAUGE, labels=STEADY[1], value=self.seq, time_unix_nano=t,
                      series_ref=1)
        for name, labels in new:
            b.samples.add(name=name, unit="1", kind=pb.GAUGE, labels=labels, value=self.seq, time_unix_nano=t,
                          series_ref=self.next_ref)
            self.next_ref += 1
        self.out.put(pb.AgentMessage(batch=b))
        return self.seq

    def acked_up_to(self, seq: int) -> bool:
        assert not self.errors, f"the stream was refused: {self.errors[0].code()} {self.errors[0].details()}"
        return self.acked >= set(range(1, seq + 1))

    def all_acked(self) -> bool:
        return self.acked_up_to(self.seq)

    def reconnect(self) -> None:
        wait_until(self.all_acked, 60, what="every batch acknowledged before the reconnect")
        self.calls.cancel()
        self.out.put(None)
        self._open()

    def close(self) -> None:
        self.out.put(None)
        self.channel.close()


def churn(client: ChurnClient, new_series, expired, held, per_round: int, reconnect: bool = False) -> list[int]:
    """ROUNDS rounds: a batch of new series (`new_series(r)`, of which `per_round` are the kind
    watched), then steady batches until the round before's are let go (`expired()` counts them);
    `held()`, the node's series then, must be within two rounds' worth. After each round another
    stream for the boot when `reconnect`. Returns what `held()` was at each round's end."""
    seen = []
    for r in range(ROUNDS):
        client.send(new_series(r))

        def round_before_gone(r: int = r) -> bool:
            seq = client.send()   # the steady series keeps coming
            return expired() >= per_round * r and client.acked_up_to(seq - 1)
        wait_until(round_before_gone, 90, interval_s=0.1,
                   what=lambda r=r: f"round {r}: the series of the round before let go (expired {expired()}, "
                                    f"held {held()}, acked {len(client.acked)} of {client.seq})")
        seen.append(held())
        assert seen[-1] <= 2 * per_round + 1, f"round {r}: {seen[-1]} series held"
        if reconnect:
            client.reconnect()
    return seen


# -- the single collector ---------------------------------------------------------------------------
def test_collector_lets_idle_series_go_and_never_refuses_a_boot_for_its_references(procs, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "collector.toml"
    cfg.write_text(f"[state]\nseries_idle_s = 1.0\n[limits]\nmax_series_per_boot = {REF_LIMIT}\n")
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr, "--config", str(cfg)], "collector")
    query = pb_grpc.QueryStub(grpc.insecure_channel(addr))
    wait_until(lambda: query.ListNodes(pb.ListNodesRequest(), timeout=2), what="the collector answering")

    def node() -> pb.NodeView:
        return query.ListNodes(pb.ListNodesRequest(node_id="churn"), timeout=5).nodes[0]

    def counters() -> dict[str, int]:
        return dict(query.ListNodes(pb.ListNodesRequest(node_id="\x00"), timeout=5).counters)

    client = ChurnClient(addr, "churn")
    try:
        held = churn(client, lambda r: [("process.memory.usage", {"pid": f"{r}-{i}"}) for i in range(PER_ROUND)],
                     lambda: counters().get("state.series.expired", 0), lambda: node().series_total, PER_ROUND,
                     reconnect=True)
        # ROUNDS x PER_ROUND series came, at most two rounds' worth were ever held at once.
        assert ROUNDS * PER_ROUND > 2 * PER_ROUND + 1 >= max(held)
        c = counters()
        assert c["limits.max_series_per_boot"] >= 1   # the references went past the bound, and were taken
        # A series that was let go and comes back (a new reference, as the agent gives it) is
        # stored again as itself; the steady one never stopped.
        seq = client.send([("process.memory.usage", {"pid": "0-7"})])
        wait_until(client.all_acked, 30, what="the returning series acknowledged")
        n = node()
        back = [s for s in n.series if s.name == "process.memory.usage" and dict(s.labels) == {"pid": "0-7"}]
        assert len(back) == 1 and back[0].value == seq
        steady = [s for s in n.series if s.name == STEADY[0]]
        assert len(steady) == 1 and steady[0].value == seq
        points = query.GetHistory(pb.HistoryRequest(node_id="churn", name=STEADY[0], labels=STEADY[1]), timeout=5)
        assert [p.value for p in points.points][-3:] == [seq - 2, seq - 1, seq]
    finally:
        client.close()


# -- cluster mode: a gateway and a worker ------------------------------------------------------------
def test_gateway_and_worker_let_churn_go_and_keep_the_node_after_reconnects(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster,
                         f"[state]\nseries_idle_s = 1.0\n[limits]\nmax_series_per_boot = {REF_LIMIT}\n")
    procs([str(BIN / "xpusense-collector"), "worker", "--config", str(cfg)], "worker")
    _, addr = start_gateway(procs, cfg)
    query = pb_grpc.QueryStub(grpc.insecure_channel(addr))

    def view() -> pb.ListNodesReply:
        return query.ListNodes(pb.ListNodesRequest(node_id="churn"), timeout=5)

    def held() -> int:
        nodes = view().nodes
        return nodes[0].series_total if nodes else 0

    client = ChurnClient(addr, "churn")
    try:
        # Kept series (the worker keeps accelerators' series, not per-process ones) and process
        # series beside them: both under new references each round; a reconnect after each round.
        def new_series(r: int) -> list[tuple[str, dict]]:
            return [*(("hw.gpu.utilization", {"device": f"gpu-{r}-{i}"}) for i in range(PER_ROUND // 2)),
                    *(("process.memory.usage", {"pid": f"{r}-{i}"}) for i in range(PER_ROUND // 2))]
        kept = PER_ROUND // 2
        seen = churn(client, new_series, lambda: view().counters.get("state.series.expired", 0), held, kept,
                     reconnect=True)
        assert max(seen) <= 2 * kept + 1 < ROUNDS * kept, seen
        # Every batch was stored and acknowledged, over ROUNDS reconnects, past the reference limit.
        assert client.all_acked() and client.next_ref - 1 > REF_LIMIT and len(client.welcomes) == ROUNDS + 1
        seq = client.send([("hw.gpu.utilization", {"device": "gpu-0-3"})])   # a series let go comes back
        wait_until(lambda: any(s.name == "hw.gpu.utilization" and dict(s.labels) == {"device": "gpu-0-3"}
                               and s.value == seq for s in view().nodes[0].series), 60,
                   what="the returning series in the node's summary")
    finally:
        client.close()
