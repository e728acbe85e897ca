"""`xpusense-collector`: serve the fleet state, print it (`nodes`), or watch it live (`top`)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import signal
import sys
import time

import grpc

from xpusense.agent.config import DEFAULT_ADDRESS, ConfigError, split_host_port
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from .config import load_collector
from .views import node_to_dict, render_table

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
log = logging.getLogger("xpusense.collector")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xpusense-collector", description="xpusense fleet collector")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="accept agent streams, keep fleet state, serve the query API")
    s.add_argument("--config", help="TOML config file (env XPUSENSE_CONFIG)")
    s.add_argument("--listen", metavar="HOST:PORT", help=f"listen address (default {DEFAULT_ADDRESS})")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--marks-file", metavar="PATH", help="record of stored sequence numbers (see docs)")
    for name, helptext in (("nodes", "fleet state: every node and its latest values"),
                           ("top", "a live terminal view of the fleet (Ctrl-C to leave)")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("--collector", metavar="HOST:PORT", default=os.environ.get("XPUSENSE_COLLECTOR", DEFAULT_ADDRESS))
        q.add_argument("--stale-s", type=float, default=10.0, help="a node silent this long is stale")
        q.add_argument("--timeout-s", type=float, default=5.0, help="give up on the collector after this long")
        if name == "nodes":
            q.add_argument("--format", choices=["table", "json"], default="table")
            q.add_argument("--node", default="", help="only this node id")
            q.add_argument("--prefix", default="", help="only series whose name starts with this")
        else:
            q.add_argument("--interval-s", type=float, default=1.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "serve":
            return _serve(args)
        split_host_port(args.collector)
        return {"nodes": _nodes, "top": _top}[args.cmd](args)
    except (ConfigError, ValueError) as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_USAGE


def _serve(args) -> int:
    from .server import BindError, serve
    from .state import FleetState
    cfg = load_collector(args.config or os.environ.get("XPUSENSE_CONFIG"),
                         {"listen": args.listen, "log_level": args.log_level, "marks_file": args.marks_file})
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .marks import MarksJournal
    journal = MarksJournal(cfg.marks_file) if cfg.marks_file else None
    try:
        state = FleetState(history_s=cfg.history_s, events_kept=cfg.events_kept, journal=journal)
    except OSError as e:
        print(f"xpusense-collector: cannot use marks_file {cfg.marks_file!r}: {e.strerror}; "
              f"fix the path or its permissions", file=sys.stderr)
        return EXIT_FAIL

    async def amain() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().create_task(freeze_long_lived(stop))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg.listen, state, cfg.max_message_bytes, stop)

    try:
        asyncio.run(amain())
    except BindError as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        if journal:
            journal.close()
    return EXIT_OK


async def freeze_long_lived(stop: asyncio.Event, every_s: float = 5.0) -> None:
    """Keep the cyclic garbage collector's pauses out of ingest latency.

    The fleet state is hundreds of thousands of long-lived objects (a series, its history deque);
    a full collection walks all of them and stalled ingest for 200-800 ms at 1,000 agents
    (bench/README.md). Every `every_s` whatever is alive is moved out of the collector's reach
    (gc.freeze, O(1)). Young objects are still collected as usual, many times a second, and
    refcounting frees everything that is not a cycle; a cycle that outlives `every_s` is kept.
    """
    while True:
        gc.freeze()
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except asyncio.TimeoutError:
            pass


def fetch(address: str, timeout_s: float, node_id: str = "", prefix: str = "") -> pb.ListNodesReply:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.QueryStub(ch).ListNodes(pb.ListNodesRequest(node_id=node_id, name_prefix=prefix),
                                               timeout=timeout_s, wait_for_ready=False)


def _unreachable(address: str, e: grpc.RpcError) -> int:
    print(f"xpusense-collector: cannot reach the collector at {address} ({e.code().name}: {e.details()}); "
          f"is `xpusense-collector serve` running there? set --collector HOST:PORT", file=sys.stderr)
    return EXIT_FAIL


def _nodes(args) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `nodes | head` ends quietly
    try:
        reply = fetch(args.collector, args.timeout_s, args.node, args.prefix)
    except grpc.RpcError as e:
        return _unreachable(args.collector, e)
    nodes = [node_to_dict(n, reply.time_unix_nano, args.stale_s) for n in reply.nodes]
    if args.format == "json":
        json.dump({"collector": args.collector, "nodes": nodes}, sys.stdout, indent=2)
        print()
    else:
        print(render_table(nodes, shutil.get_terminal_size().columns))
    return EXIT_OK


def _top(args) -> int:
    out = sys.stdout
    out.write("\x1b[?25l")  # hide the cursor while refreshing in place
    try:
        while True:
            try:
                reply = fetch(args.collector, args.timeout_s, prefix="")
                nodes = [node_to_dict(n, reply.time_unix_nano, args.stale_s) for n in reply.nodes]
                body = render_table(nodes, shutil.get_terminal_size().columns)
            except grpc.RpcError as e:
                body = f"collector {args.collector} unreachable: {e.code().name}; retrying"
            stamp = time.strftime("%H:%M:%S")
            out.write(f"\x1b[H\x1b[2Jxpusense top  {args.collector}  {stamp}  (Ctrl-C to quit)\n\n{body}\n")
            out.flush()
            time.sleep(args.interval_s)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        out.write("\x1b[?25h\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
