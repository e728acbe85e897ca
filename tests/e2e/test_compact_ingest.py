"""The compact encoding into a real collector process over gRPC (docs/design.md "The compact
encoding"): offered in the Hello and chosen in the Welcome, series defined by SeriesTables, batches
as columns. The points it holds (ListNodes, GetHistory) are exactly those of the same samples sent
as Sample messages, with and without a durable store; what it cannot read is refused with a status
naming why, counted, and nothing of it is stored."""

from __future__ import annotations

import signal
import zlib

import grpc
import pytest
from cluster_support import cluster_config, nats_cluster, start_gateway  # noqa: F401
from compact_support import as_compact, rounds
from helpers import BIN, free_port, wait_until

from xpusense.common import compact
from xpusense.common.compact_chain import Chain
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

BOOT = "boot-1"


class Collector:
    """A real `xpusense-collector serve` on loopback."""

    def __init__(self, procs, tmp_path, config: str = "", data_dir: bool = False, name: str = "collector"):
        self.addr = f"127.0.0.1:{free_port()}"
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(config)
        args = [str(BIN / "xpusense-collector"), "serve", "--listen", self.addr, "--config", str(cfg)]
        if data_dir:
            args += ["--data-dir", str(tmp_path / f"{name}-data")]
        self.proc = procs(args, name)
        self.channel = grpc.insecure_channel(self.addr)
        self.query = pb_grpc.QueryStub(self.channel)
        wait_until(lambda: self.query.ListNodes(pb.ListNodesRequest(), timeout=2), what="the collector to answer")

    def node(self, node_id: str) -> pb.NodeView | None:
        nodes = self.query.ListNodes(pb.ListNodesRequest(node_id=node_id), timeout=5).nodes
        return nodes[0] if nodes else None

    def counters(self) -> dict[str, int]:
        return dict(self.query.ListNodes(pb.ListNodesRequest(node_id="\x00"), timeout=5).counters)

    def held(self, node_id: str) -> dict:
        """Every series of the node: unit, kind, latest value and time, histogram, whole history."""
        out = {}
        for s in self.node(node_id).series:
            h = self.query.GetHistory(pb.HistoryRequest(node_id=node_id, name=s.name, labels=s.labels), timeout=5)
            out[(s.name, tuple(sorted(s.labels.items())))] = (
                s.unit, s.kind, s.value, s.time_unix_nano, s.histogram.SerializeToString(),
                h.unit, [(p.time_unix_nano, p.value) for p in h.points])
        return out


def stream(addr: str, msgs: list[pb.AgentMessage]) -> tuple[list[pb.CollectorMessage], grpc.RpcError | None]:
    """One Ingest stream: the messages, then every reply until the collector ends it (and how)."""
    got: list[pb.CollectorMessage] = []
    with grpc.insecure_channel(addr) as ch:
        try:
            for reply in pb_grpc.IngestStub(ch).Stream(iter(msgs), timeout=30):
                got.append(reply)
        except grpc.RpcError as e:
            return got, e
    return got, None


def hello(node: str, offer: bool, encodings: tuple[str, ...] = (compact.ENCODING,)) -> pb.AgentMessage:
    return pb.AgentMessage(hello=pb.Hello(node_id=node, boot_id=BOOT, batch_encodings=encodings if offer else []))


def table(defs: list[pb.Sample], boot: str = BOOT) -> pb.AgentMessage:
    return pb.AgentMessage(series=pb.SeriesTable(boot_id=boot, defs=compact.encode_defs(defs)))


def compact_messages(batches: list[pb.Batch]) -> list[pb.AgentMessage]:
    """What an agent sends on one stream: before each batch the definitions of its refs not sent
    on the stream yet, then the batch in the compact encoding."""
    out, sent = [], 0
    for b in batches:
        cb, defs = as_compact(b)
        if new := [d for d in defs if d.series_ref > sent]:
            out.append(table(new))
            sent = max(d.series_ref for d in new)
        out.append(pb.AgentMessage(batch=cb))
    return out


