"""A compact-building agent's stream to a real collector process (loopback gRPC) stores exactly
the points a Sample-encoding agent's stream stores, histograms included: through a collector that
does not choose the compact encoding (the agent expands its batches), through one that chooses only
version 1 (the agent writes its columns again) and through one that chooses the newest; an agent
building version 1 (the version before) stores the same through each."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from compact_rounds import round_of
from helpers import BIN, free_port, wait_until

from xpusense.agent.stream import StreamClient
from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

ROUNDS = 4


def stored(query, node_id: str) -> tuple[list, dict]:
    """The node's series as ListNodes shows them (latest value, histogram) and each one's history."""
    views, token = [], ""
    while True:
        reply = query.ListNodes(pb.ListNodesRequest(node_id=node_id, page_token=token), timeout=10)
        views += [s for n in reply.nodes for s in n.series]
        token = reply.next_page_token
        if not token:
            break
    latest = sorted((s.name, s.unit, s.kind, tuple(sorted(s.labels.items())), s.value, s.time_unix_nano,
                     tuple(s.histogram.bounds), tuple(s.histogram.counts), s.histogram.sum, s.histogram.count)
                    for s in views if not s.name.startswith("xpusense."))
    history = {}
    for s in views:
        points = query.GetHistory(pb.HistoryRequest(node_id=node_id, name=s.name, labels=s.labels), timeout=10)
        history[(s.name, tuple(sorted(s.labels.items())))] = [(p.time_unix_nano, p.value) for p in points.points]
    return latest, history


@pytest.mark.parametrize("collector_encodings", ["[]", '["columns-zlib-1"]', '["columns-zlib-2", "columns-zlib-1"]'])
def test_compact_agent_stores_exactly_what_a_sample_agent_stores(procs, tmp_path, collector_encodings):
    addr = f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "collector.toml"
    cfg.write_text(f"[ingest]\nbatch_encodings = {collector_encodings}\n")
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr, "--config", str(cfg)], "collector")
    channel = grpc.insecure_channel(addr)
    query = pb_grpc.QueryStub(channel)
    wait_until(lambda: query.ListNodes(pb.ListNodesRequest(), timeout=2), what="the collector answering")
    clients = {node: StreamClient(addr, node, "boot-1", lambda: pb.Inventory(hostname="h"), flush_s=0.02,
                                  backoff_initial_s=0.05, backoff_max_s=0.3, batch_encoding=encoding)
               for node, encoding in (("compact", compact.ENCODING), ("v1", "columns-zlib-1"), ("samples", ""))}
    t0 = time.time_ns() - ROUNDS * 1_000_000_000
    try:
        for c in clients.values():
            c.start()
        for i in range(ROUNDS):
            for c in clients.values():
                c.put(round_of(i, extra=i, t0=t0))   # a new series each round
                c.flush()
        wait_until(lambda: all(c.status()["acked"] == ROUNDS for c in clients.values()),
                   what="every batch of both agents acknowledged")
        assert all(c.status()["dropped_samples"] == 0 and c.status()["set_aside"] == 0 for c in clients.values())
        # The connection's encoding: what the collector's Welcome chose (its [ingest] batch_encodings).
        allowed = json.loads(collector_encodings)
        assert clients["compact"].status()["encoding"] == (allowed[0] if allowed else "")
        assert clients["v1"].status()["encoding"] == ("columns-zlib-1" if allowed else "")
        compact_latest, compact_history = stored(query, "compact")
        v1_latest, v1_history = stored(query, "v1")
        samples_latest, samples_history = stored(query, "samples")
    finally:
        for c in clients.values():
            c.stop(drain_s=0)
        channel.close()
    assert compact_latest == samples_latest == v1_latest
    assert compact_history == samples_history == v1_history
    # Every point of every round is there: the histogram sums (their values) and the new series too.
    assert compact_history[("tcp.rtt", (("dst", "10.0.0.1"),))] == [
        (t0 + i * 1_000_000_000 + 13, 3.5 * i) for i in range(ROUNDS)]
    assert len(compact_history[("big.hist", ())]) == ROUNDS
    assert set(compact_history) >= {(f"extra.{k}", (("k", str(k)),)) for k in range(ROUNDS - 1)}
    hist = next(s for s in compact_latest if s[0] == "tcp.rtt")
    assert hist[6:] == ((0.001, 0.01, 0.1), tuple(k * (ROUNDS - 1) for k in (1, 2, 3, 4)), 3.5 * (ROUNDS - 1),
                        4 * (ROUNDS - 1))
