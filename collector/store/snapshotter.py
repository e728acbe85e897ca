"""Taking snapshots of the fleet state while the collector serves, without stalling ingest.

Every `[store] snapshot_every_s` (and once more on a clean stop) the collector writes a snapshot
(snapshot.py). The position it covers is fixed first: what is durable, or earlier, down to the
lowest position of a batch accepted but not applied yet (Store.covered()). Then the nodes are
captured on the event loop a chunk at a time (about `chunk_series` series: the history arrays are
copied as bytes, milliseconds a chunk) and each chunk is packed, checksummed and written by a
worker thread of the snapshotter's own while the loop goes on serving; the next chunk is captured
once the last one is written, so a snapshot holds at most one chunk in memory besides the state.
A failed write (full disk) removes the temporary file, is counted and logged, and is tried again at
the next period: the log is kept meanwhile, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from . import image
from .snapshot import SnapshotFile

log = logging.getLogger("xpusense.collector.store")


class Snapshotter:
    def __init__(self, store, state, every_s: float, chunk_series: int = 2000):
        self.store, self.state = store, state
        self.every_s = every_s
        self.chunk_series = chunk_series
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="store-snapshot")
        self._lock: asyncio.Lock | None = None   # one snapshot at a time (made on the loop)
        self.written = 0
        self.failures = 0
        self.last: dict[str, float] = {}
        store.snapshotter = self

    async def run(self, stop: asyncio.Event) -> None:
        """Every every_s until `stop` is set (the snapshot on stop is the caller's: take())."""
        while True:
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
                return
            except TimeoutError:
                pass
            await self.take("periodic")

    async def take(self, why: str) -> str | None:
        """Write one snapshot (after the one being written, if any); its path, or None when it failed."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._take(why)

    async def _take(self, why: str) -> str | None:
        loop = asyncio.get_running_loop()
        t0, cpu_loop = time.monotonic(), 0.0
        f = None
        try:
            pos = self.store.covered()
            f = await loop.run_in_executor(self._pool, SnapshotFile, self.store.snapshots.dir, pos, self.store.fsync)
            await loop.run_in_executor(self._pool, f.add, ["f", image.fleet(self.state)])
            ids = list(self.state.nodes)
            i = 0
            while i < len(ids):
                c0 = time.perf_counter()
                unapplied = self.store.unapplied()
                chunk, size = [], 0
                while i < len(ids) and size < self.chunk_series:
                    n = self.state.nodes.get(ids[i])
                    i += 1
                    if n is not None:
                        chunk.append(image.node(n, unapplied.get(n.node_id)))
                        size += len(n.series) + 1
                cpu_loop += time.perf_counter() - c0
                await loop.run_in_executor(self._pool, f.add, ["n", chunk])
                chunk = []
            path = await loop.run_in_executor(self._pool, f.finish)
        except Exception as e:   # a full or failing disk: the log is kept; tried again next period
            self.failures += 1
            log.warning("store snapshot (%s) not written: %r; the log is kept and replayed from the last good "
                        "snapshot (counted: snapshot_failures)", why, e)
            if f is not None:
                await loop.run_in_executor(self._pool, f.abort)
            return None
        self.written += 1
        self.store.snapshot_written(pos)
        self.last = {"snapshot_bytes": f.bytes, "snapshot_nodes_written": f.nodes,
                     "snapshot_write_ms": round((time.monotonic() - t0) * 1000),
                     "snapshot_loop_ms": round(cpu_loop * 1000)}
        log.info("store snapshot (%s) %s: %d nodes, %.1f MB, covers segment %d byte %d; %.2f s (%.0f ms of it on "
                 "the event loop)", why, path, f.nodes, f.bytes / 1e6, pos[0], pos[1], time.monotonic() - t0,
                 cpu_loop * 1000)
        return path

    def stats(self) -> dict[str, float]:
        return {"snapshots_written": self.written, "snapshot_failures": self.failures, **self.last}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
