"""The collector's durable store: an append-only log of everything it acknowledges.

A batch is acknowledged only after its record is written and fsync'ed (group commit: one fsync
covers every batch that arrived while the previous one ran, so durability costs latency, not
throughput). On start the log is replayed into the fleet state: latest values, history,
inventories, events and the per-(node, boot) sequence marks that keep a resent batch from being
stored twice.

Layout: segment files `NNNNNNNN.log` in `data_dir`, each a sequence of msgpack records:
  ["i", node_id, boot_id, inventory_bytes]   a node's inventory (Hello or change)
  ["m", node_id, boot_id, seq]               a sequence mark (checkpoint)
  ["b", batch_bytes]                         a stored Batch, whole
A new segment is started every `segment_s` or `segment_bytes` and begins with a checkpoint (every
node's inventory and marks), so a segment older than the history kept (`history_s`) can be deleted
without losing what the state needs. A torn record at the end (a crash mid-write) was never
acknowledged and is skipped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

import msgpack

from xpusense.v1 import telemetry_pb2 as pb

log = logging.getLogger("xpusense.collector.store")


class StoreError(Exception):
    pass


def segments(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".log"))


def read_records(path: str) -> Iterator[list]:
    """The records of one segment, stopping at a torn tail."""
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=256 * 2**20)
        try:
            yield from unpacker
        except (ValueError, msgpack.UnpackException) as e:
            log.warning("%s: unreadable record (%s): the rest of this segment is skipped", path, e)


def stored_batches(directory: str) -> Iterator[pb.Batch]:
    """Every batch record in the store, oldest first (for tests and audits)."""
    for path in segments(directory):
        for rec in read_records(path):
            if rec and rec[0] == "b":
                yield pb.Batch.FromString(rec[1])


class Store:
    """Written from the collector's event loop thread; fsync runs in a worker thread, one at a time,
    and covers every record written before it started (group commit)."""

    def __init__(self, directory: str, history_s: float = 900.0, segment_s: float = 60.0,
                 segment_bytes: int = 64 * 2**20, fsync: bool = True):
        self.dir = directory
        self.history_s = history_s
        self.segment_s = segment_s
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-fsync")
        self._f: BinaryIO | None = None
        self._seg_id = 0
        self._seg_size = 0
        self._seg_started = 0.0
        self._checkpoint: Callable[[], list[tuple]] = lambda: []
        self._waiting: list[asyncio.Future] = []
        self._syncing = False
        # (segment id, offset) up to which everything is fsync'ed: readers never go past it.
        self.durable: tuple[int, int] = (0, 0)
        self.readers: dict[str, StoreReader] = {}
        self.commits = 0
        self.records = 0
        self.failed: str = ""

    # -- start: replay -------------------------------------------------------------------------
    def open(self, state) -> dict:
        """Replay the log into `state` (a FleetState) and open a new segment. Returns replay figures."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, ".write-test")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.unlink(probe)
        except OSError as e:
            raise StoreError(f"data_dir {self.dir!r} is not writable ({e.strerror}); set --data-dir / "
                             f"data_dir to a writable directory") from None
        t0 = time.monotonic()
        figures: dict[str, float] = {"segments": 0, "batches": 0, "inventories": 0, "marks": 0}
        for path in segments(self.dir):
            figures["segments"] += 1
            for rec in read_records(path):
                kind = rec[0] if rec else None
                if kind == "b":
                    b = pb.Batch.FromString(rec[1])
                    state.ingest(b, now_ns=b.sent_unix_nano or None)
                    figures["batches"] += 1
                elif kind == "i":
                    state.restore_inventory(rec[1], rec[2], pb.Inventory.FromString(rec[3]))
                    figures["inventories"] += 1
                elif kind == "m":
                    key = (rec[1], rec[2])
                    state.known_marks[key] = max(state.known_marks.get(key, 0), int(rec[3]))
                    figures["marks"] += 1
        # Marks of batches replayed count as known too (a node that reconnects after a restart).
        for nid, n in state.nodes.items():
            n.streams = 0
            for boot, seq in n.stored_up_to.items():
                state.known_marks[(nid, boot)] = max(state.known_marks.get((nid, boot), 0), seq)
        figures["replay_s"] = round(time.monotonic() - t0, 3)
        self._checkpoint = state.checkpoint
        existing = segments(self.dir)
        self._seg_id = int(os.path.basename(existing[-1])[:-4]) if existing else 0
        self._roll()
        if figures["segments"]:
            log.info("store %s replayed: %s", self.dir, figures)
        return figures

    # -- writing -------------------------------------------------------------------------------
    async def append(self, record: list) -> None:
        """Write one record; returns once it is durable (raises StoreError when it cannot be)."""
        await self.submit(record)

    def submit(self, record: list) -> asyncio.Future:
        """Write one record now; the future completes when it is durable (or fails with StoreError)."""
        fut = asyncio.get_running_loop().create_future()
        try:
            self._write(msgpack.packb(record, use_bin_type=True))
        except StoreError as e:
            fut.set_exception(e)
            return fut
        self._waiting.append(fut)
        if not self._syncing:
            self._sync()
        return fut

    def append_nowait(self, record: list) -> None:
        """For records nothing waits on (inventories): made durable by the next group's fsync."""
        try:
            self._write(msgpack.packb(record, use_bin_type=True))
        except StoreError:
            pass  # logged; the inventory comes again with the next Hello

    def _write(self, data: bytes) -> None:
        try:
            if self._f is None or (not self._syncing and (
                    self._seg_size > self.segment_bytes or time.monotonic() - self._seg_started > self.segment_s)):
                self._roll()
            assert self._f is not None   # _roll() opened a segment (or raised)
            self._f.write(data)
            self._seg_size += len(data)
            self.records += 1
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        err = StoreError(f"cannot write to the store in {self.dir}: {e.strerror}")
        if self.failed != str(err):
            log.error("%s; batches are not acknowledged, agents keep them and resend", err)
        self.failed = str(err)
        # The segment may end in a partial record: the next write starts a new one.
        if self._f is not None and not self._syncing:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None
        raise err from None

    def _sync(self) -> None:
        group, self._waiting = self._waiting, []
        f = self._f
        try:
            if f is None:   # closed (close(), or a failed write) while the previous fsync ran
                raise OSError(errno.EBADF, "the segment is closed")
            f.flush()
        except OSError as e:
            err = StoreError(f"cannot write to the store in {self.dir}: {getattr(e, 'strerror', e)}")
            self.failed = str(err)
            for fut in group:
                _settle(fut, err)
            return
        if not self.fsync:
            for fut in group:
                _settle(fut, None)
            self.commits += 1
            self.durable = (self._seg_id, self._seg_size)
            return
        self._syncing = True
        loop = asyncio.get_running_loop()
        upto = (self._seg_id, self._seg_size)
        task = loop.run_in_executor(self._pool, os.fsync, f.fileno())
        task.add_done_callback(lambda t: self._synced(group, t, upto))

    def _synced(self, group: list, task: asyncio.Future, upto: tuple[int, int]) -> None:
        self._syncing = False
        exc = task.exception()
        err = StoreError(f"cannot fsync the store in {self.dir}: {getattr(exc, 'strerror', exc)}") if exc else None
        if err is None:
            self.commits += 1
            self.failed = ""
            self.durable = upto
        else:
            log.error("%s; batches are not acknowledged, agents keep them and resend", err)
            self.failed = str(err)
        for fut in group:
            _settle(fut, err)
        if self._waiting:
            self._sync()

    def _roll(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None
        self._seg_id += 1
        path = os.path.join(self.dir, f"{self._seg_id:08d}.log")
        f = open(path, "ab")
        for rec in self._checkpoint():
            f.write(msgpack.packb(list(rec), use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
        self._f = f
        self._seg_size = f.tell()
        self._seg_started = time.monotonic()
        self.durable = (self._seg_id, self._seg_size)
        self._retire()

    def _retire(self) -> None:
        """Delete segments wholly older than the history kept (the checkpoint carries the rest)."""
        cutoff = time.time() - self.history_s - self.segment_s
        keep_from = min((r.cursor[0] for r in self.readers.values()), default=self._seg_id)
        for path in segments(self.dir)[:-1]:
            if int(os.path.basename(path)[:-4]) >= keep_from:
                continue   # a reader (an exporter) has not read it yet
            try:
                if os.path.getmtime(path) < cutoff:
                    os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._f is not None:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError:
                pass
            self._f.close()
            self._f = None


class StoreReader:
    """A consumer of the store with a durable cursor (an exporter): it reads every batch stored
    after its cursor, in order, up to what is fsync'ed, and commits how far it got. Segments it has
    not read are kept, so a backend outage loses nothing (the log grows until it comes back)."""

    def __init__(self, store: Store, name: str):
        self.store = store
        self.name = name
        self.path = os.path.join(store.dir, f"cursor-{name}.json")
        try:
            with open(self.path) as f:
                seg, off = json.load(f)
            self.cursor = (int(seg), int(off))
        except (OSError, ValueError, TypeError):
            self.cursor = (0, 0)   # from the oldest segment there is
        store.readers[name] = self

    def read(self, max_batches: int = 500) -> tuple[list[pb.Batch], tuple[int, int]]:
        """Batches after the cursor (at most max_batches) and the cursor after them; commit() it
        once they are safely delivered."""
        out: list[pb.Batch] = []
        seg, off = self.cursor
        limit = self.store.durable
        for path in segments(self.store.dir):
            sid = int(os.path.basename(path)[:-4])
            if sid < seg or sid > limit[0]:
                continue
            start = off if sid == seg else 0
            end = limit[1] if sid == limit[0] else os.path.getsize(path)
            if start >= end:
                seg, off = sid, start
                continue
            with open(path, "rb") as f:
                f.seek(start)
                unpacker = msgpack.Unpacker(raw=False, max_buffer_size=256 * 2**20)
                unpacker.feed(f.read(end - start))
                pos = start
                for rec in unpacker:
                    pos = start + unpacker.tell()
                    if rec and rec[0] == "b":
                        out.append(pb.Batch.FromString(rec[1]))
                    if len(out) >= max_batches:
                        return out, (sid, pos)
            seg, off = sid, end
        return out, (seg, off)

    def commit(self, cursor: tuple[int, int]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(list(cursor), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.cursor = cursor


def _settle(fut: asyncio.Future, err: Exception | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
