"""The commands of `xpusense-agent` (cli.py parses them): run, inventory, sources."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import yaml

from xpusense.common.config import addresses
from xpusense.common.journal import configure_logging
from xpusense.common.tls import make_channel

from .config import ConfigError, load_agent
from .daemon import Agent, build_sources, inventory
from .request_dir import RequestDirError
from .sources.ebpf.loader_process import discard_early
from .spool import SpoolError
from .stream import resolve
from .tiers import setup_sources

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def execute(args: argparse.Namespace, path: str | None) -> int:
    """Run the parsed command `args` with the config file at `path` (None: defaults and environment)."""
    flags = {"sources.npu_smi.path": args.npu_smi}
    if args.cmd == "run":
        flags.update({"collector.address": args.collector, "node_id": args.node_id, "log_level": args.log_level})
    try:
        cfg = load_agent(path, flags)
        if args.cmd == "run":
            resolve(cfg.collector.address)
            for address in addresses(cfg.collector.address):
                make_channel(address, cfg.collector)   # TLS/token/plaintext keys: exit 2 if unusable
    except (ConfigError, ValueError) as e:
        print(f"xpusense-agent: {e}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(cfg.log_level, "xpusense-agent")   # journal fields under systemd
    try:
        return {"run": _run, "inventory": _inventory, "sources": _sources}[args.cmd](cfg, args)
    except KeyboardInterrupt:
        return EXIT_OK


def _run(cfg, args) -> int:
    try:
        agent = Agent(cfg, setup_in_background=not args.once)
    except (SpoolError, RequestDirError) as e:
        print(f"xpusense-agent: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        discard_early()     # eBPF is off in the config: the early loader has nothing to do
    agent.install_signal_handlers()
    rc = agent.run(once=args.once)
    st = agent.stream   # an operator's (and tests/privileged/test_systemd_units.py's) count at every clean stop
    logging.getLogger("xpusense.agent").info(
        "stopped: boot %s made %d batches, %d acknowledged in this run, %d not acknowledged (kept in the spool, "
        "when on, for the next start), %d batches (%d samples) dropped or set aside", agent.boot_id, st.last_seq(),
        st.acked, st.pending(), st.dropped_batches, st.dropped_samples)
    return rc


def _with_sources(cfg):
    states, _ = setup_sources(build_sources(cfg))
    return states


def _close(states) -> None:
    for st in states:
        if st.state == "running":
            st.source.close()


def _inventory(cfg, args) -> int:
    states = _with_sources(cfg)
    try:
        inv = inventory(cfg, states)
    finally:
        _close(states)
    if args.format == "json":
        print(json.dumps(inv, indent=2))
    else:
        print(yaml.safe_dump(inv, sort_keys=False), end="")
    return EXIT_OK


def hbm_watch_row(cfg, states) -> dict:
    """The HBM watch as a row of `sources`: which accelerators it follows, and why not the others."""
    if not cfg.hbm_watch.enabled:
        return {"name": "hbm-watch", "state": "disabled", "reason": "[hbm_watch] enabled = false", "tiers": []}
    watched, not_watched = [], {}
    for st in states:
        if st.state == "running":
            for dev, why in st.source.hbm_watch_coverage().items():
                if why:
                    not_watched[dev] = why
                else:
                    watched.append(dev)
    by_reason: dict[str, list[str]] = {}
    for dev, why in not_watched.items():
        by_reason.setdefault(why, []).append(dev)
    reason = "; ".join(f"{', '.join(devs)}: {why}" for why, devs in by_reason.items())
    if not watched and not reason:
        reason = "no accelerator with HBM bandwidth data on this host (no GPU or NPU source runs)"
    return {"name": "hbm-watch", "state": "running" if watched else "unavailable", "reason": reason,
            "tiers": ["realtime"], "watched": watched, "not_watched": not_watched}


def _sources(cfg, args) -> int:
    states = _with_sources(cfg)
    rows = [st.as_dict() for st in states] + [hbm_watch_row(cfg, states)]
    _close(states)
    known = {st.name for st in states}
    # Sources switched off in config are listed too, so the answer is complete.
    for name, sect in vars(cfg.sources).items():
        enabled = sect.get("enabled", True) if isinstance(sect, dict) else sect.enabled
        if name not in known and not enabled:
            rows.append({"name": name, "state": "disabled", "reason": f"[sources.{name}] enabled = false",
                         "tiers": []})
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    print(f"{'SOURCE':<17} {'STATE':<12} {'TIERS':<26} REASON")
    for r in rows:
        print(f"{r['name']:<17} {r['state']:<12} {','.join(r['tiers']):<26} {r['reason']}")
    return EXIT_OK
