"""The agent's configuration schema and loader (the checked TOML loader is xpusense.common.config)."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import Any

from xpusense.common import compact
from xpusense.common.config import (
    DEFAULT_ADDRESS,
    ConfigError,
    Key,
    Table,
    between,
    host_ports,
    load,
    log_level,
    non_negative,
    one_of,
    positive,
    ratio,
    signal_name,
)
from xpusense.common.ids import bad_id
from xpusense.common.otlp import otlp_schema

from .diagnosis.registry import FAMILIES as RULE_FAMILIES
from .sources.registry import FAMILIES


def _encoding(v: str) -> str | None:
    return None if v == "" or v in compact.VERSIONS else \
        f'must be one of {", ".join(map(repr, compact.ENCODINGS))} or "" (Sample messages only)'


def _rule_keys(default: bool) -> dict[str, Key]:
    """The HBM watch's rule; per-vendor tables leave a key unset (None) to use the general one."""
    d = (lambda v: v) if default else (lambda v: None)
    return {
        "threshold": Key((int, float), d(0.85), ratio, help="fire at or above this utilisation"),
        "window_s": Key((int, float), d(5.0), positive, help="...for this long"),
        "low_mark": Key((int, float), d(0.75), ratio, help="re-arm only after falling below this"),
        "cooldown_s": Key((int, float), d(600.0), non_negative, help="per job, between two requests"),
    }


_POD_METADATA_DIRS = ("/run/containerd/io.containerd.runtime.v2.task/k8s.io",
                      "/run/containers/storage/overlay-containers", "/var/lib/docker/containers")

TIER_PERIOD = between(0.1, 86_400.0)

