"""The agent's on-disk spool (store.py: segments, budgets, a failing disk as a state; records.py:
the spool's records in their checksummed frames; aside.py: damaged records kept for inspection)."""

from .records import RecordError
from .store import Loc, Spool, SpoolError

__all__ = ["Loc", "RecordError", "Spool", "SpoolError"]
