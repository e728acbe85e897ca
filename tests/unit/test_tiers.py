"""The one tier loop: deadlines, a slow source timed out and skipped, failures isolated."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import wait_until

from xpusense.agent import tiers as tiers_mod
from xpusense.agent.sources.base import NEARLINE, REALTIME, Sample, Source, SourceError, Unavailable
from xpusense.agent.tiers import TierLoop, setup_sources


class Counting(Source):
    name = "fast"
    tiers = (REALTIME,)

    def __init__(self):
        self.rounds = 0

    def collect(self, tier):
        self.rounds += 1
        return [Sample("test.rounds", self.rounds, "1")]


class Blocking(Source):
    """A source whose nearline round hangs until the test releases it (a hung vendor tool)."""
    name = "slow"
    tiers = (REALTIME, NEARLINE)

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()

    def collect(self, tier):
        if tier == NEARLINE:
            if self.started.is_set():   # after the hung round: quick rounds with nothing to say
                return []
            self.started.set()
            self.release.wait(30)
            return [Sample("test.slow", 1, "1")]
        return [Sample("test.slow.realtime", 1, "1")]


class Failing(Source):
    name = "broken"
    tiers = (REALTIME,)

    def collect(self, tier):
        raise SourceError("tool printed garbage", [Sample("test.partial", 7, "1")])


class Missing(Source):
    name = "missing"
    tiers = (REALTIME,)

    def setup(self):
        raise Unavailable("no such device; install the driver")


class Sink:
    def __init__(self):
        self.lock = threading.Lock()
        self.samples: list[Sample] = []

    def __call__(self, samples, events):
        with self.lock:
            self.samples.extend(samples)

    def named(self, name, **labels):
        with self.lock:
            return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


@pytest.fixture
def loop_factory():
    made = []

    def make(sources, periods, timeout_ratio=0.5):
        states, events = setup_sources(sources)
        sink = Sink()
        loop = TierLoop(states, periods, sink, timeout_ratio=timeout_ratio)
        stop = threading.Event()
        t = threading.Thread(target=loop.run, args=(stop,), daemon=True)
        made.append((loop, stop, t))
        return loop, states, events, sink, stop, t

    yield make
    for loop, stop, t in made:
        stop.set()
        t.join(5)
        loop.close()


def test_slow_source_never_delays_the_realtime_tier(loop_factory):
    fast, slow = Counting(), Blocking()
    # Realtime rounds get their whole 50 ms period as budget: on a busy machine a 10 ms budget
    # discarded them as late, and the test saw load instead of the loop.
    loop, states, _, sink, stop, t = loop_factory([fast, slow], {REALTIME: 0.05, NEARLINE: 0.2, "offline": 100},
                                                  timeout_ratio=1.0)
    t.start()
    assert slow.started.wait(10)
    at_block = fast.rounds
    # While the slow source's 15 s-tier round hangs, the fast source and the slow source's own
    # realtime rounds go on, and the hung tier's later rounds are skipped, not queued.
    wait_until(lambda: fast.rounds >= at_block + 20, what="20 realtime rounds during the hang")
    wait_until(lambda: states[1].skipped >= 2, what="nearline rounds of the hung source to be skipped")
    wait_until(lambda: len(sink.named("test.slow.realtime")) >= 10, what="the slow source's own realtime rounds")
    slow.release.set()
    # The hung round finished long past its budget (0.2 s): discarded and counted as a timeout.
    def late_round_reported():
        ups = sink.named("xpusense.agent.source.up", source="slow", tier=NEARLINE)
        return any(u.value == 0.0 for u in ups)
    wait_until(late_round_reported, what="the late round to be reported down")
    assert states[1].timeouts >= 1
    assert sink.named("test.slow") == []   # its value came too late: discarded


def test_failing_and_unavailable_sources_do_not_stop_the_others(loop_factory):
    fast = Counting()
    loop, states, events, sink, stop, t = loop_factory([Missing(), Failing(), fast], {REALTIME: 0.02, NEARLINE: 1, "offline": 1})
    assert states[0].state == "unavailable" and "install the driver" in states[0].reason
    assert events and events[0].type == "source_unavailable"
    t.start()
    wait_until(lambda: fast.rounds >= 5 and states[1].errors >= 5, what="rounds of both sources")
    assert states[1].last_error == {REALTIME: "tool printed garbage"}
    # What the failing round could still read is kept, and its up sample says it failed.
    assert sink.named("test.partial")[0].value == 7
    assert sink.named("xpusense.agent.source.up", source="broken")[-1].value == 0.0
    assert sink.named("xpusense.agent.source.up", source="fast")[-1].value == 1.0
    assert all(s.unit == "s" for s in sink.named("xpusense.agent.source.duration"))


def test_rounds_follow_monotonic_deadlines_without_drift():
    """A fake clock: rounds are dispatched at start + k*period; a stall skips rounds, keeps the phase."""
    now = [0.0]
    dispatched = []

    class Clocked(TierLoop):
        def dispatch(self, tier):
            dispatched.append((tier, now[0]))
            return []

    class Src(Source):
        name = "x"
        tiers = (REALTIME, NEARLINE)

    states, _ = setup_sources([Src()])
    loop = Clocked(states, {REALTIME: 1.0, NEARLINE: 15.0, "offline": 300.0}, lambda s, e: None, clock=lambda: now[0])

    class StepStop:
        """stop.wait(d) advances the fake clock by d (plus a stall once) instead of sleeping."""
        def __init__(self):
            self.calls = 0

        def is_set(self):
            return now[0] >= 40

        def wait(self, d=None):
            self.calls += 1
            now[0] += d + (5.5 if self.calls == 10 else 0.0)
            return False

    loop.run(StepStop())
    rt = [t for tier, t in dispatched if tier == REALTIME]
    nl = [t for tier, t in dispatched if tier == NEARLINE]
    # The stall (9 s -> 15.5 s) makes the rounds due then late; later ones keep the phase.
    assert nl == [0.0, 15.5, 30.0]
    assert rt[:11] == [float(i) for i in range(10)] + [15.5]
    assert rt[11:] == [float(i) for i in range(16, 16 + len(rt) - 11)] and rt[-1] >= 39
    assert loop.missed_rounds[REALTIME] == 5  # rounds due at 11..15 were skipped, not run in a burst
    loop.close()


class Timed(Source):
    """Records when each of its realtime rounds ran (a few ms of work each)."""
    tiers = (REALTIME,)

    def __init__(self, name, log, lock):
        self.name, self.log, self.lock = name, log, lock

    def collect(self, tier):
        start = time.monotonic()
        while time.monotonic() - start < 0.003:   # work, not waiting: the GIL is held
            pass
        with self.lock:
            self.log.append((self.name, start, time.monotonic()))
        return [Sample("test.timed", 1, "1", {"src": self.name})]


class HungRealtime(Source):
    """A realtime source whose first round hangs until released (a stuck driver call)."""
    name = "hung"
    tiers = (REALTIME,)

    def __init__(self):
        self.release, self.started = threading.Event(), threading.Event()

    def collect(self, tier):
        if not self.started.is_set():
            self.started.set()
            self.release.wait(30)
        return []


def test_a_tiers_rounds_run_one_after_the_other(monkeypatch):
    """The rounds of one tier form a chain, each starting when the one before it is done: started
    together, a dozen sources fight for the GIL at every ctypes call (futex waits, context switches)."""
    monkeypatch.setattr(tiers_mod, "CHAIN_WAIT_MAX_S", 10.0)    # the chain never given up here: only order
    log, lock = [], threading.Lock()
    sources = [Timed(n, log, lock) for n in ("a", "b", "c")]
    states, _ = setup_sources(sources)
    loop = TierLoop(states, {REALTIME: 1.0, NEARLINE: 15.0, "offline": 300.0}, lambda s, e: None,
                    timeout_ratio=1.0, chain_wait_ratio=1.0)
    try:
        for _ in range(3):
            for f in loop.dispatch(REALTIME):
                f.result(timeout=30)
        with lock:
            rounds = list(log)
        assert len(rounds) == 9
        for k in range(3):
            one = rounds[3 * k: 3 * k + 3]
            assert [r[0] for r in one] == ["a", "b", "c"]
            assert one[0][2] <= one[1][1] and one[1][2] <= one[2][1], one   # no overlap
        assert loop.chain_waits_cut == 0
    finally:
        loop.close()


def test_a_hung_round_holds_the_next_in_its_chain_only_briefly(loop_factory):
    hung, fast = HungRealtime(), Counting()
    loop, states, _, sink, stop, t = loop_factory([hung, fast], {REALTIME: 0.05, NEARLINE: 1, "offline": 100},
                                                  timeout_ratio=1.0)
    t.start()
    try:
        assert hung.started.wait(30)
        at_hang = fast.rounds
        # The fast source behind the hung one in the chain waits for it at most a share of the
        # period, then runs beside it: its rounds go on, and the cut waits are counted.
        wait_until(lambda: fast.rounds >= at_hang + 10, what="10 rounds of the source behind the hung one")
        assert loop.chain_waits_cut >= 1
    finally:
        hung.release.set()


class FailsLater(Source):
    name = "later"
    tiers = (REALTIME,)

    def __init__(self):
        self.rounds = 0

    def collect(self, tier):
        self.rounds += 1
        if self.rounds > 3:
            raise SourceError("device gone", [])
        return [Sample("test.later", self.rounds, "1")]


def test_the_loops_own_samples_go_out_when_they_change(monkeypatch):
    """duration every round, the same duration again too; up, errors and timeouts on their first
    round, when they change, and every OWN_RESEND_S: a third of the agent's 1 s samples were these,
    mostly unchanged."""
    ticks = iter(range(10**6))

    class SameDurations:   # the tier loop's `time`: every round measured as the same 0.25 s
        def __getattr__(self, name):
            return getattr(time, name)

        def perf_counter_ns(self):
            return next(ticks) * 250_000_000

    monkeypatch.setattr(tiers_mod, "time", SameDurations())
    sink = Sink()
    states, _ = setup_sources([FailsLater()])
    loop = TierLoop(states, {REALTIME: 1.0, NEARLINE: 15.0, "offline": 300.0}, sink, timeout_ratio=1.0)
    try:
        for _ in range(5):
            for f in loop.dispatch(REALTIME):
                f.result(timeout=30)
        assert [s.value for s in sink.named("xpusense.agent.source.duration", source="later")] == [0.25] * 5
        # (a change is sent once more in the next round: a rate from the last two points is then 0)
        assert [s.value for s in sink.named("xpusense.agent.source.up", source="later")] == [1.0, 0.0, 0.0]
        assert [s.value for s in sink.named("xpusense.agent.source.errors", source="later")] == [0, 1, 2]
        assert [s.value for s in sink.named("xpusense.agent.source.timeouts", source="later")] == [0]
        assert len(sink.named("test.later")) == 3
    finally:
        loop.close()


class SharedTimed(Timed):
    """Timed, in a shared worker group, noting the thread each round ran in."""
    worker = "group"
    tiers = (REALTIME, NEARLINE)

    def collect(self, tier):
        with self.lock:
            self.log.append((self.name, tier, threading.get_ident()))
        return [Sample("test.shared", 1, "1", {"src": self.name})]


def test_sources_of_one_worker_group_share_one_thread_per_tier():
    """Sources naming the same `worker` (the eBPF probes): every round of a tier in one thread, in the
    chain's order, each source still counted and reported on its own; other sources keep theirs."""
    log, lock = [], threading.Lock()
    shared = [SharedTimed(n, log, lock) for n in ("a", "b", "c")]
    alone = Timed("alone", log, lock)
    sink = Sink()
    states, _ = setup_sources([*shared, alone])
    loop = TierLoop(states, {REALTIME: 1.0, NEARLINE: 15.0, "offline": 300.0}, sink, timeout_ratio=1.0)
    try:
        for _ in range(3):
            for tier in (REALTIME, NEARLINE):
                for f in loop.dispatch(tier):
                    f.result(timeout=30)
        with lock:
            rounds = [r for r in log if len(r) == 3 and r[1] in (REALTIME, NEARLINE)]
        assert len(rounds) == 18
        threads = {tier: {r[2] for r in rounds if r[1] == tier} for tier in (REALTIME, NEARLINE)}
        assert len(threads[REALTIME]) == 1 and len(threads[NEARLINE]) == 1
        assert threads[REALTIME] != threads[NEARLINE]     # a slow 15 s round never holds up the 1 s one
        assert [r[0] for r in rounds if r[1] == REALTIME] == ["a", "b", "c"] * 3
        assert all(st.rounds == 6 for st in states[:3]) and states[3].rounds == 3
        assert states[3].pool is not None and not states[3].tier_pools
        for name in ("a", "b", "c"):
            assert len(sink.named("xpusense.agent.source.duration", source=name)) == 6
    finally:
        loop.close()


