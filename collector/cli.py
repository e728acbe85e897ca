"""`xpusense-collector`: serve the fleet state, print it (`nodes`), or watch it live (`top`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import time

import grpc

from xpusense.common.config import DEFAULT_ADDRESS, ConfigError, split_host_port
from xpusense.common.journal import configure_logging
from xpusense.common.supervise import TASKS
from xpusense.common.tls import make_channel
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

from .auth import Security
from .certs import CertError, make_certs, make_tokens
from .cluster.cli import COMMANDS as CLUSTER_COMMANDS
from .cluster.cli import add_nats_flag, run_cluster, wants_cluster
from .cluster.cli import add_parsers as add_cluster_parsers
from .config import load_collector
from .exporters import Exporters
from .extender_http import add_extender_flag, extender_flags
from .extender_http import check_section as check_extender
from .gc_policy import freeze_long_lived, reclaim_pending
from .grpc_server import BindError, check_bind
from .limits import Limits
from .scheduler.service import add_place_parser, place_command
from .server import serve
from .state import FleetState
from .store import Store, StoreError
from .store.snapshot_taker import Snapshotter
from .views import PagingError, fetch_all, node_to_dict, render_table
from .web_config import add_web_config_flag, web_config_flags

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
log = logging.getLogger("xpusense.collector")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xpusense-collector", description="xpusense fleet collector")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="accept agent streams, keep fleet state, serve the query API")
    s.add_argument("--config", help="TOML config file (env XPUSENSE_COLLECTOR_CONFIG)")
    s.add_argument("--listen", metavar="HOST:PORT", help=f"listen address (default {DEFAULT_ADDRESS})")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--data-dir", metavar="DIR", help="durable store: batches are acknowledged once written here")
    add_extender_flag(s)
    add_web_config_flag(s)   # TLS and basic auth for /metrics (collector/web_config.py)
    add_nats_flag(s)   # cluster mode: a gateway to NATS JetStream (collector/cluster/, docs/scale.md)
    for name, helptext in (("nodes", "fleet state: every node and its latest values"),
                           ("top", "a live terminal view of the fleet (Ctrl-C to leave)")):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("--collector", metavar="HOST:PORT", default=os.environ.get("XPUSENSE_COLLECTOR", DEFAULT_ADDRESS))
        q.add_argument("--stale-s", type=float, default=10.0, help="a node silent this long is stale")
        q.add_argument("--timeout-s", type=float, default=5.0, help="give up on the collector after this long")
        _client_security_flags(q)
        if name == "nodes":
            q.add_argument("--format", choices=["table", "json"], default="table")
            q.add_argument("--node", default="", help="only this node id")
            q.add_argument("--prefix", default="", help="only series whose name starts with this")
        else:
            q.add_argument("--interval-s", type=float, default=1.0)
    _client_security_flags(add_place_parser(sub, os.environ.get("XPUSENSE_COLLECTOR", DEFAULT_ADDRESS)))
    c = sub.add_parser("certs", help="make a CA, the collector's certificate and one client certificate per node; "
                                     "with --nats, cluster mode's NATS certificates")
    c.add_argument("--out", metavar="DIR", help="where to write them (a CA already there is reused)")
    c.add_argument("--nodes", help="node ids, comma-separated (each bound to its certificate)")
    c.add_argument("--nats", metavar="DIR", dest="nats_dir",
                   help="cluster mode: a CA for NATS (reused when DIR has one), the NATS servers' certificate and "
                        "one client certificate per role (gateway, worker, scheduler, exporter)")
    c.add_argument("--nats-host", action="append", default=[], metavar="HOST",
                   help="name or IP clients and routes use for the NATS servers (repeat; default localhost, "
                        "127.0.0.1, ::1)")
    c.add_argument("--collector-host", action="append", default=[], metavar="HOST",
                   help="name or IP agents use for the collector (repeat; default localhost, 127.0.0.1, ::1)")
    c.add_argument("--days", type=int, default=365, help="validity of the certificates (the CA: 10 years)")
    t = sub.add_parser("tokens", help="make a bearer token per node and the collector's tokens_file")
    t.add_argument("--out", required=True, metavar="DIR", help="writes DIR/tokens and DIR/<node>.token")
    t.add_argument("--nodes", required=True, help="node ids, comma-separated")
    add_cluster_parsers(sub)   # worker, scheduler
    return p


def _client_security_flags(q) -> None:
    env = os.environ.get
    q.add_argument("--tls-ca", default=env("XPUSENSE_TLS_CA", ""), help="CA of the collector's certificate (TLS)")
    q.add_argument("--tls-cert", default=env("XPUSENSE_TLS_CERT", ""), help="client certificate (mTLS)")
    q.add_argument("--tls-key", default=env("XPUSENSE_TLS_KEY", ""), help="its private key")
    q.add_argument("--token-file", default=env("XPUSENSE_TOKEN_FILE", ""), help="a bearer token of the fleet")
    q.add_argument("--insecure", action="store_true", help="allow plaintext to a non-loopback collector")


def _query_channel(args):
    """A channel factory for nodes/top from the security flags (common/tls.py rules)."""
    from types import SimpleNamespace
    keys = SimpleNamespace(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                           token_file=args.token_file, insecure=args.insecure)
    names = {"address": "--collector", "tls_ca": "--tls-ca", "tls_cert": "--tls-cert", "tls_key": "--tls-key",
             "token_file": "--token-file", "insecure": "--insecure"}
    # Pages are at most the collector's limits.max_reply_bytes (4 MB by default); room for a larger one.
    return make_channel(args.collector, keys, options=[("grpc.max_receive_message_length", MAX_REPLY_BYTES)],
                        names=names)


MAX_REPLY_BYTES = 64 * 2**20


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd in CLUSTER_COMMANDS or (args.cmd == "serve" and wants_cluster(args)):
            return run_cluster(args)
        if args.cmd == "serve":
            return _serve(args)
        if args.cmd in ("certs", "tokens"):
            return _certs(args)
        split_host_port(args.collector)
        if args.cmd in ("nodes", "top", "place"):
            args.channel = _query_channel(args)
        if args.cmd == "place":
            return place_command(args)
        return {"nodes": _nodes, "top": _top}[args.cmd](args)
    except (ConfigError, ValueError) as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_USAGE


def _serve(args) -> int:
    cfg = load_collector(args.config or os.environ.get("XPUSENSE_COLLECTOR_CONFIG"),
                         {"listen": args.listen, "log_level": args.log_level, "data_dir": args.data_dir,
                          **extender_flags(args), **web_config_flags(args)})
    security = Security.from_config(cfg, args.config or "configuration")   # ConfigError: exit 2, names the key
    check_extender(cfg, args.config or "configuration")
    limits = Limits.from_config(cfg.limits)
    try:
        check_bind(cfg.listen)   # a busy port is one clear line, before anything else is said or opened
    except BindError as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_FAIL
    configure_logging(cfg.log_level, "xpusense-collector")   # journal fields under systemd (common/journal.py)
    security.warn_at_start()
    state = FleetState(history_s=cfg.history_s, events_kept=cfg.events_kept)
    exporters = Exporters.from_config(cfg, state)   # OTLP / Prometheus (docs/export.md)
    store = snapshots = None
    last_written = last_written_ns(cfg.data_dir) if cfg.data_dir else 0   # before the store writes anything
    if cfg.data_dir:
        sc = cfg.store
        store = Store(cfg.data_dir, history_s=cfg.history_s, fsync=cfg.fsync, segment_s=sc.segment_s,
                      segment_bytes=sc.segment_bytes, max_pending_bytes=sc.max_pending_bytes,
                      retry_s=sc.retry_s, damaged_keep_bytes=sc.damaged_keep_bytes, snapshot_keep=sc.snapshot_keep,
                      commit_interval_s=sc.commit_interval_s)
        exporters.use_store(store)   # before the replay: it keeps the segments not yet exported
        snapshots = (Snapshotter(store, state, sc.snapshot_every_s, level=sc.snapshot_compress_level,
                                 after_records=sc.snapshot_after_records, max_s=sc.snapshot_max_s,
                                 cpu_share=sc.snapshot_cpu_share)
                     if sc.snapshot_every_s else None)
        try:
            store.open(state)
            # The restored marks were stored by then at the latest (limits.max_seq_jump counts from it).
            state.restored_at_ns = min(state.restored_at_ns, last_written or state.restored_at_ns)
        except StoreError as e:
            print(f"xpusense-collector: {e}", file=sys.stderr)
            return EXIT_FAIL
    else:
        log.warning("no data_dir: batches are acknowledged from memory and a restart loses the fleet "
                    "state; set --data-dir for a durable store")

    async def amain() -> None:
        stop = asyncio.Event()
        # Background tasks under common/supervise.py: a failure is logged, counted (tasks.restarts) and restarted.
        TASKS.task("gc-policy", lambda: freeze_long_lived(stop, postpone=reclaim_pending), stop)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if snapshots is not None:   # store/snapshot_taker.py: a restart replays only the log after the last one
            TASKS.task("store-snapshots", lambda: snapshots.run(stop), stop)
        await serve(cfg.listen, state, cfg.max_message_bytes, stop, cfg, store=store,
                    credentials=security.server_credentials(), security=security, limits=limits)
        if snapshots is not None and store is not None:   # a clean stop: one more, covering everything durable
            try:
                await asyncio.wait_for(store.barrier(), 10.0)   # not while the disk fails (the last one stands)
                await asyncio.sleep(0)   # the streams' last durable batches are applied
                await snapshots.take("stop")
            except TimeoutError:
                log.warning("store not written within 10 s at stop: no snapshot; the next start replays the log "
                            "after the last one")

    try:
        exporters.start()
        asyncio.run(amain())
    except BindError as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        exporters.stop()
        if store is not None:
            store.close()
    return EXIT_OK


def last_written_ns(directory: str, max_files: int = 100_000) -> int:
    """When anything under `directory` was last modified (ns since the epoch; 0: nothing there)."""
    newest, seen = 0, 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            seen += 1
            if seen > max_files:
                return newest
            try:
                newest = max(newest, os.stat(os.path.join(root, name)).st_mtime_ns)
            except OSError:
                continue
    return newest


def fetch(address: str, timeout_s: float, node_id: str = "", prefix: str = "", channel=None) -> pb.ListNodesReply:
    """The whole fleet state, page by page (each call within `timeout_s`)."""
    opts = [("grpc.max_receive_message_length", MAX_REPLY_BYTES)]
    with (channel() if channel is not None else grpc.insecure_channel(address, options=opts)) as ch:
        stub = pb_grpc.QueryStub(ch)
        return fetch_all(lambda req: stub.ListNodes(req, timeout=timeout_s, wait_for_ready=False),
                         pb.ListNodesRequest(node_id=node_id, name_prefix=prefix))


def _unreachable(address: str, e: grpc.RpcError) -> int:
    print(f"xpusense-collector: cannot reach the collector at {address} ({e.code().name}: {e.details()}); "
          f"is `xpusense-collector serve` running there? set --collector HOST:PORT", file=sys.stderr)
    return EXIT_FAIL


def _nodes(args) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `nodes | head` ends quietly
    try:
        reply = fetch(args.collector, args.timeout_s, args.node, args.prefix, channel=args.channel)
    except grpc.RpcError as e:
        return _unreachable(args.collector, e)
    except PagingError as e:
        print(f"xpusense-collector: {args.collector}: {e}", file=sys.stderr)
        return EXIT_FAIL
    nodes = [node_to_dict(n, reply.time_unix_nano, args.stale_s) for n in reply.nodes]
    if args.format == "json":
        json.dump({"collector": args.collector, "nodes": nodes, "counters": dict(sorted(reply.counters.items()))},
                  sys.stdout, indent=2)
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
                reply = fetch(args.collector, args.timeout_s, prefix="", channel=args.channel)
                nodes = [node_to_dict(n, reply.time_unix_nano, args.stale_s) for n in reply.nodes]
                body = render_table(nodes, shutil.get_terminal_size().columns)
            except grpc.RpcError as e:
                body = f"collector {args.collector} unreachable: {e.code().name}; retrying"
            except PagingError as e:
                body = f"collector {args.collector}: {e}; retrying"
            stamp = time.strftime("%H:%M:%S")
            out.write(f"\x1b[H\x1b[2Jxpusense top  {args.collector}  {stamp}  (Ctrl-C to quit)\n\n{body}\n")
            out.flush()
            time.sleep(args.interval_s)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        out.write("\x1b[?25h\n")
        out.flush()


def _certs(args) -> int:
    """`certs` and `tokens`: credentials for a fleet (collector/certs.py), and the config keys to use."""
    if args.cmd == "certs" and (bool(args.out) != bool(args.nodes) or not (args.out or args.nats_dir)):
        print("xpusense-collector: certs: give --out DIR and --nodes N1,N2 (agents and collector), --nats DIR "
              "(cluster mode's NATS), or both", file=sys.stderr)
        return EXIT_USAGE
    if args.cmd == "certs" and args.nats_dir:
        code = _nats_certs(args)
        if code != EXIT_OK or not args.out:
            return code
    nodes = args.nodes.split(",")
    if args.cmd == "tokens":
        made = _made(args.out, make_tokens, args.out, nodes)
        if isinstance(made, int):
            return made
        print(f"collector: tokens_file = \"{made['tokens_file']}\"")
        for n, path in made["nodes"].items():
            print(f"node {n}: [collector] token_file = \"{path}\"  (copy it to the node, mode 0600)")
        return EXIT_OK
    made = _made(args.out, make_certs, args.out, nodes, args.collector_host, args.days)
    if isinstance(made, int):
        return made
    c = made["collector"]
    print(f"CA: {made['ca']} ({'new' if made['ca_created'] else 'reused'}; keep {made['ca_key']} offline)")
    print(f"collector ({', '.join(c['hosts'])}): [tls] ca = \"{made['ca']}\", cert = \"{c['cert']}\", "
          f"key = \"{c['key']}\"")
    for n, p in made["nodes"].items():
        print(f"node {n}: [collector] tls_ca = \"{made['ca']}\", tls_cert = \"{p['cert']}\", "
              f"tls_key = \"{p['key']}\"")
    return EXIT_OK


def _made(out: str, make, *a) -> dict | int:
    """What a credentials maker made, or the exit code after saying why it could not."""
    try:
        return make(*a)
    except CertError as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"xpusense-collector: cannot write to {out}: {e.strerror}", file=sys.stderr)
        return EXIT_FAIL


def _nats_certs(args) -> int:
    from .certs import make_nats_certs
    made = _made(args.nats_dir, make_nats_certs, args.nats_dir, args.nats_host, args.days)
    if isinstance(made, int):
        return made
    s = made["server"]
    print(f"NATS CA: {made['ca']} ({'new' if made['ca_created'] else 'reused'}; keep {made['ca_key']} offline)")
    print(f"nats-server ({', '.join(s['hosts'])}): tls and cluster.tls cert_file \"{s['cert']}\", key_file "
          f"\"{s['key']}\", ca_file \"{made['ca']}\" (deploy/cluster/nats.yaml)")
    for role, p in made["roles"].items():
        print(f"{role}: [nats] tls_ca = \"{made['ca']}\", tls_cert = \"{p['cert']}\", tls_key = \"{p['key']}\"")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
