"""Start of the collector's store: every segment read back into the fleet state; damage skipped.

Every valid record is applied. A damaged range or an invalid record is skipped, counted, logged
with its file and byte position, and its bytes are copied into `data_dir/damaged/` (within a byte
budget). Replay never refuses to start. After a snapshot (snapshot_load.py) only the log from the
snapshot's position on is read.
"""

from __future__ import annotations

import logging
import os
import time

from xpusense.v1 import telemetry_pb2 as pb

from ..wire import compact_batch
from .defs import MAX_STORED_SAMPLES, read_table
from .segment_file import Segment, Span, parse, record_count, segments

log = logging.getLogger("xpusense.collector.store")

LOGGED_RANGES = 20   # per start, one line each; then a summary (the counters stay exact)
CHUNK = 2**20        # damaged bytes are looked at and copied this much at a time
FIGURES = ("segments", "batches", "duplicates", "inventories", "marks", "damaged_ranges", "damaged_bytes",
           "damaged_records", "invalid_records", "legacy_segments", "kept_aside_bytes", "not_kept_bytes",
           "series_tables")


class Quarantine:
    """data_dir/damaged/: one file per damaged range, `<segment>.<start>-<end>`, within a budget."""

    def __init__(self, data_dir: str, budget_bytes: int):
        self.dir = os.path.join(data_dir, "damaged")
        self.budget = budget_bytes
        self._used: int | None = None

    def used(self) -> int:
        if self._used is None:
            try:
                self._used = sum(e.stat().st_size for e in os.scandir(self.dir) if e.is_file())
            except OSError:
                self._used = 0
        return self._used

    def keep(self, seg_path: str, buf, start: int, end: int) -> tuple[str, int]:
        """Copy buf[start:end] aside: (what to say in the log, bytes newly kept; -1 when not kept)."""
        zeros = all_zeros(buf, start, end)
        path = os.path.join(self.dir, f"{os.path.basename(seg_path)}.{start}-{end}" + (".zeros" if zeros else ""))
        if os.path.exists(path):
            return f"kept in {path} (an earlier start)", 0
        size = 0 if zeros else end - start   # all zeros: the name says it all
        if self.used() + size > self.budget:
            return (f"NOT kept: {self.dir} holds {self.used()} bytes of its {self.budget} budget "
                    f"([store] damaged_keep_bytes); inspect and remove it", -1)
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                for a in range(start, end, CHUNK):
                    f.write(buf[a:min(end, a + CHUNK)])
        except OSError as e:
            return f"NOT kept: cannot write {path} ({e.strerror})", -1
        self._used = self.used() + size
        return f"kept in {path}", size


def all_zeros(buf, start: int, end: int) -> bool:
    return all(buf[a:min(end, a + CHUNK)].count(0) == min(end, a + CHUNK) - a for a in range(start, end, CHUNK))


