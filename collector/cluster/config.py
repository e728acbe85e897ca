"""The `[nats]` table of the collector's config: cluster mode (docs/scale.md). With `urls` set (or
`--nats URL[,URL...]`), `serve` runs a stateless gateway that publishes batches to JetStream, and
`worker` / `scheduler` read the fleet from it; empty, the collector is the single process it always was.
"""

from __future__ import annotations

import os
import re

from xpusense.common.config import ConfigError, Key, between, non_negative, one_of, positive


def _urls(v: list) -> str | None:
    bad = [u for u in v if not re.fullmatch(r"(nats|tls)://[^\s,/]+(:\d+)?", u)]
    return f"must be nats://HOST:PORT or tls://HOST:PORT addresses (not {', '.join(map(repr, bad))})" if bad else None


def _prefix(v: str) -> str | None:
    return None if re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", v) else "must be 1-32 of a-z, 0-9, _ and -, starting with a letter"


def _bucket(v: str) -> str | None:
    return None if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", v) else "must be 1-64 of A-Z, a-z, 0-9, _ and -"


NATS_SCHEMA = {
    "urls": Key(list, [], _urls, help="the JetStream cluster's servers; set: cluster mode (flag --nats URL[,URL...])"),
    "prefix": Key(str, "xpusense", _prefix, help="first token of every subject; stream names are it upper-cased"),
    "partitions": Key(int, 12, between(1, 1024), help="P: a node's batches go to partition hash(node) mod P"),
    "streams": Key(int, 3, between(1, 256), help="S: partition k is in stream k mod S (S RAFT leaders to spread)"),
    "replicas": Key(int, 3, between(1, 5),
                    help="copies of every stream and bucket (R3: any one server may go)"),
    "storage": Key(str, "file", one_of("file", "memory")),
    "retention_s": Key((int, float), 900.0, positive,
                       help="the stream is the history: batches older than this are let go (GetHistory reads this far)"),
    "max_bytes": Key(int, 0, non_negative, help="per stream, 0: no bound but retention_s (oldest dropped past it)"),
    "duplicate_window_s": Key((int, float), 120.0, positive,
                              help="JetStream drops a batch whose node:boot:seq it stored within this window"),
    "publish_timeout_s": Key((int, float), 5.0, positive, help="wait this long for one publish ack, then send again"),
    "publish_give_up_s": Key((int, float), 30.0, positive,
                             help="after this long without an ack (no stream leader) end the agent's stream: it resends"),
    "max_received_skew_s": Key((int, float), 30.0, positive,
                               help="a worker skips (and counts) a message whose gateway receive time (Xps-Received) "
                                    "is this far ahead of when JetStream stored it, or publish_give_up_s + this "
                                    "behind"),
    "marks_bucket": Key(str, "marks", _bucket, help="KV: highest seq stored per node and boot (Hello/Welcome)"),
    "marks_flush_s": Key((int, float), 5.0, positive,
                         help="a gateway writes a boot's raised mark this long after it rose (a lagging mark only "
                              "means resends that JetStream's duplicate window drops)"),
    "marks_ttl_s": Key((int, float), 7 * 86400.0, positive, help="a boot's mark is forgotten this long after it last rose"),
    "series_bucket": Key(str, "series", _bucket,
                         help="KV: the compact encoding's series definitions the gateways write, per node, boot "
                              "and table (every reader of the streams decodes compact batches with them)"),
    "series_ttl_s": Key((int, float), 86400.0, positive,
                        help="a table is let go this long after a gateway last wrote it (a stream's tables are "
                             "written again past half of it); at least twice retention_s"),
    "series_max_bytes": Key(int, 2**32, positive,
                            help="bound of the series bucket (per replica): past it a table is refused and the "
                                 "agent's stream ends (UNAVAILABLE); ~20 kB a node"),
    "series_cache_boots": Key(int, 4096, between(1, 10**7),
                              help="agent boots whose series definitions a worker, exporter or GetHistory "
                                   "keeps (least recently used let go, counted); a miss loads them from the bucket"),
    "fleet_bucket": Key(str, "fleet", _bucket, help="KV: the per-node summaries the workers write"),
    "leases_bucket": Key(str, "leases", _bucket, help="KV: which worker owns which partition"),
    "summary_s": Key((int, float), 2.0, positive, help="a worker writes each changed node's summary this often"),
    "node_ttl_s": Key((int, float), 86400.0, positive, help="a node silent this long leaves the fleet bucket"),
    "lease_s": Key((int, float), 6.0, positive, help="a partition whose worker has not renewed it this long is taken over"),
    "snapshot_s": Key((int, float), 1.0, positive, help="a gateway answers nodes/top from a fleet snapshot this fresh"),
    "gateway_place": Key(bool, False, help="a gateway also answers Place from its own watched index (at scale, leave "
                                          "Place to `xpusense-collector scheduler` replicas)"),
    "creds_file": Key(str, "", help="NATS credentials file (JWT + nkey) for the cluster, if it asks for one "
                                    "(`{role}` in the path: this process's role)"),
    "tls_ca": Key(str, "", help="CA of the NATS servers' certificates (tls:// URLs)"),
    "tls_cert": Key(str, "", help="this process's NATS client certificate, its identity (`xpusense-collector certs "
                                  "--nats DIR` makes one per role; `{role}` in the path: gateway, worker, scheduler "
                                  "or exporter, so one config serves every role)"),
    "tls_key": Key(str, "", help="the private key of tls_cert (`{role}` as there)"),
}

