"""Quantiles of explicit-bucket histograms, as the agent's eBPF probes make them (log2 bounds in
seconds; counts cumulative over buckets, and over time): one reading for the agent's diagnosis
rules and the collector's scheduler alike.

A quantile is interpolated linearly inside the bucket it falls in, from the bucket's lower bound
(the previous bound; 0 for the first) to its upper bound: with log2 buckets the bucket's upper
bound alone overstates by up to 2x. In the last, unbounded bucket it is the last bound: what is
known of such a value is that it is at least that.
"""

from __future__ import annotations

from collections.abc import Sequence


def per_bucket(cumulative: Sequence[int]) -> list[int]:
    """Counts cumulative over buckets -> per bucket (taken as they are when they are not cumulative
    after all, as the OTLP export does)."""
    cum = [int(c) for c in cumulative]
    per = [c - p for c, p in zip(cum, [0, *cum[:-1]], strict=True)]
    return cum if any(x < 0 for x in per) else per


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of a histogram: `counts` per bucket (len(bounds) + 1, the last one
    above the last bound), `bounds` the buckets' inclusive upper bounds, ascending. None when empty."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, below = q * total, 0
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        if below + c >= rank:
            lo = float(bounds[i - 1]) if 0 < i <= len(bounds) else 0.0
            if i >= len(bounds):
                return lo
            return lo + (float(bounds[i]) - lo) * (rank - below) / c
        below += c
    return float(bounds[-1]) if bounds else None   # not reached: the counts add up to total


def window_counts(first_cumulative: Sequence[int] | None, last_cumulative: Sequence[int]) -> list[int] | None:
    """Per-bucket counts of what a histogram counted between two readings of its cumulative counts
    (`first` None: since it started). None on a reset between them (a count went down) or when the
    buckets changed."""
    last = per_bucket(last_cumulative)
    if first_cumulative is None:
        return last
    if len(first_cumulative) != len(last_cumulative):
        return None
    delta = [a - b for a, b in zip(last, per_bucket(first_cumulative), strict=True)]
    return None if any(d < 0 for d in delta) else delta