def acks(replies: list[pb.CollectorMessage]) -> list[tuple[int, bool]]:
    return [(r.ack.seq, r.ack.duplicate) for r in replies if r.HasField("ack")]


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "store"])
def test_compact_batches_hold_exactly_the_points_of_sample_messages(procs, tmp_path, durable):
    coll = Collector(procs, tmp_path, data_dir=durable)
    full = rounds("full")
    replies, err = stream(coll.addr, [hello("full", offer=False)] + [pb.AgentMessage(batch=b) for b in full])
    assert err is None and replies[0].welcome.batch_encoding == ""
    assert acks(replies) == [(b.seq, False) for b in full]

    small = rounds("small")
    msgs = [hello("small", offer=True)] + compact_messages(small)
    assert sum(m.HasField("series") for m in msgs) == 4   # refs 1-4, then 5, 6 and 7 as they come
    replies, err = stream(coll.addr, msgs)
    assert err is None, err
    assert replies[0].welcome.batch_encoding == compact.ENCODING
    assert acks(replies) == [(b.seq, False) for b in small]

    want = coll.held("full")
    assert len(want) == 9 and coll.held("small") == want   # values, ns times, histograms, ref-0 samples
    hist = next(v for k, v in want.items() if k[0] == "tcp_rtt")
    assert pb.Histogram.FromString(hist[4]).counts == [1, 3, 5]
    assert [e.id for e in coll.node("small").events if e.type == "health"] == ["e2"]
    c = coll.counters()
    assert c["ingest.compact.batches"] == len(small) and c["ingest.compact.tables"] == 4

    # A reconnect (every definition sent again on the new stream): the last batch resent is a duplicate.
    replies, err = stream(coll.addr, [hello("small", offer=True)] + compact_messages(small[-1:]))
    assert err is None and replies[0].welcome.stored_up_to == len(small)
    assert acks(replies) == [(len(small), True)]
    assert coll.held("small") == want
    if durable:   # killed: the log's series tables come before the batches that need them on replay
        coll.proc.kill(signal.SIGKILL)
        again = Collector(procs, tmp_path, data_dir=True)
        assert again.held("small") == want and again.held("full") == want


def without_ids(msgs: list[pb.AgentMessage]) -> list[pb.AgentMessage]:
    """The messages with each batch's node and boot id left out (version 2: they are the Hello's)."""
    for m in msgs:
        if m.HasField("batch"):
            m.batch.ClearField("node_id")
            m.batch.ClearField("boot_id")
    return msgs


def test_batches_without_the_hellos_ids_are_held_as_with_them_where_version_2_is_chosen(procs, tmp_path):
    coll = Collector(procs, tmp_path, data_dir=True)
    replies, err = stream(coll.addr, [hello("with", offer=True)] + compact_messages(rounds("with")))
    assert err is None and acks(replies) == [(b.seq, False) for b in rounds("with")]
    bare = rounds("bare")
    replies, err = stream(coll.addr, [hello("bare", offer=True, encodings=("columns-zlib-2",))]
                          + without_ids(compact_messages(bare)))
    assert err is None and replies[0].welcome.batch_encoding == "columns-zlib-2"
    assert acks(replies) == [(b.seq, False) for b in bare]
    want = coll.held("with")
    assert coll.held("bare") == want
    # the store kept them as an agent sending the ids sends them: a restart reads them back
    coll.proc.kill(signal.SIGKILL)
    again = Collector(procs, tmp_path, data_dir=True)
    assert again.held("bare") == want
    # where version 1 is chosen a batch names its node, as before
    v1 = pb.AgentMessage(hello=pb.Hello(node_id="v1", boot_id=BOOT, batch_encodings=["columns-zlib-1"]))
    replies, err = stream(again.addr, [v1] + without_ids(compact_messages(rounds("v1")[:1])))
    assert replies[0].welcome.batch_encoding == "columns-zlib-1" and not acks(replies)
    assert err is not None and "batch for node '' on a stream opened by node 'v1'" in err.details()


