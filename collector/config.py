"""The collector's configuration schema (loaded by the same checked TOML loader as the agent's)."""

from __future__ import annotations

from xpusense.common import compact
from xpusense.common.config import DEFAULT_ADDRESS, Key, between, host_port, load, log_level, non_negative, one_of, positive
from xpusense.common.otlp import otlp_schema

from .cluster.config import NATS_SCHEMA, check_nats
from .scheduler.config import SCHEDULER_SCHEMA, check_config
from .web_config import check_file

OTLP_EXPORT_SCHEMA = otlp_schema(collector=True)

COLLECTOR_SCHEMA = {
    "listen": Key(str, DEFAULT_ADDRESS, host_port, help="HOST:PORT for ingest, query and health"),
    "log_level": Key(str, "info", log_level),
    "history_s": Key((int, float), 900.0, positive, help="history kept per series"),
    "stale_s": Key((int, float), 10.0, positive, help="a node silent this long is shown as stale"),
    "events_kept": Key(int, 200, positive, help="recent events kept per node"),
    "max_message_bytes": Key(int, 16 * 1024 * 1024, positive),
    "data_dir": Key(str, "", help="durable store: every batch is written (and fsync'ed) here before it is "
                                  "acknowledged, and replayed at start (empty: memory only)"),
    "fsync": Key(bool, True, help="fsync each group of batches before acknowledging them"),
    # The durable store (collector/store/): segments, a failing disk, damage found at start.
    "store": {
        "segment_bytes": Key(int, 64 * 2**20, positive, help="a new segment past this size"),
        "segment_s": Key((int, float), 60.0, positive, help="a new segment past this age"),
        "max_pending_bytes": Key(int, 64 * 2**20, positive,
                                 help="records held in memory, not yet on disk (a slow or failing disk); past "
                                      "it new batches are refused (UNAVAILABLE, counted) and resent by agents"),
        "retry_s": Key((int, float), 1.0, positive, help="while the disk cannot be written, how often to try again"),
        "commit_interval_s": Key((int, float), 0.025, between(0, 1),
                                 help="a group commit (one write and fsync of every record queued) begins at most "
                                      "this often (records queued meanwhile join it): a batch waits up to this long "
                                      "more for its ack, and a busy collector fsyncs far less often (0: each group as "
                                      "soon as the last one is on disk)"),
        "damaged_keep_bytes": Key(int, 256 * 2**20, positive,
                                  help="damaged bytes found at start are copied into data_dir/damaged/ up to this"),
        "snapshot_every_s": Key((int, float), 10.0, non_negative,
                                help="a snapshot of the fleet state at most this often (and on a clean stop), so a "
                                     "restart replays only the log after it; most are diffs on the last full one; 0: "
                                     "none, the whole log is replayed"),
        "snapshot_after_records": Key(int, 10000, positive,
                                      help="a periodic snapshot only once the log holds this many records after the "
                                           "last one (a restart replays them: about 1 s per 10,000 batches), so a "
                                           "small fleet does not rewrite its history every period; 1: every period "
                                           "with anything new"),
        "snapshot_max_s": Key((int, float), 3600.0, positive,
                              help="...or once the last snapshot is this old (and anything new was logged since)"),
        "snapshot_keep": Key(int, 2, positive, help="full snapshots kept, with the diffs a fallback needs (the log "
                                                    "is kept from the oldest one on)"),
        "snapshot_compress_level": Key(int, 1, between(0, 19),
                                       help="zstd level of a snapshot's frames (1: fast; 0: written raw); "
                                            "snapshots of any level are read"),
        "snapshot_cpu_share": Key((int, float), 0.1, between(0.01, 1),
                                  help="a periodic snapshot's work (capturing nodes on the event loop, writing them "
                                       "in a thread) is paced to this share of one core, so ingest keeps up while it "
                                       "is taken (2,000 nodes: 2-3 s of work, written over 20-30 s); 1: not "
                                       "paced. A snapshot at stop is never paced"),
    },
    # The fleet state's memory (collector/state.py): history is shortened first, then new series refused.
    "state": {
        "max_memory": Key(int, 0, non_negative, help="bytes the fleet state may hold (its own estimate); at it the "
                                                     "history is shortened, then samples of new series are dropped, "
                                                     "counted and logged; 0: no budget"),
        "min_history_points": Key(int, 60, positive, help="the budget never cuts a series' history below this"),
        "series_idle_s": Key((int, float), 3600.0, positive,
                             help="a series with no point received this long is let go, with its history (counted "
                                  "state.series.expired; in cluster mode by the workers), and the gateways' and "
                                  "workers' series references idle this long are forgotten (collector/idle.py); "
                                  "keep it well above the agents' slowest tier"),
        "max_open_diagnoses_per_node": Key(int, 64, positive, help="open diagnoses kept per node (collector/diagnoses.py; "
                                                                   "in cluster mode by the workers); past it the "
                                                                   "oldest is let go, counted"),
        "max_clock_offset_s": Key((int, float), 5.0, positive,
                                  help="a node whose clock is further than this off the collector's (estimated from "
                                       "its send times against their arrival) gets a clock_offset diagnosis; its "
                                       "readings are judged by arrival either way (collector/clock.py)"),
    },
    # The Ingest stream (collector/ingest_session.py; docs/design.md "The compact encoding").
    "ingest": {
        "batch_encodings": Key(list, list(compact.ENCODINGS), one_of(*compact.ENCODINGS),
                               help="batch encodings a Welcome may choose, the newest an agent's Hello offers "
                                    "(series defined once per stream, samples as compressed columns; "
                                    "\"columns-zlib-2\" writes decimal values as their digits; \"-chained\" deflates "
                                    "each block on the stream's one before it, deflated alone again here); []: agents send "
                                    "Sample messages"),
    },
    "scheduler": SCHEDULER_SCHEMA,
    # Cluster mode (collector/cluster/, docs/scale.md): with urls set, serve is a gateway to NATS JetStream.
    "nats": NATS_SCHEMA,
    # Security (collector/auth.py, docs/security.md).
    "tls": {
        "ca": Key(str, "", help="CA of the agents' client certificates; set: mTLS, node id bound to the cert"),
        "cert": Key(str, "", help="the collector's certificate (PEM); with key: serve TLS"),
        "key": Key(str, "", help="the collector's private key (PEM, mode 0600)"),
    },
    "tokens_file": Key(str, "", help="per-node tokens: 'NODE_ID SHA256_HEX' lines (xpusense-collector tokens)"),
    "allow_insecure": Key(bool, False, help="accept plaintext on a non-loopback listen address (warns)"),
    # Hostile input (collector/limits.py): a batch over a limit ends its stream with a gRPC error.
    "limits": {
        "max_samples_per_batch": Key(int, 20_000, positive),
        "max_events_per_batch": Key(int, 10_000, positive),
        "max_labels_per_sample": Key(int, 64, positive),
        "max_label_key_len": Key(int, 256, positive),
        "max_label_value_len": Key(int, 4096, positive),
        "max_name_len": Key(int, 256, positive, help="metric names and units, event id/type/severity/device"),
        "max_text_len": Key(int, 16_384, positive, help="event messages"),
        "max_histogram_buckets": Key(int, 1024, positive),
        "max_series_per_boot": Key(int, 200_000, positive, help="distinct series references of one agent boot"),
        "batches_per_s": Key((int, float), 100.0, positive, help="per node and boot, sustained"),
        "burst_batches": Key(int, 5000, positive, help="per node and boot, at once (a resend after a reconnect)"),
        "max_seq_jump": Key(int, 100_000, positive, help="a batch's seq at most this far above the last stored of its "
                                                         "boot, plus batches_per_s per second since then"),
        "max_series_per_node": Key(int, 200_000, positive, help="distinct series (name + labels) of one node, "
                                                                "whatever the series_ref"),
        "max_nodes": Key(int, 10_000, positive, help="node ids held in the fleet state; a new one past it is refused"),
        "max_streams": Key(int, 10_000, positive, help="Ingest streams open at once"),
        "max_stream_pending_batches": Key(int, 64, positive, help="with a durable store: read on one stream, not yet "
                                                                  "acknowledged; past it (or the bytes) the stream "
                                                                  "is not read (memory only: one at a time)"),
        "max_stream_pending_bytes": Key(int, 8 * 2**20, positive, help="their size on the wire"),
        "max_inventory_bytes": Key(int, 2**20, positive, help="one node's inventory"),
        "max_series_table_bytes": Key(int, 64 * 2**20, positive,
                                      help="one SeriesTable's series definitions once inflated (the compact "
                                           "encoding); past it the stream is refused, INVALID_ARGUMENT"),
        "max_reply_bytes": Key(int, 4_000_000, positive, help="one ListNodes page (nodes/top read every page)"),
    },
    # kube-scheduler's extender (collector/extender_http.py, docs/kubernetes.md).
    "kubernetes": {
        "extender": {
            "enabled": Key(bool, False, help="serve kube-scheduler's extender (POST /filter, /prioritize) on listen"),
            "listen": Key(str, "127.0.0.1:9471", host_port, help="HOST:PORT of the extender (--extender-listen)"),
            "max_request_bytes": Key(int, 32 * 2**20, positive,
                                     help="an ExtenderArgs body over this is refused (413, counted); Nodes of "
                                          "5,000 nodes take ~25 MB, NodeNames (nodeCacheCapable) ~0.1 MB"),
            "max_connections": Key(int, 64, positive, help="connections open at once; past it 503, counted"),
            "verdict_shapes": Key(int, 16, positive,
                                  help="request shapes whose verdicts on every node are kept up to date; past it "
                                       "the least recently asked is dropped, counted"),
            "name_lists": Key(int, 2, positive,
                              help="lists of node names per request shape whose replies are kept and patched; "
                                   "past it the least recently asked is dropped, counted"),
            "timeout_s": Key((int, float), 5.0, positive,
                             help="a connection that takes longer than this over its TLS handshake, a request's "
                                  "head or its body is closed"),
        },
    },
    # Exporters (collector/otlp_export.py, collector/prometheus.py; docs/export.md).
    "export": {
        "otlp": OTLP_EXPORT_SCHEMA,
        "prometheus": {
            "enabled": Key(bool, False, help="serve the fleet's latest values for Prometheus to scrape"),
            "listen": Key(str, "127.0.0.1:9470", host_port, help="HOST:PORT of the /metrics endpoint"),
            "compat_names": Key(bool, False, help="also write dcgm-exporter (DCGM_FI_*) and npu-exporter "
                                                  "(npu_chip_info_*) names for the signals that have one"),
            "max_age_s": Key((int, float), 900.0, positive, help="series older than this are left out"),
            "web_config_file": Key(str, "", check_file,
                                   help="TLS and basic auth for /metrics: a Prometheus web-config file "
                                        "(exporter-toolkit's format; --web-config-file); empty: plain HTTP, open"),
            "timeout_s": Key((int, float), 10.0, positive,
                             help="a /metrics connection silent this long in its TLS handshake or request head "
                                  "is closed (counted)"),
        },
    },
}

COLLECTOR_ENV = {"XPUSENSE_LISTEN": "listen"}


def load_collector(path: str | None = None, flags: dict | None = None, env: dict | None = None):
    cfg = load(COLLECTOR_SCHEMA, path, env, COLLECTOR_ENV, flags)
    check_config(cfg, path or "configuration")
    check_nats(cfg, path or "configuration")
    return cfg
