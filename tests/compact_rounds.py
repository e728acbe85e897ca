"""Rounds of agent samples for the compact encoding's tests (gauges, a counter, histograms, one
over the columns' bucket bound) and what a Sample-encoding agent's batches carry for them."""

from __future__ import annotations

from xpusense.agent.batch_build import sample_to_proto
from xpusense.agent.sources.base import COUNTER, HISTOGRAM, Sample
from xpusense.v1 import telemetry_pb2 as pb

T0 = 1_700_000_000_000_000_000


def round_of(i: int, extra: int = 0, t0: int = T0) -> list[Sample]:
    """Round `i`: two gauges (labels in either order), a counter, a histogram, a histogram with more
    buckets than the columns carry, and `extra` series more."""
    t = t0 + i * 1_000_000_000
    out = [Sample("gpu.util", 0.5 + i, "1", {"gpu": "0", "uuid": "GPU-a"}, time_ns=t),
           Sample("gpu.util", 0.25 * i, "1", {"uuid": "GPU-b", "gpu": "1"}, time_ns=t + 7),
           Sample("net.bytes", 1e9 + i, "By", {"device": "eth0"}, kind=COUNTER, time_ns=t + 11),
           Sample("tcp.rtt", 3.5 * i, "s", {"dst": "10.0.0.1"}, kind=HISTOGRAM, time_ns=t + 13,
                  bounds=(0.001, 0.01, 0.1), counts=(i, 2 * i, 3 * i, 4 * i)),
           Sample("big.hist", 2.0 * i, "s", {}, kind=HISTOGRAM, time_ns=t + 17,
                  bounds=tuple(float(b) for b in range(300)), counts=tuple(range(i, i + 301)))]
    out += [Sample(f"extra.{k}", float(k * i), "1", {"k": str(k)}, time_ns=t + 19) for k in range(extra)]
    return out


def norm(s: pb.Sample) -> tuple:
    """A sample as stored: everything but its series_ref."""
    h = s.histogram
    return (s.name, s.unit, s.kind, tuple(sorted(s.labels.items())), s.value, s.time_unix_nano,
            tuple(h.bounds), tuple(h.counts), h.sum, h.count)


def expected(rounds: list[list[Sample]]) -> list[tuple]:
    """What a Sample-encoding agent's batches carry for these rounds (its own encoder), sorted."""
    return sorted(norm(sample_to_proto(s)) for r in rounds for s in r)
