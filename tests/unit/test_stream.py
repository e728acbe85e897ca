"""The stream client against a real gRPC collector on loopback: queueing, resends, exactly once."""

from __future__ import annotations

import random

import grpc
import pytest
from helpers import InProcessCollector, free_port, record_figure, wait_until

from xpusense.agent.sources.base import COUNTER, HISTOGRAM, Sample
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


# -- the spool's damaged records and a failing disk, seen from the stream ----

def spool_with(tmp_path, batches):
    """A spool holding (boot, seq, bytes) records, as a killed agent would have left it."""
    from xpusense.agent.spool import Spool
    sp = Spool(str(tmp_path / "spool"))
    sp.open()
    for boot, seq, data in batches:
        sp.append(boot, seq, 1, data)
    sp._stop.set()
    sp._lockf.close()
    return sp


def old_batch(seq, node="node-a", boot="old"):
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq)
    b.samples.add(name="test.value", unit="1", kind=pb.GAUGE, labels={"k": "v"}, value=float(seq),
                  time_unix_nano=1_000_000_000 + seq)
    return b.SerializeToString()


def test_a_spooled_batch_that_cannot_be_sent_is_set_aside_once_and_the_rest_delivered(tmp_path, client_factory):
    """The issue's undecodable record was resent forever and nothing after it was delivered. Here
    one record does not decode and one is another node's: both are set aside, counted, never sent."""
    from xpusense.agent.spool import Spool
    spool_with(tmp_path, [("old", 1, old_batch(1)), ("old", 2, b"\x0a\xff\xff\xff not protobuf"),
                          ("old", 3, old_batch(3)), ("old", 4, old_batch(4, node="node-b")), ("old", 5, old_batch(5))])
    sp = Spool(str(tmp_path / "spool"))   # no validator: the stream must catch them when it reads them back
    found = sp.open()
    assert len(found) == 5
    coll = InProcessCollector()
    client = client_factory(coll.addr, spool=sp)
    client.resume(found)
    client.start()
    try:
        wait_until(lambda: client.pending() == 0, what="the spooled batches delivered or set aside")
        put_batch(client, 100)
        wait_until(lambda: client.pending() == 0 and client.acked == 4, what="the new boot's batch delivered")
        hist = coll.on_loop(lambda: coll.state.history("node-a", "test.value", {"k": "v"}))
        assert [p.value for p in hist.points] == [1.0, 3.0, 5.0, 100.0]
        assert client.set_aside == 2 and client.dropped_batches == 2 and sp.damaged_records == 2
        assert client.reconnects == 1, "a bad record must not tear the stream down"
        assert len(list((tmp_path / "spool" / "damaged").iterdir())) == 2
    finally:
        client.stop(drain_s=0)
        sp.close()
        coll.stop()
    again = Spool(str(tmp_path / "spool"))
    assert again.open() == [], "nothing set aside comes back after a restart"
    again.close()


def test_while_the_spool_cannot_write_batches_wait_in_memory_within_their_budget(tmp_path, client_factory):
    from test_spool import fill_up, small_tmpfs

    from xpusense.agent.spool import Spool
    with small_tmpfs(tmp_path / "mnt") as mnt:
        sp = Spool(str(mnt / "spool"))
        sp.open()
        client = client_factory(f"127.0.0.1:{free_port()}", spool=sp, queue_batches=5)

        def put_batch(client, i):                  # a batch over a page: the disk cannot take it
            client.put([Sample("test.value", float(i), "1", {"k": "v"}, time_ns=1_000_000_000 + i)]
                       + [Sample("test.pad", 0.0, "1", {"d": str(d)}, time_ns=1) for d in range(200)])
            client.flush()

        put_batch(client, 1)                       # on disk
        filler = fill_up(mnt)
        for i in range(2, 14):                     # 12 batches the disk does not take
            put_batch(client, i)
        st = client.status()
        assert st["spool"]["state"] == "failing" and st["spool"]["write_failures"] == 12
        assert st["memory_batches"] == 5 and st["dropped_batches"] == 7 and st["last_seq"] == 13
        filler.unlink()
        put_batch(client, 14)                      # on disk again, and the 5 held in memory with it
        assert sp.state == "ok" and client.status()["memory_batches"] == 0 and sp.status()["batches"] == 7
        client.stop(drain_s=0)                     # (never started: as if killed before sending)
        sp.close()
        again = Spool(str(mnt / "spool"))
        found = again.open()
        assert [k[1] for k, _ in found] == [1, 9, 10, 11, 12, 13, 14], "in seq order, wherever they lie"
        coll = InProcessCollector()
        client = client_factory(coll.addr, spool=again)
        client.resume(found)
        client.start()
        try:
            wait_until(lambda: client.pending() == 0, what="everything kept delivered")
            hist = coll.on_loop(lambda: coll.state.history("node-a", "test.value", {"k": "v"}))
            # 2..8 were dropped (counted) while the disk was full; every other seq was kept and delivered.
            assert [p.value for p in hist.points] == [1.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0]
        finally:
            client.stop(drain_s=0)
            again.close()
            coll.stop()


