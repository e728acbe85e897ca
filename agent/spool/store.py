"""The agent's on-disk spool: every batch is written here when it is cut, and forgotten when the
collector has acknowledged it, so batches survive a collector outage and a `kill -9` of the agent.

Segments `NNNNNNNN.seg` of checksummed records (records.py): batches and acknowledged marks; and
`acked.json` (ack_file.py). On start the unacknowledged batches of earlier boots are handed back,
in order. Damaged records are skipped, counted and kept aside (aside.py); a failing disk is a
state, not a crash (Spool).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import TextIO

from xpusense.common.supervise import TASKS

from . import ack_file, records
from .aside import Aside

log = logging.getLogger("xpusense.agent.spool")

_SEGMENT = re.compile(r"^(\d{8,12})\.seg$")
ACKS_SAVE_S = 10.0          # acknowledged marks recorded at most this often for acknowledgements alone
_LOGGED_PER_START = 20      # damaged spans logged one by one at start; the rest in the summary


@dataclasses.dataclass(slots=True)
class Loc:
    """Where one batch lies in the spool."""
    segment: int
    offset: int
    length: int          # of the whole record
    samples: int
    top: int = -1        # the highest series_ref its columns use, when the stream knows it (-1: read it)


@dataclasses.dataclass
class Segment:
    id: int
    path: str
    size: int = 0
    unacked: dict = dataclasses.field(default_factory=dict)   # (boot, seq) not yet acknowledged -> samples


class SpoolError(Exception):
    pass


class Spool:
    """A segment is deleted once all its batches are acknowledged. While batches are only
    acknowledged, the marks are appended to the open segment at most every ACKS_SAVE_S (lagging
    marks mean a few batches sent again, which the collector drops); acked.json, a new file each
    time (a few pages of file system metadata), is written when a segment is deleted, a batch set
    aside, and at close. A record whose framing, checksum or content (`validate`)
    does not check out at start, or that cannot be read back later (`set_aside`), is never handed
    out again. `append` returns None when a record cannot be written, after cutting the segment
    back to its last whole record: the change of state is logged once, and the next append that
    succeeds puts the spool back to `ok`. `fsync`: `batch` before each batch is sent; `interval`
    every `fsync_interval_s` once a batch of the open segment has waited a whole interval for its
    acknowledgement (a healthy stream's batches are acknowledged first and never fsync'ed; a power
    loss can take up to two intervals' unacknowledged batches); `never`. Over
    `max_bytes` or `max_batches` the oldest segments are deleted, every batch in them counted.
    With `node_id`, a batch that begins with it and its record's boot (a Batch's fields 1 and 2,
    written first) is kept without them and handed back whole."""

    @staticmethod
    def for_node(base: str, node_id: str) -> str:
        """The spool directory of one node id under the configured base."""
        return os.path.join(base, re.sub(r"[^A-Za-z0-9._-]", "_", node_id) or "_")

    def __init__(self, directory: str, max_bytes: int = 256 * 2**20, segment_bytes: int = 4 * 2**20,
                 fsync: str = "interval", fsync_interval_s: float = 1.0,
                 on_drop: Callable[[list[tuple[str, int]], int], None] | None = None,
                 max_batches: int = 50_000, damaged_max_bytes: int = 16 * 2**20,
                 validate: Callable[[str, int, bytes], str | None] | None = None, node_id: str = ""):
        self.dir = directory
        self.node_id = node_id
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.max_batches = max_batches
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.on_drop = on_drop
        self.validate = validate          # (boot, seq, batch bytes) -> why it is unusable, or None
        self.aside = Aside(os.path.join(directory, "damaged"), damaged_max_bytes)
        self.segments: dict[int, Segment] = {}
        self.acked: dict[str, int] = {}
        self.set_aside_keys: dict[tuple[str, int], int] = {}   # set aside at run time -> segment id
        self._found: dict | None = None   # at start: the batches found so far
        self.lost_at_open: dict[str, int] = {}
        self._fd: int | None = None
        self._cur: Segment | None = None
        self._tainted = False             # the open segment's tail could not be cut back: write a new one
        self._lock = threading.Lock()
        self._lockf: TextIO | None = None
        self.before_fsync: Callable[[], None] | None = None   # run before each fsync (series definitions)
        self._dirty = False
        self._waiting: tuple[str, int] | None = None   # the oldest unacknowledged batch at the last flush
        self._acks_dirty = False
        self._aside_dirty = False          # a batch set aside since acked.json was last written
        self._acks_saved_at = 0.0          # time.monotonic() of that write
        self._acks_error = ""
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._bytes = 0
        self._count = 0
        self.state = "ok"                 # "ok" or "failing" (cannot write; see `error`)
        self.error = ""
        self.write_failures = 0           # batches that could not be written (kept in memory by the stream)
        self.dropped_batches = 0
        self.dropped_samples = 0
        self.damaged_records = 0
        self.damaged_bytes = 0

    # -- start ---------------------------------------------------------------------------------
    def open(self) -> list[tuple[tuple[str, int], Loc]]:
        """Open (creating) the spool; return the batches of earlier runs not yet acknowledged.
        What was dropped or found damaged on the way is in `lost_at_open`."""
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
        self._load_acked()
        found: dict[tuple[str, int], Loc] = {}
        self._found = found
        legacy: list[Segment] = []
        ids = []
        for name in sorted(os.listdir(self.dir)):
            m = _SEGMENT.match(name)
            if m:
                ids.append(int(m.group(1)))
            elif name.endswith(".seg"):
                log.warning("spool %s: %s is not a segment name of this agent's, left alone", self.dir, name)
        for sid in sorted(ids):
            seg = Segment(sid, os.path.join(self.dir, f"{sid:08d}.seg"))
            if self._scan(seg, found):
                legacy.append(seg)
            else:
                self.segments[sid] = seg
        for seg in list(self.segments.values()):
            if not seg.unacked:
                self._delete(seg)
        self._bytes = sum(s.size for s in self.segments.values())
        self._count = sum(len(s.unacked) for s in self.segments.values())
        try:
            self._roll(max(ids, default=0) + 1)
        except OSError as e:
            self._failed(e, "open a segment")
        for seg in legacy:
            self._migrate(seg, found)
        self._enforce_budget()
        self._found = None
        self.lost_at_open = {"dropped_batches": self.dropped_batches, "dropped_samples": self.dropped_samples,
                             "damaged_records": self.damaged_records}
        self._flusher = TASKS.thread("spool-flush", self._flush_loop, self._stop)
        self._flusher.start()
        if found:
            log.info("spool %s: %d batches from earlier runs to send (%d samples)", self.dir, len(found),
                     sum(loc.samples for loc in found.values()))
        # Boots in the order they were first written, each in seq order (batches held in memory while
        # the disk was full are written after later ones): the collector takes a boot's seqs ascending.
        first: dict[str, int] = {}
        for boot, _ in found:
            first.setdefault(boot, len(first))
        if self.damaged_records:
            log.warning("spool %s: %d damaged records (%d bytes) skipped at start, counted as dropped; "
                        "their bytes are in %s", self.dir, self.damaged_records, self.damaged_bytes, self.aside.dir)
        return sorted(found.items(), key=lambda kv: (first[kv[0][0]], kv[0][1]))

    def _load_acked(self) -> None:
        try:
            self.acked, self.set_aside_keys = ack_file.load(self.dir)
        except (OSError, ValueError) as e:
            log.warning("spool %s: acked.json unreadable (%s): every batch in the spool is sent again "
                        "(the collector drops the ones it has)", self.dir, e)

    def _scan(self, seg: Segment, found: dict) -> bool:
        """Read one segment at start, its batches to send into `found`; True for a segment of the
        format before framing (re-written by _migrate)."""
        fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            seg.size = os.fstat(fd).st_size
            if records.is_legacy(fd):
                return True
            for item in records.scan(fd):
                if isinstance(item, records.Damaged):
                    self._damaged(fd, seg, item.offset, item.length, item.records, item.reason)
                    continue
                if isinstance(item, records.Acks):
                    self._acked_at_open(item.marks, found, seg)
                    continue
                key = (item.boot, item.seq)
                if item.seq <= self.acked.get(item.boot, 0) or self.set_aside_keys.get(key) == seg.id:
                    continue
                if key in found:
                    log.warning("spool %s: batch %s again at byte %d of %s, the copy is skipped", self.dir, key,
                                item.offset, os.path.basename(seg.path))
                    continue
                why = self.validate(item.boot, item.seq, self._whole(item.boot, item.batch)) if self.validate else None
                if why:
                    self._damaged(fd, seg, item.offset, item.length, 1, why)
                    continue
                seg.unacked[key] = item.samples
                found[key] = Loc(seg.id, item.offset, item.length, item.samples)
                if len(found) > self.max_batches:   # memory stays bounded whatever the files hold
                    self._drop_oldest_found(found, seg)
            return False
        finally:
            os.close(fd)

    def _acked_at_open(self, marks: dict[str, int], found: dict, scanning: Segment) -> None:
        """Marks read at start: the batches found so far that they cover are not handed out."""
        raised = {b: m for b, m in marks.items() if m > self.acked.get(b, 0)}
        if not raised:
            return
        self.acked.update(raised)
        for key in [k for k in found if k[1] <= raised.get(k[0], 0)]:
            loc = found.pop(key)
            (scanning if loc.segment == scanning.id else self.segments[loc.segment]).unacked.pop(key, None)

    def _drop_oldest_found(self, found: dict, scanning: Segment) -> None:
        key = next(iter(found))
        loc = found.pop(key)
        seg = scanning if loc.segment == scanning.id else self.segments[loc.segment]
        self.dropped_samples += seg.unacked.pop(key)
        self.dropped_batches += 1
        if self.dropped_batches == 1 or self.dropped_batches % 10000 == 0:
            log.warning("spool %s holds more than [spool] max_batches = %d batches: the oldest are dropped and "
                        "counted (%d so far)", self.dir, self.max_batches, self.dropped_batches)

    def _damaged(self, fd: int, seg: Segment, offset: int, length: int, count: int, why: str) -> None:
        self.damaged_records += count
        self.damaged_bytes += length
        kept = self.aside.keep(fd, os.path.basename(seg.path), offset, length)
        if self.aside.kept + self.aside.failed <= _LOGGED_PER_START:
            log.warning("spool %s: damaged record at byte %d of %s (%d bytes, %s): skipped, counted as %d dropped "
                        "batch%s; bytes kept in %s", self.dir, offset, os.path.basename(seg.path), length, why,
                        count, "" if count == 1 else "es", kept or "(not kept)")

    def _migrate(self, seg: Segment, found: dict) -> None:
        """Re-write a segment of the format before framing; it is deleted once all of it is re-written."""
        fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for item in records.legacy_records(fd):
                if isinstance(item, records.Good) and self.validate and (why := self.validate(item.boot, item.seq,
                                                                                             item.batch)):
                    item = records.Damaged(item.offset, item.length, 1, why)
                if isinstance(item, records.Damaged):
                    self._damaged(fd, seg, item.offset, item.length, item.records, item.reason)
                elif item.seq > self.acked.get(item.boot, 0) and (item.boot, item.seq) not in found:
                    if (loc := self.append(item.boot, item.seq, item.samples, item.batch)) is None:
                        log.warning("spool %s: %s (format before framing) not fully re-written (%s); the rest waits "
                                    "for the next start", self.dir, os.path.basename(seg.path), self.error)
                        return
                    found[(item.boot, item.seq)] = loc
        finally:
            os.close(fd)
        log.info("spool %s: %s re-written in the current format", self.dir, os.path.basename(seg.path))
        os.unlink(seg.path)

    # -- writing -------------------------------------------------------------------------------
    def _roll(self, sid: int) -> None:
        """Close the open segment and open a new one (OSError: the disk is failing)."""
        old, fd = self._cur, self._fd
        if fd is not None:
            self._fd = None
            try:
                if old is None or old.unacked:   # all acknowledged: it is deleted below, no fsync
                    self._fsync(fd)
            finally:
                os.close(fd)
            self._tainted = False
        if old is not None and not old.unacked:   # everything in it was acknowledged while it was open
            self._delete(old)
        while True:
            path = os.path.join(self.dir, f"{sid:08d}.seg")
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
                self._tainted = False
                break
            except FileExistsError:   # not ours (we list them at start): leave it and take the next id
                sid += 1
        self._cur = self.segments[sid] = Segment(sid, path)

    def _whole(self, boot: str, batch: bytes) -> bytes:
        """A stored batch with the ids `append` left out put back (one that has a node id as it was)."""
        return batch if not self.node_id or batch[:1] == b"\x0a" else records.batch_ids(self.node_id, boot) + batch

    def append(self, boot: str, seq: int, samples: int, data: bytes) -> Loc | None:
        """Write one batch; its place in the spool, or None when it could not be written (see `error`)."""
        if self.node_id:
            data = records.without_ids(data, records.batch_ids(self.node_id, boot))
        rec = records.encode(boot, seq, samples, data)
        with self._lock:
            if self._stop.is_set():
                return None
            for attempt in (1, 2):
                cur = self._cur
                try:
                    if (cur is None or self._fd is None or self._tainted
                            or (cur.size and (cur.size + len(rec) > self.segment_bytes
                                              or len(cur.unacked) >= max(1, self.max_batches // 16)))):
                        self._roll(max(self.segments, default=0) + 1)
                    assert self._cur is not None and self._fd is not None
                    seg, offset = self._cur, self._write(self._fd, rec)
                    break
                except OSError as e:
                    # The next record goes to a new segment, so that this one, once acknowledged, is
                    # deleted and its room given back; at once when it is acknowledged already.
                    if self._cur is not None and self._cur.size:
                        self._tainted = True
                        if attempt == 1 and not self._cur.unacked:
                            continue
                    self._failed(e, "write")
                    return None
            self._dirty = self.fsync == "interval"
            self._bytes += offset + len(rec) - seg.size
            seg.size = offset + len(rec)
            seg.unacked[(boot, seq)] = samples
            self._count += 1
            if self.state != "ok":
                log.warning("spool %s writable again (%d batches could not be written meanwhile and were kept "
                            "in memory)", self.dir, self.write_failures)
                self.state, self.error = "ok", ""
            self._enforce_budget()
            return Loc(seg.id, offset, len(rec), samples)

    def _fsync(self, fd: int) -> None:
        if self.before_fsync is not None:
            self.before_fsync()
        os.fsync(fd)

    def _write(self, fd: int, rec: bytes, batch: bool = True) -> int:
        """Append one whole record or nothing (a partial one is cut off again); its offset. `batch`:
        a batch, fsynced at once with `fsync = "batch"`."""
        offset = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(rec)
            while view:
                view = view[os.write(fd, view):]
            if batch and self.fsync == "batch":
                self._fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, offset)
            except OSError:
                self._tainted = True
            raise
        return offset

    def _failed(self, e: OSError, doing: str) -> None:
        """Called locked: the disk refused a write or an fsync."""
        if doing == "write":
            self.write_failures += 1
        why = f"{doing}: {e.strerror or e}"
        if self.state != "failing" or why != self.error:
            log.warning("spool %s cannot %s: new batches are kept in memory (up to [stream] queue_batches) and "
                        "sent from there; writing resumes by itself when the disk takes it", self.dir, why)
        self.state, self.error = "failing", why

    def _delete(self, seg: Segment) -> None:
        self.segments.pop(seg.id, None)
        self._bytes -= seg.size
        self._count -= len(seg.unacked)
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass

    def _enforce_budget(self) -> None:
        """Called locked (or at start): drop the oldest segments over the budgets."""
        while (self._bytes > self.max_bytes or self._count > self.max_batches) and len(self.segments) > 1:
            oldest = self.segments[min(self.segments)]
            if oldest is self._cur:
                break
            lost = list(oldest.unacked)
            samples = sum(oldest.unacked.values())
            self._delete(oldest)
            self.dropped_batches += len(lost)
            self.dropped_samples += samples
            log.warning("spool %s over its budget (%d bytes, %d batches): dropped the oldest segment, %d batches, "
                        "%d samples not acknowledged (%d batches, %d samples dropped so far; one in flight can still be "
                        "delivered, the stream counts it when its acknowledgement does not come)", self.dir,
                        self.max_bytes, self.max_batches, len(lost), samples, self.dropped_batches,
                        self.dropped_samples)
            if self._found is not None:     # at start: not handed out yet
                for key in lost:
                    self._found.pop(key, None)
            elif self.on_drop:
                self.on_drop(lost, samples)

    def read(self, loc: Loc, key: tuple[str, int] | None = None) -> bytes:
        """The serialised Batch at `loc`, checked (RecordError when it is not the record it should be;
        KeyError when its segment was dropped over budget)."""
        with self._lock:
            seg = self.segments.get(loc.segment)
            if seg is None:
                raise KeyError(f"segment {loc.segment} is gone (dropped over budget)")
            path = seg.path
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            boot, seq, _, batch = records.read_at(fd, loc.offset, loc.length)
        finally:
            os.close(fd)
        if key is not None and (boot, seq) != key:
            raise records.RecordError(f"the record there holds batch {(boot, seq)}, not {key}")
        return self._whole(boot, batch)

    def set_aside(self, key: tuple[str, int], loc: Loc, why: str) -> None:
        """A batch that cannot be sent (unreadable, or not a batch of ours): keep its bytes aside,
        count it, and never hand it out again (remembered in acked.json across restarts)."""
        with self._lock:
            seg = self.segments.get(loc.segment)
            if seg is None or key not in seg.unacked:
                return
            try:
                fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                self.damaged_records += 1
                log.warning("spool %s: batch %s (%s) set aside, counted as dropped; its segment cannot be read (%s)",
                            self.dir, key, why, e.strerror or e)
            else:
                try:
                    self._damaged(fd, seg, loc.offset, loc.length, 1, f"batch {key}: {why}")
                finally:
                    os.close(fd)
            self.set_aside_keys[key] = seg.id
            self._acks_dirty = self._aside_dirty = True
            self._forget(seg, key)

    # -- acknowledgements ----------------------------------------------------------------------
    def ack(self, boot: str, seq: int, loc: Loc | None = None) -> None:
        """The collector has `(boot, seq)`. Without `loc` (a batch kept in memory) only the mark moves."""
        with self._lock:
            if seq > self.acked.get(boot, 0):
                self.acked[boot] = seq
                self._acks_dirty = True
            seg = self.segments.get(loc.segment) if loc is not None else None
            if seg is not None and (boot, seq) in seg.unacked:
                self._forget(seg, (boot, seq))

    def _forget(self, seg: Segment, key: tuple[str, int]) -> None:
        del seg.unacked[key]
        self._count -= 1
        if not seg.unacked and seg is not self._cur:
            self._delete(seg)
            self._save_acked()

    def _marks(self) -> dict[str, int]:
        """Called locked: the marks worth keeping, those of boots that still have batches in the spool
        (all of them when none has)."""
        live = {b for s in self.segments.values() for b, _ in s.unacked}
        return {b: s for b, s in self.acked.items() if b in live} or dict(self.acked)

    def _append_acks(self) -> bool:
        """Called locked: the marks as a record of the open segment, whose last page is being written
        anyway; False where there is no segment to take it."""
        cur = self._cur
        if cur is None or self._fd is None or self._tainted:
            return False
        rec = records.encode_acks(self._marks())
        try:
            offset = self._write(self._fd, rec, batch=False)
        except OSError:
            return False
        self._bytes += offset + len(rec) - cur.size
        cur.size = offset + len(rec)
        self._acks_dirty = False
        self._acks_saved_at = time.monotonic()
        return True

    def _save_acked(self) -> None:
        """Called locked. A failure is logged once per change and tried again at the next flush."""
        # Batches set aside are remembered while the segment that holds them is there.
        self.set_aside_keys = {k: sid for k, sid in self.set_aside_keys.items() if sid in self.segments}
        try:
            ack_file.save(self.dir, self._marks(), self.set_aside_keys)
        except OSError as e:
            self._acks_dirty = True
            if self._acks_error != str(e):
                log.warning("spool %s: cannot record acknowledgements (%s): after a restart some batches are sent "
                            "again (the collector drops them)", self.dir, e.strerror or e)
            self._acks_error = str(e)
            return
        self._acks_dirty = self._aside_dirty = False
        self._acks_saved_at = time.monotonic()
        self._acks_error = ""

    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def status(self) -> dict:
        return {"state": self.state, "error": self.error, "bytes": self._bytes, "batches": self._count,
                "write_failures": self.write_failures, "damaged_records": self.damaged_records,
                "dropped_batches": self.dropped_batches}

    # -- lifecycle -----------------------------------------------------------------------------
    def _flush_loop(self) -> None:
        """Every fsync_interval_s: fsync the open segment (`interval` mode) and record the acks."""
        while not self._stop.wait(self.fsync_interval_s):
            try:
                self._flush_once()
            except Exception:   # never let the thread die: the next round tries again
                log.exception("spool %s: flush round failed", self.dir)

    def _flush_once(self) -> None:
        with self._lock:
            oldest = next(iter(self._cur.unacked), None) if self._cur is not None else None
            if self._dirty and oldest is None:
                # Everything written to the open segment was acknowledged already: the collector has
                # it, so nothing on disk is needed any more and there is nothing to fsync (a healthy
                # stream's every second; the fsync was most of this thread's CPU).
                self._dirty = False
            # A batch sent since the last round is most likely acknowledged before the next one: an
            # fsync now would write its page again for nothing (a page a second for one batch a second).
            waited, self._waiting = oldest is not None and oldest == self._waiting, oldest
            if self._dirty and waited and self._fd is not None and self.fsync == "interval":
                try:
                    self._fsync(self._fd)
                    self._dirty = False
                except OSError as e:
                    # What was written since the last fsync may not be on disk: later batches go
                    # to a new segment, and the ones in this one are checked when read back.
                    self._tainted = True
                    self._failed(e, "fsync")
            if self._acks_dirty and (self._aside_dirty or time.monotonic() - self._acks_saved_at >= ACKS_SAVE_S):
                if self._aside_dirty or not self._append_acks():
                    self._save_acked()

    def close(self) -> None:
        self._stop.set()
        if self._flusher:
            self._flusher.join(timeout=5)
        with self._lock:
            if self._fd is not None:
                try:
                    self._fsync(self._fd)
                except OSError as e:
                    log.warning("spool %s: final fsync failed: %s", self.dir, e.strerror or e)
                os.close(self._fd)
                self._fd = None
            self._save_acked()
            if self._lockf is not None:
                self._lockf.close()
                self._lockf = None
            if self._cur is not None and not self._cur.unacked:
                self._delete(self._cur)
