"""Taking snapshots of the fleet state while the collector serves, without stalling ingest.

Every `[store] snapshot_every_s` that the log holds `snapshot_after_records` records after the last
one (or the last is `snapshot_max_s` old), and on a clean stop, a snapshot is written: so a restart
replays a bounded log, and a small fleet does not rewrite its history every few seconds. Mostly
diffs on the last full one; a full one when the last diff reached 1/DIFF_RATIO of it. Nodes
are captured on the event loop a chunk at a time and written by a worker thread meanwhile, a
periodic snapshot paced to `cpu_share` of a core so ingest keeps up; a failed write is counted,
logged and tried again next period (the log is kept meanwhile).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from . import fleet_image
from .snapshot_file import SnapshotFile
from .writer import why_failed

DIFF_RATIO = 8
DICTIONARY_CHUNK = 256   # nodes' series definitions per snapshot record

log = logging.getLogger("xpusense.collector.store")


class Snapshotter:
    def __init__(self, store, state, every_s: float, chunk_series: int = 2000, level: int = 1,
                 after_records: int = 1, max_s: float = 3600.0, cpu_share: float = 1.0):
        self.store, self.state, self.level = store, state, level
        self.cpu_share = cpu_share   # of one core, at most, while a periodic snapshot is taken
        self._stop: asyncio.Event | None = None   # once set, a snapshot under way is no longer paced
        self.every_s, self.after_records, self.max_s = every_s, after_records, max_s
        self.periods = self.skipped = 0   # periods passed; of them, without a snapshot (too little new)
        self._records_at, self._taken_at = 0, time.monotonic()   # durable records at the last snapshot
        self.chunk_series = chunk_series
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-snapshot")
        self._lock: asyncio.Lock | None = None   # one snapshot at a time (made on the loop)
        self.written = 0
        self.full_written = 0
        self.bytes_written = 0
        self.failures = 0
        self.paced_s = 0.0   # of the snapshot being (or last) written: time waited to keep to cpu_share
        # The last full snapshot written by this process: (position, id), its size, what diffs need of it.
        self.base: tuple[tuple[int, int], int] | None = None
        self.base_image: fleet_image.Base | None = None
        self.base_bytes = 0
        self.diff_bytes = 0   # of the last diff
        # The series definitions the last snapshots wrote, encoded (only the writer thread uses it).
        self.encoded: fleet_image.Encoded = {}
        self.last: dict[str, float] = {}
        store.snapshotter = self

    async def run(self, stop: asyncio.Event) -> None:
        """Every every_s until `stop` is set (the snapshot on stop is the caller's: take()). The batches
        replayed at start are in the log after the last snapshot: they count as records since it."""
        self._records_at = self.store.records_durable() - int(self.store.replay.get("batches", 0))
        self._stop = stop
        while True:
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
                return
            except TimeoutError:
                pass
            self.periods += 1
            new = self.store.records_durable() - self._records_at
            if new <= 0 or (new < self.after_records and time.monotonic() - self._taken_at < self.max_s):
                self.skipped += 1
                self.store.retire()
                continue
            await self.take("periodic", paced=True)

    async def take(self, why: str, full: bool | None = None, paced: bool = False) -> str | None:
        """Write one snapshot (after the one being written, if any); its path, or None when it failed.
        `full`: a full one, or a diff (when there is a full one to write it on); None: as the policy says.
        `paced`: its work (on the loop and in the writer thread) kept to `cpu_share` of a core, until
        the stop event of `run` is set (a snapshot at stop is not paced)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._take(why, full, paced and self.cpu_share < 1.0)

    async def _pace(self, t0: float, cpu: float) -> None:
        """Wait until `cpu` seconds of work since `t0` are at most `cpu_share` of the time passed."""
        wait = cpu / self.cpu_share - (time.monotonic() - t0)
        if wait <= 0 or (self._stop is not None and self._stop.is_set()):
            return
        w0 = time.monotonic()
        try:
            if self._stop is None:
                await asyncio.sleep(wait)
            else:
                await asyncio.wait_for(self._stop.wait(), wait)
        except TimeoutError:
            pass
        finally:
            self.paced_s += time.monotonic() - w0

    def _timed(self, fn, *args):
        """In the writer thread: fn(*args) and the CPU time it took there."""
        c0 = time.thread_time()
        out = fn(*args)
        return out, time.thread_time() - c0

    async def _take(self, why: str, full: bool | None, paced: bool) -> str | None:
        """The position covered is fixed first (Store.covered(): what is durable, down to the lowest
        batch accepted but not applied). Then nodes are captured on the loop about `chunk_series`
        series at a time, and each chunk is written by the pool before the next is captured: at
        most one chunk is held besides the state. Paced: after each chunk, a wait until the work
        so far is at most cpu_share of the time since the start."""
        loop = asyncio.get_running_loop()
        t0, cpu_loop, cpu_pool = time.monotonic(), 0.0, 0.0
        self.paced_s = 0.0
        f = None
        if full is None:
            full = self.diff_bytes * DIFF_RATIO >= self.base_bytes
        full = full or self.base is None
        base_image = None if full else self.base_image
        into = fleet_image.Base() if full else None
        records_at = self.store.records_durable()   # what this snapshot can cover at most
        try:
            pos = self.store.covered()
            f = await loop.run_in_executor(self._pool, SnapshotFile, self.store.snapshots.dir, pos, self.store.fsync,
                                           None if full else self.base, self.level)
            cpu_pool += (await loop.run_in_executor(self._pool, self._timed, f.add,
                                                    ["f", fleet_image.fleet(self.state)]))[1]
            ids = list(self.state.nodes)
            i = 0
            while i < len(ids):
                c0 = time.perf_counter()
                unapplied = self.store.unapplied()
                chunk: list[list] = []
                parts: list[bytes] = []
                size = 0
                while i < len(ids) and size < self.chunk_series:
                    n = self.state.nodes.get(ids[i])
                    i += 1
                    if n is not None:
                        chunk.append(fleet_image.capture(n, unapplied.get(n.node_id), parts, base_image, into))
                        size += len(n.series) + 1
                cpu_loop += time.perf_counter() - c0
                cpu_pool += (await loop.run_in_executor(self._pool, self._timed, f.add, ["n", chunk], parts))[1]
                chunk, parts = [], []
                if paced:
                    await self._pace(t0, cpu_loop + cpu_pool)
            c0 = time.perf_counter()
            defs = fleet_image.dictionary(self.state, base_image, into)
            cpu_loop += time.perf_counter() - c0
            encoded: fleet_image.Encoded = {} if full else self.encoded
            for j in range(0, len(defs), DICTIONARY_CHUNK):
                cpu_pool += (await loop.run_in_executor(self._pool, self._timed, self._add_dictionary, f,
                                                        defs[j:j + DICTIONARY_CHUNK], encoded))[1]
                if paced:
                    await self._pace(t0, cpu_loop + cpu_pool)
            path, cpu = await loop.run_in_executor(self._pool, self._timed, f.finish)
            cpu_pool += cpu
        except Exception as e:   # a full or failing disk: the log is kept; tried again next period
            self.failures += 1
            log.warning("store snapshot (%s) not written: %s; the log is kept and replayed from the last good "
                        "snapshot; tried again in %g s (counted: snapshot_failures)", why, why_failed(e), self.every_s)
            if f is not None:
                self._abort(f)
            return None
        self.written += 1
        self.bytes_written += f.bytes
        self._records_at, self._taken_at = records_at, time.monotonic()
        self.encoded = encoded
        if full:
            self.full_written += 1
            self.base, self.base_image, self.base_bytes, self.diff_bytes = (pos, f.id), into, f.bytes, 0
        else:
            self.diff_bytes = f.bytes
        try:
            self.store.snapshot_written(pos)   # prunes older snapshots, deletes segments it no longer needs
        except OSError as e:   # the snapshot stands; what it frees is freed after the next one
            log.warning("store snapshot (%s) written, but older snapshots and segments not pruned: %s", why, why_failed(e))
        self.last = {"snapshot_bytes": f.bytes, "snapshot_nodes_written": f.nodes, "snapshot_full": int(full),
                     "snapshot_write_ms": round((time.monotonic() - t0) * 1000),
                     "snapshot_loop_ms": round(cpu_loop * 1000),
                     "snapshot_work_ms": round((cpu_loop + cpu_pool) * 1000),
                     "snapshot_paced_ms": round(self.paced_s * 1000)}
        log.info("store snapshot (%s) %s: %d nodes, %.1f MB, %s, covers segment %d byte %d; %.2f s (%.0f ms of it on "
                 "the event loop, %.0f ms of work in all, %.0f ms paced)", why, path, f.nodes, f.bytes / 1e6,
                 "full" if full else "a diff", pos[0], pos[1], time.monotonic() - t0, cpu_loop * 1000,
                 (cpu_loop + cpu_pool) * 1000, self.paced_s * 1000)
        return path

    def _add_dictionary(self, f: SnapshotFile, rows: fleet_image.Definitions, into: fleet_image.Encoded) -> None:
        f.add(["d", fleet_image.encode_dictionary(rows, self.encoded, into)])

    def _abort(self, f: SnapshotFile) -> None:
        """Remove what a failed snapshot wrote (here, not in the pool: it may be shut down at stop;
        closing and unlinking a file take no time worth a thread). Never raises: it is an error path."""
        try:
            f.abort()
        except Exception as e:
            log.error("store snapshot %s: cannot be removed after a failed write: %s; it is never loaded (a "
                      "temporary name; removed at the next start)", f.tmp, why_failed(e))

    def stats(self) -> dict[str, float]:
        return {"snapshots_written": self.written, "snapshots_full_written": self.full_written,
                "snapshot_bytes_written": self.bytes_written, "snapshot_failures": self.failures,
                "snapshot_periods_skipped": self.skipped, **self.last}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
