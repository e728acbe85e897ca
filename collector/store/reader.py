"""Reading the collector's store after start: exporters' cursors (StoreReader) and audits.

A StoreReader reads the batches stored after its durable cursor, in order, up to what is durable;
segments it has not read are kept (writer.py retention), so a backend outage loses nothing. It
hands compact batches over with their samples, by the series definitions it read before them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

from google.protobuf.message import DecodeError

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

from ..series_dictionary import MissingDefinition, SeriesDictionary
from .defs import expanded, read_table
from .segment_file import InvalidRecord, Segment, Span, parse, segments

log = logging.getLogger("xpusense.collector.store")

REPORTED_MAX = 1024   # damaged ranges a reader remembers having logged (then it starts again)


def _spans(seg: Segment, start: int) -> Iterator[Span]:
    if seg.format() == "legacy":
        return (s for s in seg.legacy_spans() if s.start >= start)
    return seg.spans(start)


def _batch(span: Span, dictionary: SeriesDictionary | None = None) -> pb.Batch | None:
    """The batch a valid frame holds; None for other records (a series table: into `dictionary`).
    Raises InvalidRecord."""
    assert span.payload is not None
    rec = parse(span.payload)
    if rec[0] == "d" and dictionary is not None:
        try:
            dictionary.add(rec[1], *read_table(rec[1], rec[2]))
        except (ValueError, DecodeError) as e:
            raise InvalidRecord(f"series table does not read ({e})") from None
    if rec[0] != "b":
        return None
    try:
        return pb.Batch.FromString(rec[1])
    except DecodeError as e:
        raise InvalidRecord(f"batch does not parse ({e})") from None


def stored_batches(directory: str) -> Iterator[pb.Batch]:
    """Every batch in the store, oldest first, compact ones with their samples; damage and what
    cannot be expanded skipped (for tests and audits)."""
    dictionary = SeriesDictionary()
    for _, path in segments(directory):
        with Segment(path) as seg:
            for span in _spans(seg, 0):
                if span.payload is None:
                    continue
                try:
                    b = _batch(span, dictionary)
                    if b is not None:
                        yield expanded(b, dictionary)
                except (InvalidRecord, MissingDefinition, compact.CompactError):
                    continue


class StoreReader:
    """A consumer of the store with a durable cursor (an exporter)."""

    def __init__(self, store, name: str):
        self.store = store
        self.name = name
        self.path = os.path.join(store.dir, f"cursor-{name}.json")
        self.skipped_ranges = 0
        self.unexpanded = 0   # compact batches not handed over: no definition, or columns that do not decode
        # The series definitions read (a segment begins with every boot's: reset there), else the
        # live state's (a cursor in the middle of a segment after a restart).
        live = store.dictionary
        self.dictionary = SeriesDictionary(live.max_per_boot if live is not None else 200_000)
        self._reported: set[tuple[int, int]] = set()
        try:
            with open(self.path) as f:
                seg, off = json.load(f)
            self.cursor = (int(seg), int(off))
        except FileNotFoundError:
            self.cursor = (0, 0)   # from the oldest segment there is
        except (OSError, ValueError, TypeError) as e:
            log.warning("store reader %s: cursor file %s unreadable (%s): reading again from the oldest segment "
                        "(what was exported is sent again)", name, self.path, e)
            self.cursor = (0, 0)
        store.readers[name] = self

    def read(self, max_batches: int = 500) -> tuple[list[pb.Batch], tuple[int, int]]:
        """Batches after the cursor (at most max_batches) and the cursor after them; commit() it
        once they are safely delivered."""
        out: list[pb.Batch] = []
        seg, off = self.cursor
        limit = self.store.durable
        for sid, path in segments(self.store.dir):
            if sid < seg or sid > limit[0]:
                continue
            start = off if sid == seg else 0
            if start == 0:
                self.dictionary = SeriesDictionary(self.dictionary.max_per_boot)
            try:
                with Segment(path, limit[1] if sid == limit[0] else None) as s:
                    end = s.size
                    for span in _spans(s, start) if start < end else ():
                        b = self._take(sid, span)
                        if b is not None:
                            out.append(b)
                            if len(out) >= max_batches:
                                return out, (sid, span.end)
            except OSError as e:   # deleted meanwhile (retention) or unreadable: go on with the next
                log.warning("store reader %s: cannot read %s (%s): skipped", self.name, path, e.strerror)
                end = start
            seg, off = sid, max(start, end)
        return out, (seg, off)

    def _take(self, sid: int, span: Span) -> pb.Batch | None:
        try:
            if span.payload is not None:
                b = _batch(span, self.dictionary)
                return self._expanded(sid, span, b) if b is not None and b.columns else b
            why = "damaged"
        except InvalidRecord as e:
            why = f"invalid record: {e}"
        if (sid, span.start) not in self._reported:
            self.skipped_ranges += 1
            if len(self._reported) >= REPORTED_MAX:
                self._reported.clear()
            self._reported.add((sid, span.start))
            log.warning("store reader %s: segment %d bytes %d-%d skipped (%s)", self.name, sid, span.start,
                        span.end, why)
        return None

    def _expanded(self, sid: int, span: Span, b: pb.Batch) -> pb.Batch | None:
        """A compact batch with its samples, by the definitions read, else the live state's; None
        (counted, logged once) when neither has them or its columns do not decode."""
        try:
            try:
                return expanded(b, self.dictionary)
            except MissingDefinition:
                live = self.store.dictionary
                if live is None:
                    raise
                return expanded(b, live)
        except (MissingDefinition, compact.CompactError) as e:
            why = str(e)
        if (sid, span.start) not in self._reported:
            self.unexpanded += 1
            if len(self._reported) >= REPORTED_MAX:
                self._reported.clear()
            self._reported.add((sid, span.start))
            log.warning("store reader %s: segment %d bytes %d-%d: batch %s/%s seq %d not handed over (%s)",
                        self.name, sid, span.start, span.end, b.node_id, b.boot_id, b.seq, why)
        return None

    def commit(self, cursor: tuple[int, int]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(list(cursor), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.cursor = cursor
