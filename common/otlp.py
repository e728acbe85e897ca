"""OTLP metrics from xpusense samples: the conversion and the sender that the agent's direct export
and the collector's exporter share, and their `[export.otlp]` config table.
direct export (opentelemetry-sdk's OTLP gRPC metric exporter) for operators who want only
observability.

Conversion:
- one OTLP Resource per node: `service.name` xpusense, `host.name`, `xpusense.node.id`, and from the
  inventory labels the agent sends (`[labels]` in its config): `cloud` -> `cloud.provider`, `region`
  -> `cloud.region`, `zone` -> `cloud.availability_zone`, `k8s_node` (or `k8s.node.name`) ->
  `k8s.node.name`;
- a series with a `device` label that names an inventory resource gets that device's attributes:
  `hw.id`, `hw.type` (gpu / npu), `hw.vendor`, `hw.model` (and `hw.uuid` when NVML gave one);
- names and units are those of docs/metrics.md, unchanged; gauges become Gauges, counters
  cumulative monotonic Sums, histograms cumulative explicit-bucket Histograms (our cumulative
  `counts` become OTLP's per-bucket counts).

A cumulative point needs a start time. The wire says counters run "since an unspecified start", so
the start is the first time this exporter saw the series, moved to the previous point's time when
the value falls (a counter reset: an agent or device restart). After an exporter restart the start
moves on; backends treat that as a new cumulative stream, not as a reset to zero.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from xpusense import __version__
from xpusense.v1 import telemetry_pb2 as pb

from .config import Key, complaint_from, positive

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Gauge, Histogram, HistogramDataPoint, MetricsData, NumberDataPoint, Sum

log = logging.getLogger("xpusense.otlp")

SCOPE_NAME = "xpusense"

INVENTORY_LABEL_ATTRIBUTES = {
    "cloud": "cloud.provider",
    "cloud.provider": "cloud.provider",
    "region": "cloud.region",
    "cloud.region": "cloud.region",
    "zone": "cloud.availability_zone",
    "cloud.availability_zone": "cloud.availability_zone",
    "k8s_node": "k8s.node.name",
    "k8s.node.name": "k8s.node.name",
}


def resource_attributes(node_id: str, inv: pb.Inventory | None) -> dict[str, str]:
    attrs = {"service.name": "xpusense", "xpusense.node.id": node_id}
    if inv is not None:
        if inv.hostname:
            attrs["host.name"] = inv.hostname
        for k, v in inv.labels.items():
            if k in INVENTORY_LABEL_ATTRIBUTES and v:
                attrs[INVENTORY_LABEL_ATTRIBUTES[k]] = v
    return attrs


def device_attributes(inv: pb.Inventory | None) -> dict[str, dict[str, str]]:
    """Inventory resource id -> the attributes a series about that device gets."""
    out: dict[str, dict[str, str]] = {}
    if inv is None:
        return out
    for r in inv.resources:
        if not r.id:
            continue
        a = {"hw.id": r.id, "hw.type": r.type.lower(), "hw.vendor": r.vendor, "hw.model": r.model}
        uuid = r.attributes.get("uuid")
        if uuid:
            a["hw.uuid"] = uuid
        out[r.id] = {k: v for k, v in a.items() if v}
    return out


class StartTimes:
    """The start time of each cumulative series (see the module docstring)."""

    def __init__(self, max_series: int = 1_000_000):
        self.max_series = max_series
        self._seen: dict[tuple, tuple[int, int, float]] = {}   # key -> (start_ns, last_ns, last_value)

    def start(self, key: tuple, t_ns: int, value: float) -> int:
        got = self._seen.get(key)
        if got is None:
            if len(self._seen) >= self.max_series:
                self._seen.clear()   # bounded memory; starts move on, as after a restart
            start = t_ns
        else:
            start, last_ns, last_value = got
            if value < last_value and t_ns >= last_ns:   # a reset: the new run began after the last point
                start = last_ns + 1 if last_ns < t_ns else t_ns
        if start > t_ns:
            start = t_ns
        self._seen[key] = (start, max(t_ns, got[1] if got else 0), value)
        return start


def _histogram_point(s: pb.Sample, attrs: dict, start_ns: int) -> HistogramDataPoint:
    from opentelemetry.sdk.metrics.export import HistogramDataPoint
    h = s.histogram
    cum = list(h.counts)
    per_bucket = [c - p for c, p in zip(cum, [0] + cum[:-1])]
    if any(x < 0 for x in per_bucket):   # not cumulative after all: take the counts as they are
        per_bucket = cum
    count = h.count or (cum[-1] if cum else 0)
    return HistogramDataPoint(attributes=attrs, start_time_unix_nano=start_ns, time_unix_nano=s.time_unix_nano,
                              count=int(count), sum=float(h.sum or s.value), bucket_counts=per_bucket,
                              explicit_bounds=list(h.bounds),
                              # the SDK types min/max as float, but None (unknown) is accepted and encoded as absent
                              min=None, max=None,  # type: ignore[arg-type]
                              exemplars=[])


def metrics_data(groups: Iterable[tuple[dict, dict, Iterable[pb.Sample]]], starts: StartTimes,
                 series_key_prefix: tuple = ()) -> MetricsData:
    """groups: (resource attributes, device attributes by id, samples) -> the SDK's MetricsData.

    Points of the same metric name within a resource go into one Metric (several points of one
    series at different times are allowed: each is a point in time of a cumulative stream).
    """
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Histogram,
        Metric,
        MetricsData,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    scope = InstrumentationScope(SCOPE_NAME, __version__)
    # resource key -> (resource attributes, metric name -> (unit, kind, points)); the points of one
    # metric are all NumberDataPoints (gauge, counter) or all HistogramDataPoints (histogram).
    by_resource: dict[tuple, tuple[dict, dict[str, tuple[str, int, list[NumberDataPoint | HistogramDataPoint]]]]] = {}
    for res_attrs, devices, samples in groups:
        rkey = tuple(sorted(res_attrs.items()))
        _, metrics = by_resource.setdefault(rkey, (res_attrs, {}))
        node = res_attrs.get("xpusense.node.id", "")
        for s in samples:
            labels = dict(s.labels)
            dev = labels.get("device")
            attrs = {**devices[dev], **labels} if dev in devices else labels
            kind = s.kind
            entry = metrics.get(s.name)
            if entry is None:
                entry = metrics[s.name] = (s.unit, kind, [])
            elif entry[1] != kind:
                continue   # one name, one kind: a sample that disagrees is dropped (never seen from our sources)
            if kind == pb.GAUGE or kind == pb.METRIC_KIND_UNSPECIFIED:
                entry[2].append(NumberDataPoint(attributes=attrs, start_time_unix_nano=0,
                                                time_unix_nano=s.time_unix_nano, value=float(s.value),
                                                exemplars=[]))
                continue
            key = (*series_key_prefix, node, s.name, tuple(sorted(labels.items())))
            if kind == pb.COUNTER:
                start = starts.start(key, s.time_unix_nano, s.value)
                entry[2].append(NumberDataPoint(attributes=attrs, start_time_unix_nano=start,
                                                time_unix_nano=s.time_unix_nano, value=float(s.value),
                                                exemplars=[]))
            elif kind == pb.HISTOGRAM:
                total = float(s.histogram.count or (s.histogram.counts[-1] if s.histogram.counts else 0))
                start = starts.start(key, s.time_unix_nano, total)
                entry[2].append(_histogram_point(s, attrs, start))
    out = []
    for res_attrs, metrics in by_resource.values():
        ms = []
        for name, (unit, kind, points) in metrics.items():
            if not points:
                continue
            data: Sum | Histogram | Gauge
            if kind == pb.COUNTER:
                data = Sum(data_points=cast("list[NumberDataPoint]", points),
                           aggregation_temporality=AggregationTemporality.CUMULATIVE, is_monotonic=True)
            elif kind == pb.HISTOGRAM:
                data = Histogram(data_points=cast("list[HistogramDataPoint]", points),
                                 aggregation_temporality=AggregationTemporality.CUMULATIVE)
            else:
                data = Gauge(data_points=cast("list[NumberDataPoint]", points))
            ms.append(Metric(name=name, description="", unit=unit, data=data))
        if ms:
            out.append(ResourceMetrics(resource=Resource(res_attrs), scope_metrics=[
                ScopeMetrics(scope=scope, metrics=ms, schema_url="")], schema_url=""))
    return MetricsData(resource_metrics=out)


def parse_headers(text: str) -> dict[str, str]:
    """'k1=v1,k2=v2' (OTEL_EXPORTER_OTLP_HEADERS style) -> dict; raises ValueError on a bad pair."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"header {part!r} is not KEY=VALUE")
        out[k.strip().lower()] = v.strip()
    return out


