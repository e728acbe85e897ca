"""The agent's batches: a round's samples and events cut into one pb.Batch, once, in the encoding
the agent's config names (`[stream] batch_encoding`): Sample messages, or the compact columns
(common/compact.py) with the series the columns cannot carry (no series_ref, an oversized
histogram) as Sample messages; and the spool's check of a stored one (batch_problem)."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from operator import itemgetter

from google.protobuf.message import DecodeError

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

from .series_refs import KINDS, SeriesRefs
from .sources.base import HISTOGRAM, Event, Sample
from .spool.defs import SeriesDefs

log = logging.getLogger("xpusense.agent.stream")
_I64 = 1 << 63
MAX_ROWS = 1 << 20     # no batch of this agent's comes near it ([stream] max_samples_per_batch)


def fill_histogram(h: pb.Histogram, s: Sample) -> None:
    h.bounds.extend(s.bounds)
    h.counts.extend(s.counts)
    h.sum, h.count = s.value, (s.counts[-1] if s.counts else 0)


def event_to_proto(e: Event) -> pb.Event:
    return pb.Event(id=e.id, type=e.type, severity=e.severity, device=e.device, message=e.message,
                    attributes=e.attributes, time_unix_nano=e.time_ns)


def sample_to_proto(s: Sample, series_ref: int = 0) -> pb.Sample:
    m = pb.Sample(name=s.name, unit=s.unit, kind=KINDS[s.kind], labels=s.labels, value=s.value,
                  time_unix_nano=s.time_ns, series_ref=series_ref)
    if s.kind == HISTOGRAM:
        fill_histogram(m.histogram, s)
    return m


def batch_problem(node_id: str) -> Callable[[str, int, bytes], str | None]:
    """The spool's check of a stored batch: why it must not be sent (it would be refused, or stored
    as something else), or None."""
    def check(boot: str, seq: int, data: bytes) -> str | None:
        try:
            b = pb.Batch.FromString(data)
        except DecodeError as e:
            return f"not a Batch ({e})"
        if b.node_id != node_id:
            return f"a batch of node {b.node_id!r}, not {node_id!r}"
        if (b.boot_id, b.seq) != (boot, seq):
            return f"batch {(b.boot_id, b.seq)} filed as {(boot, seq)}"
        if b.columns:
            try:
                compact.decode_columns(b.columns, MAX_ROWS)
            except compact.CompactError as e:
                return f"its columns do not decode ({e})"
        return None
    return check


def points(b: pb.Batch) -> int:
    """The samples a batch this agent built carries, in its columns and as Sample messages."""
    return len(b.samples) + (len(compact.decode_columns(b.columns, MAX_ROWS)) if b.columns else 0)


class BatchBuilder:
    """Cuts batches with `refs` (this boot's series numbers and templates). With `defs` (the compact
    encoding), each new series' template is kept as its definition and samples go into the columns
    as (ref, time, value) rows sorted by ref, histograms by row: no pb.Sample per sample. A sample a
    source built wrong (a value or time of the wrong type) is dropped, counted in `unencodable`."""

    def __init__(self, refs: SeriesRefs, defs: SeriesDefs | None, boot_id: str,
                 on_unencodable: Callable[[str, Exception], None], version: int = compact.VERSION):
        self.refs, self.defs, self.boot_id = refs, defs, boot_id
        self.version = version   # of the columns' blocks
        self.on_unencodable = on_unencodable
        self.top = 0     # the highest series_ref defined in this boot

    def build(self, b: pb.Batch, chunk: list[Sample]) -> tuple[int, int]:
        """Fill `b` with `chunk`: the samples it holds, and the highest series_ref its columns use
        (0: none)."""
        if self.defs is None:
            self._samples(b, chunk)
            return len(b.samples), 0
        return self._columns(b, chunk)

    def _samples(self, b: pb.Batch, chunk: list[Sample]) -> None:
        add, templates = b.samples.add, self.refs.templates
        for s in chunk:
            try:
                m = add()
                tmpl = templates.get((s.name, s.unit, s.kind, tuple(s.labels.items())))   # as refs.template
                m.CopyFrom(tmpl if tmpl is not None else self.refs.template(s))   # name, unit, kind, labels, ref
                m.value, m.time_unix_nano = s.value, s.time_ns
                if s.kind == HISTOGRAM:
                    fill_histogram(m.histogram, s)
            except (TypeError, ValueError, KeyError) as e:   # a source's bug must not take the batch
                del b.samples[-1]
                self.on_unencodable(s.name, e)

    def _template(self, s: Sample) -> pb.Sample:
        tmpl = self.refs.template(s)
        if tmpl.series_ref > self.top:       # numbers only grow in a boot: a new series
            assert self.defs is not None
            self.top = tmpl.series_ref
            self.defs.add(self.boot_id, tmpl)
        return tmpl

    def _columns(self, b: pb.Batch, chunk: list[Sample]) -> tuple[int, int]:
        rows: list[compact.Row] = []
        hists: dict[int, compact.Histogram] = {}
        templates = self.refs.templates
        for s in chunk:
            try:
                tmpl = templates.get((s.name, s.unit, s.kind, tuple(s.labels.items())))   # as refs.template
                if tmpl is None:
                    tmpl = self._template(s)
                ref, t, v = tmpl.series_ref, s.time_ns, s.value
                if not (isinstance(t, int) and -_I64 <= t < _I64 and isinstance(v, (int, float))):
                    raise TypeError(f"time {t!r} and value {v!r} must be an int64 and a number")
                if s.kind == HISTOGRAM:
                    h = (array("d", s.bounds), array("Q", s.counts))
                    if len(h[0]) > compact.MAX_BUCKETS or len(h[1]) > compact.MAX_BUCKETS + 1:
                        ref = 0      # more buckets than the columns carry
                    elif ref:
                        hists[len(rows)] = h
                if not ref:
                    m = b.samples.add()
                    m.CopyFrom(tmpl)
                    m.value, m.time_unix_nano = v, t
                    if s.kind == HISTOGRAM:
                        fill_histogram(m.histogram, s)
                    continue
                rows.append((ref, t, v))
            except (TypeError, ValueError, KeyError, OverflowError) as e:   # a source's bug must not take the batch
                self.on_unencodable(s.name, e)
        if not rows:
            return len(b.samples), 0
        if hists:
            order = sorted(range(len(rows)), key=[r[0] for r in rows].__getitem__)
            hists = {j: hists[i] for j, i in enumerate(order) if i in hists}
            rows = [rows[i] for i in order]
        else:
            rows.sort(key=itemgetter(0))
        b.columns = compact.encode_columns(rows, hists, self.version)
        return len(b.samples) + len(rows), rows[-1][0]
