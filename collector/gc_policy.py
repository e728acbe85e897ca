"""The collector processes' garbage-collection policy: keep the cyclic collector's pauses out of
ack and Place latency (the single collector, a cluster gateway, a scheduler replica), by freezing
what is long-lived, and reclaiming an ended stream's garbage cycles soon after it ends.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("xpusense.collector.gc")

FREEZE_EVERY_S = 0.1
SWEEP_EVERY_S = 3600.0


def sweep(why: str) -> int:
    """One full collection of everything, frozen or not (gc.unfreeze, collect, freeze): the one long
    pause of this policy, logged with `why`. The objects freed."""
    started = time.process_time()
    gc.unfreeze()
    freed = gc.collect()
    gc.freeze()
    log.info("garbage collector sweep (%s): %d objects freed in %.0f ms of CPU, %d kept", why, freed,
             1e3 * (time.process_time() - started), gc.get_freeze_count())
    return freed


async def freeze_long_lived(stop: asyncio.Event | None = None, every_s: float = FREEZE_EVERY_S,
                            sweep_s: float = SWEEP_EVERY_S, postpone: Callable[[], bool] | None = None) -> None:
    """The policy, until `stop` is set (or the task is cancelled); the thresholds and the frozen
    objects are given back at the end.

    These processes hold up to millions of long-lived objects (the fleet state, a gateway's streams,
    a replica's index) and make ~100 short-lived ones a node a second; with CPython's defaults every
    collection walks all of them, and full ones ran several times a minute, each a pause of up to
    hundreds of ms (bench/collector_ingest.py, bench/fleet_scale.py). So:
    - every `every_s` whatever is alive is frozen (gc.freeze, O(1)): a collection never finds more
      than `every_s` of new objects; reference counting still frees everything that is not a cycle;
    - the automatic full collections are off; the young generations are collected as CPython decides;
    - a cycle that became garbage before a freeze is kept until the next sweep (every `sweep_s`).
      The one that matters in the single collector, an aborted stream's last message, is freed by
      `Reclaim`, and nothing is frozen while one of its runs is due (`postpone`)."""
    stop = stop or asyncio.Event()
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(t0, t1, 2**30)
    last_sweep = time.monotonic()
    try:
        while not stop.is_set():
            if time.monotonic() - last_sweep >= sweep_s:
                last_sweep = time.monotonic()
                sweep("every %.0f s" % sweep_s)
            elif postpone is None or not postpone():
                gc.freeze()
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass
    finally:
        gc.unfreeze()
        gc.set_threshold(t0, t1, t2)


class Reclaim:
    """Collect garbage cycles soon after a stream ended: an aborted call's exception and traceback
    keep its frames, and the last message read, in a cycle that reference counting does not free.
    Twice: `delay_s` after the end, and `late_s` after that (gRPC may still hold the call then),
    again if another stream ended meanwhile. Cheap where the long-lived state is frozen: only what
    is not frozen yet is looked at."""

    waiting = 0   # instances with runs due, in this process

    def __init__(self, delay_s: float = 0.05, late_s: float = 1.0, deep_every_s: float = 30.0):
        self.delay_s, self.late_s, self.deep_every_s = delay_s, late_s, deep_every_s
        self.pending = False   # runs are due
        self.again = False     # a stream ended after the first run
        self.runs = 0
        # A message read before a freeze is frozen with everything else alive then: after a stream
        # the collector aborted (a refused batch, often a large one), the late run is a sweep of
        # everything (~0.4 s of CPU at 1,000 nodes), at most every `deep_every_s`, counted in
        # `deep_runs`: a client refused again and again costs that pause that often, and its refused
        # messages are held at most that long.
        self.deep_wanted = False   # an aborted stream ended since the last sweep
        self.deep_runs = 0
        self.deep_last = -deep_every_s
        self.deep_timer: asyncio.TimerHandle | None = None

    def soon(self, aborted: bool = False) -> None:
        self.deep_wanted |= aborted
        if self.pending:
            self.again = True
            return
        self.pending = True
        Reclaim.waiting += 1
        asyncio.get_running_loop().call_later(self.delay_s, self._run, True)

    def _run(self, first: bool) -> None:
        self.runs += 1
        if not first and self.deep_wanted:
            self._deep()
        else:
            gc.collect()
        if first or self.again:
            self.again = False
            asyncio.get_running_loop().call_later(self.late_s, self._run, False)
        else:
            self.pending = False
            Reclaim.waiting -= 1

    def _deep(self) -> None:
        if not gc.get_freeze_count():   # nothing frozen (no freeze policy in this process)
            self.deep_wanted = False
            gc.collect()
            return
        loop = asyncio.get_running_loop()
        wait = self.deep_last + self.deep_every_s - loop.time()
        if wait > 0:
            gc.collect()
            if self.deep_timer is None:
                self.deep_timer = loop.call_later(wait, self._deep_due)
            return
        self.deep_wanted, self.deep_last = False, loop.time()
        self.deep_runs += 1
        sweep("after an aborted stream")

    def _deep_due(self) -> None:
        self.deep_timer = None
        if self.deep_wanted:
            self._deep()


def reclaim_pending() -> bool:
    """Whether a collection after a stream's end is due: garbage that a freeze now would keep."""
    return Reclaim.waiting > 0
