"""What the store's counters mean. They are in the Query API's `counters` as `store.<key>` (and
in `xpusense-collector nodes --format json`), and as Prometheus metrics
(`xpusense_collector_store_<key>`) for a registry that takes `StoreMetrics(store)`."""

from __future__ import annotations

from collections.abc import Iterator

# stats() key -> (kind, help)
METRICS = {
    "writable": ("gauge", "1 while the store can write, 0 while its disk fails (full, read-only, I/O errors)"),
    "unwritable_episodes": ("counter", "times the store went from writable to failing"),
    "write_errors": ("counter", "failed write or fsync attempts (each retried; nothing acknowledged meanwhile)"),
    "held_bytes": ("gauge", "bytes of records queued in memory, not yet durable"),
    "max_held_bytes": ("gauge", "the most bytes held in memory at once since start"),
    "max_pending_bytes": ("gauge", "the bound on held_bytes ([store] max_pending_bytes)"),
    "refused_records": ("counter", "records refused because held_bytes was at its bound (their batches are resent)"),
    "refused_bytes": ("counter", "bytes of those records"),
    "room_waits": ("counter", "times a stream waited for held_bytes to fall under its bound before being read further"),
    "commits": ("counter", "group commits (one write + fsync each)"),
    "commit_waits": ("counter", "group commits that waited for [store] commit_interval_s since the one before to "
                     "begin (records queued meanwhile joined them)"),
    "records": ("counter", "records queued for writing"),
    "log_bytes_written": ("counter", "bytes written to the log's segments since start (snapshot_bytes_written: to "
                          "snapshots; together, the store's own disk writes)"),
    "reader_skipped_ranges": ("counter", "damaged ranges or invalid records exporters' readers skipped"),
    "reader_unexpanded_batches": ("counter", "compact batches exporters' readers could not expand to samples (a series "
                                  "definition missing or columns that do not decode): skipped, logged"),
    "replay_batches": ("gauge", "batches replayed at start"),
    "replay_series_tables": ("gauge", "series definition tables (the compact encoding's) read at start"),
    "replay_ms": ("gauge", "how long the replay at start took, ms"),
    "replay_damaged_ranges": ("gauge", "damaged ranges found at start (skipped, logged, kept aside)"),
    "replay_damaged_bytes": ("gauge", "bytes in those ranges"),
    "replay_damaged_records": ("gauge", "records in those ranges, at least"),
    "replay_invalid_records": ("gauge", "records with a good checksum that could not be applied at start"),
    "replay_kept_aside_bytes": ("gauge", "damaged bytes copied into data_dir/damaged/ at start"),
    "replay_not_kept_bytes": ("gauge", "damaged bytes not copied aside (over [store] damaged_keep_bytes)"),
    "snapshot_loaded": ("gauge", "1 when start loaded a snapshot and replayed only the log after it"),
    "snapshot_nodes": ("gauge", "nodes in the snapshot loaded at start"),
    "snapshot_load_ms": ("gauge", "how long loading it took, ms (replay_ms is the log after it)"),
    "snapshot_damaged": ("gauge", "snapshots found damaged or partial at start (ignored, moved aside or removed)"),
    "snapshot_diff_loaded": ("gauge", "1 when start loaded a diff on the full snapshot (what changed since it)"),
    "snapshots_written": ("counter", "snapshots written since start ([store] snapshot_every_s, and on a clean stop)"),
    "snapshots_full_written": ("counter", "of them, full ones (the others are diffs on the last full one)"),
    "snapshot_bytes_written": ("counter", "bytes of every snapshot written since start"),
    "snapshot_full": ("gauge", "1 when the last snapshot written was a full one, 0 a diff"),
    "snapshot_failures": ("counter", "snapshots that could not be written (the log is kept; tried again)"),
    "snapshot_periods_skipped": ("counter", "snapshot_every_s periods without a snapshot: fewer than [store] "
                                 "snapshot_after_records records logged since the last one, which is younger than "
                                 "snapshot_max_s (or none at all)"),
    "snapshot_bytes": ("gauge", "bytes of the last snapshot written"),
    "snapshot_write_ms": ("gauge", "how long writing the last snapshot took, ms"),
    "snapshot_loop_ms": ("gauge", "of it, ms on the event loop (capturing the nodes, a chunk at a time)"),
    "snapshot_work_ms": ("gauge", "the last snapshot's work, ms: on the event loop and in its writer thread"),
    "snapshot_paced_ms": ("gauge", "of snapshot_write_ms, ms waited to keep a periodic snapshot's work to [store] "
                          "snapshot_cpu_share of a core"),
}


class StoreMetrics:
    """prometheus-client custom collector over a Store's stats()."""

    def __init__(self, store):
        self.store = store

    def describe(self):
        return []

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        stats = self.store.stats()
        for key, (kind, help_) in METRICS.items():
            name = f"xpusense_collector_store_{key}"
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield cls(name, help_, value=float(stats.get(key, 0)))
