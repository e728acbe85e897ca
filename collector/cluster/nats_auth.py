"""Who may do what in cluster mode's NATS: one identity per role (a client certificate the servers
map to a user, `verify_and_map`), each allowed only the subjects its work needs (permissions), and
the nats-server configuration that says so (`authorization` and `tls` blocks). localnats.py runs its
servers with it and deploy/cluster/nats.yaml carries the same text, rendered for the default
[nats] table (`python -m xpusense.collector.cluster.nats_auth` prints it for a config)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .subjects import stream_name, stream_of, token

ROLES = ("gateway", "worker", "scheduler", "exporter")
ORG, UNIT = "xpusense", "xpusense-nats"       # O and OU of every NATS certificate (no node id holds ',' or '=')
SERVER_CN = "xpusense-nats-server"            # the servers' certificate: clients and routes
EXPORTER_DURABLE = "otlp"                     # the exporter's durable consumers: otlp-<stream index>
API = "$JS.API"


def role_cn(role: str) -> str:
    return f"xpusense-nats-{role}"


def identity(cn: str) -> str:
    """The user name nats-server maps a certificate with no matching SAN to: its subject, RFC 2253."""
    return f"CN={cn},OU={UNIT},O={ORG}"


def inbox_prefix(role: str) -> str:
    """Where a role's replies (API answers, pull deliveries, publish acks) come."""
    return f"_INBOX.{role}"


def _reads(stream: str) -> list[str]:
    """Read a stream (or a KV bucket's): its info, ephemeral consumers (nats-py names them), direct
    gets, flow control of a push consumer (a KV watch)."""
    return [f"{API}.STREAM.INFO.{stream}", f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.*",
            f"{API}.CONSUMER.CREATE.{stream}.*.>", f"{API}.CONSUMER.INFO.{stream}.*",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.*", f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>",
            f"{API}.STREAM.MSG.GET.{stream}", f"$JS.FC.{stream}.>"]


def _owns(stream: str, durable: str) -> list[str]:
    """Create, reset and acknowledge a durable consumer."""
    return [f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}", f"{API}.CONSUMER.RESET.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>"]


