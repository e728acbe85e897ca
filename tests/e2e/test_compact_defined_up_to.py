"""A Welcome's `series_defined_up_to`, with a real collector process on loopback and the agent's
stream client: a reconnect to the same collector (a cut relay) and one to a collector restarted from
its store send SeriesTables of the new series only; a collector restarted without a store (its
dictionary empty) gets every definition again; a collector claiming more definitions than the agent
made ends the connection. The points stored stay those of a Sample-encoding agent."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
import pytest
from compact_rounds import round_of
from helpers import BIN, InProcessCollector, free_port, wait_until
from test_compact_agent_collector import stored

from xpusense.agent import stream as stream_mod
from xpusense.agent.stream import StreamClient
from xpusense.collector import server as server_mod
from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from wire_bytes import Relay  # noqa: E402

T0 = 1_700_000_000_000_000_000


class Sent:
    """The compact agent's SeriesTables as its stream serializes them, in order: each one's refs."""

    def __init__(self, monkeypatch, boot: str = "boot-compact"):
        self.tables: list[list[int]] = []
        real = stream_mod.encode_message

        def spy(m):
            if isinstance(m, pb.AgentMessage) and m.HasField("series") and m.series.boot_id == boot:
                self.tables.append([d.series_ref for d in compact.decode_defs(m.series.defs, 1 << 24)])
            return real(m)
        monkeypatch.setattr(stream_mod, "encode_message", spy)


def client(addr: str, node: str, encoding: str = compact.ENCODING) -> StreamClient:
    return StreamClient(addr, node, f"boot-{node}", lambda: pb.Inventory(hostname="h"), flush_s=0.02,
                        backoff_initial_s=0.05, backoff_max_s=0.3, batch_encoding=encoding)


def serve(procs, addr: str, data: Path | None):
    args = [str(BIN / "xpusense-collector"), "serve", "--listen", addr]
    proc = procs(args + (["--data-dir", str(data)] if data else []), "collector")
    query = pb_grpc.QueryStub(channel := grpc.insecure_channel(addr))
    wait_until(lambda: query.ListNodes(pb.ListNodesRequest(), timeout=2), what="the collector answering")
    return proc, query, channel


def send(clients: list[StreamClient], i: int, acked: int) -> None:
    """Round `i` (`i` extra series: a new one each round from round 2) by every client, acknowledged."""
    for c in clients:
        c.put(round_of(i, extra=i, t0=T0))
        c.flush()
    wait_until(lambda: all(c.status()["acked"] == acked for c in clients), what=f"round {i} acknowledged")


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "store"])
def test_a_reconnect_to_the_same_collector_sends_only_new_definitions(procs, tmp_path, monkeypatch, durable):
    sent = Sent(monkeypatch)
    addr = f"127.0.0.1:{free_port()}"
    proc, query, channel = serve(procs, addr, tmp_path / "data" if durable else None)
    relay = Relay(("127.0.0.1", int(addr.rsplit(":", 1)[1])))
    compact_c, samples_c = client(f"127.0.0.1:{relay.port}", "compact"), client(addr, "samples", "")
    try:
        compact_c.start()
        samples_c.start()
        for i in range(2):
            send([compact_c, samples_c], i, i + 1)
        assert sent.tables == [[1, 2, 3, 4], [5, 6]]   # a whole sample's ref (big.hist) with the next
        before = len(sent.tables)
        relay.cut()   # the same collector, a new connection
        wait_until(lambda: compact_c.status()["reconnects"] == 2, what="the agent reconnected through the relay")
        send([compact_c, samples_c], 2, 3)
        # Refs 1-6 are held: only the series new in round 2 is defined on the new connection.
        assert sent.tables[before:] == [[7]]
        assert all(c.status()["dropped_samples"] == 0 and c.status()["set_aside"] == 0 for c in (compact_c, samples_c))
        assert stored(query, "compact") == stored(query, "samples")
        counters = dict(query.ListNodes(pb.ListNodesRequest(node_id="\x00"), timeout=5).counters)
        assert counters["ingest.compact.batches"] == 3 and counters.get("ingest.compact.batches_missing_definition", 0) == 0
    finally:
        for c in (compact_c, samples_c):
            c.stop(drain_s=0)
        relay.close()
        channel.close()


@pytest.mark.parametrize("durable,sig,defined_again", [
    (True, signal.SIGKILL, [[7]]),                        # the log replayed: refs 1-6 held
    (True, signal.SIGTERM, [[7]]),                        # the snapshot on stop: refs 1-6 held
    (False, signal.SIGTERM, [[1, 2, 3, 4, 5, 6, 7]]),     # no store: nothing held, every one again
], ids=["store-killed", "store-stopped", "memory"])
def test_a_restarted_collector_is_sent_the_definitions_it_does_not_hold(procs, tmp_path, monkeypatch, durable, sig,
                                                                         defined_again):
    sent = Sent(monkeypatch)
    addr = f"127.0.0.1:{free_port()}"
    data = tmp_path / "data" if durable else None
    proc, query, channel = serve(procs, addr, data)
    compact_c, samples_c = client(addr, "compact"), client(addr, "samples", "")
    try:
        compact_c.start()
        samples_c.start()
        for i in range(2):
            send([compact_c, samples_c], i, i + 1)
        assert sent.tables == [[1, 2, 3, 4], [5, 6]]   # a whole sample's ref (big.hist) with the next
        before = len(sent.tables)
        proc.kill(sig)
        channel.close()
        proc, query, channel = serve(procs, addr, data)   # the same address: the agents reconnect to it
        wait_until(lambda: all(c.status()["reconnects"] == 2 for c in (compact_c, samples_c)),
                   what="both agents reconnected to the restarted collector")
        send([compact_c, samples_c], 2, 3)
        assert sent.tables[before:] == defined_again
        assert compact_c.status()["set_aside"] == 0 and compact_c.status()["dropped_samples"] == 0
        assert stored(query, "compact") == stored(query, "samples")
        assert len(stored(query, "compact")[0]) == 7   # every series, its definition held by the restarted one
    finally:
        for c in (compact_c, samples_c):
            c.stop(drain_s=0)
        channel.close()


class OverClaim:
    """An Ingest.Stream whose first Welcome claims series definitions up to 1000 for the agent's boot,
    which made a handful; later ones hold none and acknowledge every batch. What each connection got:
    ("table", refs) and ("batch", seq)."""

    def __init__(self):
        self.got: list[list[tuple]] = []

    async def stream(self, request_iterator):
        hello = (await anext(aiter(request_iterator))).hello
        got: list[tuple] = []
        self.got.append(got)
        yield pb.CollectorMessage(welcome=pb.Welcome(boot_id=hello.boot_id, batch_encoding=compact.ENCODING,
                                                     series_defined_up_to=1000 if len(self.got) == 1 else 0))
        async for msg in request_iterator:
            if msg.HasField("series"):
                got.append(("table", [d.series_ref for d in compact.decode_defs(msg.series.defs, 1 << 24)]))
            elif msg.HasField("batch"):
                got.append(("batch", msg.batch.seq))
                boot = msg.batch.boot_id or hello.boot_id   # version 2 leaves out the Hello's
                yield pb.CollectorMessage(ack=pb.Ack(boot_id=boot, seq=msg.batch.seq))


def test_a_welcome_claiming_more_definitions_than_made_ends_the_connection(monkeypatch):
    over = OverClaim()

    async def stream(self, request_iterator, context):   # an async generator, as grpc wants it
        async for msg in over.stream(request_iterator):
            yield msg
    monkeypatch.setattr(server_mod.IngestServicer, "Stream", stream)
    coll = InProcessCollector()
    c = client(coll.addr, "n1")
    try:
        for i in range(2):
            c.put(round_of(i, extra=i, t0=T0))
            c.flush()
        c.start()
        wait_until(lambda: c.pending() == 0, what="both batches acknowledged on a later connection")
        assert c.status()["impossible_acks"] == 1
        # Nothing was sent on the lying connection; the next one defined every series before its batches.
        assert over.got[0] == []
        assert over.got[1] == [("table", [1, 2, 3, 4]), ("batch", 1), ("table", [5, 6]), ("batch", 2)]
    finally:
        c.stop(drain_s=0)
        coll.stop()
