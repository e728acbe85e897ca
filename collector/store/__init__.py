"""The collector's durable store: every batch it acknowledges, in checksummed segment files,
replayed into the fleet state at start; damaged bytes cost only the records they touch, and a disk
that cannot be written is a state, not a crash. Snapshots of the fleet state shorten the replay.

Segments: segment_file.py (format), writer.py, replay.py, reader.py, metrics.py. Snapshots:
snapshot_file.py (format), fleet_image.py (the state as plain data), snapshot_taker.py (taking
them while serving), snapshot_load.py (which to load at start, damage, which to keep).
"""

from .metrics import StoreMetrics
from .reader import StoreReader, stored_batches
from .segment_file import StoreError, segments
from .writer import Store

__all__ = ["Store", "StoreError", "StoreMetrics", "StoreReader", "segments", "stored_batches"]
