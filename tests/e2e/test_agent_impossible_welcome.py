"""A collector that claims to hold more than the agent ever sent, with real processes: a fake
collector (a real gRPC server on loopback) welcomes the agent with `stored_up_to` = 2^64-1 (a
forged mark, or one that lost its state). The agent takes nothing as acknowledged, logs and counts
the claim, keeps its spool, and every batch arrives at the honest collector it fails over to."""

from __future__ import annotations

import asyncio
import signal
import threading

import grpc
from helpers import BIN, free_port, nodes_json, wait_until
from test_faults import FAST, check_exactly_once, spooled

from xpusense.collector.store import stored_batches
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

FORGED = 2**64 - 1
NODE = "claimed-node"


class LyingCollector(pb_grpc.IngestServicer):
    """Answers every Hello with Welcome(stored_up_to = 2^64-1) and acknowledges nothing."""

    def __init__(self, addr: str):
        self.addr = addr
        self.welcomed: list[str] = []     # the boot ids it welcomed
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self._call(self._start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _start(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        pb_grpc.add_IngestServicer_to_server(self, server)
        server.add_insecure_port(self.addr)
        await server.start()
        return server

    async def Stream(self, request_iterator, context):   # noqa: N802 (the gRPC method's name)
        first = await anext(aiter(request_iterator))
        self.welcomed.append(first.hello.boot_id)
        yield pb.CollectorMessage(welcome=pb.Welcome(boot_id=first.hello.boot_id, stored_up_to=FORGED))
        async for _ in request_iterator:   # batches: read, never acknowledged
            pass

    def stop(self) -> None:
        self._call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def value(node, name):
    found = [s for s in node["series"] if s["name"] == name]
    return found[0]["value"] if found else None


def test_a_welcome_claiming_more_than_was_sent_drops_nothing(procs, tmp_path, own_spool_dir):
    lying, honest = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "agent.toml"
    cfg.write_text(FAST)
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", f"{lying},{honest}",
                   "--node-id", NODE], "agent")
    spool = own_spool_dir / NODE
    # No collector yet: batches pile up unacknowledged in the spool.
    wait_until(lambda: len(spooled(spool)) >= 5, what="batches piling up in the spool")
    fake = LyingCollector(lying)
    try:
        # Its Welcome is the first message of the connection: in the agent's hands once it says so.
        wait_until(lambda: f"connected to collector {lying} " in agent.output(), what="the agent at the lying collector")
        boot = fake.welcomed[0]
        data = tmp_path / "collector-data"
        procs([str(BIN / "xpusense-collector"), "serve", "--listen", honest, "--data-dir", str(data)], "collector")
    finally:
        fake.stop()

    def view():
        return next((n for n in nodes_json(honest)["nodes"] if n["node_id"] == NODE), None)
    # The honest collector gets every batch of the boot from seq 1: none was taken as stored.
    wait_until(lambda: (n := view()) and n["stored_up_to"] >= 10, timeout_s=90, what="batches at the honest collector")
    stored = [(b.boot_id, b.seq, len(b.samples)) for b in stored_batches(str(data)) if b.node_id == NODE]
    per_boot, _ = check_exactly_once(stored)        # seqs 1..max of the boot, none missing, none twice
    assert set(per_boot) == {boot} and min(per_boot[boot]) == 1, sorted(per_boot.get(boot, []))[:5]
    # The claim was counted (the agent's own series, at the honest collector) and logged.
    wait_until(lambda: (value(view(), "xpusense.agent.stream.impossible_acks") or 0) >= 1, timeout_s=30,
               what="xpusense.agent.stream.impossible_acks at the honest collector")
    agent.kill(signal.SIGTERM)
    out = agent.output()
    warning = next((ln for ln in out.splitlines() if f"up to seq {FORGED}," in ln), "")
    assert f"collector {lying} " in warning and f"boot {boot} " in warning and "sent only up to " in warning, warning
    assert "Traceback" not in out