def _others(stream: str, durable: str) -> list[str]:
    """What a role that does not own a durable consumer may not do to it (its ephemeral rights would
    let it): change it, pull its messages, acknowledge them."""
    return [f"{API}.CONSUMER.CREATE.{stream}.{durable}", f"{API}.CONSUMER.CREATE.{stream}.{durable}.>",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>"]


def durables(ncfg: Any) -> dict[str, list[tuple[str, str]]]:
    """role -> its durable consumers, (stream, name): a worker's per partition, an exporter's per stream."""
    return {"worker": [(stream_of(ncfg.prefix, k, ncfg.streams), f"w-p{k}") for k in range(ncfg.partitions)],
            "exporter": [(stream_name(ncfg.prefix, i), f"{EXPORTER_DURABLE}-{i}") for i in range(ncfg.streams)]}


def permissions(ncfg: Any) -> dict[str, dict[str, dict[str, list[str]]]]:
    """role -> {"publish": {"allow": [...], "deny": [...]}, "subscribe": {"allow": [...]}} for the
    [nats] table `ncfg` (deny wins over allow):

        gateway    publishes batches, creates the streams and buckets, writes `marks` and `series`,
                   reads `fleet` and the streams (snapshots, GetHistory)
        worker     consumes the streams through its durable consumers, reads `marks`, writes `fleet`
                   and `leases`
        scheduler  reads `fleet` (list, then watch) and the streams (GetHistory)
        exporter   consumes the streams through its durable consumers, reads `fleet`

    Every reader of the streams also reads `series` (the compact encoding's definitions).

    Every client gets replies on its own inbox prefix (`_INBOX.<role>`): one role cannot read what
    was delivered to another. A reader creates ephemeral consumers; a durable consumer is created,
    reset, pulled from and acknowledged only by the role it belongs to. Nobody may delete or purge
    a stream or a consumer."""
    streams = [stream_name(ncfg.prefix, i) for i in range(ncfg.streams)]
    marks, fleet, leases, series = ncfg.marks_bucket, ncfg.fleet_bucket, ncfg.leases_bucket, ncfg.series_bucket
    kv = {b: f"KV_{b}" for b in (marks, fleet, leases, series)}
    info = [f"{API}.INFO"] + [f"{API}.STREAM.INFO.{s}" for s in [*streams, *kv.values()]]   # ensure() looks them up
    read_streams = [x for s in streams for x in _reads(s)]
    owned = durables(ncfg)
    allow = {
        "gateway": [f"{token(ncfg.prefix)}.*.*.*",
                    *(f"{API}.STREAM.{op}.{s}" for s in streams for op in ("CREATE", "UPDATE")),
                    *(f"{API}.STREAM.CREATE.{s}" for s in kv.values()),
                    f"$KV.{marks}.>", *_reads(kv[marks]), *_reads(kv[fleet]), *read_streams,
                    f"$KV.{series}.>", *_reads(kv[series])],
        "worker": [*read_streams, *_reads(kv[marks]), f"$KV.{fleet}.>", *_reads(kv[fleet]),
                   f"$KV.{leases}.>", *_reads(kv[leases]), *_reads(kv[series])],
        "scheduler": [*_reads(kv[fleet]), *read_streams, *_reads(kv[series])],
        "exporter": [*read_streams, *_reads(kv[fleet]), *_reads(kv[series])],
    }
    out = {}
    for role in ROLES:
        mine = [x for s, d in owned.get(role, []) for x in _owns(s, d)]
        deny = [x for other, ds in owned.items() if other != role for s, d in ds for x in _others(s, d)]
        out[role] = {"publish": {"allow": list(dict.fromkeys(info + allow[role] + mine)), "deny": deny},
                     "subscribe": {"allow": [f"{inbox_prefix(role)}.>"]}}
    return out


def authorization_conf(ncfg: Any) -> str:
    """nats-server's `authorization` block: the role users (no anonymous user) and their permissions."""
    lines = ["authorization {", "  users: ["]
    for role, perms in permissions(ncfg).items():
        lines.append(f"    {{user: {json.dumps(identity(role_cn(role)))}, permissions: {{")
        for what, lists in perms.items():
            lines.append(f"      {what}: {{")
            for kind, subjects in lists.items():
                if subjects:
                    lines.append(f"        {kind}: [")
                    lines += [f"          {json.dumps(x)}" for x in subjects]
                    lines.append("        ]")
            lines.append("      }")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def tls_conf(cert: str, key: str, ca: str) -> str:
    """TLS for clients (a certificate of the CA required, mapped to its user) and for the routes
    (only the servers' certificate is let in as a route)."""
    return (f"tls {{\n  cert_file: {json.dumps(cert)}\n  key_file: {json.dumps(key)}\n  ca_file: {json.dumps(ca)}\n"
            f"  verify_and_map: true\n  timeout: 5\n}}\n")


def route_tls_conf(cert: str, key: str, ca: str, indent: str = "    ") -> str:
    """Inside `cluster {}`: the routes' TLS and the one identity a route may have."""
    body = tls_conf(cert, key, ca).splitlines()
    out = [indent + body[0]] + [indent + line for line in body[1:]]
    out += [f"{indent}authorization {{", f"{indent}  user: {json.dumps(identity(SERVER_CN))}", f"{indent}}}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    from xpusense.common.config import ConfigError

    from ..config import load_collector
    p = argparse.ArgumentParser(prog="python -m xpusense.collector.cluster.nats_auth",
                                description="print nats-server's authorization block for a collector config's [nats]")
    p.add_argument("--config", help="the collector's TOML config (default: the built-in [nats] defaults)")
    a = p.parse_args(argv)
    try:
        cfg = load_collector(a.config, env={})
    except ConfigError as e:
        print(f"nats_auth: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(authorization_conf(cfg.nats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
