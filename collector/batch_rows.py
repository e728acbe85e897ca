"""A batch's samples as ingest reads them, once a batch, for the limits and the fleet state: read
from the bytes the batch came in by a C reader (collector/_wire_rows.c) where it was built, else
through protobuf's objects (reading those from Python is the costly part of ingest). The usual batch
(an agent's round: one time, its series in the order of their refs) is held as columns with no
object per sample, which a frame takes in one call (columns.store_row); any other as rows. A batch
in the compact encoding (wire.CompactBatch) gives the columns it was decoded into."""

from __future__ import annotations

import itertools
import operator
from array import array
from typing import Any

from .wire import CompactBatch, WireBatch, _wire_rows

# A sample's (series_ref, time_unix_nano, value), read through protobuf's objects.
_ROW = operator.attrgetter("series_ref", "time_unix_nano", "value")
_FIRST = operator.itemgetter(0)


def rows(batch: Any, wire: bytes | None = None) -> list[tuple[int, int, float]]:
    """(series_ref, time, value) of each of the batch's samples, in order: from `wire`, the batch's
    bytes as received, by the C reader where it can (~5x faster), else from `batch`'s objects (a
    compact batch: from its columns)."""
    if batch.__class__ is CompactBatch:
        return batch.rows()
    if wire is not None and _wire_rows is not None:
        got = _wire_rows.rows(wire)
        if got is not None:
            return got
    return list(map(_ROW, batch.samples))


def _columns(batch: Any, wire: bytes | None) -> tuple[tuple[int, ...], int | None, bytes, bool] | None:
    """The columns of the batch (refs, time, values, rising): a WireBatch's (the C reader's, read
    with it) or a CompactBatch's; else read from `wire` by the C reader; None where it cannot."""
    if batch.__class__ is WireBatch or batch.__class__ is CompactBatch:
        return batch.columns
    return _wire_rows.columns(wire) if wire is not None and _wire_rows is not None else None


def refs_of(batch: Any, wire: bytes | None = None) -> tuple[int, ...] | list[int]:
    """The samples' series_ref, in order (what Limits.check reads of every batch): from `wire` by
    the C reader where it can, else from `batch`'s objects."""
    got = _columns(batch, wire)
    return got[0] if got is not None else [s.series_ref for s in batch.samples]


class BatchRows:
    """A batch's samples: `refs` (their series_ref, in order) always; `time`, `values` and `rising`
    when the C reader read them as columns (their one time, else None; their values as the bytes
    of an array('d'); whether the refs rise strictly); `rows()` in any case."""

    __slots__ = ("refs", "time", "values", "rising", "_rows", "_batch", "_wire")

    def __init__(self, batch: Any, wire: bytes | None = None):
        if batch.__class__ is WireBatch:
            wire = batch.wire
        elif batch.__class__ is CompactBatch:
            wire = None   # its bytes are columns the C reader does not read
        self._batch, self._wire = batch, wire
        got = _columns(batch, wire)
        if got is None:
            self._rows: list[tuple[int, int, float]] | None = rows(batch)
            self.refs: tuple[int, ...] | list[int] = list(map(_FIRST, self._rows))
            self.time: int | None = None
            self.values = b""
            self.rising = False
        else:
            self._rows = None
            self.refs, self.time, self.values, self.rising = got

    def rows(self) -> list[tuple[int, int, float]]:
        """(series_ref, time, value) of each sample, in order (read once, on first use): from the
        columns when the samples share one time, else read again from the bytes."""
        if self._rows is None:
            if self.time is not None:
                self._rows = list(zip(self.refs, itertools.repeat(self.time), array("d", self.values)))
            else:
                self._rows = rows(self._batch, self._wire)
        self._wire = None
        return self._rows
