"""Measured latency for data affinity: a region pair's round-trip time from the agents'
`xpusense.network.tcp.rtt{remote_region}` histograms, per node a window of snapshots (RttWindow),
per pair the median of its nodes' figures (MeasuredLatency); docs/scheduler.md "Measured latency"."""

from __future__ import annotations

import bisect
import heapq
from typing import Any, NamedTuple

from xpusense.common.histograms import per_bucket, quantile

SPACING = 8   # snapshots at least window / SPACING apart: at most SPACING + 2 per series


class RttWindow:
    """One RTT series of one node (a remote region): snapshots of its cumulative counts and the
    node's figure over the window (see the module docstring)."""
    __slots__ = ("snaps", "bounds", "seen", "grew_ns", "median_s", "samples")

    def __init__(self) -> None:
        self.snaps: list[tuple[int, tuple[int, ...]]] = []   # (collector ns, counts cumulative over time)
        self.bounds: tuple[float, ...] = ()
        self.seen: Any = None   # the series' histogram last read (the state makes one per point)
        self.grew_ns = 0        # collector time of the last snapshot whose counts grew
        self.median_s: float | None = None
        self.samples = 0

    def observe(self, histogram: Any, now: int, window_ns: int) -> bool:
        """The series' latest point (a telemetry_pb2.Histogram; FleetState stores a new one per
        point), read at collector time `now`. True when the figure was worked out again (new
        samples, or a restart)."""
        if histogram is None or histogram is self.seen:
            return False
        self.seen = histogram
        counts = tuple(per_bucket(histogram.counts))
        bounds = tuple(histogram.bounds)
        snaps = self.snaps
        if snaps and (bounds != self.bounds or len(counts) != len(snaps[-1][1])
                      or any(c < p for c, p in zip(counts, snaps[-1][1]))):
            snaps.clear()   # the agent restarted or the buckets changed: counted afresh from here
            self.median_s, self.samples, self.grew_ns = None, 0, 0
            self.bounds = bounds
            snaps.append((now, counts))
            return True
        self.bounds = bounds
        if snaps and counts == snaps[-1][1]:
            return False    # nothing new measured (a resend of an unchanged histogram)
        if snaps:
            self.grew_ns = now
        if len(snaps) >= 2 and now - snaps[-2][0] < window_ns // SPACING:
            snaps[-1] = (now, counts)
        else:
            snaps.append((now, counts))
        cut = now - window_ns
        while len(snaps) >= 2 and snaps[1][0] <= cut:
            del snaps[0]    # snaps[0]: the newest at or before the window's start (or the oldest kept)
        if len(snaps) < 2:
            return False
        base, last = snaps[0][1], snaps[-1][1]
        delta = [a - b for a, b in zip(last, base)]
        self.samples = sum(delta)
        self.median_s = quantile(bounds, delta, 0.5)
        return True


class Measured(NamedTuple):
    """A region pair's measured figure: the median over its nodes of their RTT medians."""
    ms: float
    nodes: int
    newest_ns: int     # collector time of the newest measurement among them


class MeasuredLatency:
    """Per region pair (node region, remote region) the figures of the nodes that measure it."""

    def __init__(self, window_ns: int, max_age_ns: int):
        self.window_ns, self.max_age_ns = window_ns, max_age_ns
        self.values: dict[tuple[str, str], list[float]] = {}     # pair -> its nodes' figures (ms), sorted
        self.newest: dict[tuple[str, str], int] = {}             # pair -> newest measurement's time
        self.members: dict[tuple[str, str], tuple[str, float, int]] = {}   # (node, remote) -> (region, ms, t)
        self.expiries: list[tuple[int, str, str, int]] = []      # heap: (t + max_age, node, remote, t)

    def set(self, node: str, region: str, remote: str, ms: float | None, t: int) -> None:
        """The node's figure (ms, None: none) to `remote`, last grown at `t` (collector ns)."""
        self.drop(node, remote)
        if ms is None or not region or self.max_age_ns <= 0:
            return
        pair = (region, remote)
        self.members[(node, remote)] = (region, ms, t)
        bisect.insort(self.values.setdefault(pair, []), ms)
        if t > self.newest.get(pair, -1):
            self.newest[pair] = t
        heapq.heappush(self.expiries, (t + self.max_age_ns, node, remote, t))

    def drop(self, node: str, remote: str) -> None:
        old = self.members.pop((node, remote), None)
        if old is None:
            return
        pair = (old[0], remote)
        values = self.values[pair]
        del values[bisect.bisect_left(values, old[1])]
        if not values:
            del self.values[pair]
            del self.newest[pair]

    def expire(self, now: int) -> None:
        """Drop the figures whose last growth is `max_age` old by `now` (those that came due only)."""
        heap = self.expiries
        while heap and heap[0][0] <= now:
            _, node, remote, t = heapq.heappop(heap)
            m = self.members.get((node, remote))
            if m is not None and m[2] == t:
                self.drop(node, remote)

    def figure(self, region: str, remote: str) -> Measured | None:
        """The pair's measured figure now (expire() first), None when no node measures it."""
        values = self.values.get((region, remote))
        if not values:
            return None
        n = len(values)
        return Measured((values[(n - 1) // 2] + values[n // 2]) / 2.0, n, self.newest[(region, remote)])
