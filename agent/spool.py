"""The agent's on-disk spool: every batch is written here when it is cut, and forgotten when the
collector has acknowledged it, so batches survive a collector outage and a `kill -9` of the agent.

Layout: segment files `NNNNNNNN.seg` in the spool directory, each a sequence of msgpack records
`[boot_id, seq, samples, batch_bytes]` (the serialised `Batch`), plus `acked.json`, the highest
acknowledged sequence number per agent boot (written every `fsync_interval_s`; one that lags
only means a few batches are sent again, and the collector drops them). A segment is deleted once every batch in it is
acknowledged. On start, the records of earlier boots that were not acknowledged are handed back,
in order, to be sent again with their original boot id and sequence number (the collector drops
any it already stored).

Durability (`fsync`): `batch` fsyncs each record before the batch is sent; `interval` (default)
fsyncs the open segment every `fsync_interval_s`; `never` leaves it to the kernel. Records written
with write() survive a killed agent in every mode; a power loss can take the last interval's
batches in `interval` mode. A torn last record (a crash mid-write) is detected and skipped.

Budget: when the spool passes `max_bytes`, the oldest segments are deleted and every batch and
sample in them is counted as dropped and reported: loss is never silent.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO, TextIO

import msgpack

log = logging.getLogger("xpusense.agent.spool")


@dataclasses.dataclass
class Loc:
    """Where one batch lies in the spool."""
    segment: int
    offset: int
    length: int          # of the whole record
    samples: int


@dataclasses.dataclass
class Segment:
    id: int
    path: str
    size: int = 0
    unacked: set = dataclasses.field(default_factory=set)   # (boot, seq) keys not yet acknowledged


class SpoolError(Exception):
    pass


class Spool:
    @staticmethod
    def for_node(base: str, node_id: str) -> str:
        """The spool directory of one node id under the configured base."""
        return os.path.join(base, re.sub(r"[^A-Za-z0-9._-]", "_", node_id) or "_")

    def __init__(self, directory: str, max_bytes: int = 256 * 2**20, segment_bytes: int = 4 * 2**20,
                 fsync: str = "interval", fsync_interval_s: float = 1.0,
                 on_drop: Callable[[list[tuple[str, int]], int], None] | None = None):
        self.dir = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.on_drop = on_drop
        self.segments: dict[int, Segment] = {}
        self.acked: dict[str, int] = {}
        self._f: BinaryIO | None = None
        self._cur: Segment | None = None
        self._lock = threading.Lock()
        self._lockf: TextIO | None = None
        self._dirty = False
        self._acks_dirty = False
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self.dropped_batches = 0
        self.dropped_samples = 0
        self.torn_records = 0

    # -- start ---------------------------------------------------------------------------------
    def open(self) -> list[tuple[tuple[str, int], Loc]]:
        """Open (creating) the spool; return the batches of earlier runs not yet acknowledged."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._lockf = open(os.path.join(self.dir, ".lock"), "w")
        except OSError as e:
            raise SpoolError(f"spool directory {self.dir!r} is not writable ({e.strerror}); "
                             f"set [spool] dir to a writable path or [spool] enabled = false") from None
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SpoolError(f"spool directory {self.dir!r} is in use by another agent with the same node id; "
                             f"give each agent its own node id or [spool] dir") from None
        try:
            with open(os.path.join(self.dir, "acked.json")) as f:
                self.acked = {str(k): int(v) for k, v in json.load(f).items()}
        except (OSError, ValueError):
            self.acked = {}
        found: list[tuple[tuple[str, int], Loc]] = []
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(".seg"):
                continue
            sid = int(name[:-4])
            seg = Segment(sid, os.path.join(self.dir, name))
            for key, loc in self._scan(seg):
                if key[1] > self.acked.get(key[0], 0):
                    seg.unacked.add(key)
                    found.append((key, loc))
            seg.size = os.path.getsize(seg.path)
            if seg.unacked:
                self.segments[sid] = seg
            else:
                os.unlink(seg.path)
        next_id = max(self.segments, default=0) + 1
        self._roll(next_id)
        self._flusher = threading.Thread(target=self._flush_loop, name="spool-flush", daemon=True)
        self._flusher.start()
        if found:
            log.info("spool %s: %d batches from earlier runs to send (%d samples)", self.dir, len(found),
                     sum(loc.samples for _, loc in found))
        return found

    def _scan(self, seg: Segment) -> Iterator[tuple[tuple[str, int], Loc]]:
        with open(seg.path, "rb") as f:
            data = f.read()
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
        unpacker.feed(data)
        offset = 0
        while True:
            try:
                rec = unpacker.unpack()
            except msgpack.OutOfData:
                if offset < len(data):
                    self.torn_records += 1
                    log.warning("spool %s: %d bytes of a record cut short by a crash, skipped",
                                seg.path, len(data) - offset)
                return
            except (ValueError, msgpack.UnpackException):
                self.torn_records += 1
                log.warning("spool %s: unreadable record at byte %d, rest of segment skipped", seg.path, offset)
                return
            end = unpacker.tell()
            try:
                boot, seq, samples, _ = rec
                yield (str(boot), int(seq)), Loc(seg.id, offset, end - offset, int(samples))
            except (TypeError, ValueError):
                self.torn_records += 1
            offset = end

    def _roll(self, sid: int) -> None:
        old = self._cur
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        if old is not None and not old.unacked:   # everything in it was acknowledged while it was open
            del self.segments[old.id]
            os.unlink(old.path)
        seg = Segment(sid, os.path.join(self.dir, f"{sid:08d}.seg"))
        self._f = open(seg.path, "ab")
        self._cur = self.segments[sid] = seg

    # -- writing -------------------------------------------------------------------------------
    def append(self, boot: str, seq: int, samples: int, data: bytes) -> Loc:
        rec = msgpack.packb([boot, seq, samples, data], use_bin_type=True)
        with self._lock:
            assert self._cur is not None and self._f is not None, "append() on a spool that is not open"
            if self._cur.size and self._cur.size + len(rec) > self.segment_bytes:
                self._roll(self._cur.id + 1)
            seg = self._cur
            loc = Loc(seg.id, seg.size, len(rec), samples)
            self._f.write(rec)
            self._f.flush()           # into the kernel: survives a killed agent
            if self.fsync == "batch":
                os.fsync(self._f.fileno())
            else:
                self._dirty = True
            seg.size += len(rec)
            seg.unacked.add((boot, seq))
            self._enforce_budget()
        return loc

    def _enforce_budget(self) -> None:
        total = sum(s.size for s in self.segments.values())
        while total > self.max_bytes and len(self.segments) > 1:
            oldest = self.segments[min(self.segments)]
            if oldest is self._cur:
                break
            lost = sorted(oldest.unacked)
            samples = 0
            for key, loc in self._scan(oldest):
                if key in oldest.unacked:
                    samples += loc.samples
            del self.segments[oldest.id]
            os.unlink(oldest.path)
            total -= oldest.size
            self.dropped_batches += len(lost)
            self.dropped_samples += samples
            log.warning("spool %s over its budget (%d bytes): dropped the oldest segment, %d batches, "
                        "%d samples never delivered (%d batches, %d samples dropped so far)", self.dir,
                        self.max_bytes, len(lost), samples, self.dropped_batches, self.dropped_samples)
            if self.on_drop:
                self.on_drop(lost, samples)

    def read(self, loc: Loc) -> bytes:
        """The serialised Batch at `loc`."""
        with self._lock:
            seg = self.segments.get(loc.segment)
            if seg is None:
                raise KeyError(f"segment {loc.segment} is gone (dropped over budget)")
            if seg is self._cur:
                assert self._f is not None   # the current segment is always open
                self._f.flush()
            path = seg.path
        with open(path, "rb") as f:
            f.seek(loc.offset)
            rec = msgpack.unpackb(f.read(loc.length), raw=False)
        return rec[3]

    # -- acknowledgements ----------------------------------------------------------------------
    def ack(self, boot: str, seq: int, loc: Loc | None = None) -> None:
        with self._lock:
            if seq > self.acked.get(boot, 0):
                self.acked[boot] = seq
                self._acks_dirty = True
            segs = [self.segments.get(loc.segment)] if loc else list(self.segments.values())
            for seg in segs:
                if seg is None or (boot, seq) not in seg.unacked:
                    continue
                seg.unacked.discard((boot, seq))
                if not seg.unacked and seg is not self._cur:
                    del self.segments[seg.id]
                    self._save_acked()
                    os.unlink(seg.path)
                break

    def _save_acked(self) -> None:
        self._acks_dirty = False
        # Keep marks only for boots that still have batches in the spool, and the newest one.
        live = {b for s in self.segments.values() for b, _ in s.unacked}
        marks = {b: s for b, s in self.acked.items() if b in live}
        tmp = os.path.join(self.dir, "acked.json.tmp")
        with open(tmp, "w") as f:
            json.dump(marks or self.acked, f)
        os.replace(tmp, os.path.join(self.dir, "acked.json"))

    def bytes_used(self) -> int:
        with self._lock:
            return sum(s.size for s in self.segments.values())

    # -- lifecycle -----------------------------------------------------------------------------
    def _flush_loop(self) -> None:
        """Every fsync_interval_s: fsync the open segment (`interval` mode) and record the acks."""
        while not self._stop.wait(self.fsync_interval_s):
            with self._lock:
                if self._dirty and self._f is not None and self.fsync == "interval":
                    os.fsync(self._f.fileno())
                    self._dirty = False
                if self._acks_dirty:
                    self._save_acked()

    def close(self) -> None:
        self._stop.set()
        if self._flusher:
            self._flusher.join(timeout=5)
        with self._lock:
            if self._f is not None:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()
                self._f = None
            self._save_acked()
            if self._lockf is not None:
                self._lockf.close()
                self._lockf = None
            if self._cur is not None and not self._cur.unacked:
                try:
                    os.unlink(self._cur.path)
                except OSError:
                    pass
                self.segments.pop(self._cur.id, None)
