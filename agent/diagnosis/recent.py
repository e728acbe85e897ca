"""The node's recent samples of the series some rule reads, for `keep_s`: what rules look at.

Only the names the rules declare are kept (a rule's `reads`), so the memory this takes follows the
rules, not the node's whole output. Series and points per series are bounded; what does not fit is
counted in `dropped_series` / `dropped_points`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from xpusense.common.histograms import quantile, window_counts

from ..sources.base import HISTOGRAM, Sample

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclasses.dataclass
class Series:
    name: str
    labels: dict[str, str]
    points: list[Sample]   # oldest first, each with its time_ns

    @property
    def values(self) -> list[float]:
        return [p.value for p in self.points]

    @property
    def span_s(self) -> float:
        return (self.points[-1].time_ns - self.points[0].time_ns) / 1e9 if len(self.points) > 1 else 0.0


def covers(s: Series, window_s: float) -> bool:
    """Whether a series' points cover a window: its span plus one sampling interval reaches it (a
    nearline series read every 15 s spans 45 s of a 60 s window), within 5%."""
    n = len(s.points)
    return n >= 2 and s.span_s + s.span_s / (n - 1) >= window_s * 0.95


def _matches(labels: dict[str, str], match: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


class Recent:
    def __init__(self, names: Iterable[str], keep_s: float = 300.0, max_series: int = 4096,
                 max_points_per_series: int = 2048):
        self.names = frozenset(names)
        self.keep_ns = int(keep_s * 1e9)
        self.max_series, self.max_points = max_series, max_points_per_series
        self._series: dict[SeriesKey, collections.deque[Sample]] = {}
        self.dropped_series = 0
        self.dropped_points = 0
        self.newest_ns = 0

    def add(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            if s.name not in self.names:
                continue
            key = (s.name, tuple(sorted(s.labels.items())))
            points = self._series.get(key)
            if points is None:
                if len(self._series) >= self.max_series:
                    self.dropped_series += 1
                    continue
                points = self._series[key] = collections.deque()
            if points and s.time_ns < points[-1].time_ns:
                continue   # out of order (a slow round finishing late): the newer point stands
            if len(points) >= self.max_points:
                points.popleft()
                self.dropped_points += 1
            points.append(s)
            self.newest_ns = max(self.newest_ns, s.time_ns)
        self._expire()

    def _expire(self) -> None:
        horizon = self.newest_ns - self.keep_ns
        for key in [k for k, pts in self._series.items() if pts and pts[-1].time_ns < horizon]:
            del self._series[key]   # a series gone quiet for longer than kept (a process that ended)
        for pts in self._series.values():
            while pts and pts[0].time_ns < horizon:
                pts.popleft()

    def window(self, name: str, now_ns: int, window_s: float, **match: str) -> list[Series]:
        """Every series called `name` whose labels include `match`, with its points of the last `window_s`."""
        since = now_ns - int(window_s * 1e9)
        out = []
        for (n, labels), pts in self._series.items():
            if n != name:
                continue
            lab = dict(labels)
            if not _matches(lab, match):
                continue
            kept = [p for p in pts if since <= p.time_ns <= now_ns]
            if kept:
                out.append(Series(name, lab, kept))
        return out

    def latest(self, name: str, **match: str) -> list[Series]:
        """The newest point of every matching series (one point each)."""
        return [Series(n, dict(labels), [pts[-1]]) for (n, labels), pts in self._series.items()
                if n == name and pts and _matches(dict(labels), match)]


def histogram_counts(series: Series) -> tuple[tuple[float, ...], list[int]] | None:
    """(bounds, per-bucket counts) of what a histogram series counted between its first and last
    point (a lone point: since the probe started); None without a histogram, or on a reset inside
    the window."""
    first, last = series.points[0], series.points[-1]
    if last.kind != HISTOGRAM or not last.counts:
        return None
    counts = window_counts(first.counts if len(series.points) > 1 else None, last.counts)
    return None if counts is None else (tuple(last.bounds), counts)


def histogram_quantile(series: Series, q: float) -> tuple[float, int] | None:
    """(q-quantile, observations) of what a histogram series counted in its window
    (xpusense.common.histograms: interpolated inside the bucket); None without new observations."""
    got = histogram_counts(series)
    if got is None or (n := sum(got[1])) <= 0:
        return None
    value = quantile(got[0], got[1], q)
    return None if value is None else (value, n)


def counter_rate(series: Series) -> float | None:
    """Per-second increase of a counter over its window (None with fewer than two points; a reset
    counts from zero)."""
    if len(series.points) < 2 or series.span_s <= 0:
        return None
    inc = 0.0
    for a, b in zip(series.points, series.points[1:], strict=False):
        inc += b.value - a.value if b.value >= a.value else b.value
    return inc / series.span_s
