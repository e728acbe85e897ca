"""Marks: what the cluster has stored per node and agent boot, the `stored_up_to` of the Welcome
(Marks, in the `marks` KV bucket), and SeqWindow, the downstream side of exactly once. A mark may
lag behind the stream (a gateway killed between writes: the agent resends a little, and JetStream's
duplicate window or SeqWindow drops it), and is never ahead of it: it is raised only after the
publish ack."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time

import nats.js.errors

from .subjects import mark_key

log = logging.getLogger("xpusense.collector.cluster")


MAX_ROSE_AT = 100_000   # boots whose mark's time is remembered after their stream ended


class _Mark:
    __slots__ = ("seq", "written", "revision", "task", "spread", "due", "rose_at")

    def __init__(self, seq: int, revision: int, rose_at: float = 0.0):
        self.seq, self.written, self.revision = seq, seq, revision
        self.rose_at = rose_at   # when (time.monotonic) seq rose or was first read here
        self.task: asyncio.Task | None = None
        self.spread = True   # its first write waits a random share of flush_s (then flush_s each)
        self.due = 0.0       # when (loop time) its next write was set for


class Marks:
    """A gateway reads a boot's mark from the bucket when the agent says Hello, raises it in memory
    as JetStream acknowledges each batch, and writes it back every `flush_s` and when the stream ends
    (a boot's first write after a random share of `flush_s`, so that agents that all said Hello
    together do not write their marks in the same second), with compare-and-set on the key's
    revision so a slower gateway never lowers what a faster one wrote.

    For limits.py's bound on sequence numbers (`seq_mark`): when a boot's mark rose, on this
    gateway's clock: when it raised it, or when it first read it (the bucket keeps no time; the
    first read is a bound no looser). That time is remembered past the stream's end for the last
    MAX_ROSE_AT boots, so an agent refused for a seq too far ahead is let in once enough time has
    passed, whatever its reconnects."""

    def __init__(self, kv, flush_s: float = 5.0, rng: random.Random | None = None, clock=time.monotonic):
        self.kv = kv
        self.flush_s = flush_s
        self.rng = rng or random.Random()
        self.clock = clock
        self.marks: dict[tuple[str, str], _Mark] = {}
        self.rose_at: collections.OrderedDict[tuple[str, str], tuple[int, float]] = collections.OrderedDict()
        self.writes = 0

    async def get(self, node_id: str, boot_id: str) -> int:
        """The boot's mark as the bucket has it now (0: nothing stored), remembered from here on."""
        seq, rev = await self._read(node_id, boot_id)
        m = self.marks.get((node_id, boot_id))
        if m is None:
            m = self.marks[(node_id, boot_id)] = _Mark(seq, rev, self._first_seen(node_id, boot_id, seq))
        elif seq > m.seq or rev > m.revision:
            if seq > m.seq:
                m.rose_at = self._first_seen(node_id, boot_id, seq)
            m.seq, m.written, m.revision = max(m.seq, seq), max(m.written, seq), rev
        return m.seq

    def _first_seen(self, node_id: str, boot_id: str, seq: int) -> float:
        """When this gateway first knew the boot's mark at `seq` (now, unless remembered)."""
        known = self.rose_at.get((node_id, boot_id))
        return known[1] if known is not None and known[0] == seq else self.clock()

    def seq_mark(self, node_id: str, boot_id: str) -> tuple[int, float] | None:
        """The boot's mark and the seconds since it rose (limits.Stored); None: nothing stored
        (or not read here yet: the gateway reads a boot's mark before its first batch is checked)."""
        m = self.marks.get((node_id, boot_id))
        seq, at = (m.seq, m.rose_at) if m is not None else self.rose_at.get((node_id, boot_id), (0, 0.0))
        return (seq, self.clock() - at) if seq else None

    async def _read(self, node_id: str, boot_id: str) -> tuple[int, int]:
        try:
            entry = await self.kv.get(mark_key(node_id, boot_id))
        except nats.js.errors.KeyDeletedError as gone:   # expired: written again over its tombstone
            return 0, (gone.entry.revision or 0) if gone.entry is not None else 0
        except nats.js.errors.KeyNotFoundError:
            return 0, 0
        try:
            return int(entry.value or b"0"), entry.revision or 0
        except ValueError:
            return 0, entry.revision or 0

    def raised(self, node_id: str, boot_id: str, seq: int) -> None:
        """JetStream acknowledged batch `seq`: the mark is at least that; written within flush_s."""
        m = self.marks.get((node_id, boot_id))
        if m is None:
            m = self.marks[(node_id, boot_id)] = _Mark(0, 0)
        if seq > m.seq:
            m.seq, m.rose_at = seq, self.clock()
            if m.task is None:
                delay = self.flush_s
                if m.spread:
                    m.spread, delay = False, self.flush_s * self.rng.random()
                loop = asyncio.get_running_loop()
                m.due = loop.time() + delay
                m.task = loop.create_task(self._write_later(node_id, boot_id, m, delay))

    async def _write_later(self, node_id: str, boot_id: str, m: _Mark, delay: float | None = None) -> None:
        try:
            await asyncio.sleep(self.flush_s if delay is None else delay)
            await self._write(node_id, boot_id, m)
        except asyncio.CancelledError:
            m.task = None
            raise
        m.task = None
        if m.seq > m.written:   # raised while writing, or the cluster did not answer: once more
            m.task = asyncio.get_running_loop().create_task(self._write_later(node_id, boot_id, m))

    async def flush_all(self, timeout_s: float | None = None) -> int:
        """Write every raised mark now (the gateway is stopping), for at most `timeout_s` (None: no
        bound; with the cluster gone a write tries 5 times, each a publish timeout). The marks not
        written: their agents resend what followed them, dropped downstream by message id or
        SeqWindow."""
        writes = [asyncio.ensure_future(self.flush(n, b)) for (n, b), m in list(self.marks.items())
                  if m.seq > m.written]
        if not writes:
            return 0
        done, late = await asyncio.wait(writes, timeout=timeout_s)
        for t in late:
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)   # their cancellations taken before this returns
        return len(late) + sum(1 for t in done if t.exception() is not None)

    async def flush(self, node_id: str, boot_id: str) -> None:
        """Write the boot's mark now (the stream ended); then forget it here."""
        m = self.marks.get((node_id, boot_id))
        if m is None:
            return
        if m.task is not None:
            m.task.cancel()
            m.task = None
        try:
            await self._write(node_id, boot_id, m)
        finally:
            if self.marks.get((node_id, boot_id)) is m and m.task is None:
                del self.marks[(node_id, boot_id)]
                self.rose_at[(node_id, boot_id)] = (m.seq, m.rose_at)
                self.rose_at.move_to_end((node_id, boot_id))
                while len(self.rose_at) > MAX_ROSE_AT:
                    self.rose_at.popitem(last=False)

    async def _write(self, node_id: str, boot_id: str, m: _Mark) -> None:
        key = mark_key(node_id, boot_id)
        for _ in range(5):
            seq = m.seq
            if seq <= m.written:
                return
            try:
                m.revision = await self.kv.update(key, str(seq).encode(), last=m.revision)
                m.written = seq
                self.writes += 1
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                have, rev = await self._read(node_id, boot_id)   # another gateway wrote it: only ever up
                m.revision = rev
                if have >= seq:
                    m.written = m.seq = max(m.seq, have)
                    return
            except (nats.errors.TimeoutError, nats.js.errors.APIError, nats.js.errors.ServiceUnavailableError) as e:
                log.debug("marks: writing %s: %s", key, e)
                await asyncio.sleep(0.5)


class SeqWindow:
    """Which sequence numbers of one (node, boot) were taken: `take(seq)` is True the first time.
    The highest seen and which of the `span` below it were seen, so that batches arriving out of
    order (a publish retried after a leader change lands after its successors) are taken once each.
    `at`: when `high` rose (the stream's time, ns; for limits.py's bound on sequence numbers)."""

    __slots__ = ("high", "seen", "span", "at")

    def __init__(self, high: int = 0, span: int = 1024, at: int = 0):
        # bit i of seen: high - i was taken; a window restored at `high` took everything up to it
        self.high, self.span, self.at = high, span, at
        self.seen = (1 << span) - 1 if high else 0

    def take(self, seq: int, at: int = 0) -> bool:
        if seq > self.high:
            shift = seq - self.high
            self.seen = ((self.seen << shift) | 1) & ((1 << self.span) - 1) if shift < self.span else 1
            self.high, self.at = seq, at
            return True
        back = self.high - seq
        if back >= self.span or self.seen >> back & 1:
            return False
        self.seen |= 1 << back
        return True
