"""The collector's durable store, writing side: group commit, a failing disk as a state, retention.

A record is framed (segment_file.py) and queued on the event loop; one I/O thread writes every
queued record in one pwrite and fsyncs it (a group at most every `commit_interval_s`), then the
records' futures complete and the batches are acknowledged. A disk that cannot be written holds
the records in memory, within a bound, and writes them again every `retry_s` (Store).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import time
from collections.abc import Callable

from xpusense.common.fsync import fsync_dir

from .defs import Tables
from .replay import Replay
from .segment_file import SEGMENT_MAGIC, StoreError, frame, segment_name, segments
from .snapshot_load import Snapshots

log = logging.getLogger("xpusense.collector.store")


def _pwrite_all(fd: int, data: bytes, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def why_failed(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return repr(exc)


class _Segments:
    """The segment being written. Only the store's I/O thread touches it (close(): after it)."""

    def __init__(self, directory: str, fsync: bool):
        self.dir = directory
        self.fsync = fsync
        self.fd = -1
        self.seg_id = 0
        self.off = 0              # everything before it is written (and fsync'ed)
        self.broken = False       # a failed write could not be cut back: the next write starts a segment
        self.opened_at = 0.0
        self.bytes_written = 0    # to segments since start (what was cut back after a failed write not counted)

    def write(self, data: bytes, roll: bytes | None) -> tuple[int, int]:
        """Write `data` at the end of the segment (of a new one, beginning with `roll`, when given)
        and make it durable; on failure nothing of it stays and OSError is raised."""
        if roll is not None:
            return self._roll(roll + data)
        try:
            _pwrite_all(self.fd, data, self.off)
            if self.fsync and data:
                os.fsync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, self.off)   # no partial record left behind
            except OSError:
                self.broken = True
            raise
        self.off += len(data)
        self.bytes_written += len(data)
        return self.seg_id, self.off

    def _roll(self, body: bytes) -> tuple[int, int]:
        new_id = self.seg_id + 1
        while os.path.exists(os.path.join(self.dir, segment_name(new_id))):
            new_id += 1
        path = os.path.join(self.dir, segment_name(new_id))
        data = SEGMENT_MAGIC + body
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)   # boot ids: docs/security.md
        try:
            _pwrite_all(fd, data, 0)
            if self.fsync:
                os.fsync(fd)
                fsync_dir(self.dir)
        except OSError:
            os.close(fd)
            try:
                os.unlink(path)   # a failed roll leaves no segment behind
            except OSError:
                pass
            raise
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.seg_id, self.off, self.broken = fd, new_id, len(data), False
        self.bytes_written += len(data)
        self.opened_at = time.monotonic()
        return self.seg_id, self.off

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Store:
    """Written from the collector's event loop thread; I/O runs in one worker thread.

    A disk that cannot be written (full, read-only, failing) is a state, not a crash: the segment
    is cut back to what was durable, the records stay queued, one log line says so, health goes
    NOT_SERVING (`on_change`), and the same records are written again every `retry_s` until it
    works (no segment per failure). What is held is bounded by `max_pending_bytes`: the server
    waits for room (`wait_room`) before it takes a batch, so a stream is held back rather than
    ended; a record submitted past the bound anyway is refused (StoreError, counted)."""

    def __init__(self, directory: str, history_s: float = 900.0, segment_s: float = 60.0,
                 segment_bytes: int = 64 * 2**20, fsync: bool = True, max_pending_bytes: int = 64 * 2**20,
                 retry_s: float = 1.0, damaged_keep_bytes: int = 256 * 2**20, snapshot_keep: int = 2,
                 commit_interval_s: float = 0.0):
        self.dir = directory
        self.history_s = history_s
        self.segment_s = segment_s
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.max_pending_bytes = max_pending_bytes
        self.retry_s = retry_s
        self.damaged_keep_bytes = damaged_keep_bytes
        # A group commit begins at most this often: records queued meanwhile join the next group (a
        # write and fsync cost the core the loop runs on about half of what a whole batch costs).
        self.commit_interval_s = commit_interval_s
        self._kicked_at = -commit_interval_s   # (monotonic) when the last group commit began
        self._kick_timer: asyncio.TimerHandle | None = None
        self._io = _Segments(directory, fsync)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-io")
        self._checkpoint: Callable[[], list[tuple]] = lambda: []
        self.dictionary = None            # the fleet state's series dictionary: a new segment begins with it
        self._tables = Tables()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[bytes, asyncio.Future | None]] = []   # queued, not yet handed to I/O
        self._pending_bytes = 0
        self._inflight: list[tuple[bytes, asyncio.Future | None]] = []  # being written now
        self._inflight_bytes = 0
        self._busy = False
        self._io_task: concurrent.futures.Future | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._refusing = False
        self._closed = False
        self._room: list[asyncio.Future] = []   # streams waiting for room under max_pending_bytes
        self._waiting_logged = False
        # (segment id, offset) up to which everything is durable: readers never go past it.
        self.durable: tuple[int, int] = (0, 0)
        self.readers: dict = {}            # name -> StoreReader (reader.py)
        self.on_change: list[Callable[[bool], None]] = []   # fn(writable), on the loop, per state change
        self.failing = ""                  # why the disk cannot be written now; "" while it can
        self.failing_since = 0.0
        self.replay: dict[str, float] = {}
        # Snapshots (snapshot_load.py, snapshot_taker.py): the one to start from, and what retention keeps for them.
        self.snapshots = Snapshots(directory, snapshot_keep)
        self.snapshotter = None            # a Snapshotter, when [store] snapshot_every_s is set
        self.snapshot_floor: tuple[int, int] | None = None   # the oldest kept snapshot's position
        # Batches accepted and submitted but not applied to the fleet state yet (the server says
        # when): durable future -> (node, boot, seq, a position at or before its record).
        self.inflight: dict[asyncio.Future, tuple[str, str, int, tuple[int, int]]] = {}
        # Counters (stats(), metrics.py).
        self.commits = 0
        self.commit_waits = 0
        self.records = 0
        self.write_errors = 0
        self.unwritable_episodes = 0
        self.refused_records = 0
        self.refused_bytes = 0
        self.room_waits = 0
        self.max_held_bytes = 0

    # -- start ---------------------------------------------------------------------------------
    def open(self, state) -> dict[str, float]:
        """Replay the store into `state` (a FleetState); returns the replay's figures. Raises
        StoreError only when the directory cannot be used at all (it does not exist and cannot be
        made, or files cannot be created in it)."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            probe = os.path.join(self.dir, ".write-test")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))   # no data: a full disk passes
            os.unlink(probe)
        except OSError as e:
            raise StoreError(f"data_dir {self.dir!r} is not writable ({e.strerror}); set --data-dir / "
                             f"data_dir to a writable directory") from None
        start = self.snapshots.load_newest(state)
        self.replay = Replay(self.dir, state, self.damaged_keep_bytes, start=start or (0, 0)).run()
        self.replay.update(self.snapshots.figures)
        self.snapshot_floor = self.snapshots.prune()
        self._checkpoint = state.checkpoint
        self.dictionary = state.dictionary
        existing = segments(self.dir)
        if existing:
            self._io.seg_id = existing[-1][0]
            self._io.off = os.path.getsize(existing[-1][1])   # where it ends: the next segment says so
            self.durable = (existing[-1][0], os.path.getsize(existing[-1][1]))
        f = self.replay
        damage = f["damaged_ranges"] + f["invalid_records"]
        if f["segments"] or damage:
            (log.warning if damage else log.info)(
                "store %s replayed: %d batches, %d inventories, %d marks from %d segments in %.2f s%s%s",
                self.dir, f["batches"], f["inventories"], f["marks"], f["segments"], f["replay_s"],
                f" after a snapshot of {f['snapshot_nodes']:.0f} nodes (loaded in {f['snapshot_load_ms']:.0f} ms)"
                if f["snapshot_loaded"] else "",
                f"; SKIPPED {f['damaged_ranges']:.0f} damaged ranges ({f['damaged_bytes']:.0f} bytes, at least "
                f"{f['damaged_records']:.0f} records) and {f['invalid_records']:.0f} invalid records" if damage else "")
        return self.replay

    # -- writing -------------------------------------------------------------------------------
    async def append(self, record: list) -> None:
        """Write one record; returns once it is durable (raises StoreError when it is refused)."""
        await self.submit(record)

    def submit(self, record: list) -> asyncio.Future:
        """Queue one record; the future completes once it is durable, or fails at once with
        StoreError when the store already holds max_pending_bytes not yet written."""
        fut = self._loop_now().create_future()
        self._enqueue(frame(record), fut)
        return fut

    def append_nowait(self, record: list) -> None:
        """For records nothing waits on (inventories): durable with the next group (outside the
        event loop: queued for the next group that runs on it)."""
        try:
            self._loop_now()
        except RuntimeError:
            self._loop = None
        self._enqueue(frame(record), None)

    def append_defs(self, node_id: str, table: bytes) -> None:
        """A SeriesTable of `node_id` as received (its bytes), logged in order with the batches:
        queued now and durable with the next group, so before any batch submitted after it is
        acknowledged. StoreError when the store refuses it (closed, or max_pending_bytes held):
        the stream must end then, as a later batch needing it would be stored without it (the
        agent sends every definition again on its next stream)."""
        try:
            self._loop_now()
        except RuntimeError:
            self._loop = None
        refused = self._enqueue(frame(["d", node_id, table]), None)
        if refused is not None:
            raise refused

    def barrier(self) -> asyncio.Future:
        """A future that completes once everything queued before it is durable."""
        fut = self._loop_now().create_future()
        if not self._pending and not self._busy:
            fut.set_result(None)
        else:
            self._pending.append((b"", fut))
        return fut

    # -- what a snapshot covers (snapshot_taker.py) ---------------------------------------------
    def track(self, durable: asyncio.Future, node_id: str, boot_id: str, seq: int) -> None:
        """A batch submitted (its record written at or after what is durable now), not applied yet."""
        self.inflight[durable] = (node_id, boot_id, seq, self.durable)

    def untrack(self, durable: asyncio.Future) -> None:
        """The batch was applied to the fleet state, or will never be (its write was refused)."""
        self.inflight.pop(durable, None)

    def covered(self) -> tuple[int, int]:
        """A position every record not applied to the fleet state yet is at or after."""
        return min([self.durable, *(e[3] for e in self.inflight.values())])

    def unapplied(self) -> dict[str, dict[str, int]]:
        """node -> boot -> the lowest seq accepted but not applied yet."""
        out: dict[str, dict[str, int]] = {}
        for nid, boot, seq, _ in self.inflight.values():
            boots = out.setdefault(nid, {})
            boots[boot] = min(seq, boots.get(boot, seq))
        return out

    def snapshot_written(self, pos: tuple[int, int]) -> None:
        self.snapshot_floor = self.snapshots.prune()
        if self.snapshot_floor is None or self.snapshot_floor > pos:   # pruned by someone else meanwhile
            self.snapshot_floor = pos
        self._retire()

    def _loop_now(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    def records_durable(self) -> int:
        """Records queued since start that are on disk now (not queued or being written)."""
        return self.records - len(self._pending) - len(self._inflight)

    def held_bytes(self) -> int:
        return self._pending_bytes + self._inflight_bytes

    def has_room(self, nbytes: int) -> bool:
        held = self.held_bytes()
        return held == 0 or held + nbytes <= self.max_pending_bytes

    async def wait_room(self, nbytes: int) -> None:
        """Return once a record of about `nbytes` fits under max_pending_bytes (at once, usually;
        nbytes 0, size unknown: once what is held is at most the bound, which the record may pass).
        The server waits here before it takes a batch, so a slow or failing disk holds streams
        back (gRPC flow control reaches the agents, which keep their batches) instead of ending them."""
        if self.has_room(nbytes):
            return
        self.room_waits += 1
        if not self._waiting_logged:
            self._waiting_logged = True
            log.warning("store %s holds %d bytes not yet on disk ([store] max_pending_bytes %d%s): streams are "
                        "not read until there is room; agents keep their batches (counted: room_waits)",
                        self.dir, self.held_bytes(), self.max_pending_bytes,
                        f"; the disk: {self.failing}" if self.failing else "; the disk is slower than ingest")
        while not self.has_room(nbytes):
            fut = self._loop_now().create_future()
            self._room.append(fut)
            await fut

    def _enqueue(self, data: bytes, fut: asyncio.Future | None) -> StoreError | None:
        """Queue a framed record; the StoreError it was refused with, or None."""
        held = self.held_bytes()
        if self._closed or (held and held + len(data) > self.max_pending_bytes):
            return self._refuse(data, fut, held)
        self._pending.append((data, fut))
        self._pending_bytes += len(data)
        self.records += 1
        self.max_held_bytes = max(self.max_held_bytes, held + len(data))
        if not self._busy and not self.failing and self._loop is not None:
            self._kick_soon()
        return None

    def _refuse(self, data: bytes, fut: asyncio.Future | None, held: int) -> StoreError:
        self.refused_records += 1
        self.refused_bytes += len(data)
        why = "it is closed" if self._closed else (
            f"it holds {held} bytes not yet on disk ([store] max_pending_bytes {self.max_pending_bytes}; "
            + (f"the disk: {self.failing})" if self.failing else "the disk is slower than ingest)"))
        if not self._refusing:
            self._refusing = True
            log.warning("store %s refuses new records, %s: their streams end with UNAVAILABLE and agents "
                        "resend them later (counted: refused_records)", self.dir, why)
        err = StoreError(f"the collector's store cannot take more now: {why}; retry later")
        if fut is not None:
            fut.set_exception(err)
        return err

    def _kick_soon(self) -> None:
        """Begin a group commit now, or once commit_interval_s has passed since the last one began."""
        if self._kick_timer is not None:
            return
        assert self._loop is not None
        wait = self._kicked_at + self.commit_interval_s - time.monotonic()
        if wait <= 0:
            self._kick()
            return
        self.commit_waits += 1
        self._kick_timer = self._loop.call_later(wait, self._kick_timed)

    def _kick_timed(self) -> None:
        self._kick_timer = None
        if self._pending and not (self._closed or self._busy or self.failing):
            self._kick()

    def _kick(self) -> None:
        assert self._loop is not None
        self._kicked_at = time.monotonic()
        group, self._pending = self._pending, []
        self._inflight, self._inflight_bytes, self._pending_bytes = group, self._pending_bytes, 0
        io = self._io
        roll: tuple[bytes, list] | None = None
        if io.fd < 0 or io.broken or (not self.failing and (
                io.off > self.segment_bytes or time.monotonic() - io.opened_at > self.segment_s)):
            roll = self._roll_records()
        self._busy = True
        self._io_task = self._pool.submit(self._write, b"".join(d for d, _ in group), roll)
        asyncio.wrap_future(self._io_task, loop=self._loop).add_done_callback(self._done)

    def _done(self, task: asyncio.Future) -> None:
        self._busy = False
        group, self._inflight = self._inflight, []
        held, self._inflight_bytes = self._inflight_bytes, 0
        exc = StoreError("write cancelled") if task.cancelled() else task.exception()
        if exc is None:
            rolled = task.result()[0] != self.durable[0]
            self.durable = task.result()
            self.commits += 1
            if self.failing:
                log.warning("store %s is writable again after %.1f s: %d records held were written; "
                            "acknowledging again", self.dir, time.monotonic() - self.failing_since, len(group))
                self.failing = ""
                self._notify()
            if self._refusing and self.held_bytes() < self.max_pending_bytes // 2:
                self._refusing = False
                log.info("store %s takes new records again (%d refused so far)", self.dir, self.refused_records)
            for _, fut in group:
                _settle(fut, None)
            waiting, self._room = self._room, []
            for fut in waiting:
                _settle(fut, None)   # each checks again for room
            if self._waiting_logged and self.held_bytes() < self.max_pending_bytes // 2:
                self._waiting_logged = False
            if rolled:
                self._retire()
            if self._pending and not self._closed:
                self._kick_soon()
            return
        # Nothing of the group is on disk: it goes back to the front of the queue, tried again later.
        self.write_errors += 1
        self._pending[:0] = group
        self._pending_bytes += held
        why = why_failed(exc)
        if not self.failing:
            self.unwritable_episodes += 1
            self.failing_since = time.monotonic()
            log.error("store %s cannot be written: %s. Holding %d bytes in memory (at most %d, [store] "
                      "max_pending_bytes); nothing is acknowledged until it is on disk; trying again every "
                      "%.1f s", self.dir, why, self.held_bytes(), self.max_pending_bytes, self.retry_s)
            self.failing = why
            self._notify()
        elif why != self.failing:
            log.error("store %s still cannot be written, now: %s", self.dir, why)
            self.failing = why
        if not self._closed:
            assert self._loop is not None
            self._retry = self._loop.call_later(self.retry_s, self._try_again)

    def _roll_records(self) -> tuple[bytes, list]:
        """What a new segment begins with: where the previous one ended, and a checkpoint (every
        node's inventory and marks; and the series definitions of every boot held, as taken here
        on the loop, encoded by `_write` in the I/O thread)."""
        io = self._io
        seal = [frame(["s", io.seg_id, io.off])] if io.seg_id else []
        defs: list = self._tables.take(self.dictionary) if self.dictionary is not None else []
        return b"".join(seal + [frame(list(r)) for r in self._checkpoint()]), defs

    def _write(self, data: bytes, roll: tuple[bytes, list] | None) -> tuple[int, int]:
        """In the I/O thread (or at close, after it): one write, and a new segment first with `roll`."""
        return self._io.write(data, None if roll is None else roll[0] + self._tables.records(roll[1]))

    def _try_again(self) -> None:
        self._retry = None
        if self._closed or self._busy:
            return
        self._retire()   # an outage may outlast the history kept: deleting old segments frees space
        self._kick()

    def _notify(self) -> None:
        for fn in self.on_change:
            try:
                fn(not self.failing)
            except Exception:
                log.exception("store state watcher failed")

    def retire(self) -> None:
        """Delete what retention lets go of now (a period without a snapshot: segments age meanwhile)."""
        self._retire()

    def _retire(self) -> None:
        """Delete segments wholly older than the history kept (a newer segment's checkpoint
        carries their inventories and marks), unless a reader (an exporter) has not read them, or,
        with snapshots on, the oldest snapshot kept does not cover them (a damaged newest one falls
        back to it and replays the log after it)."""
        cutoff = time.time() - self.history_s - self.segment_s
        keep_from = min((r.cursor[0] for r in self.readers.values()), default=self.durable[0])
        if self.snapshotter is not None:
            keep_from = min(keep_from, self.snapshot_floor[0] if self.snapshot_floor else 0)
        try:
            listed = segments(self.dir)
        except OSError as e:
            log.warning("store %s: cannot list the segments (%s): none deleted", self.dir, e.strerror)
            return
        for sid, path in listed:
            if sid >= min(keep_from, self.durable[0]):
                break
            try:
                if os.path.getmtime(path) < cutoff:
                    os.unlink(path)
            except OSError:
                pass

    def stats(self) -> dict[str, float]:
        """Counters and states, for metrics (metrics.py) and status."""
        readers = list(self.readers.values())
        return {"writable": 0 if self.failing else 1, "unwritable_episodes": self.unwritable_episodes,
                "write_errors": self.write_errors, "held_bytes": self.held_bytes(),
                "max_held_bytes": self.max_held_bytes, "max_pending_bytes": self.max_pending_bytes,
                "refused_records": self.refused_records, "refused_bytes": self.refused_bytes,
                "room_waits": self.room_waits,
                "commits": self.commits, "commit_waits": self.commit_waits, "records": self.records,
                "log_bytes_written": self._io.bytes_written,
                "reader_skipped_ranges": sum(r.skipped_ranges for r in readers),
                "reader_unexpanded_batches": sum(r.unexpanded for r in readers),
                **{(k if k.startswith("snapshot") else f"replay_{k}"): v for k, v in self.replay.items()
                   if k != "replay_s"},
                "replay_ms": round(self.replay.get("replay_s", 0) * 1000),
                **(self.snapshotter.stats() if self.snapshotter is not None else {})}

    def close(self) -> None:
        """Called once the event loop has stopped: what is still queued is written if it can be
        (it was never acknowledged; agents resend it and the resend counts as a duplicate)."""
        self._closed = True
        if self.snapshotter is not None:
            self.snapshotter.close()
        if self._retry is not None:
            self._retry.cancel()
        if self._kick_timer is not None:
            self._kick_timer.cancel()
        self._pool.shutdown(wait=True)
        left = self._pending
        t = self._io_task
        if self._busy and not (t is not None and t.done() and not t.cancelled() and t.exception() is None):
            left = self._inflight + left   # the loop stopped before it heard how that write went: it failed
        data = b"".join(d for d, _ in left)
        if data:
            io = self._io
            try:
                self._write(data, self._roll_records() if io.fd < 0 or io.broken else None)
            except OSError as e:
                log.error("store %s closed with %d records (%d bytes) not on disk (%s): they were never "
                          "acknowledged; agents resend them", self.dir, len(left), len(data), why_failed(e))
        self._io.close()


def _settle(fut: asyncio.Future | None, err: Exception | None) -> None:
    if fut is None or fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
