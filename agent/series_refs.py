"""The agent's series references for one boot: the number (`series_ref`) each series (name and
labels) is sent with, so the collector reads a sample's name and labels only the first time it sees
the number, and each series' encoded template (name, unit, kind, labels, ref), copied into every
sample (agent/stream.py builds batches from them)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from xpusense.v1 import telemetry_pb2 as pb

from .sources.base import COUNTER, GAUGE, HISTOGRAM, Sample

log = logging.getLogger("xpusense.agent.stream")

KINDS = {GAUGE: pb.GAUGE, COUNTER: pb.COUNTER, HISTOGRAM: pb.HISTOGRAM}
MAX_REF = 0xFFFFFFFF   # series_ref is a uint32


class SeriesRefs:
    """Series come and go (process series carry pids), so the table is kept in two generations
    turned every `[stream] series_idle_s`: a series sampled since the last turn is in the current
    one, and at a turn the series with no sample in the whole generation before are retired
    (counted `retired`), so a reference goes between series_idle_s and twice that after its series'
    last sample. A retired series that comes back gets a new number: a number is never given twice
    in a boot (the wire has no message that retires one, and the collector may still map it), and
    once 2**32 - 1 (or `max_refs`, the bound of the definitions kept per boot) are spent new series
    are sent without one (0: the collector reads name and labels). Not thread-safe: StreamClient calls it under its lock."""

    def __init__(self, max_templates: int, idle_s: float = 900.0, clock: Callable[[], float] = time.monotonic,
                 max_refs: int = MAX_REF):
        self.max_templates = max_templates
        self.max_refs = min(max_refs, MAX_REF)   # numbers given per boot; past it new series get 0
        self.idle_s = idle_s
        self.clock = clock
        # Current generation: series (name, sorted labels) -> series_ref, and (name, unit, kind,
        # labels in their given order) -> its template; and the generation before.
        self.series: dict[tuple, int] = {}
        self.templates: dict[tuple, pb.Sample] = {}
        self._series_old: dict[tuple, int] = {}
        self._templates_old: dict[tuple, pb.Sample] = {}
        self._turn_at = clock() + idle_s
        self._last = 0          # the highest number given in this boot
        self.retired = 0        # references retired (their series had no sample for idle_s or more)
        self.unnumbered = 0     # new series given 0 because max_refs numbers were given in this boot

    def __len__(self) -> int:
        """References held (both generations)."""
        return len(self.series) + len(self._series_old)

    def turn_if_due(self) -> int:
        """At a turn, the references of the series with no sample since the last one retired (how
        many: returned) and the current generation made the older."""
        if self.clock() < self._turn_at:
            return 0
        gone = len(self._series_old)
        self._series_old, self.series = self.series, {}
        self._templates_old, self.templates = self.templates, {}
        self._turn_at = self.clock() + self.idle_s
        self.retired += gone
        return gone

    def template(self, s: Sample) -> pb.Sample:
        """The series' template, built once a generation: copying it costs a third of building a
        Sample from its fields (the agent's 1 s path). Found by the labels in their given order (a
        source builds a series' labels the same way every round), so that no sort is paid per
        sample; the series_ref is found by the sorted labels. A caller looks in `templates` first
        (a dict lookup) and calls this only when the key is not there."""
        key = (s.name, s.unit, s.kind, tuple(s.labels.items()))
        tmpl = self.templates.get(key)
        if tmpl is None:
            tmpl = self._templates_old.pop(key, None)   # used in the generation before: in use again
            ref = self.ref((s.name, tuple(sorted(s.labels.items()))))
            if tmpl is None or tmpl.series_ref != ref:
                tmpl = pb.Sample(name=s.name, unit=s.unit, kind=KINDS[s.kind], labels=s.labels, series_ref=ref)
            if len(self.templates) >= self.max_templates:   # series come and go (pids, pods): start again
                self.templates.clear()
            self.templates[key] = tmpl
        return tmpl

    def ref(self, series: tuple) -> int:
        """The series' number in the current generation: its own if it has one, else a new one."""
        ref = self.series.get(series)
        if ref is None:
            ref = self._series_old.pop(series, None)
            if ref is None:
                self._last += 1
                ref = self._last if self._last <= self.max_refs else 0
                if not ref:
                    self.unnumbered += 1
                    if self.unnumbered % 1000 == 1:
                        log.warning("%d series references given in this boot ([stream] max_series_defs): new series "
                                    "are sent whole, without one (%d so far)", self.max_refs, self.unnumbered)
            self.series[series] = ref
        return ref