def chained(msgs: list[pb.AgentMessage]) -> list[pb.AgentMessage]:
    """The messages with each batch's block deflated on the one before it, as an agent sends them."""
    chain = Chain(10_000)
    for m in msgs:
        if m.HasField("batch") and m.batch.columns:
            m.batch.columns = chain.send(m.batch.columns)
    return msgs


def test_chained_blocks_are_held_and_stored_as_the_blocks_deflated_alone(procs, tmp_path):
    coll = Collector(procs, tmp_path, data_dir=True)
    replies, err = stream(coll.addr, [hello("alone", True, ("columns-zlib-2",))] + compact_messages(rounds("alone")))
    assert err is None and replies[0].welcome.batch_encoding == "columns-zlib-2"
    batches = rounds("chained")
    msgs = chained(compact_messages(batches))
    assert sum(m.batch.columns[1] & 0x20 for m in msgs if m.HasField("batch")) == 0x20 * (len(batches) - 1)
    replies, err = stream(coll.addr, [hello("chained", True, (compact.CHAINED,))] + msgs)
    assert err is None and replies[0].welcome.batch_encoding == compact.CHAINED
    assert acks(replies) == [(b.seq, False) for b in batches]
    want = coll.held("alone")
    assert coll.held("chained") == want

    # A block deflated on another block than the one before it: FAILED_PRECONDITION (the agent
    # reconnects, and its new stream starts a chain anew); nothing of it is stored.
    msgs = compact_messages(rounds("broken"))
    third = next(m.batch for m in msgs if m.HasField("batch") and m.batch.seq == 3)
    raw = zlib.decompress(third.columns)
    msgs = chained(msgs)
    third.columns = compact.deflate(raw, b"another block")
    replies, err = stream(coll.addr, [hello("broken", True, (compact.CHAINED,))] + msgs)
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "batch 3 of node 'broken': columns do not inflate" in err.details()
    assert acks(replies) == [(1, False), (2, False)] and coll.node("broken").stored_up_to == 2
    # and one deflated on a block before it where none came before it on the stream
    replies, err = stream(coll.addr, [hello("broken", True, (compact.CHAINED,))] + [m for m in msgs if m.HasField("series")] + [
        m for m in msgs if m.HasField("batch") and m.batch.seq == 4])
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "with none before them on this stream" in err.details()

    # The store holds blocks that read alone: killed, the collector replays them to the same points.
    coll.proc.kill(signal.SIGKILL)
    again = Collector(procs, tmp_path, data_dir=True)
    assert again.held("chained") == want and again.node("broken").stored_up_to == 2