def test_a_sample_that_cannot_be_encoded_costs_that_sample_only(client_factory):
    coll = InProcessCollector()
    client = client_factory(coll.addr)
    client.start()
    try:
        client.put([Sample("test.value", 1.0, "1", {"k": "v"}, time_ns=1_000_000_001),
                    Sample("test.value", "not a number", "1", {"k": "v"}, time_ns=1_000_000_002)])
        ticks = client.progress()
        wait_until(lambda: client.acked == 1 and client.progress() > ticks, what="the batch delivered, the batcher alive")
        hist = coll.on_loop(lambda: coll.state.history("node-a", "test.value", {"k": "v"}))
        assert [p.value for p in hist.points] == [1.0]
        assert client.dropped_samples == 1 and client.dropped_batches == 0 and client.last_seq() == 1
    finally:
        client.stop(drain_s=0)
        coll.stop()


def test_a_connection_that_fails_at_once_does_not_reset_the_backoff(client_factory, monkeypatch):
    """A collector that accepts and then fails must not reset the backoff at each connect: only a
    connection that stayed up backoff_reset_s resets it."""
    import asyncio
    import threading
    import time
    hold, done = threading.Event(), threading.Event()
    connections = []

    async def flaky(self, request_iterator, context):
        connections.append(time.monotonic())
        n = len(connections)
        yield pb.CollectorMessage(welcome=pb.Welcome())
        # The first 8 fail at once; the 9th stays up until the test lets go; later ones stay up.
        while n > 8 and not (done if n > 9 else hold).is_set():
            await asyncio.sleep(0.01)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "disk full (test)")

    monkeypatch.setattr(server_mod.IngestServicer, "Stream", flaky)
    coll = InProcessCollector()
    client = client_factory(coll.addr, backoff_initial_s=0.02, backoff_max_s=0.4, backoff_reset_s=0.3)
    client.start()
    try:
        wait_until(lambda: len(connections) >= 8 and client.reconnects >= 8, what="eight short connections")
        # Eight failures in a row: the wait has grown to its cap (jittered in [cap/2, cap]).
        assert client.backoff_s >= 0.2, client.backoff_s
        wait_until(lambda: len(connections) >= 9 and client.connected, what="a connection that stays up")
        up = time.monotonic()
        wait_until(lambda: time.monotonic() - up >= 0.5, what="the connection to outlive backoff_reset_s")
        hold.set()
        wait_until(lambda: len(connections) >= 10 and client.backoff_s <= 0.02, what="the backoff reset after it")
        gaps = [b - a for a, b in zip(connections, connections[1:8])]
        record_figure("backoff: collector that accepts then fails", connections_before_cap=8,
                      first_gap_ms=round(gaps[0] * 1000), seventh_gap_ms=round(gaps[-1] * 1000))
    finally:
        hold.set()
        done.set()
        client.stop(drain_s=0)
        coll.stop()


