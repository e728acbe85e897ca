"""engine.disconnect closes a connection whose reconnect was cut short in its TLS handshake (a server
dying mid-handshake): nats-py's close then waits on a socket asyncio never reports closed, as
start_tls had swapped its protocol. The servers are small NATS speakers on loopback: one serves a
single TLS connection and drops it, the other never answers the reconnect's TLS hello."""

from __future__ import annotations

import asyncio
import json
import ssl

import nats

from xpusense.collector.certs import make_certs
from xpusense.collector.cluster.engine import disconnect

INFO = b"INFO " + json.dumps({"server_id": "fake", "version": "2.10.0", "proto": 1, "max_payload": 1048576,
                              "tls_required": True, "headers": True}).encode() + b"\r\n"


def test_disconnect_returns_when_a_reconnect_handshake_was_cut_short(tmp_path):
    paths = make_certs(str(tmp_path), ["n1"], collector_hosts=["127.0.0.1"])
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(paths["collector"]["cert"], paths["collector"]["key"])
    client_ctx = ssl.create_default_context(cafile=paths["ca"])

    async def scenario() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        served, drop, stalled = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def serve_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            good.close()                 # one connection: the reconnect finds only the stalling one
            writer.write(INFO)
            await writer.drain()
            while not (await reader.readline()).startswith(b"PING"):
                pass
            writer.write(b"PONG\r\n")
            await writer.drain()
            served.set()
            await drop.wait()
            writer.transport.abort()

        async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            stalled.set()                # never answers the client's TLS hello
            await reader.read()

        good = await asyncio.start_server(serve_once, "127.0.0.1", 0, ssl=server_ctx)
        staller = await asyncio.start_server(stall, "127.0.0.1", 0)
        urls = [f"nats://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in (good, staller)]
        nc = await nats.connect(servers=urls, tls=client_ctx, tls_handshake_first=True, dont_randomize=True,
                                connect_timeout=30, reconnect_time_wait=0.05, max_reconnect_attempts=-1,
                                ping_interval=600, drain_timeout=1.0)
        try:
            await asyncio.wait_for(served.wait(), 30)
            drop.set()
            await asyncio.wait_for(stalled.wait(), 30)
            start = loop.time()
            await asyncio.wait_for(disconnect(nc), 30)
            return nc.is_closed, loop.time() - start
        finally:
            staller.close()

    closed, took_s = asyncio.run(scenario())
    assert closed
    assert took_s < 10.0, f"disconnect took {took_s:.1f} s"
