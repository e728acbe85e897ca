"""What every measurement is tagged with: the tier it is taken at and the kind of its value.

The agent's sources, the probes' specs and the collector all use these names; the wire carries the
kind as an enum (proto/xpusense/v1).
"""

from __future__ import annotations

# Tiers (DESIGN.md "Tiers"): default periods 1 s, 15 s, 5 min, set in [tiers].
REALTIME, NEARLINE, OFFLINE = "realtime", "nearline", "offline"
TIERS = (REALTIME, NEARLINE, OFFLINE)

# Kinds: gauges carry the value now, counters the running total, histograms cumulative buckets.
GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
KINDS = (GAUGE, COUNTER, HISTOGRAM)
