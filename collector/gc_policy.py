"""The collector processes' garbage-collection policy: keep the cyclic collector's pauses out of
ack and Place latency (the single collector, a cluster gateway, a scheduler replica).

Each holds hundreds of thousands to millions of long-lived objects (the fleet state, a gateway's
streams, a replica's index) and makes ~100 short-lived ones a node a second (the scheduler index's
refreshed summaries, each stream's messages). Any collection walks every object not frozen, and
CPython starts one by allocations minus frees, which that churn leaves even. Measured with CPython's
defaults: at 1,000 agents a single collector's young collections found 120,000 objects and took
50-80 ms of CPU, the full ones 50-180 ms, more than once a second (bench/collector_ingest.py); a
gateway's full collections 110-210 ms, several a minute (bench/fleet_scale.py --ack-only); a
replica of 10,000 nodes following 1,000 updates/s, 17 full collections in 30 s of up to 580 ms,
every Place call behind one (bench/fleet_scale.py --place-only). So, in `freeze_long_lived`:
- every `every_s` whatever is alive is frozen (gc.freeze, O(1): moved out of the collector's
  reach), so a collection never finds more than `every_s` of new objects; reference counting still
  frees everything that is not a cycle, frozen or not;
- the automatic full collections are off (the third threshold out of reach); the young
  generations are collected as CPython decides;
- a cycle that became garbage before a freeze is kept until the next sweep: every `sweep_s`
  gc.unfreeze, a full collection, gc.freeze (the one long pause, logged). Such cycles are few; the
  one that matters in the single collector, an aborted stream's last message, is freed by
  server._Reclaim, and nothing is frozen while one of its runs is due (`postpone()`). A message
  that was alive at a freeze (a large batch read while the stream was young) is frozen with it,
  though: after a stream the collector aborted, _Reclaim sweeps (at most every `deep_every_s`).
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
    """The policy above, until `stop` is set (or the task is cancelled); the thresholds and the
    frozen objects are given back at the end."""
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