def test_what_cannot_be_read_is_refused_and_nothing_of_it_stored(procs, tmp_path):
    coll = Collector(procs, tmp_path, "[limits]\nmax_series_table_bytes = 2048\nmax_name_len = 32\n")
    batches = rounds("n")
    first, defs = as_compact(batches[0])   # refs 1-4

    # A ref with no definition: FAILED_PRECONDITION, so the agent reconnects and sends them all.
    replies, err = stream(coll.addr, [hello("n", True), table(defs[:3]), pb.AgentMessage(batch=first)])
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
    assert "no definition for series_ref 4 of node 'n' boot 'boot-1'" in err.details()
    assert acks(replies) == [] and coll.node("n").stored_up_to == 0
    assert coll.counters()["ingest.compact.batches_missing_definition"] == 1
    replies, err = stream(coll.addr, [hello("n", True), table(defs), pb.AgentMessage(batch=first)])
    assert err is None and acks(replies) == [(1, False)]

    # Columns that do not decode: INVALID_ARGUMENT (the agent sets the batch aside).
    bad = pb.Batch(node_id="n", boot_id=BOOT, seq=2, columns=b"\x78\x9cnot zlib")
    replies, err = stream(coll.addr, [hello("n", True), pb.AgentMessage(batch=bad)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "columns do not inflate" in err.details(), err
    cut = pb.Batch(node_id="n", boot_id=BOOT, seq=2, columns=as_compact(batches[1])[0].columns[:-4])
    replies, err = stream(coll.addr, [hello("n", True), pb.AgentMessage(batch=cut)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cut short" in err.details(), err
    assert acks(replies) == [] and coll.node("n").stored_up_to == 1
    assert coll.counters()["ingest.compact.batches_undecodable"] == 2

    # Series tables: undecodable, over max_series_table_bytes once inflated, without a boot id.
    junk = pb.AgentMessage(series=pb.SeriesTable(boot_id=BOOT, defs=b"junk"))
    _, err = stream(coll.addr, [hello("n", True), junk])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "definitions do not inflate" in err.details(), err
    big = [pb.Sample(name="x" * 200, series_ref=r) for r in range(100, 120)]
    _, err = stream(coll.addr, [hello("n", True), table(big)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "limits.max_series_table_bytes = 2048" in err.details()
    _, err = stream(coll.addr, [hello("n", True), table(defs, boot="")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "SeriesTable boot_id" in err.details(), err
    _, err = stream(coll.addr, [hello("n", True), table([pb.Sample(name="n" * 33, series_ref=50)])])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err   # a name no sample may have either
    assert "a metric name of 33 characters, more than the collector's limits.max_name_len = 32" in err.details()
    # A ref the boot holds, given another series: refused; the same definition again is taken.
    other = pb.Sample(name=defs[0].name, unit=defs[0].unit, kind=defs[0].kind, labels={"device": "elsewhere"},
                      series_ref=defs[0].series_ref)
    replies, err = stream(coll.addr, [hello("n", True), table(defs), table([other])])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert f"series_ref {defs[0].series_ref} is defined as {defs[0].name}" in err.details(), err.details()
    c = coll.counters()
    assert c["ingest.compact.tables_undecodable"] == 2 and c["limits.max_series_table_bytes"] == 1
    assert c["ingest.compact.tables_refused"] == 2 and c["limits.max_name_len"] == 1

    # An agent that offered nothing gets "" and may send neither.
    replies, err = stream(coll.addr, [hello("old", False), table(defs)])
    assert replies[0].welcome.batch_encoding == ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "Welcome chose batch encoding ''" in err.details()
    replies, err = stream(coll.addr, [hello("old", False), pb.AgentMessage(batch=as_compact(rounds("old")[0])[0])])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "compact encoding on a stream" in err.details()
    assert coll.node("n").stored_up_to == 1 and coll.held("n") and coll.node("old").stored_up_to == 0


def test_batch_encodings_empty_never_chooses_one(procs, tmp_path):
    coll = Collector(procs, tmp_path, '[ingest]\nbatch_encodings = []\n')
    replies, err = stream(coll.addr, [hello("n", True)])
    assert err is None and replies[0].welcome.batch_encoding == ""
    bad = tmp_path / "bad.toml"
    bad.write_text('[ingest]\nbatch_encodings = ["zstd-9"]\n')
    p = procs([str(BIN / "xpusense-collector"), "serve", "--listen", f"127.0.0.1:{free_port()}",
               "--config", str(bad)], "bad")
    assert p.p.wait(30) == 2 and "batch_encodings" in p.output()


def test_a_gateway_that_does_not_choose_the_encoding_refuses_it(nats_cluster, procs, tmp_path):  # noqa: F811
    _, addr = start_gateway(procs, cluster_config(tmp_path, nats_cluster, "[ingest]\nbatch_encodings = []\n"))
    _, defs = as_compact(rounds("g")[0])
    replies, err = stream(addr, [hello("g", True), table(defs)])
    assert replies and replies[0].welcome.batch_encoding == ""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "SeriesTable on a stream" in err.details(), err