class BreaksWhenClosedMidRound(Source):
    """A round that never ends if its source is closed under it (pyroute2's get_links on a netlink
    socket closed meanwhile did: the agent's exit then waited on that worker thread for good)."""
    name = "netlink"
    tiers = (REALTIME,)

    def __init__(self):
        self.in_round = threading.Event()
        self.release = threading.Event()
        self.running = False
        self.closed_mid_round: bool | None = None

    def collect(self, tier):
        self.running = True
        self.in_round.set()
        self.release.wait(30)
        self.running = False
        return []

    def close(self):
        self.closed_mid_round = self.running


def stopped_mid_round(loop_factory) -> tuple[TierLoop, BreaksWhenClosedMidRound]:
    """A loop stopped while its one source is in a round (held until the test releases it)."""
    src = BreaksWhenClosedMidRound()
    loop, _, _, _, stop, t = loop_factory([src], {REALTIME: 0.05, NEARLINE: 1.0, "offline": 10.0}, timeout_ratio=1.0)
    t.start()
    wait_until(src.in_round.is_set, timeout_s=30, what="a round started")
    stop.set()
    t.join(30)
    return loop, src


def test_close_lets_the_rounds_in_progress_finish_before_closing_their_sources(loop_factory):
    loop, src = stopped_mid_round(loop_factory)
    closing = threading.Thread(target=loop.close, kwargs={"wait_s": 60.0})
    closing.start()
    wait_until(lambda: loop._lock._waiters, timeout_s=30, what="close() waiting for the round")   # type: ignore[attr-defined]
    assert src.closed_mid_round is None   # not closed while its round runs
    src.release.set()
    closing.join(30)
    assert not closing.is_alive() and src.closed_mid_round is False


def test_close_gives_up_on_a_round_that_does_not_end(loop_factory, caplog):
    loop, src = stopped_mid_round(loop_factory)
    loop.close(wait_s=0.2)   # a bound, not a wait for something: the round is held until released
    assert src.closed_mid_round is True and "closed under it: netlink" in caplog.text
    src.release.set()