@pytest.mark.parametrize("then", ["ack", "abort", "ack-last-late"])
def test_a_batch_dropped_over_budget_while_in_flight_counts_only_if_never_acknowledged(client_factory, monkeypatch, then):
    """The memory queue overflows while its oldest batch is already on the wire: whether that one
    is lost is known only when its acknowledgement comes, or the connection ends without it; and a
    drain (a stop drains before it cancels the stream) waits for that acknowledgement too."""
    import asyncio
    import threading
    got, release, late = [], threading.Event(), threading.Event()

    async def slow(self, request_iterator, context):
        await anext(aiter(request_iterator))
        yield pb.CollectorMessage(welcome=pb.Welcome())
        async for msg in request_iterator:
            got.append(msg.batch.seq)
            if len(got) == 3:
                break
        while not release.is_set():
            await asyncio.sleep(0.01)
        if then == "abort":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gone before acknowledging (test)")
        for seq in got if then == "ack" else (2, 3):
            yield pb.CollectorMessage(ack=pb.Ack(boot_id="boot-1", seq=seq))
        while not late.is_set():
            await asyncio.sleep(0.01)
        yield pb.CollectorMessage(ack=pb.Ack(boot_id="boot-1", seq=1))
        await asyncio.Event().wait()

    monkeypatch.setattr(server_mod.IngestServicer, "Stream", slow)
    coll = InProcessCollector()
    client = client_factory(coll.addr, queue_batches=2)
    client.start()
    try:
        wait_until(lambda: client.connected, what="connected")
        for i in range(1, 4):
            put_batch(client, i)
            wait_until(lambda i=i: got == list(range(1, i + 1)), what=f"batch {i} on the wire")
        assert client.pending() == 2 and client.dropped_batches == 0, "in flight: not counted yet"
        release.set()
        if then == "ack":
            wait_until(lambda: client.acked == 3, what="all three acknowledged")
            assert client.dropped_batches == 0
        elif then == "abort":
            wait_until(lambda: client.dropped_batches == 1, what="the one dropped counted once the stream ended")
            assert client.dropped_samples == 1
        else:
            wait_until(lambda: client.pending() == 0, what="batches 2 and 3 acknowledged")
            assert client.drain(0.05) is False, "batch 1, dropped in flight, is not acknowledged yet"
            late.set()
            assert client.drain(60) is True
            assert client.acked == 3 and client.dropped_batches == 0
    finally:
        release.set()
        late.set()
        client.stop(drain_s=0)
        coll.stop()


def test_a_batch_the_collector_refuses_for_good_is_set_aside_not_resent_forever(client_factory):
    """A batch over the collector's limits (INVALID_ARGUMENT, 'batch rejected') would be resent on
    every reconnect and hold back every batch after it: it is set aside and counted instead."""
    from xpusense.collector.limits import Limits
    coll = InProcessCollector(limits=Limits(max_label_value_len=16, batches_per_s=1000))
    client = client_factory(coll.addr)
    client.start()
    try:
        put_batch(client, 1)
        wait_until(lambda: client.acked == 1, what="batch 1 stored")
        client.put([Sample("test.value", 2.0, "1", {"k": "v" * 100}, time_ns=1_000_000_002)])
        client.flush()
        put_batch(client, 3)
        wait_until(lambda: client.pending() == 0, what="batch 2 set aside, batch 3 stored")
        hist = coll.on_loop(lambda: coll.state.history("node-a", "test.value", {"k": "v"}))
        assert [p.value for p in hist.points] == [1.0, 3.0]
        assert client.set_aside == 1 and client.dropped_batches == 1 and client.reconnects == 2
        assert "limits.max_label_value_len" in client.last_error
    finally:
        client.stop(drain_s=0)
        coll.stop()


def test_a_rounds_samples_put_moments_apart_go_out_as_one_batch(client_factory):
    """The batcher cuts flush_s after the first samples came, not on a clock of its own: the sources
    of one round, which finish milliseconds apart, cost one spool record, one message, one ack."""
    coll = InProcessCollector()
    client = client_factory(coll.addr, flush_s=0.5)
    client.start()
    try:
        for part in range(3):   # three sources finishing one after the other within the window
            client.put([Sample("test.part", float(part), "1", {"source": str(part)}, time_ns=1_000_000_000 + part)])
        wait_until(lambda: client.acked >= 1, what="the round's batch acknowledged")
        assert client.last_seq() == 1
        node = coll.on_loop(lambda: coll.state.view().nodes[0])
        assert sorted(s.labels["source"] for s in node.series if s.name == "test.part") == ["0", "1", "2"]
        # Asleep while nothing comes, the batcher still ticks (the watchdog's progress()).
        ticks = client.progress()
        wait_until(lambda: client.progress() > ticks, what="an idle tick of the batcher")
        assert client.last_seq() == 1
    finally:
        client.stop(drain_s=0)
        coll.stop()


