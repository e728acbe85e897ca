"""The agent's side of the compact encoding against a recording Ingest servicer on loopback (real
gRPC): each series defined once per connection before its first use, batches expanded to Sample
messages where the Welcome does not choose the encoding, old boots' spooled batches sent with their
definitions after a restart, and set aside (never sent wrong) when those are gone."""

from __future__ import annotations

import os
import threading
from concurrent import futures

import grpc
import pytest
from compact_rounds import expected, norm, round_of
from helpers import free_port, wait_until

from xpusense.agent.batch_build import batch_problem
from xpusense.agent.batch_send import Connection, Unsendable
from xpusense.agent.config import load_agent
from xpusense.agent.sources.base import Sample
from xpusense.agent.spool import Spool
from xpusense.agent.spool.defs import SeriesDefs
from xpusense.agent.spool.records import batch_ids
from xpusense.agent.stream import StreamClient
from xpusense.common import compact
from xpusense.common.compact_chain import Chain
from xpusense.common.config import ConfigError
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc


class Recorder(pb_grpc.IngestServicer):
    """Answers Welcome(batch_encoding=`encoding` when the Hello offers it) and acks every batch;
    keeps each connection's messages, and reads them as a collector would: a compact batch whose
    references were not defined before it on the same stream fails the test."""

    def __init__(self, encoding: str):
        self.encoding = encoding
        self.streams: list[list[pb.AgentMessage]] = []
        self.stored: dict[str, int] = {}
        self.samples: dict[str, list[pb.Sample]] = {}     # by boot, as stored
        self.abort_at: set[int] = set()                  # batch seqs at which the stream is cut, once
        self.undecodable: set[int] = set()               # batch seqs refused as a collector refuses bad columns
        self.problems: list[str] = []
        self.versions: set[int] = set()                  # of the columns received
        self.ids_left_out = 0                            # batches that came without their node and boot id
        self.chained = 0                                 # blocks that came deflated on the one before them
        self.lock = threading.Lock()

    def Stream(self, request_iterator, context):
        msgs: list[pb.AgentMessage] = []
        defs: dict[str, dict[int, pb.Sample]] = {}
        with self.lock:
            self.streams.append(msgs)
        chosen = ""
        chain = Chain(100_000)
        for m in request_iterator:
            with self.lock:
                msgs.append(m)
            kind = m.WhichOneof("msg")
            if kind == "hello":
                hello = m.hello
                chosen = self.encoding if self.encoding in m.hello.batch_encodings else ""
                yield pb.CollectorMessage(welcome=pb.Welcome(boot_id=m.hello.boot_id, batch_encoding=chosen,
                                                             stored_up_to=self.stored.get(m.hello.boot_id, 0)))
            elif kind == "series":
                for d in compact.decode_defs(m.series.defs, 1 << 24):
                    defs.setdefault(m.series.boot_id, {})[d.series_ref] = d
            elif kind == "batch":
                b = m.batch
                if not b.node_id:   # version 2: the Hello's ids, left out
                    if compact.VERSIONS.get(chosen, 0) < 2 or b.boot_id:
                        self.problems.append(f"batch {b.seq} without ids on a stream that chose {chosen!r}")
                    b.node_id, b.boot_id = hello.node_id, hello.boot_id
                    self.ids_left_out += 1
                if b.seq in self.undecodable:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"batch {b.seq} of boot {b.boot_id[:8]} refused: columns do not inflate (test)")
                if b.seq in self.abort_at:
                    self.abort_at.discard(b.seq)
                    context.abort(grpc.StatusCode.UNAVAILABLE, "cut by the test")
                got = list(b.samples)
                if b.columns and chosen == compact.CHAINED:
                    block = b.columns
                    b.columns = chain.receive(block)
                    if b.columns != block:
                        self.chained += 1
                        if not self.chained_on_stream(msgs):
                            self.problems.append(f"batch {b.seq}: the stream's first block chained")
                if b.columns:
                    if not chosen:
                        self.problems.append(f"compact batch {b.seq} on a stream that did not choose it")
                    cols = compact.decode_columns(b.columns, 100_000)
                    self.versions.add(compact.version_of(b.columns))
                    if chosen and compact.version_of(b.columns) > compact.VERSIONS[chosen]:
                        self.problems.append(f"batch {b.seq}: columns newer than {chosen}")
                    held = defs.get(b.boot_id, {})
                    if missing := [r for r in cols.refs if r not in held]:
                        self.problems.append(f"batch {b.seq}: no definition for {missing}")
                        continue
                    got = [compact.sample(held[r[0]], r, cols.histograms.get(i)) for i, r in enumerate(cols.rows())]
                    got += list(b.samples)
                with self.lock:
                    if b.seq > self.stored.get(b.boot_id, 0):
                        self.stored[b.boot_id] = b.seq
                        self.samples.setdefault(b.boot_id, []).extend(got)
                yield pb.CollectorMessage(ack=pb.Ack(boot_id=b.boot_id, seq=b.seq))

    @staticmethod
    def chained_on_stream(msgs: list[pb.AgentMessage]) -> bool:
        """Whether a compact batch came on this stream before the last message."""
        return any(m.WhichOneof("msg") == "batch" and m.batch.columns for m in msgs[:-1])

    def kinds(self, i: int) -> list[str]:
        with self.lock:
            return [m.WhichOneof("msg") for m in self.streams[i]]