ROLE_PLACEHOLDER = "{role}"


def check_nats(cfg, where: str) -> None:
    """Cross-key rules of [nats]; ConfigError names the key."""
    n = cfg.nats
    if n.streams > n.partitions:
        raise ConfigError(f"{where}: 'nats.streams' ({n.streams}) must not exceed 'nats.partitions' ({n.partitions})")
    if n.lease_s < 2 * n.summary_s:
        raise ConfigError(f"{where}: 'nats.lease_s' ({n.lease_s:g}) must be at least twice 'nats.summary_s' "
                          f"({n.summary_s:g}): a worker renews its leases when it writes summaries")
    if n.series_ttl_s < 2 * n.retention_s:
        raise ConfigError(f"{where}: 'nats.series_ttl_s' ({n.series_ttl_s:g}) must be at least twice "
                          f"'nats.retention_s' ({n.retention_s:g}): every batch the streams keep needs its "
                          f"series definitions")
    if bool(n.tls_cert) != bool(n.tls_key):
        have, miss = ("tls_cert", "tls_key") if n.tls_cert else ("tls_key", "tls_cert")
        raise ConfigError(f"{where}: 'nats.{have}' is set but 'nats.{miss}' is not: a client certificate needs "
                          f"its private key (both, or neither)")


def role_files(ncfg, role: str, where: str = "configuration") -> dict[str, str]:
    """tls_ca, tls_cert, tls_key and creds_file with `{role}` made `role`, each checked to be a
    readable file (ConfigError names the key); unset keys are ''. A cluster-mode process checks
    them at start, before it connects."""
    out = {}
    for key in ("tls_ca", "tls_cert", "tls_key", "creds_file"):
        path = getattr(ncfg, key).replace(ROLE_PLACEHOLDER, role)
        if path:
            _check_file(where, key, path)
        out[key] = path
    return out


def _check_file(where: str, key: str, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: 'nats.{key}' = {path!r}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{where}: 'nats.{key}' = {path!r}: not readable by this user")


def split_urls(text: str) -> list[str]:
    """`--nats` value: comma-separated URLs; a bare HOST:PORT gets nats://."""
    out = []
    for u in (x.strip() for x in text.split(",")):
        if u:
            out.append(u if "://" in u else f"nats://{u}")
    return out