AGENT_SCHEMA: dict[str, Any] = {
    "node_id": Key(str, "", lambda v: bad_id("node id", v) if v else None,
                   help="node id; default: the host name (1-253 printable characters, no spaces)"),
    "log_level": Key(str, "info", log_level),
    "labels": Key(Table, Table(), help="cloud, region, zone, price... sent with the inventory"),
    "collector": {
        "address": Key(str, DEFAULT_ADDRESS, host_ports,
                       help="HOST:PORT of the collector, or several comma-separated (cluster-mode gateways): "
                            "the agent moves to the next when one goes; a DNS name may have several records"),
        # How the agent proves who it is and checks the collector (common/tls.py, docs/security.md).
        "tls_ca": Key(str, "", help="CA that signed the collector's certificate (PEM); set: TLS"),
        "tls_cert": Key(str, "", help="this node's client certificate (PEM), with tls_key: mTLS"),
        "tls_key": Key(str, "", help="this node's private key (PEM, mode 0600)"),
        "token_file": Key(str, "", help="file holding this node's bearer token (xpusense-collector tokens)"),
        "insecure": Key(bool, False, help="allow plaintext to a non-loopback collector (warns)"),
    },
    "tiers": {
        # 0.1 s at least: GPM samples closer than 100 ms are invalid, and a tier is not a busy loop.
        "realtime_s": Key((int, float), 1.0, TIER_PERIOD),
        "nearline_s": Key((int, float), 15.0, TIER_PERIOD),
        "offline_s": Key((int, float), 300.0, TIER_PERIOD),
        "timeout_ratio": Key((int, float), 0.8, lambda v: None if 0 < v <= 1 else "must be in (0, 1]",
                             help="a source round is abandoned after this share of its tier's period"),
    },
    "spool": {
        "enabled": Key(bool, True, help="keep every batch on disk until the collector acknowledges it"),
        "dir": Key(str, "", help="default /var/lib/xpusense/spool as root, else ~/.local/state/xpusense/spool; "
                                 "one subdirectory per node id (env XPUSENSE_SPOOL_DIR)"),
        "max_bytes": Key(int, 256 * 2**20, positive, help="disk budget; over it the oldest batches are dropped and counted"),
        "segment_bytes": Key(int, 4 * 2**20, positive),
        "fsync": Key(str, "interval", one_of("batch", "interval", "never"),
                     help="batch: each batch before it is sent; interval: every fsync_interval_s, once a batch "
                          "has waited a whole interval for its acknowledgement; never"),
        "fsync_interval_s": Key((int, float), 1.0, positive),
        "max_batches": Key(int, 50_000, positive,
                           help="batches kept unacknowledged (bounds memory); over it the oldest are dropped, counted"),
        "damaged_max_bytes": Key(int, 16 * 2**20, non_negative,
                                 help="damaged records are copied to <spool>/damaged/ up to this (oldest go first)"),
    },
    "stream": {
        "queue_batches": Key(int, 3600, positive, help="batches kept in memory while the collector is away"),
        "flush_s": Key((int, float), 0.2, positive),
        "max_samples_per_batch": Key(int, 5000, positive),
        "backoff_initial_s": Key((int, float), 0.2, positive),
        "backoff_max_s": Key((int, float), 10.0, positive),
        "backoff_reset_s": Key((int, float), 10.0, positive,
                               help="a connection up this long resets the backoff to its initial delay"),
        "reconnect_max_s": Key((int, float), 1.0, positive,
                               help="while no collector answers at all, each address is tried again at least this "
                                    "often (a TCP connect), so one back after an outage is found within about this "
                                    "long; failures after a connection was made back off up to backoff_max_s"),
        "series_idle_s": Key((int, float), 900.0, positive,
                             help="a series with no sample this long has its series reference retired (the table "
                                  "of references does not only grow); one that comes back gets a new number"),
        "batch_encoding": Key(str, compact.ENCODING, _encoding,
                              help="batches built as compressed columns, each series defined once per stream "
                                   "(\"columns-zlib-2-chained\": each block also sent deflated on the one sent before "
                                   "it, fewer bytes for a deflate a batch on the collector; offered in Hello with the "
                                   "older compact encodings; a collector that chooses an older one gets the columns in "
                                   "it, one that chooses none Sample messages); "
                                   "\"\": Sample messages only"),
        "max_series_defs": Key(int, 100_000, positive,
                               help="series definitions kept per boot for the compact encoding (with the spool, on "
                                    "disk beside it); past it a new series is sent whole, without a reference, counted"),
    },
    "hbm_watch": {
        "enabled": Key(bool, True),
        "actions": Key(list, ["signal", "file", "event"], one_of("signal", "file", "event"),
                       help="how a job is asked: the signal goes only to processes with a handler for it "
                            "installed (xpusense.client.checkpoint does it); the others get the file and event"),
        "signal": Key(str, "SIGUSR1", signal_name,
                      help="sent to a job's processes that catch it (SigCgt), never to one that does not"),
        "request_dir": Key(str, "/run/xpusense/checkpoint",
                           help="request files, one per request; created 1777 when missing; the agent refuses one "
                                "writable by others without the sticky bit, a symlink, or one owned by another user"),
        "group_by": Key(str, "auto", one_of("auto", "cgroup", "pgid", "pid")),
        **_rule_keys(True),
        "vendor": {"nvidia": _rule_keys(False), "huawei": _rule_keys(False)},
    },
    # Diagnosis rules (agent/diagnosis/, docs/diagnosis.md): each rule's keys beside its code.
    "diagnosis": {
        "enabled": Key(bool, True, help="turn the node's signals into diagnosis events that name a cause"),
        "open_after_s": Key((int, float), 30.0, non_negative, help="a finding holding this long opens a diagnosis"),
        "close_after_s": Key((int, float), 60.0, non_negative, help="...and gone this long closes it"),
        "check_every_s": Key((int, float), 5.0, positive, help="how often the rules look"),
        "keep_s": Key((int, float), 300.0, positive, help="how much recent history the rules may read"),
        "max_open": Key(int, 64, positive, help="open diagnoses at most; past it a finding is counted, not opened"),
        **{family.name: family.schema for family in RULE_FAMILIES},
    },
    # Kubernetes pod attribution of process and cgroup series (agent/pods.py, docs/deploy.md).
    "k8s": {
        "enabled": Key(bool, False, help="label pid/cgroup series with their pod, namespace and container"),
        "node_name": Key(str, "", help="this node's Kubernetes name, sent as inventory label k8s_node "
                                       "(env XPUSENSE_K8S_NODE_NAME, from the downward API)"),
        "procfs": Key(str, "/proc", help="where /proc/PID/cgroup is read (the host's: hostPID)"),
        "pod_resources_socket": Key(str, "/var/lib/kubelet/pod-resources/kubelet.sock",
                                    help="kubelet pod-resources API (device assignments); empty: not used"),
        "metadata_dirs": Key(list, list(_POD_METADATA_DIRS), help="container runtimes' state dirs (pod names)"),
        "refresh_s": Key((int, float), 10.0, positive, help="pod-resources and cache refresh period"),
        # Node labels as a Node Feature Discovery feature file (agent/nfd_labels.py, docs/kubernetes.md).
        "nfd_feature_file": Key(str, "", help="write this node's labels here in NFD's feature-file format (the "
                                              "DaemonSet: /etc/kubernetes/node-feature-discovery/features.d/xpusense); "
                                              "empty: not written. Works without `enabled`"),
        "nfd_expiry_s": Key((int, float), 600.0, between(60.0, 604_800.0),
                            help="the file's # +expiry-time: NFD drops the labels this long after the last write "
                                 "(an agent gone); rewritten when half of it has passed"),
        "nfd_check_s": Key((int, float), 60.0, positive,
                           help="how often the inventory is compared with the labels written (health readings "
                                "and events are seen at once); the file is written only when they differ"),
    },
    # The agent's own OTLP export (agent/otlp_export.py); usually the collector exports instead.
    "export": {"otlp": otlp_schema(collector=False)},
    # [sources.NAME]: each source family declares its keys beside its code (agent/sources/registry.py).
    "sources": {family.name: family.schema for family in FAMILIES},
}


AGENT_ENV = {"XPUSENSE_NODE_ID": "node_id", "XPUSENSE_COLLECTOR": "collector.address",
             "XPUSENSE_SPOOL_DIR": "spool.dir", "XPUSENSE_K8S_NODE_NAME": "k8s.node_name"}


def load_agent(path: str | None = None, flags: dict[str, Any] | None = None,
               env: dict[str, str] | None = None) -> SimpleNamespace:
    cfg = load(AGENT_SCHEMA, path, env, AGENT_ENV, flags)
    w = cfg.hbm_watch
    for vendor, r in [("", w)] + list(vars(w.vendor).items()):
        threshold = r.threshold if r.threshold is not None else w.threshold
        low = r.low_mark if r.low_mark is not None else w.low_mark
        if low > threshold:
            key = f"hbm_watch.{'vendor.' + vendor + '.' if vendor else ''}low_mark"
            raise ConfigError(f"{path or 'configuration'}: '{key}' ({low}) must not be above the threshold ({threshold})")
    if not cfg.node_id:
        cfg.node_id = socket.gethostname()
    if not cfg.spool.dir:
        cfg.spool.dir = ("/var/lib/xpusense/spool" if os.geteuid() == 0
                         else os.path.expanduser("~/.local/state/xpusense/spool"))
    return cfg
