"""The stream client against a collector (a real gRPC server on loopback) that claims to hold more
than the agent sent: an ack of a seq never sent, and a Welcome above what a restarted agent's spool
holds of an earlier boot. Nothing is taken as acknowledged, the claim is counted and the
connection ends; the next connection gets every batch."""

from __future__ import annotations

import pytest
from helpers import InProcessCollector, wait_until

from xpusense.agent.sources.base import Sample
from xpusense.agent.spool import Spool
from xpusense.agent.stream import StreamClient
from xpusense.collector import server as server_mod
from xpusense.v1 import telemetry_pb2 as pb


def client(addr, boot, **kw):
    return StreamClient(addr, "node-a", boot, lambda: pb.Inventory(hostname="h"), flush_s=0.02,
                        backoff_initial_s=0.02, backoff_max_s=0.2, **kw)


def put_batch(c, i):
    c.put([Sample("test.value", float(i), "1", {"k": "v"}, time_ns=1_000_000_000 + i)])
    c.flush()


class Liar:
    """The Ingest.Stream of a collector whose first connection lies (`first`: how), later ones
    acknowledge every batch; what each connection received, as (boot, seq)."""

    def __init__(self, first):
        self.first = first
        self.got: list[list[tuple[str, int]]] = []

    async def stream(self, request_iterator):
        hello = (await anext(aiter(request_iterator))).hello
        got: list[tuple[str, int]] = []
        self.got.append(got)
        lying = len(self.got) == 1
        yield pb.CollectorMessage(welcome=self.first["welcome"] if lying and "welcome" in self.first
                                  else pb.Welcome(boot_id=hello.boot_id, stored_up_to=0))
        async for msg in request_iterator:
            got.append((msg.batch.boot_id, msg.batch.seq))
            seq = msg.batch.seq + self.first.get("ack_above", 0) if lying else msg.batch.seq
            yield pb.CollectorMessage(ack=pb.Ack(boot_id=msg.batch.boot_id, seq=seq))


@pytest.fixture
def liar(monkeypatch):
    def make(**first):
        lie = Liar(first)

        async def stream(self, request_iterator, context):   # an async generator, as grpc wants it
            async for msg in lie.stream(request_iterator):
                yield msg
        monkeypatch.setattr(server_mod.IngestServicer, "Stream", stream)
        return lie
    return make


def test_an_ack_of_a_seq_never_sent_trims_nothing_is_counted_and_ends_the_connection(liar):
    lie = liar(ack_above=1_000_000)
    coll = InProcessCollector()
    c = client(coll.addr, "boot-1")
    try:
        for i in range(1, 4):
            put_batch(c, i)
        c.start()
        wait_until(lambda: c.pending() == 0 and len(lie.got) >= 2, what="every batch acknowledged, on a second connection")
        assert c.status()["impossible_acks"] == 1
        assert c.acked == 3 and c.duplicates == 0
        assert lie.got[1][:3] == [("boot-1", 1), ("boot-1", 2), ("boot-1", 3)], "all sent again after the lie"
    finally:
        c.stop(drain_s=0)
        coll.stop()


def test_a_restarted_agent_refuses_a_welcome_above_what_its_spool_holds_of_an_earlier_boot(tmp_path, liar):
    """The earlier boot's highest seq comes from the spool (its batches and acknowledged mark)."""
    sp = Spool(str(tmp_path / "spool"))
    sp.open()
    before = client("127.0.0.1:1", "boot-old", spool=sp)
    for i in range(1, 5):
        put_batch(before, i)
    sp.ack("boot-old", 1)                            # batch 1 was acknowledged before the restart
    before.stop(drain_s=0)                           # never connected: as if killed
    sp.close()
    again = Spool(str(tmp_path / "spool"))
    found = again.open()
    assert [k for k, _ in found] == [("boot-old", 2), ("boot-old", 3), ("boot-old", 4)]
    lie = liar(welcome=pb.Welcome(boot_id="boot-old", stored_up_to=5))
    coll = InProcessCollector()
    c = client(coll.addr, "boot-new", spool=again)
    c.resume(found)
    c.start()
    try:
        wait_until(lambda: c.pending() == 0, what="every batch acknowledged or taken as stored")
        sent_again = lie.got[1] if len(lie.got) > 1 else []
        assert sent_again[:3] == [("boot-old", 2), ("boot-old", 3), ("boot-old", 4)], "not taken as stored by the lie"
        assert c.acked == 3 and c.status()["impossible_acks"] == 1
    finally:
        c.stop(drain_s=0)
        again.close()
        coll.stop()
