"""The scheduler's measured latency (collector/scheduler/latency.py): the median of an RTT histogram
interpolated within its bucket, a node's window over cumulative histograms, and the per region pair
median over nodes with its expiry. (Through the collector: tests/e2e/test_place_measured_latency.py.)"""

from __future__ import annotations

import pytest

from xpusense.collector.scheduler.latency import MeasuredLatency, RttWindow
from xpusense.common.histograms import per_bucket, quantile
from xpusense.probes.specs import log2_bounds_s
from xpusense.v1 import telemetry_pb2 as pb

S = 1_000_000_000
BOUNDS = log2_bounds_s(40)   # the tcp_rtt probe's: slot i holds [2^(i-1), 2^i - 1] ns


def slot(seconds: float) -> int:
    """The probe's slot of an RTT (bpf_log2l of its ns)."""
    return min(int(seconds * 1e9).bit_length(), 39)


def hist(per_slot: dict[int, int]) -> pb.Histogram:
    """A histogram as the agent sends it: counts cumulative over buckets."""
    counts, total = [], 0
    for i in range(40):
        total += per_slot.get(i, 0)
        counts.append(total)
    return pb.Histogram(bounds=BOUNDS, counts=counts, count=total)


def test_median_is_interpolated_within_its_bucket_not_its_upper_bound():
    # All samples in (1, 3]: the median is half way, 2, where the bucket's upper bound says 3.
    assert quantile((0.0, 1.0, 3.0, 7.0), [0, 0, 4, 0, 0], 0.5) == pytest.approx(2.0)
    # 1 + 1 below; the median (the 5th of 10) is 3/6 of the way into (1, 3].
    assert quantile((0.0, 1.0, 3.0, 7.0), [1, 1, 6, 2, 0], 0.5) == pytest.approx(1 + 2 * 3 / 6)
    # In the first bucket, from 0.
    assert quantile((2.0, 4.0), [4, 0, 0], 0.5) == pytest.approx(1.0)
    # In the overflow bucket: its lower bound (the last bound), all that is known.
    assert quantile((1.0, 2.0), [1, 0, 5], 0.5) == 2.0
    assert quantile((1.0, 2.0), [0, 0, 0], 0.5) is None


def test_median_of_an_rtt_in_the_probe_s_log2_buckets():
    # 1 ms = 1,000,000 ns lands in slot 20: [524,288, 1,048,575] ns. The interpolated median of a
    # bucket full of them is its middle; the upper bound would say 1.05 ms, about 2x the lower.
    per = [0] * 40
    per[slot(0.001)] = 50
    lo, hi = BOUNDS[19], BOUNDS[20]
    assert slot(0.001) == 20 and hi == pytest.approx(1.048575e-3)
    assert quantile(BOUNDS, per, 0.5) == pytest.approx((lo + hi) / 2)
    assert 0.5e-3 < quantile(BOUNDS, per, 0.5) < 0.8e-3


def test_bucket_counts_from_cumulative_and_from_plain():
    assert per_bucket([0, 2, 2, 5]) == [0, 2, 0, 3]
    assert per_bucket([3, 1, 0]) == [3, 1, 0]   # not cumulative after all: taken as they are


def test_window_counts_only_samples_after_the_first_histogram_and_within_the_window():
    w = RttWindow()
    window = 180 * S
    # The first histogram seen: 100 old samples at ~200 ms, since the agent started: a baseline only.
    assert not w.observe(hist({slot(0.2): 100}), 0, window)
    assert w.median_s is None
    # 10 s later: 20 new samples at ~1 ms. Only they count.
    assert w.observe(hist({slot(0.2): 100, slot(0.001): 20}), 10 * S, window)
    assert w.samples == 20 and w.grew_ns == 10 * S
    assert w.median_s == pytest.approx((BOUNDS[19] + BOUNDS[20]) / 2)
    # A resend of the same histogram (new time, same counts) is no new measurement.
    assert not w.observe(hist({slot(0.2): 100, slot(0.001): 20}), 20 * S, window)
    assert w.grew_ns == 10 * S
    h = hist({slot(0.2): 100, slot(0.001): 30})
    assert w.observe(h, 30 * S, window) and w.samples == 30
    assert not w.observe(h, 40 * S, window)   # the same point read again (a refresh without a new one)
    assert w.grew_ns == 30 * S
    # 60 samples at ~40 ms over the next minutes: the median (the 45th of 90) moves to their bucket,
    # 15 of its 60 in.
    assert w.observe(hist({slot(0.2): 100, slot(0.001): 30, slot(0.04): 60}), 100 * S, window)
    assert w.samples == 90 and w.median_s == pytest.approx(BOUNDS[25] + (BOUNDS[26] - BOUNDS[25]) * 15 / 60)
    # At t=300 s the window starts at 120 s: the baseline is the newest snapshot at or before it
    # (t=100 s), so only the 5 samples since count.
    assert w.observe(hist({slot(0.2): 100, slot(0.001): 30, slot(0.04): 65}), 300 * S, window)
    assert w.samples == 5 and w.grew_ns == 300 * S
    # The agent restarted (counts went down): counted afresh, no figure until the next growth.
    assert w.observe(hist({slot(0.001): 3}), 310 * S, window)
    assert w.median_s is None and w.samples == 0
    assert w.observe(hist({slot(0.001): 7}), 320 * S, window)
    assert w.samples == 4 and w.median_s == pytest.approx((BOUNDS[19] + BOUNDS[20]) / 2)


def test_window_keeps_a_bounded_number_of_snapshots():
    w = RttWindow()
    for i in range(1, 2001):   # a new histogram every second for 2,000 s
        w.observe(hist({slot(0.001): i}), i * S, 180 * S)
    assert len(w.snaps) <= 10
    # The window's samples: those since the newest snapshot at or before t=1820 s (>= 180 s of them,
    # at most 180 s + the snapshots' spacing of 22.5 s).
    assert 180 <= w.samples <= 180 + 23


def test_pair_median_over_nodes_and_expiry_after_max_age():
    lat = MeasuredLatency(window_ns=180 * S, max_age_ns=300 * S)
    lat.set("n1", "a", "b", 40.0, 10 * S)
    lat.set("n2", "a", "b", 42.0, 20 * S)
    lat.set("n3", "a", "b", 300.0, 30 * S)   # one node far off does not move the median
    lat.set("m1", "c", "b", 1.0, 5 * S)
    assert lat.figure("a", "b") == (42.0, 3, 30 * S)
    assert lat.figure("c", "b") == (1.0, 1, 5 * S)
    assert lat.figure("b", "a") is None          # measured from a to b says nothing of b's nodes
    lat.set("n2", "a", "b", 44.0, 40 * S)       # a node's new figure replaces its old one
    assert lat.figure("a", "b") == (44.0, 3, 40 * S)
    lat.expire(305 * S)                          # m1 (5 s + 300 s) is due; n1 (310 s) is not yet
    assert lat.figure("c", "b") is None
    assert lat.figure("a", "b") == (44.0, 3, 40 * S)
    lat.expire(310 * S)
    assert lat.figure("a", "b") == ((44.0 + 300.0) / 2, 2, 40 * S)
    lat.expire(335 * S)                          # n3 goes; n2's first entry (due at 320 s) was superseded
    assert lat.figure("a", "b") == (44.0, 1, 40 * S)
    lat.set("n2", "other", "b", None, 336 * S)   # no figure: taken out
    assert lat.figure("a", "b") is None
    assert not lat.values and not lat.newest