def test_series_templates_keep_each_series_ref_and_fields(client_factory):
    """Each sample is built from its series' template (name, unit, kind, labels, ref); a histogram
    gets its own buckets, and a cleared template cache keeps the refs of this boot."""
    coll = InProcessCollector()
    client = client_factory(coll.addr, max_samples_per_batch=2)
    client.refs.max_templates = 2
    client.start()
    try:
        hist = Sample("test.lat", 3.0, "s", {"k": "h"}, kind=HISTOGRAM, bounds=[1.0, 2.0], counts=[1, 2, 3],
                      time_ns=1_000_000_003)
        client.put([Sample("test.a", 1.0, "1", {"k": "a"}, time_ns=1_000_000_001),
                    Sample("test.b", 2.0, "By", {"k": "b"}, kind=COUNTER, time_ns=1_000_000_002), hist])
        client.put([Sample("test.a", 4.0, "1", {"k": "a"}, time_ns=2_000_000_001)])
        client.flush()
        wait_until(lambda: client.pending() == 0 and client.acked >= 2, what="the batches acknowledged")
        assert client.refs.series == {("test.a", (("k", "a"),)): 1, ("test.b", (("k", "b"),)): 2,
                                  ("test.lat", (("k", "h"),)): 3}
        points = coll.on_loop(lambda: coll.state.history("node-a", "test.a", {"k": "a"}))
        assert [p.value for p in points.points] == [1.0, 4.0]
        node = coll.on_loop(lambda: coll.state.view().nodes[0])
        by_name = {s.name: s for s in node.series}
        assert by_name["test.b"].unit == "By" and by_name["test.b"].value == 2.0
        assert list(by_name["test.lat"].histogram.counts) == [1, 2, 3]
    finally:
        client.stop(drain_s=0)
        coll.stop()


def test_a_series_whose_labels_come_in_another_order_keeps_its_ref_and_its_wire_form():
    """Templates are found by the labels in their given order (no sort per sample): the same series
    with its labels in another order still gets its one series_ref, and the same encoded sample."""
    client = StreamClient("127.0.0.1:1", "node-a", "boot-1", lambda: pb.Inventory(), channel=lambda: None)
    one = Sample("test.a", 1.0, "1", {"device": "gpu0", "direction": "receive"}, time_ns=5)
    other = Sample("test.a", 1.0, "1", {"direction": "receive", "device": "gpu0"}, time_ns=5)
    client.put([one, other, Sample("test.a", 1.0, "1", {"device": "gpu1", "direction": "receive"}, time_ns=5)])
    with client._cond:
        client._cut_locked()
    batch = next(iter(client._pending.values()))
    first, second, third = batch.samples
    assert first.series_ref == second.series_ref == 1 and third.series_ref == 2
    assert first.SerializeToString(deterministic=True) == second.SerializeToString(deterministic=True)
    assert len(client.refs.series) == 2


def test_an_encoded_batch_goes_out_as_the_same_agent_message_at_every_length_prefix_size():
    from xpusense.agent.batch_send import batch_message, encode_message
    for n in (0, 1, 120, 127, 128, 16_000, 16_383, 16_384, 2_100_000):
        b = pb.Batch(node_id="n" * n, boot_id="b", seq=n + 1)
        want = pb.AgentMessage(batch=b).SerializeToString()
        assert batch_message(b.SerializeToString()) == want, n
        assert encode_message(want) is want and encode_message(pb.AgentMessage(batch=b)) == want


def test_a_spooled_batch_is_sent_from_memory_and_read_back_only_to_resend_it(tmp_path, client_factory):
    from xpusense.agent.spool import Spool
    sp = Spool(str(tmp_path / "spool"))
    assert sp.open() == []
    reads = []
    real_read = sp.read
    sp.read = lambda loc, key=None: reads.append(key) or real_read(loc, key)   # counts, reads for real
    port = free_port()
    client = client_factory(f"127.0.0.1:{port}", spool=sp)
    client.start()
    coll = InProcessCollector(port)
    try:
        for i in (1, 2, 3):
            put_batch(client, i)
            wait_until(lambda: client.pending() == 0, what=f"batch {i} acknowledged")
        assert reads == [], "a batch just written was read back from the spool to send it"
    finally:
        coll.stop()
    put_batch(client, 4)          # kept while no collector answers: sent after the reconnect
    coll = InProcessCollector(port)
    try:
        wait_until(lambda: client.pending() == 0, what="batch 4 delivered after the reconnect")
        hist = coll.on_loop(lambda: coll.state.history("node-a", "test.value", {"k": "v"}))
        assert [p.value for p in hist.points] == [4.0]
        assert reads in ([], [("boot-1", 4)])    # from memory, or read back for the new connection
    finally:
        client.stop(drain_s=0)
        sp.close()
        coll.stop()
