"""The cluster-mode commands of `xpusense-collector` (docs/scale.md; or `python -m
xpusense.collector.cluster`). `--nats` or `[nats] urls` selects cluster mode; the rest of the
config means what it means for one collector.

    serve --nats URL[,URL...]       a stateless gateway (the agent protocol, batches into JetStream)
    worker --nats URL[,URL...]      fleet state from the streams into the `fleet` bucket
    scheduler --nats URL[,URL...]   Place (and Query) from the `fleet` bucket, list-then-watch
    exporter --nats URL[,URL...]    [export.otlp] from the streams, a durable consumer (export.py)"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from xpusense.common.config import ConfigError, load
from xpusense.common.journal import configure_logging

from .config import NATS_SCHEMA, check_nats, role_files, split_urls

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def load_config(path: str | None, flags: dict, env: dict | None = None):
    """The collector's config with its [nats] table; ConfigError names the bad key."""
    from ..config import COLLECTOR_ENV, COLLECTOR_SCHEMA
    from ..scheduler.config import check_config
    schema = COLLECTOR_SCHEMA if "nats" in COLLECTOR_SCHEMA else {**COLLECTOR_SCHEMA, "nats": NATS_SCHEMA}
    cfg = load(schema, path, env, COLLECTOR_ENV, flags)
    where = path or "configuration"
    check_config(cfg, where)
    check_nats(cfg, where)
    return cfg


COMMANDS = ("worker", "scheduler", "exporter")
ROLE_OF = {"serve": "gateway", "worker": "worker", "scheduler": "scheduler", "exporter": "exporter"}   # nats_auth


def add_parsers(sub) -> None:
    """`worker`, `scheduler` and `exporter` subcommands (serve gets --nats from add_nats_flag)."""
    w = sub.add_parser("worker", help="cluster mode: keep fleet state from the streams, write it to the fleet bucket")
    s = sub.add_parser("scheduler", help="cluster mode: answer Place and Query from the fleet bucket (list, then watch)")
    e = sub.add_parser("exporter", help="cluster mode: OTLP export ([export.otlp]) from the streams, durably")
    for q in (w, s, e):
        q.add_argument("--config", help="TOML config file (env XPUSENSE_COLLECTOR_CONFIG)")
        add_nats_flag(q)
        q.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--listen", metavar="HOST:PORT", help="where to serve Place and Query (default: the config's listen)")
    from ..extender_http import add_extender_flag
    add_extender_flag(s)
    from ..web_config import add_web_config_flag
    add_web_config_flag(s)   # TLS and basic auth for the replica's /metrics ([export.prometheus])


def add_nats_flag(p) -> None:
    p.add_argument("--nats", metavar="URL[,URL...]",
                   help="the NATS JetStream cluster (cluster mode; docs/scale.md); also env XPUSENSE_NATS, [nats] urls")


def _flags(args) -> dict:
    flags = {"log_level": getattr(args, "log_level", None), "listen": getattr(args, "listen", None)}
    if getattr(args, "data_dir", None):
        flags["data_dir"] = args.data_dir
    urls = getattr(args, "nats", None) or os.environ.get("XPUSENSE_NATS")
    if urls:
        flags["nats.urls"] = split_urls(urls)
    from ..extender_http import extender_flags
    from ..web_config import web_config_flags
    return {**flags, **extender_flags(args), **web_config_flags(args)}


def wants_cluster(args) -> bool:
    """Whether `serve` runs as a gateway: --nats given, or [nats] urls in its config."""
    if getattr(args, "nats", None) or os.environ.get("XPUSENSE_NATS"):
        return True
    try:
        cfg = load_config(args.config or os.environ.get("XPUSENSE_COLLECTOR_CONFIG"), {})
    except ConfigError:
        return False   # the single collector's loader says what is wrong
    return bool(cfg.nats.urls)


def run_cluster(args) -> int:
    """serve (as a gateway), worker or scheduler; exit 0, 1 (cluster unreachable, port busy) or 2."""
    from ..grpc_server import BindError, check_bind
    from .engine import ClusterUnavailable
    try:
        cfg = load_config(args.config or os.environ.get("XPUSENSE_COLLECTOR_CONFIG"), _flags(args))
        if not cfg.nats.urls:
            raise ConfigError("cluster mode needs the NATS cluster: give --nats URL[,URL...] or [nats] urls")
        if cfg.data_dir and args.cmd == "serve":
            raise ConfigError("data_dir / --data-dir is the single collector's store: in cluster mode the "
                              "JetStream streams are the store; leave it out")
        role_files(cfg.nats, ROLE_OF[args.cmd], args.config or "configuration")   # its NATS identity's files
        from ..auth import Security
        security = Security.from_config(cfg, args.config or "configuration")
        from ..extender_http import check_section
        if getattr(args, "extender_listen", None) and args.cmd == "serve":
            raise ConfigError("in cluster mode kube-scheduler's extender is served by the scheduler replicas: give "
                              "--extender-listen (or [kubernetes.extender]) to `xpusense-collector scheduler`")
        check_section(cfg, args.config or "configuration")
        if args.cmd in ("serve", "scheduler"):
            check_bind(cfg.listen)
    except (ConfigError, ValueError) as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BindError as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_FAIL
    configure_logging(cfg.log_level, "xpusense-collector")   # journal fields under systemd (common/journal.py)
    if args.cmd in ("serve", "scheduler"):
        security.warn_at_start()

    async def amain() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if args.cmd == "serve":
            from ..limits import Limits
            from .serve import run_gateway
            await run_gateway(cfg, stop, security, Limits.from_config(cfg.limits), security.server_credentials())
        elif args.cmd == "worker":
            from .worker import run_worker
            await run_worker(cfg, stop)
        elif args.cmd == "exporter":
            from .export import run_exporter
            await run_exporter(cfg, stop)
        else:
            from .scheduler import run_scheduler
            await run_scheduler(cfg, stop, security, security.server_credentials())

    try:
        asyncio.run(amain())
    except (ClusterUnavailable, BindError) as e:
        print(f"xpusense-collector: {e}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xpusense.collector.cluster", description="xpusense cluster mode")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="a gateway: the agent protocol, batches into JetStream")
    s.add_argument("--config")
    s.add_argument("--listen", metavar="HOST:PORT")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    add_nats_flag(s)
    add_parsers(sub)
    return run_cluster(p.parse_args(argv))
