"""The floor under the single collector's ingest: a gRPC server that speaks the agent's Ingest stream
and does nothing else (Floor), so that `bench/collector_ingest.py` measures what grpc's asyncio
server and the event loop cost a batch on this machine before any of the collector's own work.

    .venv/bin/python bench/collector_ingest.py --agents 1500 --rate 1 --seconds 20 --warmup-s 30 \
        --collector-cmd ".venv/bin/python bench/grpc_floor.py"

The collector's command line is taken as given (`serve --listen ADDR ...`); only --listen is read."""

from __future__ import annotations

import asyncio
import sys

from xpusense.common.grpc_engine import POLLING_LISTENER, choose_engine

choose_engine(POLLING_LISTENER)   # before grpc is imported, as xpusense-collector does

import grpc  # noqa: E402

from xpusense.collector.grpc_server import SERVER_OPTIONS  # noqa: E402
from xpusense.collector.wire import _wire_rows  # noqa: E402  (None where it was not built)
from xpusense.v1 import telemetry_pb2 as pb  # noqa: E402


def _bytes(raw: bytes) -> bytes:
    return raw


class Floor:
    """On the same engine and server options as `xpusense-collector serve` (grpc's polling listener,
    chosen before grpc is imported; the same keepalive), a message's bytes taken as they came (no
    protobuf deserializer): the Hello answered with a Welcome, each batch read by the collector's own
    C reader (collector/_wire_rows.c, every field checked as the collector checks it) and acknowledged
    with an Ack built as the collector builds one, in the stream's one task. Nothing is kept but a
    count of acknowledged batches per node, which Query.ListNodes answers as `batches_stored`, so the
    bench's cross-check holds. No limits, fleet state, scheduler index or store."""

    def __init__(self) -> None:
        self.acked: dict[str, int] = {}

    async def stream(self, requests, context):
        first = True
        async for raw in requests:
            if first:   # the Hello
                first = False
                hello = pb.AgentMessage.FromString(raw).hello
                self.acked.setdefault(hello.node_id, 0)
                yield pb.CollectorMessage(welcome=pb.Welcome(boot_id=hello.boot_id)).SerializeToString()
                continue
            lean = _wire_rows.lean_batch(raw)
            if lean is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not a batch the C reader reads whole")
            node_id, boot_id, seq = lean[0], lean[1], lean[2]
            self.acked[node_id] = self.acked.get(node_id, 0) + 1
            yield pb.CollectorMessage(ack=pb.Ack(boot_id=boot_id, seq=seq, duplicate=False)).SerializeToString()

    async def list_nodes(self, raw: bytes, context) -> bytes:
        return pb.ListNodesReply(nodes=[pb.NodeView(node_id=n, batches_stored=k)
                                        for n, k in self.acked.items()]).SerializeToString()


async def main(listen: str) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    floor = Floor()
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("xpusense.v1.Ingest", {
            "Stream": grpc.stream_stream_rpc_method_handler(floor.stream, _bytes, _bytes)}),
        grpc.method_handlers_generic_handler("xpusense.v1.Query", {
            "ListNodes": grpc.unary_unary_rpc_method_handler(floor.list_nodes, _bytes, _bytes)}),
    ))
    if server.add_insecure_port(listen) == 0:
        sys.exit(f"grpc_floor: cannot listen on {listen}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    if "--listen" not in sys.argv[:-1] or _wire_rows is None:
        sys.exit("usage: grpc_floor.py serve --listen HOST:PORT [...] (needs the collector's C reader built)")
    try:
        asyncio.run(main(sys.argv[sys.argv.index("--listen") + 1]))
    except KeyboardInterrupt:
        pass