headers_check = complaint_from(parse_headers)


class OtlpSender:
    """One OTLP gRPC metric exporter (the SDK's) from config: endpoint, insecure, headers, timeout_s.

    `send()` makes one export call (the SDK retries transient errors inside it, within timeout_s)
    and says whether the backend accepted. `shutdown()` interrupts a send in progress.
    """

    def __init__(self, endpoint: str, insecure: bool = False, headers: str = "", timeout_s: float = 10.0,
                 reconnect_backoff_max_s: float = 5.0, exporter=None):
        self.endpoint = endpoint
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            exporter = OTLPMetricExporter(
                endpoint=endpoint, insecure=insecure, headers=parse_headers(headers) or None, timeout=timeout_s,
                # gRPC's own reconnect backoff grows to 120 s: keep it near ours so a backend that
                # came back is used within seconds.
                # (the SDK annotates channel_options as string values; grpc takes these options as ints)
                channel_options=(("grpc.max_reconnect_backoff_ms",  # type: ignore[arg-type]
                                  int(reconnect_backoff_max_s * 1000)),
                                 ("grpc.initial_reconnect_backoff_ms", 200)))
        self.exporter = exporter
        self.timeout_s = timeout_s

    def send(self, data) -> bool:
        from opentelemetry.sdk.metrics.export import MetricExportResult
        try:
            return self.exporter.export(data, timeout_millis=self.timeout_s * 1000) == MetricExportResult.SUCCESS
        except Exception as e:   # an encoding bug must not kill the export thread
            log.error("OTLP export to %s failed: %s: %s", self.endpoint, type(e).__name__, e)
            return False

    def shutdown(self) -> None:
        try:
            self.exporter.shutdown(timeout_millis=1000)
        except Exception:
            pass


