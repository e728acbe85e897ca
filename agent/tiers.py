"""The one scheduling loop: every tier's rounds from time.monotonic() deadlines, no thread per tier
(TierLoop). The loop records, for every source, its last duration and success as samples of its
own (`xpusense.agent.source.*`)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable

from .sources.base import (
    COUNTER,
    NEARLINE,
    OFFLINE,
    REALTIME,
    TIERS,
    Event,
    Sample,
    Source,
    SourceError,
    Unavailable,
    stamp,
)

log = logging.getLogger("xpusense.agent.tiers")

Sink = Callable[[list[Sample], list[Event]], None]
JOIN_POLL_S = 0.2   # how often the loop looks for sources that finished setting up late
OWN_RESEND_S = 15.0   # the loop's own samples of a source (up, errors...): sent on change, else this often
CHAIN_WAIT_MAX_S = 0.05   # the longest a round waits for the one before it (see the module's text)
# At close, how long the rounds in progress may take to finish before their sources are closed under
# them: a source closed mid-round can leave its worker thread waiting forever (pyroute2's get_links on
# a closed netlink socket did), and the interpreter joins that thread at exit.
CLOSE_WAIT_S = 5.0


class SourceState:
    """What the agent knows about one source: availability, last round, counters."""

    def __init__(self, source: Source):
        self.source = source
        self.name = source.name
        self.state = "new"          # running | unavailable | failed
        self.reason = ""
        self.busy: set[str] = set()   # tiers with a round in progress
        self.last_duration_s = 0.0
        self.last_error: dict[str, str] = {}   # by tier; absent when its last round succeeded
        self.rounds = 0
        self.errors = 0
        self.timeouts = 0
        self.skipped = 0
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.tier_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}   # a shared worker's, by tier
        resend = source.resend_unchanged_s
        self.changes = ChangeFilter(resend) if resend is not None else None   # unchanged series held back
        self.own_changes = ChangeFilter(OWN_RESEND_S)   # for the loop's own samples of this source

    def as_dict(self) -> dict:
        return {
            "name": self.name, "state": self.state, "reason": self.reason,
            "tiers": list(self.source.tiers), "rounds": self.rounds, "errors": self.errors,
            "timeouts": self.timeouts, "skipped": self.skipped, "last_error": dict(self.last_error),
            "last_duration_s": round(self.last_duration_s, 6), **self.source.describe(),
        }


def setup_source(src: Source) -> tuple[SourceState, list[Event]]:
    """Run setup() of one source; an unavailable one is logged once and kept with its reason."""
    st = SourceState(src)
    events = []
    try:
        src.setup()
        st.state = "running"
    except Unavailable as e:
        st.state, st.reason = "unavailable", str(e)
        log.warning("source %s unavailable: %s", src.name, e)
        events.append(Event("source_unavailable", f"{src.name}: {e}", "warning", attributes={"source": src.name}))
    except Exception as e:  # a bug or an unexpected environment: say it, run the others
        st.state, st.reason = "failed", f"setup failed: {type(e).__name__}: {e}"
        log.exception("source %s failed to set up", src.name)
        events.append(Event("source_unavailable", f"{src.name}: {st.reason}", "warning",
                            attributes={"source": src.name}))
    return st, events


def setup_sources(sources: list[Source]) -> tuple[list[SourceState], list[Event]]:
    """setup() of every source, one after the other (the CLI's `sources`, `inventory`, `run --once`)."""
    states, events = [], []
    for src in sources:
        st, ev = setup_source(src)
        states.append(st)
        events += ev
    return states, events


class TierLoop:
    """Each source runs its collect() in a worker thread of its own (sources naming the same
    `Source.worker` share one per tier, for rounds that never block), so a slow source never delays
    the loop, and another source only a little: the rounds of one tier run one after the other, each
    waiting for the one before it at most `chain_wait_ratio` of the period (CHAIN_WAIT_MAX_S at most).
    A dozen sources started at the same instant fight for the GIL at every ctypes call and bpf
    syscall, and those hand-offs cost more CPU than the reads. A round of a source still busy with
    its previous round of that tier is skipped and counted (never queued behind); a round that
    finishes later than its timeout (a share of the tier's period) is discarded and counted."""

    def __init__(self, states: list[SourceState], periods_s: dict[str, float], sink: Sink,
                 timeout_ratio: float = 0.8, clock: Callable[[], float] = time.monotonic,
                 chain_wait_ratio: float = 0.05):
        self.states = [s for s in states if s.state == "running"]
        self.chain_wait_ratio = chain_wait_ratio
        self.periods_s = periods_s
        self.sink = sink
        self.timeout_ratio = timeout_ratio
        self.clock = clock
        self.missed_rounds = {t: 0 for t in TIERS}
        self.rounds = {t: 0 for t in TIERS}
        self._lock = threading.Condition()   # notified when a round ends (close waits for them)
        self.chain_waits_cut = 0   # rounds that stopped waiting for a slow round before them
        self.joining = 0     # sources still setting up, to be add()ed; the loop looks for them often
        self._shared: dict[tuple[str, str], concurrent.futures.ThreadPoolExecutor] = {}   # (worker, tier)
        for st in self.states:
            self._give_pool(st)

    def _give_pool(self, st: SourceState) -> None:
        # One worker per tier: a slow 15 s round of a source never holds up its 1 s round.
        group = st.source.worker
        if not group:
            st.pool = concurrent.futures.ThreadPoolExecutor(len(st.source.tiers) or 1,
                                                            thread_name_prefix=f"src-{st.name}")
            return
        with self._lock:    # one thread per (worker, tier), in submission order: the chain's order
            for t in st.source.tiers:
                if (group, t) not in self._shared:
                    self._shared[group, t] = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix=f"src-{group}-{t}")
                st.tier_pools[t] = self._shared[group, t]

    def add(self, st: SourceState) -> None:
        """A source whose setup finished after the loop started joins it (its tiers from the next
        due round; a tier no source had so far starts at once)."""
        self._give_pool(st)
        with self._lock:
            self.states = self.states + [st]

    def tiers_in_use(self) -> list[str]:
        with self._lock:
            states = self.states
        return [t for t in TIERS if any(t in st.source.tiers for st in states)]

    def dispatch(self, tier: str) -> list[concurrent.futures.Future]:
        """Start one round of `tier` on every source that has it; never blocks."""
        now_ns = time.time_ns()
        timeout_s = self.periods_s[tier] * self.timeout_ratio
        chain_wait_s = min(CHAIN_WAIT_MAX_S, self.periods_s[tier] * self.chain_wait_ratio)
        self.rounds[tier] += 1
        futures = []
        before: threading.Event | None = None   # the round before this one in the chain
        with self._lock:
            states = self.states
        for st in states:
            if tier not in st.source.tiers:
                continue
            with self._lock:
                if tier in st.busy:
                    st.skipped += 1
                    self.sink([Sample("xpusense.agent.source.skipped", st.skipped, "{round}",
                                      {"source": st.name}, COUNTER, now_ns)], [])
                    continue
                st.busy.add(tier)
            pool = st.tier_pools.get(tier) or st.pool
            assert pool is not None   # every state is given its pool in __init__ or add()
            done = threading.Event()
            fut = pool.submit(self._run, st, tier, now_ns, timeout_s, before, chain_wait_s, done)
            before = done
            futures.append(fut)
        return futures

    def _run(self, st: SourceState, tier: str, now_ns: int, timeout_s: float,
             before: threading.Event | None = None, chain_wait_s: float = 0.0,
             done: threading.Event | None = None) -> None:
        if before is not None and not before.wait(chain_wait_s):
            with self._lock:   # the round before is slow: this one goes on beside it
                self.chain_waits_cut += 1
        try:
            self._collect_round(st, tier, now_ns, timeout_s)
        finally:
            if done is not None:
                done.set()

    def _collect_round(self, st: SourceState, tier: str, now_ns: int, timeout_s: float) -> None:
        t0 = time.perf_counter_ns()
        samples: list[Sample] = []
        events: list[Event] = []
        error = ""
        try:
            samples = st.source.collect(tier)
            events = st.source.events()
        except SourceError as e:
            error, samples = str(e), e.samples
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.debug("source %s round failed", st.name, exc_info=True)
        duration = (time.perf_counter_ns() - t0) / 1e9   # whole ns: 9 decimals, as the compact encoding's digits
        labels = {"source": st.name, "tier": tier}
        with self._lock:
            st.busy.discard(tier)
            self._lock.notify_all()
            st.rounds += 1
            st.last_duration_s = duration
            if duration > timeout_s:
                st.timeouts += 1
                error = f"{tier} round took {duration:.3f} s, over its {timeout_s:.3f} s budget; discarded"
                log.warning("source %s: %s", st.name, error)
                samples = []  # late values are stale; events are facts that happened: keep them
            elif error:
                st.errors += 1
                if error != st.last_error.get(tier):
                    log.warning("source %s: %s", st.name, error)
            if error:
                st.last_error[tier] = error
            else:
                st.last_error.pop(tier, None)
            took = Sample("xpusense.agent.source.duration", duration, "s", labels)
            health = [
                Sample("xpusense.agent.source.up", 0.0 if error else 1.0, "1", dict(labels)),
                Sample("xpusense.agent.source.errors", st.errors, "{error}", {"source": st.name}, COUNTER),
                Sample("xpusense.agent.source.timeouts", st.timeouts, "{round}", {"source": st.name}, COUNTER),
            ]
        if st.changes is not None:
            out = st.changes.keep([*samples, took, *health], time.monotonic())
        else:   # the loop's own samples of every source: the duration each round; up, errors, timeouts seldom change
            out = [*samples, took, *st.own_changes.keep(health, time.monotonic())]
        self.sink(stamp(out, now_ns), stamp_events(events))

    def run(self, stop: threading.Event) -> None:
        """Dispatch rounds at their deadlines until `stop` is set."""
        due: dict[str, float] = {}
        while not stop.is_set():
            now = self.clock()
            for t in self.tiers_in_use():
                due.setdefault(t, now)   # a tier starts when its first source is there
                if due[t] <= now:
                    self.dispatch(t)
                    period = self.periods_s[t]
                    due[t] += period
                    if due[t] <= now:  # we were held up: skip the rounds we missed, keep the phase
                        missed = int((now - due[t]) // period) + 1
                        self.missed_rounds[t] += missed
                        due[t] += missed * period
            wait_s = max(0.0, min(due.values()) - self.clock()) if due else None
            if self.joining:   # a source still setting up may bring a tier: look again soon
                wait_s = min(wait_s, JOIN_POLL_S) if wait_s is not None else JOIN_POLL_S
            if wait_s is None:
                stop.wait()
                break
            stop.wait(wait_s)

    def run_once(self, wait_s: float = 30.0) -> None:
        """One round of every tier in use, waiting for all of them (`run --once`)."""
        futures = [f for t in self.tiers_in_use() for f in self.dispatch(t)]
        concurrent.futures.wait(futures, timeout=wait_s)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """No more rounds; the ones in progress get `wait_s` to finish, then every source is closed
        (a source still in its round after that is closed under it: a hung call is ended that way)."""
        with self._lock:
            states = self.states
        for st in states:
            if st.pool:
                st.pool.shutdown(wait=False, cancel_futures=True)
        for pool in list(self._shared.values()):
            pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            if not self._lock.wait_for(lambda: not any(st.busy for st in states), timeout=wait_s):
                log.warning("sources still in a round after %.0f s, closed under it: %s", wait_s,
                            ", ".join(st.name for st in states if st.busy))
        for st in states:
            try:
                st.source.close()
            except Exception:
                log.exception("source %s: close failed", st.name)


class ChangeFilter:
    """For a source with `resend_unchanged_s` set: a series' sample is sent when it differs from the
    last one sent (value, and buckets for histograms), once more when it has stopped changing (so a
    rate from the last two points falls to 0), and when the last one sent is `resend_s` old (so the
    collector keeps the series). Series not seen for 10 x resend_s are forgotten."""

    def __init__(self, resend_s: float):
        self.resend_s = resend_s
        self._sent: dict[tuple, tuple[tuple, float, bool, float]] = {}   # key -> (what, when sent, changed, seen)
        self._pruned = 0.0

    def keep(self, samples: list[Sample], now: float) -> list[Sample]:
        out = []
        sent = self._sent
        for s in samples:
            # The labels in the order the source gave them (the same every round): no sort per sample.
            key = (s.name, tuple(s.labels.items()))
            what = (s.value, s.counts)
            prev = sent.get(key)
            if prev is None or prev[0] != what or prev[2] or now - prev[1] >= self.resend_s:
                sent[key] = (what, now, prev is not None and prev[0] != what, now)
                out.append(s)
            else:
                sent[key] = (prev[0], prev[1], False, now)
        if now - self._pruned >= 10 * self.resend_s:
            self._pruned = now
            for key in [k for k, v in sent.items() if now - v[3] >= 10 * self.resend_s]:
                del sent[key]
        return out


def stamp_events(events: list[Event]) -> list[Event]:
    for ev in events:
        ev.time_ns = ev.time_ns or time.time_ns()
        ev.id = ev.id or uuid.uuid4().hex
    return events


def periods_from_config(tiers_cfg) -> dict[str, float]:
    return {REALTIME: float(tiers_cfg.realtime_s), NEARLINE: float(tiers_cfg.nearline_s),
            OFFLINE: float(tiers_cfg.offline_s)}
