"""The collector's durable store: group commit, replay, readers with durable cursors."""

from __future__ import annotations

import asyncio

from xpusense.collector.state import FleetState
from xpusense.collector.store import Store, StoreReader, stored_batches
from xpusense.v1 import telemetry_pb2 as pb


def batch(node, boot, seq, value):
    b = pb.Batch(node_id=node, boot_id=boot, seq=seq, sent_unix_nano=seq * 10**9)
    b.samples.add(name="x", unit="1", kind=pb.GAUGE, value=value, time_unix_nano=seq * 10**9, series_ref=1)
    return b


async def store_all(store, state, batches):
    for b in batches:
        if state.accept(b) is not None:
            await store.append(["b", b.SerializeToString()])
            state.apply(b)


def test_replay_restores_values_marks_and_inventory(tmp_path):
    st = FleetState()
    store = Store(str(tmp_path))
    store.open(st)
    st.hello(pb.Hello(node_id="n", boot_id="b1", inventory=pb.Inventory(hostname="h1")))
    store.append_nowait(["i", "n", "b1", pb.Inventory(hostname="h1").SerializeToString()])
    asyncio.run(store_all(store, st, [batch("n", "b1", s, s * 1.5) for s in range(1, 6)]))
    assert store.commits >= 1 and store.durable[1] > 0
    store.close()

    again = FleetState()
    figures = Store(str(tmp_path)).open(again)
    assert figures["batches"] == 5
    n = again.view().nodes[0]
    assert n.inventory.hostname == "h1" and n.stored_up_to == 5
    assert [s.value for s in n.series] == [7.5]
    assert [p.value for p in again.history("n", "x", {}).points] == [1.5, 3.0, 4.5, 6.0, 7.5]
    # A resend of seq 3 after the restart is a duplicate; seq 6 is new.
    assert again.accept(batch("n", "b1", 3, 0)) is None and again.accept(batch("n", "b1", 6, 0)) == 5
    assert [b.seq for b in stored_batches(str(tmp_path))] == [1, 2, 3, 4, 5]


def test_reader_cursor_survives_and_sees_only_new_batches(tmp_path):
    st = FleetState()
    store = Store(str(tmp_path))
    store.open(st)

    async def go():
        await store_all(store, st, [batch("n", "b", s, s) for s in range(1, 4)])
        r = StoreReader(store, "otlp")
        got, cur = r.read()
        assert [b.seq for b in got] == [1, 2, 3]
        r.commit(cur)
        await store_all(store, st, [batch("n", "b", s, s) for s in range(4, 6)])
        r2 = StoreReader(store, "otlp")   # as after a restart: the cursor is read back
        got, cur = r2.read()
        assert [b.seq for b in got] == [4, 5]
        got, _ = r2.read(max_batches=1)
        assert [b.seq for b in got] == [4]
    asyncio.run(go())
    store.close()