@pytest.fixture
def serve():
    servers = []

    def start(encoding: str, port: int | None = None) -> tuple[Recorder, str]:
        rec = Recorder(encoding)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_IngestServicer_to_server(rec, server)
        port = server.add_insecure_port(f"127.0.0.1:{port or 0}")
        server.start()
        servers.append(server)
        return rec, f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(0)


@pytest.fixture
def client_factory():
    made = []

    def make(addr, boot="boot-1", **kw):
        kw = {"flush_s": 0.02, "backoff_initial_s": 0.02, "backoff_max_s": 0.2, "reconnect_max_s": 0.2,
              "batch_encoding": compact.CHAINED, **kw}   # offering every compact encoding
        c = StreamClient(addr, "node-a", boot, lambda: pb.Inventory(hostname="h"), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop(drain_s=0)


def refs_of(table: pb.SeriesTable) -> list[int]:
    return [d.series_ref for d in compact.decode_defs(table.defs, 1 << 24)]


def test_each_series_is_defined_once_per_connection_before_the_first_batch_using_it(serve, client_factory):
    rec, addr = serve(compact.ENCODING)
    client = client_factory(addr)
    client.start()
    rounds = [round_of(1), round_of(2, extra=1), round_of(3, extra=1)]
    client.put(rounds[0])
    client.flush()
    wait_until(lambda: client.status()["acked"] == 1, what="the first batch acknowledged")
    client.put(rounds[1])                  # one new series
    client.flush()
    wait_until(lambda: client.status()["acked"] == 2, what="the second batch acknowledged")
    rec.abort_at.add(3)                    # the third batch's stream is cut: it goes again on a new one
    client.put(rounds[2])
    client.flush()
    wait_until(lambda: client.status()["acked"] == 3 and len(rec.streams) == 2, what="the third batch, resent")
    assert not rec.problems
    first, second = rec.streams
    assert first[0].hello.batch_encodings == list(compact.ENCODINGS)
    assert rec.kinds(0) == ["hello", "series", "batch", "series", "batch", "batch"]
    # The first table holds every series the first batch's columns use (big.hist, 5, has more
    # buckets than they carry and goes whole); the second only those numbered since, up to the new one.
    assert refs_of(first[1].series) == [1, 2, 3, 4] and first[1].series.boot_id == "boot-1"
    assert sorted(compact.decode_columns(first[2].batch.columns, 100).refs) == [1, 2, 3, 4]
    assert [s.name for s in first[2].batch.samples] == ["big.hist"]
    assert [(d.name, d.series_ref) for d in compact.decode_defs(first[3].series.defs, 1 << 20)] == \
        [("big.hist", 5), ("extra.0", 6)]
    # A new connection defines them all again before the resent batch.
    assert rec.kinds(1) == ["hello", "series", "batch"]
    assert refs_of(second[1].series) == [1, 2, 3, 4, 5, 6]
    assert sorted(norm(s) for s in rec.samples["boot-1"]) == expected(rounds)
    assert all(not m.batch.samples or m.batch.columns for m in first + second if m.HasField("batch"))


def test_a_batch_the_collector_cannot_decode_is_set_aside_and_the_stream_goes_on(serve, client_factory):
    """Refused as undecodable (INVALID_ARGUMENT, never acknowledged): resending it would silence the node."""
    rec, addr = serve(compact.ENCODING)
    rec.undecodable.add(2)
    client = client_factory(addr)
    client.start()
    for i in range(3):
        client.put(round_of(i))
        client.flush()
    wait_until(lambda: client.pending() == 0, what="every batch acknowledged or set aside")
    st = client.status()
    assert st["set_aside"] == 1 and st["dropped_batches"] == 1 and st["dropped_samples"] == len(round_of(1))
    assert rec.stored["boot-1"] == 3 and len(rec.samples["boot-1"]) == 2 * len(round_of(0))


@pytest.mark.parametrize("agent_encoding", [compact.ENCODING, ""])
def test_where_the_welcome_does_not_choose_it_batches_go_as_the_sample_messages_of_today(
        serve, client_factory, agent_encoding):
    """An old collector or a cluster gateway: the compact batches, expanded, carry exactly what a
    Sample-encoding agent sends (histograms too); no SeriesTable, no columns."""
    rec, addr = serve("")
    client = client_factory(addr, batch_encoding=agent_encoding)
    client.start()
    rounds = [round_of(1, extra=2), round_of(2, extra=3)]
    for r in rounds:
        client.put(r)
        client.flush()
    wait_until(lambda: client.status()["acked"] == 2, what="both batches acknowledged")
    assert not rec.problems
    assert "series" not in rec.kinds(0)
    assert list(rec.streams[0][0].hello.batch_encodings) == compact.offered(agent_encoding)
    assert all(not m.batch.columns for m in rec.streams[0] if m.HasField("batch"))
    assert sorted(norm(s) for s in rec.samples["boot-1"]) == expected(rounds)


def test_past_max_series_defs_new_series_go_whole_counted(serve, client_factory):
    rec, addr = serve(compact.ENCODING)
    client = client_factory(addr, max_series_defs=2)
    client.start()
    rounds = [round_of(1, extra=2)]
    client.put(rounds[0])
    client.flush()
    wait_until(lambda: client.status()["acked"] == 1, what="the batch acknowledged")
    batch = rec.streams[0][2].batch
    assert sorted(compact.decode_columns(batch.columns, 100).refs) == [1, 2]
    assert {s.series_ref for s in batch.samples} == {0}
    assert client.status()["series_unnumbered"] == 5 and client.status()["series_defs"] == 2
    assert sorted(norm(s) for s in rec.samples["boot-1"]) == expected(rounds)


def spool_of(directory, node="node-a") -> tuple[Spool, list]:
    sp = Spool(str(directory), validate=batch_problem(node), fsync_interval_s=0.05)
    return sp, sp.open()


def old_boot_in_the_spool(tmp_path, client_factory, encoding=compact.ENCODING) -> list[list[Sample]]:
    """An agent that never reached a collector: its boot's batches and definitions in the spool."""
    sp, found = spool_of(tmp_path / "spool")
    assert found == []
    client = client_factory(f"127.0.0.1:{free_port()}", boot="boot-old", spool=sp, batch_encoding=encoding)
    rounds = [round_of(1), round_of(2, extra=2)]
    for r in rounds:
        client.put(r)
        client.flush()
    client.stop(drain_s=0)
    sp.close()
    assert os.path.exists(tmp_path / "spool" / "series-boot-old.xsd") == bool(encoding)
    return rounds


def restarted(tmp_path, serve, client_factory, collector_encoding, **kw):
    """The agent started again on the spool old_boot_in_the_spool left, with a new boot, against a
    recording collector answering `collector_encoding`: (its recorder, the client, the spool's batches)."""
    sp, found = spool_of(tmp_path / "spool")
    rec, addr = serve(collector_encoding)
    client = client_factory(addr, boot="boot-new", spool=sp, **kw)
    client.resume(found)
    client.start()
    return rec, client, found


@pytest.mark.parametrize("collector_encoding", [*compact.ENCODINGS, ""])
def test_after_a_restart_an_old_boots_spooled_batches_go_with_their_definitions(
        tmp_path, serve, client_factory, collector_encoding):
    rounds = old_boot_in_the_spool(tmp_path, client_factory)
    rec, client, found = restarted(tmp_path, serve, client_factory, collector_encoding)
    assert [k for k, _ in found] == [("boot-old", 1), ("boot-old", 2)]
    client.put(round_of(3))
    client.flush()
    wait_until(lambda: client.pending() == 0, what="every batch acknowledged")
    assert not rec.problems
    assert sorted(norm(s) for s in rec.samples["boot-old"]) == expected(rounds)
    assert sorted(norm(s) for s in rec.samples["boot-new"]) == expected([round_of(3)])
    if collector_encoding:   # an older collector gets the columns in its version, spooled ones too
        tables = [m.series.boot_id for m in rec.streams[0] if m.HasField("series")]
        assert tables == ["boot-old", "boot-old", "boot-new"]
        assert rec.versions == {compact.VERSIONS[collector_encoding]}
        # version 2 leaves the Hello's ids out of its boot's batches (round 3's), not the old boot's
        assert rec.ids_left_out == (1 if compact.VERSIONS[collector_encoding] >= 2 else 0)
        # chained: every block after the stream's first goes deflated on the one before it
        assert (rec.chained >= 2) if collector_encoding == compact.CHAINED else rec.chained == 0
    client.put(round_of(4))     # the next cut lets the old boot's definitions go
    client.flush()
    wait_until(lambda: not os.path.exists(tmp_path / "spool" / "series-boot-old.xsd"),
               what="the old boot's definitions file deleted")
    assert os.path.exists(tmp_path / "spool" / "series-boot-new.xsd")
    assert client.status()["set_aside"] == 0


@pytest.mark.parametrize(("old", "new", "collector"), [("", compact.ENCODING, compact.ENCODING),
                                                       (compact.ENCODING, "", compact.ENCODING),
                                                       ("columns-zlib-1", compact.ENCODING, compact.ENCODING)])
def test_spools_of_either_encoding_go_after_a_restart_with_the_other(tmp_path, serve, client_factory, old, new,
                                                                     collector):
    """Sample batches spooled by an agent before the compact encoding go as they are, and so do
    columns of version 1; compact ones spooled before the config turned it off go expanded."""
    rounds = old_boot_in_the_spool(tmp_path, client_factory, encoding=old)
    rec, client, _ = restarted(tmp_path, serve, client_factory, collector, batch_encoding=new)
    wait_until(lambda: client.pending() == 0, what="the old boot's batches acknowledged")
    assert not rec.problems and client.status()["set_aside"] == 0
    assert sorted(norm(s) for s in rec.samples["boot-old"]) == expected(rounds)
    assert rec.versions == ({1} if old == "columns-zlib-1" else set())   # expanded where the agent offers none


@pytest.mark.parametrize("collector_encoding", [compact.ENCODING, ""])
@pytest.mark.parametrize("harm", ["deleted", "damaged"])
def test_spooled_batches_whose_definitions_are_gone_are_set_aside_never_sent(
        tmp_path, serve, client_factory, collector_encoding, harm):
    old_boot_in_the_spool(tmp_path, client_factory)
    path = tmp_path / "spool" / "series-boot-old.xsd"
    if harm == "deleted":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF     # the second frame's definitions (the series new in round 2)
        path.write_bytes(bytes(data))
    rec, client, _ = restarted(tmp_path, serve, client_factory, collector_encoding)
    client.put(round_of(3))
    client.flush()
    wait_until(lambda: client.pending() == 0, what="the new boot's batch acknowledged, the old ones set aside")
    assert not rec.problems
    sent_old = {m.batch.seq for s in rec.streams for m in s if m.HasField("batch") and m.batch.boot_id == "boot-old"}
    st = client.status()
    if harm == "deleted":
        assert sent_old == set() and st["set_aside"] == 2
    else:   # the first frame holds round 1's definitions: that batch goes, round 2's does not
        assert sent_old == {1} and st["set_aside"] == 1 and st["series_defs_damaged"] == 1
    assert st["dropped_batches"] == st["set_aside"]
    assert st["spool"]["damaged_records"] == st["set_aside"] + (harm == "damaged")   # the frame, counted too
    assert sorted(norm(s) for s in rec.samples["boot-new"]) == expected([round_of(3)])
    assert os.listdir(tmp_path / "spool" / "damaged")    # the set-aside batches' bytes kept


def test_batch_encoding_other_than_the_compact_one_or_none_is_a_config_error(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[stream]\nbatch_encoding = "zstd"\n')
    with pytest.raises(ConfigError, match=r"agent.toml: 'stream.batch_encoding' must be one of 'columns-zlib-2-chained', "
                                          r"'columns-zlib-2', 'columns-zlib-1' or \"\""):
        load_agent(str(cfg), env={})
    assert load_agent(None, env={}).stream.batch_encoding == compact.ENCODING


def test_a_batch_that_cannot_be_sent_leaves_the_chain_where_it_was():
    """A chained connection moves its chain on only for a batch it hands over: one set aside (a ref
    whose definition is gone) does not, so the collector inflates the next block on the one it had."""
    defs = SeriesDefs(None, 100)
    for ref in (1, 2, 3):
        defs.add("boot-1", pb.Sample(name=f"m{ref}", unit="1", kind=pb.GAUGE, series_ref=ref))
    conn = Connection(defs, compact.CHAINED, {"boot-1": 3}, batch_ids("node-a", "boot-1"))

    def batch(seq: int, refs: list[int]) -> tuple[bytes, list]:
        rows = [(r, 1_000 + seq, seq + r / 4) for r in refs]
        return pb.Batch(node_id="node-a", boot_id="boot-1", seq=seq,
                        columns=compact.encode_columns(rows)).SerializeToString(), rows

    reader, got = Chain(100), []
    for seq, refs in ((1, [1, 2, 3]), (2, [1, 9]), (3, [1, 2, 3]), (4, [2, 3])):
        data, rows = batch(seq, refs)
        try:
            msgs = conn.messages("boot-1", data, -1)
        except Unsendable as e:
            assert seq == 2 and "no definition for series_ref 9" in str(e)
            continue
        block = pb.AgentMessage.FromString(msgs[-1]).batch.columns
        alone = reader.receive(block)
        assert (alone != block) == (seq > 1)   # every block after the stream's first went chained
        got.append(compact.decode_columns(alone, 100).rows() == rows)
    assert got == [True, True, True]
