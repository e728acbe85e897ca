"""gc_policy.freeze_long_lived: what is alive is frozen, no automatic full collections meanwhile, a cycle
frozen as garbage is freed by the sweep, and nothing is frozen while gc_policy.Reclaim has a run due."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

from xpusense.collector.gc_policy import Reclaim, freeze_long_lived


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """A reference cycle, garbage at once (only the collector frees it); a weak reference to it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


async def until(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return False


def test_frozen_garbage_waits_for_the_sweep_and_the_thresholds_come_back():
    before = gc.get_threshold()

    async def main() -> tuple:
        stop = asyncio.Event()
        gc.collect()
        gc.disable()   # no collection of our own in between: only what freeze_long_lived does
        try:
            task = asyncio.get_running_loop().create_task(freeze_long_lived(stop, every_s=0.01, sweep_s=3600.0))
            ref = cycle()
            frozen = await until(lambda: gc.get_freeze_count() > 0)
            during = gc.get_threshold()
            gc.collect()   # a full collection does not look at frozen objects: the cycle stays
            kept = ref() is not None
            stop.set()
            await task
        finally:
            gc.enable()
        return frozen, during, kept, ref

    try:
        frozen, during, kept, ref = asyncio.run(main())
        assert frozen, "nothing was frozen"
        assert during[:2] == before[:2] and during[2] >= 2**30, during   # automatic full collections off
        assert kept, "the frozen cycle was collected without a sweep"
        assert gc.get_threshold() == before
        # The sweep: unfreeze, collect, freeze again.
        async def sweep() -> bool:
            stop = asyncio.Event()
            task = asyncio.get_running_loop().create_task(freeze_long_lived(stop, every_s=0.01, sweep_s=0.0))
            freed = await until(lambda: ref() is None)
            stop.set()
            await task
            return freed
        assert asyncio.run(sweep()), "the sweep did not free the frozen cycle"
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_no_freeze_while_a_reclaim_is_due():
    before = gc.get_threshold()
    gc.unfreeze()
    due, asked = [True], [0]

    def postpone() -> bool:
        asked[0] += 1
        return due[0]

    async def main() -> tuple[int, int]:
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(
            freeze_long_lived(stop, every_s=0.01, sweep_s=3600.0, postpone=postpone))
        assert await until(lambda: asked[0] >= 5), "freeze_long_lived did not tick"
        while_due = gc.get_freeze_count()
        due[0] = False
        await until(lambda: gc.get_freeze_count() > 0)
        after = gc.get_freeze_count()
        stop.set()
        await task
        return while_due, after

    try:
        while_due, after = asyncio.run(main())
        assert while_due == 0, "frozen while a reclaim was due"
        assert after > 0, "not frozen once the reclaim was done"
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_reclaim_runs_twice_and_again_for_a_stream_that_ended_meanwhile(monkeypatch):
    from xpusense.collector.gc_policy import Reclaim, reclaim_pending
    # The count is per process: a collector of an earlier test whose loop was closed before its late
    # run leaves its run counted (in `serve` the process ends with its loop).
    monkeypatch.setattr(Reclaim, "waiting", 0)

    async def main() -> list:
        r = Reclaim(delay_s=0.01, late_s=0.05)
        seen = [reclaim_pending()]
        r.soon()
        seen.append(reclaim_pending())
        assert await until(lambda: r.runs == 1)
        r.soon()   # another stream ended after the first run: one more late run
        assert await until(lambda: not r.pending)
        seen += [reclaim_pending(), r.runs]
        return seen

    assert asyncio.run(main()) == [False, True, False, 3]


def test_without_a_stop_event_it_runs_until_cancelled_and_gives_everything_back():
    """As a scheduler replica runs it: cancelled at the end, the thresholds and frozen objects back."""
    async def run() -> tuple:
        before = gc.get_threshold()
        task = asyncio.get_running_loop().create_task(freeze_long_lived(every_s=0.01, sweep_s=3600.0))
        on = await until(lambda: gc.get_threshold()[2] == 2**30 and gc.get_freeze_count() > 0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return on, before, gc.get_threshold(), gc.get_freeze_count()

    try:
        on, before, after, frozen_after = asyncio.run(run())
        assert on, "full collections not turned off, or nothing frozen"
        assert after == before and frozen_after == 0
    finally:
        gc.unfreeze()


def test_after_an_aborted_stream_the_reclaim_sweeps_frozen_cycles_at_most_every_deep_every_s():
    """A cycle frozen while alive (a refused message read before a freeze) is kept by a plain
    reclaim, freed by the sweep after an aborted stream; a second aborted stream within
    deep_every_s gets a timer, not a second sweep at once."""
    async def settled(r: Reclaim) -> bool:
        return await until(lambda: not r.pending)

    def frozen_cycle() -> weakref.ref:
        """A cycle frozen while alive, garbage only after the freeze."""
        a, b = Node(), Node()
        a.other, b.other = b, a
        gc.freeze()
        return weakref.ref(a)

    async def main() -> tuple:
        r = Reclaim(delay_s=0.01, late_s=0.01, deep_every_s=3600.0)
        first = frozen_cycle()
        r.soon()                      # a stream that ended on its own: young garbage only
        assert await settled(r)
        kept_by_plain = first() is not None
        r.soon(aborted=True)          # aborted: the late run sweeps everything
        assert await settled(r)
        freed_by_sweep, sweeps_then = first() is None, r.deep_runs
        second = frozen_cycle()
        r.soon(aborted=True)          # again, 3600 s too soon: collected later, by the timer
        assert await settled(r)
        held = second() is not None and r.deep_runs == sweeps_then and r.deep_timer is not None
        r.deep_timer.cancel()
        return kept_by_plain, freed_by_sweep, sweeps_then, held

    gc.unfreeze()
    try:
        kept_by_plain, freed_by_sweep, sweeps, held = asyncio.run(main())
    finally:
        gc.unfreeze()
    assert kept_by_plain, "a plain reclaim collected a frozen cycle"
    assert freed_by_sweep and sweeps == 1, "the sweep after an aborted stream did not free it"
    assert held, "a second sweep ran within deep_every_s"
