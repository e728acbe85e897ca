"""The compact encoding as an agent sends it, for the collector's tests: a batch of full samples
turned into columns (rows by ref, histograms by row, ref-0 samples whole) with the definitions its
refs need, and rounds of one boot that exercise every path (one time, several, ref 0, histograms)."""

from __future__ import annotations

from xpusense.common import compact
from xpusense.v1 import telemetry_pb2 as pb

S = 10**9


def definition(s: pb.Sample) -> pb.Sample:
    d = pb.Sample()
    d.CopyFrom(s)
    for f in ("value", "time_unix_nano", "histogram"):
        d.ClearField(f)
    return d


def as_compact(b: pb.Batch) -> tuple[pb.Batch, list[pb.Sample]]:
    """`b` in the compact encoding, and the definitions of the refs it uses."""
    with_ref = sorted((s for s in b.samples if s.series_ref), key=lambda s: s.series_ref)
    rows = [(s.series_ref, s.time_unix_nano, s.value) for s in with_ref]
    hists = {i: (list(s.histogram.bounds), list(s.histogram.counts))
             for i, s in enumerate(with_ref) if s.HasField("histogram")}
    out = pb.Batch(node_id=b.node_id, boot_id=b.boot_id, seq=b.seq, sent_unix_nano=b.sent_unix_nano,
                   columns=compact.encode_columns(rows, hists), events=b.events,
                   samples=[s for s in b.samples if not s.series_ref])
    return out, [definition(s) for s in with_ref]


def sample(name: str, ref: int, t: int, v: float, kind=pb.GAUGE, hist=None, **labels) -> pb.Sample:
    s = pb.Sample(name=name, unit="1", kind=kind, labels=labels, value=v, time_unix_nano=t, series_ref=ref)
    if hist is not None:
        s.histogram.bounds.extend(hist[0])
        s.histogram.counts.extend(hist[1])
        s.histogram.sum, s.histogram.count = v, hist[1][-1]
    return s


def rounds(node: str = "n1", boot: str = "boot-1", n: int = 6, t0: int = 1_000 * S + 123) -> list[pb.Batch]:
    """Batches of one boot: one time each (the usual round), several times in one, ref-0 samples,
    histograms, a series new in a later batch, an event, values that are not whole numbers."""
    out = []
    for k in range(n):
        t = t0 + k * S
        ss = [sample("gpu_util", 1 + d, t, 0.25 * d + k / 3, device=str(d)) for d in range(3)]
        ss.append(sample("power_w", 4, t, 300.5 + k, device="0"))
        if k % 2:   # a slower tier's sample, at its own time, in the same batch
            ss.append(sample("temp_c", 5, t - S // 2, 40.0 + k, device="0"))
        if k >= 3:   # a series that starts later
            ss.append(sample("mem_used", 7, t, 1e9 * k, pb.COUNTER, device="0"))
        events = []
        if k == 2:   # a histogram, samples without a ref, an event
            ss.append(sample("tcp_rtt", 6, t, 12.5, pb.HISTOGRAM, ([1.0, 10.0], [1, 3, 5]), peer="a"))
            ss.append(sample("no_ref", 0, t, 7.0, device="9"))
            ss.append(sample("no_ref", 0, t + 5, 8.0, device="8"))
            events.append(pb.Event(id=f"e{k}", type="health", severity="warning", message="m", time_unix_nano=t))
        out.append(pb.Batch(node_id=node, boot_id=boot, seq=k + 1, sent_unix_nano=t, samples=ss, events=events))
    return out
