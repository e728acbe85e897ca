"""The collector's durable store: every batch it acknowledges, in checksummed segment files.

A batch is acknowledged only after its record is written and fsync'ed (group commit). At start the
store is replayed into the fleet state: latest values, history, inventories, events and the
per-(node, boot) marks that keep a resent batch from being stored twice. Damaged bytes cost only
the records they touch: skipped, counted, logged with their position, kept aside in
`data_dir/damaged/`. A disk that cannot be written is a state (health NOT_SERVING, records held
in memory within a bound, retried), not a crash.

- frames.py: the format (segment header; frames of magic, length, crc32, msgpack record), the scan
  that finds valid frames and damaged ranges;
- replay.py: start: every segment into the fleet state, damage counted and kept aside;
- writer.py: Store: group commit, the failing-disk state, segments and retention by history_s;
- reader.py: StoreReader (the OTLP exporter's durable cursor), stored_batches (audits, tests);
- metrics.py: the counters as Prometheus metrics;
- image.py, snapfile.py, snapshot.py, snapshotter.py: snapshots of the fleet state (the state as
  plain data and raw history arrays; the checksummed files, written atomically; which to load at
  start, damage counted and fallen back from, which to keep; taking one while serving: a full one,
  then diffs of what changed since it), so a restart replays only the log after the newest good
  one ([store] snapshot_every_s).

A new segment is started every `segment_s` or `segment_bytes` and begins with a checkpoint
(every node's inventory and marks), so a segment older than the history kept can be deleted
without losing what the state needs.
"""

from .frames import StoreError, segments
from .metrics import StoreMetrics
from .reader import StoreReader, stored_batches
from .writer import Store

__all__ = ["Store", "StoreError", "StoreMetrics", "StoreReader", "segments", "stored_batches"]
