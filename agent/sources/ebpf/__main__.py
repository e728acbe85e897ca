"""`python -m xpusense.agent.sources.ebpf`: print the C the agent would load here, or try loading it."""

from __future__ import annotations

import argparse
import json
import sys

from xpusense.common.config import ConfigError

from ..base import Unavailable
from .family import ebpf_sources, plans_for, table_from
from .loader import render_c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xpusense.agent.sources.ebpf",
                                 description="Show the eBPF C the agent would load here, or try loading it.")
    ap.add_argument("--print-c", action="store_true", help="print the C that will be compiled (with -D flags)")
    ap.add_argument("--probes", default="", help="comma-separated probes (default: all)")
    ap.add_argument("--config-json", default="", help="[sources.ebpf] keys as a JSON object")
    ap.add_argument("--load", action="store_true", help="compile, attach, print describe() of each probe, detach")
    args = ap.parse_args(argv)
    cfg = json.loads(args.config_json) if args.config_json else {}
    if args.probes:
        cfg["probes"] = [p for p in args.probes.split(",") if p]
    try:
        table = table_from(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plans, why = plans_for(table)
    for probe, reason in why.items():
        print(f"// {probe}: not built here: {reason}", file=sys.stderr)
    if args.print_c or not args.load:
        print(render_c(plans))
    if args.load:
        sources = ebpf_sources(table)
        for s in sources:
            try:
                s.setup()
                print(json.dumps({"source": s.name, "state": "running", **s.describe()}))
            except Unavailable as e:
                print(json.dumps({"source": s.name, "state": "unavailable", "reason": str(e)}))
        for s in sources:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