def endpoint_check(v: str) -> str | None:
    if re.fullmatch(r"(https?://)?(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-_]+):\d{1,5}/?", v):
        return None
    return "must be HOST:PORT or http(s)://HOST:PORT (the OTLP gRPC receiver, usually port 4317)"


def otlp_schema(collector: bool) -> dict:
    schema = {
        "enabled": Key(bool, False, help="export metrics over OTLP gRPC"),
        "endpoint": Key(str, "127.0.0.1:4317", endpoint_check,
                        help="OTLP gRPC receiver; https:// means TLS (with the system's CAs)"),
        "insecure": Key(bool, True, help="plaintext gRPC (no TLS) unless the endpoint says https://"),
        "headers": Key(str, "", headers_check, help="KEY=VALUE,KEY=VALUE sent with every export (e.g. auth)"),
        "interval_s": Key((int, float), 5.0 if collector else 10.0, positive, help="how often queued points are sent"),
        "timeout_s": Key((int, float), 10.0, positive, help="one export call, the SDK's own retries included"),
        "backoff_max_s": Key((int, float), 30.0, positive, help="longest wait between two tries while the backend fails"),
        "max_request_points": Key(int, 5000, positive, help="points per export request (gRPC's 4 MiB default limit)"),
    }
    if collector:
        schema["queue_batches"] = Key(int, 10_000, positive,
                                      help="without data_dir: batches kept for the backend (oldest dropped, counted)")
    else:
        schema["queue_points"] = Key(int, 200_000, positive,
                                     help="points kept for the backend (oldest dropped, counted)")
        schema["only"] = Key(bool, False, help="export only over OTLP: no stream to a collector")
    return schema
