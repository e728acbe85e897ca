"""The agent's on-disk spool (store.py: segments, budgets, a failing disk as a state; records.py:
the spool's records in their checksummed frames; aside.py: damaged records kept for inspection;
defs.py: each boot's series definitions, kept beside the batches that use them)."""

from .records import RecordError
from .store import Loc, Spool, SpoolError

__all__ = ["Loc", "RecordError", "Spool", "SpoolError"]