class Replay:
    def __init__(self, directory: str, state, keep_bytes: int, start: tuple[int, int] = (0, 0)):
        self.dir = directory
        self.start = start
        self.state = state
        self.quarantine = Quarantine(directory, keep_bytes)
        self.figures: dict[str, float] = dict.fromkeys(FIGURES, 0)
        # Checkpoint marks are merged at the end: a checkpoint is written with the marks of batches
        # accepted at that moment, which may follow it in the same segment (they are not resends).
        self.marks: dict[tuple[str, str], int] = {}
        self._path = ""
        self.seals: list[tuple[str, int, int]] = []   # (segment saying it, previous segment id, its size)
        self._logged = 0

    def run(self) -> dict[str, float]:
        t0 = time.monotonic()
        for sid, path in segments(self.dir):
            if sid < self.start[0]:
                continue
            self.figures["segments"] += 1
            try:
                self._segment(path, self.start[1] if sid == self.start[0] else 0)
            except OSError as e:   # unreadable file: its records are lost, said and counted
                self._damaged(path, Span(0, 0, None), f"cannot read the file ({e.strerror})", 1)
        # Marks of batches replayed count as known too (a node that reconnects after a restart).
        st = self.state
        self._check_seals()
        for key, seq in self.marks.items():
            st.known_marks[key] = max(st.known_marks.get(key, 0), seq)
        for nid, n in st.nodes.items():
            n.streams = 0
            for boot, seq in n.stored_up_to.items():
                st.known_marks[(nid, boot)] = max(st.known_marks.get((nid, boot), 0), seq)
        # Definitions of boots no mark remembers go (an agent sends its boot's again on each stream).
        for nid, boot in [k for k in st.dictionary.boots if k not in st.known_marks]:
            st.dictionary.forget(nid, boot)
        if self._logged > LOGGED_RANGES:
            log.warning("store %s: %d more damaged ranges or invalid records not logged one by one",
                        self.dir, self._logged - LOGGED_RANGES)
        self.figures["replay_s"] = round(time.monotonic() - t0, 3)
        return self.figures

    def _segment(self, path: str, start: int = 0) -> None:
        self._path = path
        with Segment(path) as seg:
            fmt = seg.format()
            if fmt == "legacy":
                self.figures["legacy_segments"] += 1
                log.warning("store %s: written by an older xpusense without checksums: read as it is", path)
            spans = seg.legacy_spans() if fmt == "legacy" else seg.spans(start)
            for span in spans:
                if span.start < start:   # legacy: read from its start, applied from the snapshot's position
                    continue
                if span.payload is None:
                    what = ("all zeros" if all_zeros(seg.buf, span.start, span.end)
                            else "not a whole record with a good checksum")
                    if span.end == seg.size:
                        what += ", to the end of the file"
                    self._damaged(path, span, what, record_count(seg.buf, span.start, span.end), seg.buf)
                    continue
                try:
                    self._apply(parse(span.payload))
                except Exception as e:   # a good checksum around a record that cannot be applied
                    self.figures["invalid_records"] += 1
                    self._damaged(path, span, f"invalid record: {e}", 0, seg.buf)

    def _apply(self, rec: list) -> None:
        kind, st, fig = rec[0], self.state, self.figures
        if kind == "b":
            b = pb.Batch.FromString(rec[1])
            if not b.node_id or not b.boot_id or b.seq <= 0:
                raise ValueError(f"batch without node, boot or seq ({b.node_id!r}, {b.boot_id!r}, {b.seq})")
            if b.columns:   # the compact encoding: its series by the definitions read before it
                got = compact_batch(b, st.dictionary, MAX_STORED_SAMPLES)
                stored = st.ingest(got, now_ns=b.sent_unix_nano or None)
            else:
                stored = st.ingest(b, now_ns=b.sent_unix_nano or None, wire=rec[1])
            if stored:
                fig["batches"] += 1
            else:
                fig["duplicates"] += 1
        elif kind == "i":
            st.restore_inventory(rec[1], rec[2], pb.Inventory.FromString(rec[3]))
            fig["inventories"] += 1
        elif kind == "m":
            key = (rec[1], rec[2])
            self.marks[key] = max(self.marks.get(key, 0), rec[3])
            fig["marks"] += 1
        elif kind == "d":
            st.dictionary.add(rec[1], *read_table(rec[1], rec[2]))
            fig["series_tables"] += 1
        else:
            self.seals.append((self._path, rec[1], rec[2]))

    def _check_seals(self) -> None:
        """A segment shorter than the next one says it was (cut at a record boundary), or missing
        between two that are there (deleted): what was in it is lost, and said so."""
        present = dict(segments(self.dir))
        first = min(present, default=0)
        for said_by, sid, size in self.seals:
            path = present.get(sid)
            try:
                actual = os.path.getsize(path) if path else -1
            except OSError:
                actual = -1
            if actual < 0 and (sid > first or (sid == self.start[0] and size > self.start[1])):   # the snapshot's tail
                self._damaged(f"{self.dir}/{sid:08d}.log", Span(0, size, None),
                              f"the segment is missing, {said_by} says it held {size} bytes", 1)
            elif path is not None and 0 <= actual < size:
                self._damaged(path, Span(actual, size, None),
                              f"the file ends early: {said_by} says it ended at byte {size}", 1)

    def _damaged(self, path: str, span: Span, what: str, records: int, buf=None) -> None:
        """Count and log a damaged range; buf: the segment's bytes, to keep it aside (None: nothing to keep)."""
        fig = self.figures
        if records:
            fig["damaged_ranges"] += 1
            fig["damaged_records"] += records
            fig["damaged_bytes"] += span.end - span.start
        kept, size = (self.quarantine.keep(path, buf, span.start, span.end) if buf is not None and span.end > span.start
                      else ("nothing to keep", 0))
        if size < 0:
            fig["not_kept_bytes"] += span.end - span.start
        else:
            fig["kept_aside_bytes"] += size
        self._logged += 1
        if self._logged <= LOGGED_RANGES:
            log.warning("store %s bytes %d-%d (%d bytes%s) damaged (%s): skipped and counted; %s", path,
                        span.start, span.end, span.end - span.start,
                        f", at least {records} records" if records else "", what, kept)
