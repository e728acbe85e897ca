"""The stream client against a real gRPC collector on loopback: queueing, resends, exactly once."""

from __future__ import annotations

import random

import grpc
import pytest
from helpers import InProcessCollector, free_port, wait_until

from xpusense.agent.sources.base import Sample
from xpusense.agent.stream import StreamClient
from xpusense.collector import server as server_mod
from xpusense.collector.state import FleetState
from xpusense.common.backoff import backoff_delays
from xpusense.v1 import telemetry_pb2 as pb


@pytest.fixture
def client_factory():
    made = []

    def make(addr, **kw):
        kw = {"flush_s": 0.02, "backoff_initial_s": 0.02, "backoff_max_s": 0.2, **kw}
        c = StreamClient(addr, "node-a", "boot-1", lambda: pb.Inventory(hostname="h"), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop(drain_s=0)


def put_batch(client, i):
    client.put([Sample("test.value", float(i), "1", {"k": "v"}, time_ns=1_000_000_000 + i)])
    client.flush()


def test_queue_while_collector_down_then_everything_delivered_in_order(client_factory):
    port = free_port()
    client = client_factory(f"127.0.0.1:{port}")
    client.start()
    for i in range(1, 6):
        put_batch(client, i)
    assert client.pending() == 5 and not client.connected
    coll = InProcessCollector(port)
    try:
        wait_until(lambda: client.pending() == 0, what="the queue to drain")
        node = coll.on_loop(lambda: coll.state.view().nodes[0])
        assert node.stored_up_to == 5 and node.batches_stored == 5 and node.batches_duplicate == 0
        # Latest value is the last one sent: batches were stored in order.
        assert [s.value for s in node.series if s.name == "test.value"] == [5.0]
        hist = coll.on_loop(lambda: coll.state.history("node-a", "test.value", {"k": "v"}))
        assert [p.value for p in hist.points] == [1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        coll.stop()


def test_full_queue_drops_the_oldest_and_counts_the_loss(client_factory):
    client = client_factory(f"127.0.0.1:{free_port()}", queue_batches=3)
    for i in range(1, 6):
        put_batch(client, i)
    assert client.pending() == 3
    st = client.status()
    assert st["dropped_batches"] == 2 and st["dropped_samples"] == 2 and st["last_seq"] == 5


def test_resend_after_lost_ack_is_stored_once(client_factory, monkeypatch):
    """The collector stores batch 3, then the stream dies before the ack: the agent resends it."""
    port = free_port()
    original = server_mod.IngestServicer.Stream
    killed = []

    async def flaky(self, request_iterator, context):
        async for msg in original(self, request_iterator, context):
            if msg.HasField("ack") and msg.ack.seq == 3 and not killed:
                killed.append(3)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost (test)")
            yield msg

    monkeypatch.setattr(server_mod.IngestServicer, "Stream", flaky)
    coll = InProcessCollector(port)
    client = client_factory(coll.addr)
    client.start()
    try:
        for i in range(1, 6):
            put_batch(client, i)
        wait_until(lambda: client.pending() == 0 and client.last_seq() == 5, what="every batch acknowledged")
        node = coll.on_loop(lambda: coll.state.view().nodes[0])
        assert killed == [3]
        assert node.batches_stored == 5, "a batch was stored twice or lost"
        assert client.reconnects >= 2
        hist = coll.on_loop(lambda: coll.state.history("node-a", "test.value", {"k": "v"}))
        assert [p.value for p in hist.points] == [1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        coll.stop()


def test_state_drops_a_batch_it_already_stored():
    st = FleetState()
    st.hello(pb.Hello(node_id="n", boot_id="b"))
    b = pb.Batch(node_id="n", boot_id="b", seq=1)
    b.samples.add(name="x", unit="1", kind=pb.COUNTER, value=10, time_unix_nano=1_000_000_000)
    assert st.ingest(b) is True
    assert st.ingest(b) is False
    b2 = pb.Batch(node_id="n", boot_id="b", seq=2)
    b2.samples.add(name="x", unit="1", kind=pb.COUNTER, value=30, time_unix_nano=3_000_000_000)
    assert st.ingest(b2) is True
    node = st.view().nodes[0]
    assert (node.batches_stored, node.batches_duplicate, node.stored_up_to) == (2, 1, 2)
    assert node.series[0].rate == pytest.approx(10.0)  # (30 - 10) / 2 s


def test_new_boot_starts_its_own_sequence():
    st = FleetState()
    for boot in ("b1", "b2"):
        st.hello(pb.Hello(node_id="n", boot_id=boot))
        assert st.ingest(pb.Batch(node_id="n", boot_id=boot, seq=1)) is True


def test_backoff_grows_with_jitter_up_to_the_cap():
    d = backoff_delays(0.1, 1.0, random.Random(7))
    got = [next(d) for _ in range(8)]
    caps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    assert all(c / 2 <= g <= c for g, c in zip(got, caps))
    assert len(set(got)) == len(got)  # jittered, not a fixed schedule


def test_stop_interrupts_the_backoff_wait(client_factory):
    client = client_factory(f"127.0.0.1:{free_port()}", backoff_initial_s=600.0, backoff_max_s=600.0)
    client.start()
    wait_until(lambda: client.last_error, what="a first failed connect")
    client.stop(drain_s=0)
    assert not any(t.is_alive() for t in client._threads)


def test_made_up_boot_ids_do_not_grow_the_state_without_bound():
    from xpusense.collector.state import MAX_BOOTS_REMEMBERED
    st = FleetState()
    st.hello(pb.Hello(node_id="n", boot_id="live"))
    for i in range(100):
        assert st.ingest(pb.Batch(node_id="n", boot_id=f"fake{i}", seq=1)) is True
    n = st.nodes["n"]
    assert len(n.stored_up_to) <= MAX_BOOTS_REMEMBERED and "live" in n.stored_up_to
    assert len(n.refs) <= MAX_BOOTS_REMEMBERED
