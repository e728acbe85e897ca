"""`xpusense-agent`: run the agent, print this node's inventory, or list its sources.

Only the argument parser, common/grpc_engine (grpc's client engine must be chosen before grpc is
imported) and the eBPF loader's starter are imported before the command runs: `run` first starts
the loader process (loader_process.start_early), so that it compiles the probes while the agent imports the
rest (commands.py) and starts; the agent's eBPF sources take it over, and one nobody took is ended.
"""

from __future__ import annotations

import argparse
import os
import sys

from xpusense.common.grpc_engine import POLLING_CLIENT, choose_engine

from .sources.ebpf.loader_process import discard_early, start_early


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xpusense-agent", description="xpusense per-node telemetry agent")
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--config", help="TOML config file (env XPUSENSE_AGENT_CONFIG)")
        sp.add_argument("--npu-smi", metavar="PATH", help="the npu-smi executable ([sources.npu_smi] path)")

    r = sub.add_parser("run", help="measure this node and stream to the collector")
    common(r)
    r.add_argument("--collector", metavar="HOST:PORT[,HOST:PORT...]",
                   help="collector address, or several (cluster-mode gateways, failed over in turn); env XPUSENSE_COLLECTOR")
    r.add_argument("--node-id", metavar="ID", help="node id (env XPUSENSE_NODE_ID; default: host name)")
    r.add_argument("--once", action="store_true", help="one round of every tier, send it, exit")
    r.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    i = sub.add_parser("inventory", help="this node's resources in the inventory schema")
    common(i)
    i.add_argument("--format", choices=["yaml", "json"], default="yaml")

    s = sub.add_parser("sources", help="every source: whether it runs here, and why not")
    common(s)
    s.add_argument("--format", choices=["table", "json"], default="table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = args.config or os.environ.get("XPUSENSE_AGENT_CONFIG")
    if args.cmd == "run":
        choose_engine(POLLING_CLIENT)   # before grpc is imported: it reads its experiments then
        # grpc's fork handlers off: the host source's netns helper (pyroute2) forks while the stream
        # is busy in gRPC; the handlers then skip ("other threads are calling into gRPC") and the
        # agent was seen to die of SIGSEGV right after. The children forked never use gRPC.
        if "grpc" not in sys.modules:
            os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        start_early(path or "")
    try:
        from .commands import execute
        return execute(args, path)
    finally:
        discard_early()


if __name__ == "__main__":
    sys.exit(main())
