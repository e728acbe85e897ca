"""One series of a node in the collector's fleet state (state.py): what it is (name, unit, kind,
labels), its latest and previous point (and the latest's time on the collector's clock, when it was
received: collector/clock.py), its histogram, and where its history is: its own History (series_history.py) or a
column of a Frame (columns.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from xpusense.v1 import telemetry_pb2 as pb

from .series_history import History

if TYPE_CHECKING:
    from .columns import Frame


def read_labels(labels) -> dict[str, str]:
    """A protobuf map<string, string> as a dict. The map's own iteration and lookup are C calls;
    dict(labels) and labels.items() go through collections.abc's Python generators, about twice
    the time (a node's first batch reads 160 maps)."""
    return {k: labels[k] for k in labels}


def series_key(name: str, labels: dict[str, str]) -> tuple:
    """How a node's series are found: by name and sorted labels."""
    return (name, tuple(sorted(labels.items())))


class Series:
    """One series of a node: what it is, its latest and previous point, and its history: its own
    History, or (`frame` set) a column of a Frame (collector/columns.py) after the points its History
    held before. The latest and previous values are read through properties, which look at the
    frame's last rows; the general ingest path and a snapshot's restore write the underscored
    fields of a series without a frame. `idle_n` and `idle_at`: its points received when the idle
    sweep (collector/idle.py) last saw that count move, and when (unset until it first looks)."""

    __slots__ = ("name", "unit", "kind", "labels", "_value", "_time_ns", "_prev_value", "_prev_time_ns",
                 "_recv_ns", "histogram", "history", "frame", "col", "idle_n", "idle_at")

    def __init__(self, s: pb.Sample, labels: dict[str, str] | None = None):
        self.name = s.name
        self.unit = s.unit
        self.kind = s.kind
        self.labels = read_labels(s.labels) if labels is None else labels   # read only: may be shared
        self._value = math.nan
        self._time_ns = 0
        self._prev_value = math.nan
        self._prev_time_ns = 0
        self._recv_ns = 0
        self.histogram = None
        self.history = History()
        self.frame: Frame | None = None
        self.col = 0

    @property
    def value(self) -> float:
        f = self.frame
        return self._value if f is None or not f.t else f.v[len(f.v) - f.k + self.col]

    @property
    def time_ns(self) -> int:
        f = self.frame
        return self._time_ns if f is None or not f.t else f.t[-1]

    @property
    def recv_ns(self) -> int:
        """Its latest point's time on the collector's clock (when received, clock.received_at); its
        stamp where that is not known (restored from a snapshot, _recv_ns unset, until its next point)."""
        f = self.frame
        return (getattr(self, "_recv_ns", 0) if f is None or not f.t else f.recv_ns) or self.time_ns

    @property
    def prev_value(self) -> float:
        f = self.frame
        if f is None or not f.t:
            return self._prev_value
        return self._value if len(f.t) == 1 else f.v[len(f.v) - 2 * f.k + self.col]

    @property
    def prev_time_ns(self) -> int:
        f = self.frame
        if f is None or not f.t:
            return self._prev_time_ns
        return self._time_ns if len(f.t) == 1 else f.t[-2]

    def latest(self) -> tuple[float, int, float, int]:
        """(value, time_ns, prev_value, prev_time_ns) as the four properties read them, with one
        look at the frame (a snapshot reads them for every series)."""
        f = self.frame
        if f is None or not f.t:
            return self._value, self._time_ns, self._prev_value, self._prev_time_ns
        t, v, at = f.t, f.v, len(f.v) - f.k + self.col
        if len(t) == 1:
            return v[at], t[-1], self._value, self._time_ns
        return v[at], t[-1], v[at - f.k], t[-2]

    def rate(self) -> float:
        if self.kind != pb.COUNTER or not self.prev_time_ns or self.time_ns <= self.prev_time_ns:
            return math.nan
        if self.value < self.prev_value:  # counter reset (agent or device restart)
            return math.nan
        return (self.value - self.prev_value) / ((self.time_ns - self.prev_time_ns) / 1e9)
