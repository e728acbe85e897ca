"""OTLP from xpusense samples and events: the conversion to the SDK's MetricsData and log records,
the sender, and the `[export.otlp]` config table, shared by the agent's direct export and the
collector's exporter. Names, instruments and attributes come from common/semconv.py; resources,
instruments, start times and events as docs/export.md "OTLP" describes them."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from xpusense import __version__
from xpusense.v1 import telemetry_pb2 as pb

from . import semconv as sc
from .config import Key, complaint_from, positive
from .histograms import per_bucket

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import Gauge, Histogram, HistogramDataPoint, MetricsData, NumberDataPoint, Sum
    from opentelemetry.sdk.resources import Resource

log = logging.getLogger("xpusense.otlp")

SCOPE_NAME = "xpusense"
SERVICE_NAME = "xpusense"
# semconv service.instance.id: "the ID SHOULD be used as source of a UUID Version 5 and SHOULD use
# the following UUID as the namespace".
SERVICE_INSTANCE_NAMESPACE = uuid.UUID("4d63009a-8d0f-11ee-aad7-4c796ed8e320")

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
# The agent's HOST inventory resource (agent/sources/host.py) -> resource attributes.
HOST_ATTRIBUTES = {"host_id": "host.id", "arch": "host.arch", "os_type": "os.type"}
# platform.machine() -> semconv host.arch
ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm32",
        "i386": "x86", "i686": "x86", "ppc64le": "ppc64", "ppc64": "ppc64", "s390x": "s390x", "ia64": "ia64"}
ACCELERATOR_TYPES = ("GPU", "NPU")


def host_arch(machine: str) -> str:
    return ARCH.get(machine.lower(), machine.lower())


def service_instance_id(node_id: str) -> str:
    return str(uuid.uuid5(SERVICE_INSTANCE_NAMESPACE, node_id))


def resource_attributes(node_id: str, inv: pb.Inventory | None) -> dict[str, str]:
    """A node's resource: service.*, its id (service.instance.id a UUID v5 of it, the same whichever
    path its points take), host.* from the inventory's HOST resource, cloud.* / k8s.* from its labels."""
    attrs = {"service.name": SERVICE_NAME, "service.version": __version__,
             "service.instance.id": service_instance_id(node_id), "xpusense.node.id": node_id}
    if inv is not None:
        if inv.hostname:
            attrs["host.name"] = inv.hostname
        for k, v in inv.labels.items():
            if k in INVENTORY_LABEL_ATTRIBUTES and v:
                attrs[INVENTORY_LABEL_ATTRIBUTES[k]] = v
        for r in inv.resources:
            if r.type.upper() == "HOST":
                for k, a in HOST_ATTRIBUTES.items():
                    if r.attributes.get(k):
                        attrs[a] = host_arch(r.attributes[k]) if a == "host.arch" else r.attributes[k]
    return attrs


def local_host_attributes() -> dict[str, str]:
    """host.id and host.arch from the SDK's host detector (the agent's direct mode, as a fallback for
    an inventory without a HOST resource); {} when it cannot tell."""
    try:
        from opentelemetry.sdk.resources import get_aggregated_resources
        from opentelemetry.util._importlib_metadata import entry_points
        detector = next(iter(entry_points(group="opentelemetry_resource_detector", name="host"))).load()()
        got = dict(get_aggregated_resources([detector]).attributes)
    except Exception as e:   # a detector that fails costs only its attributes
        log.debug("host resource detector: %s", e)
        return {}
    out = {k: str(got[k]) for k in ("host.id", "host.arch") if got.get(k)}
    if "host.arch" in out:
        out["host.arch"] = host_arch(out["host.arch"])
    return out


class Resources:
    """Resource per attribute set, made once with the SDK's Resource.create() (its detectors run once)."""

    def __init__(self, max_size: int = 100_000):
        self.max_size = max_size
        self._made: dict[tuple, Resource] = {}

    def get(self, attrs: dict) -> Resource:
        key = tuple(sorted(attrs.items()))
        got = self._made.get(key)
        if got is None:
            from opentelemetry.sdk.resources import Resource
            if len(self._made) >= self.max_size:
                self._made.clear()
            got = self._made[key] = Resource.create(attrs, schema_url=sc.SCHEMA_URL)
        return got


def device_attributes(inv: pb.Inventory | None) -> dict[str, dict[str, str]]:
    """Inventory resource id -> every hw.* attribute a point about that device may get (semconv.py
    picks those the metric's model lists). Ascend NPUs are `hw.type` gpu: they report the hw.gpu.*
    metrics, the model has no npu type, and `hw.vendor` / `hw.model` tell them apart."""
    out: dict[str, dict[str, str]] = {}
    if inv is None:
        return out
    for r in inv.resources:
        if not r.id or r.type.upper() == "HOST":
            continue
        at = r.attributes
        a = {"hw.id": r.id, "hw.type": "gpu" if r.type.upper() in ACCELERATOR_TYPES else r.type.lower(),
             "hw.vendor": r.vendor, "hw.model": r.model,
             "hw.driver_version": at.get("driver") or at.get("driver_version", ""),
             "hw.firmware_version": at.get("firmware_version") or at.get("vbios_version", ""),
             "hw.serial_number": at.get("serial", ""), sc.UUID: at.get("uuid", "")}
        out[r.id] = {k: v for k, v in a.items() if v}
    return out


class StartTimes:
    """The start time of each cumulative series. The wire says counters run "since an unspecified
    start", so the start is the first time this exporter saw the series, moved to the previous
    point's time when the value falls (a counter reset: an agent or device restart); an
    UpDownCounter's start stays the first time seen. After an exporter restart the start moves on:
    backends treat that as a new cumulative stream, not as a reset to zero."""

    def __init__(self, max_series: int = 1_000_000):
        self.max_series = max_series
        self._seen: dict[tuple, tuple[int, int, float]] = {}   # key -> (start_ns, last_ns, last_value)

    def start(self, key: tuple, t_ns: int, value: float, resets: bool = True) -> int:
        """resets=False (UpDownCounters): a value that falls is no reset, the start stays."""
        got = self._seen.get(key)
        if got is None:
            if len(self._seen) >= self.max_series:
                self._seen.clear()   # bounded memory; starts move on, as after a restart
            start = t_ns
        else:
            start, last_ns, last_value = got
            if resets and value < last_value and t_ns >= last_ns:   # a reset: the new run began after the last point
                start = last_ns + 1 if last_ns < t_ns else t_ns
        if start > t_ns:
            start = t_ns
        self._seen[key] = (start, max(t_ns, got[1] if got else 0), value)
        return start


@dataclasses.dataclass
class Point:
    """One OTLP point of a wire sample, after the semconv mapping."""
    name: str
    instrument: str
    attributes: dict
    resource: tuple          # (key, value) pairs added to the node's resource
    value: float

    @functools.cached_property
    def key(self) -> tuple:
        return tuple(sorted(self.attributes.items()))


def _device(spec: sc.Metric | None, labels: dict, devices: dict) -> dict:
    """The hw.* attributes of the device (or sensor, or MIG instance) a point is about."""
    dev = labels.get("device")
    if not dev:
        return {}
    info = devices.get(dev) or {"hw.id": dev, "hw.type": "gpu", **({"hw.vendor": labels["vendor"]}
                                                                   if labels.get("vendor") else {})}
    mig = labels.get("mig_instance")
    if spec is not None and spec.device == sc.SENSOR:
        parent = f"{dev}/gi{mig}" if mig else dev
        sensor = labels.get("sensor", "")
        out = {"hw.id": f"{parent}/temperature" + (f"/{sensor}" if sensor else ""), "hw.parent": parent}
        if sensor:
            out["hw.sensor_location"] = sensor
        return out
    wanted = spec.hw if spec is not None else sc.DEFAULT_HW
    if mig:   # a MIG instance: its own hw.id; of the GPU's attributes only those true of it too
        return {"hw.id": f"{dev}/gi{mig}", "hw.parent": dev,
                **{k: info[k] for k in ("hw.type", "hw.vendor", "hw.driver_version") if k in wanted and k in info}}
    return {"hw.id": info["hw.id"], **{k: info[k] for k in wanted if k in info}}


def map_sample(s: pb.Sample, devices: dict, legacy_names: bool = False) -> list[Point]:
    """A wire sample -> its OTLP points (none, one, or one per state of a state set)."""
    spec = sc.lookup(s.name)
    labels = dict(s.labels)
    kind = {pb.COUNTER: sc.COUNTER, pb.HISTOGRAM: sc.HISTOGRAM}.get(s.kind, sc.GAUGE)
    if spec is None or (legacy_names and spec.legacy):
        attrs = {k: v for k, v in labels.items() if k not in ("device", "vendor", "mig_instance")}
        return [Point(s.name, kind, {**attrs, **_device(spec, labels, devices)}, (), float(s.value))]
    attrs, res = {}, []
    for k, v in labels.items():
        if (spec.device and k in sc.DEVICE_LABELS) or (spec.states is not None and k == spec.states.label):
            continue
        lab = spec.labels.get(k)
        if lab is None:
            attrs[k] = v
            continue
        if not lab.to:
            continue
        value = lab.values.get(v, v)
        if value is None:
            return []
        out: str | int = value
        if lab.integer:
            try:
                out = int(value)
            except ValueError:
                continue   # not a number: the attribute is left out rather than sent with the wrong type
        if lab.resource:
            res.append((lab.to, out))
        else:
            attrs[lab.to] = out
            if lab.detail and value != v:
                attrs[lab.detail] = v
    attrs.update(spec.const)
    if spec.device:
        attrs.update(_device(spec, labels, devices))
    instrument = spec.otlp_instrument
    if spec.states is None:
        return [Point(spec.name, instrument, attrs, tuple(sorted(res)), float(s.value))]
    st = spec.states
    wire = labels.get(st.label, "")
    state = st.values[wire] if wire in st.values else ("ok" if s.value >= 1 else "degraded")
    return [Point(spec.name, instrument, {**attrs, st.attribute: x}, tuple(sorted(res)), 1.0 if x == state else 0.0)
            for x in st.states]


def _histogram_point(s: pb.Sample, attrs: dict, start_ns: int) -> HistogramDataPoint:
    from opentelemetry.sdk.metrics.export import HistogramDataPoint
    h = s.histogram
    cum = list(h.counts)
    count = h.count or (cum[-1] if cum else 0)
    return HistogramDataPoint(attributes=attrs, start_time_unix_nano=start_ns, time_unix_nano=s.time_unix_nano,
                              count=int(count), sum=float(h.sum or s.value), bucket_counts=per_bucket(cum),
                              explicit_bounds=list(h.bounds),
                              # the SDK types min/max as float, but None (unknown) is accepted and encoded as absent
                              min=None, max=None,  # type: ignore[arg-type]
                              exemplars=[])


# One OTLP metric being built: (unit, instrument, (attributes key, time) -> [value, attributes, sample]).
_Building = tuple[str, str, dict[tuple, list]]


def _collect(groups, legacy_names: bool) -> dict[tuple, tuple[dict, dict[str, _Building]]]:
    """Map every sample; of two points of one series at one time (a batch sent twice) the later counts."""
    by_resource: dict[tuple, tuple[dict, dict[str, _Building]]] = {}
    for res_attrs, devices, samples in groups:
        base = tuple(sorted(res_attrs.items()))
        # A series comes once per round: map its labels once per request (the value is the sample's,
        # except in a state set, where it is part of the key).
        memo: dict[tuple, list[Point]] = {}
        for s in samples:
            spec = sc.lookup(s.name)
            key = (s.name, s.kind, tuple(sorted(s.labels.items())),
                   s.value if spec is not None and spec.states is not None else None)
            mapped = memo.get(key)
            if mapped is None:
                mapped = memo[key] = map_sample(s, devices, legacy_names)
            states = key[3] is not None
            for p in mapped:
                value = p.value if states else float(s.value)
                rkey = base + p.resource
                if rkey not in by_resource:
                    by_resource[rkey] = ({**res_attrs, **dict(p.resource)}, {})
                metrics = by_resource[rkey][1]
                entry = metrics.get(p.name)
                if entry is None:
                    entry = metrics[p.name] = (s.unit, p.instrument, {})
                elif entry[1] != p.instrument:
                    continue   # one name, one instrument: a point that disagrees is dropped
                entry[2][(p.key, s.time_unix_nano)] = [value, p.attributes, s]
    return by_resource


def metrics_data(groups: Iterable[tuple[dict, dict, Iterable[pb.Sample]]], starts: StartTimes,
                 series_key_prefix: tuple = (), legacy_names: bool = False,
                 resources: Resources | None = None) -> MetricsData:
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
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    resources = resources or Resources()
    scope = InstrumentationScope(SCOPE_NAME, __version__, schema_url=sc.SCHEMA_URL)
    out = []
    for rkey, (res_attrs, metrics) in _collect(groups, legacy_names).items():
        ms = []
        for name, (unit, instrument, points) in metrics.items():
            dps: list = []
            for (akey, t_ns), (value, attrs, s) in points.items():
                if instrument == sc.GAUGE:
                    dps.append(NumberDataPoint(attributes=attrs, start_time_unix_nano=0, time_unix_nano=t_ns,
                                               value=value, exemplars=[]))
                    continue
                key = (*series_key_prefix, rkey, name, akey)
                if instrument == sc.HISTOGRAM:
                    total = float(s.histogram.count or (s.histogram.counts[-1] if s.histogram.counts else 0))
                    dps.append(_histogram_point(s, attrs, starts.start(key, t_ns, total)))
                else:
                    start = starts.start(key, t_ns, value, resets=instrument == sc.COUNTER)
                    dps.append(NumberDataPoint(attributes=attrs, start_time_unix_nano=start, time_unix_nano=t_ns,
                                               value=value, exemplars=[]))
            if not dps:
                continue
            data: Sum | Histogram | Gauge
            if instrument in (sc.COUNTER, sc.UPDOWNCOUNTER):
                data = Sum(data_points=cast("list[NumberDataPoint]", dps),
                           aggregation_temporality=AggregationTemporality.CUMULATIVE,
                           is_monotonic=instrument == sc.COUNTER)
            elif instrument == sc.HISTOGRAM:
                data = Histogram(data_points=cast("list[HistogramDataPoint]", dps),
                                 aggregation_temporality=AggregationTemporality.CUMULATIVE)
            else:
                data = Gauge(data_points=cast("list[NumberDataPoint]", dps))
            ms.append(Metric(name=name, description="", unit=unit, data=data))
        if ms:
            out.append(ResourceMetrics(resource=resources.get(res_attrs), scope_metrics=[
                ScopeMetrics(scope=scope, metrics=ms, schema_url=sc.SCHEMA_URL)], schema_url=sc.SCHEMA_URL))
    return MetricsData(resource_metrics=out)


# Event severity (wire) -> OTLP SeverityNumber and its short name.
SEVERITY = {"info": (9, "INFO"), "warning": (13, "WARN"), "critical": (17, "ERROR")}
EVENT_NAME_PREFIX = "xpusense."


def log_attributes(e: pb.Event) -> dict[str, str]:
    attrs = dict(e.attributes)
    attrs["event.name"] = EVENT_NAME_PREFIX + (e.type or "event")
    attrs["xpusense.event.id"] = e.id
    if e.device:
        attrs["hw.id"] = e.device
    return attrs


def log_records(groups: Iterable[tuple[dict, Iterable[pb.Event]]], observed_ns: int,
                resources: Resources | None = None) -> list:
    """groups: (resource attributes, events) -> the SDK's ReadableLogRecords, one per event."""
    from opentelemetry._logs import LogRecord, SeverityNumber
    from opentelemetry.sdk._logs import ReadableLogRecord
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    resources = resources or Resources()
    scope = InstrumentationScope(SCOPE_NAME, __version__, schema_url=sc.SCHEMA_URL)
    out = []
    for res_attrs, events in groups:
        resource = resources.get(res_attrs)
        for e in events:
            number, text = SEVERITY.get(e.severity.lower(), (0, e.severity.upper()))
            attrs = log_attributes(e)
            rec = LogRecord(timestamp=e.time_unix_nano or observed_ns, observed_timestamp=observed_ns,
                            severity_text=text or None, severity_number=SeverityNumber(number),
                            body=e.message, attributes=attrs, event_name=attrs["event.name"])
            out.append(ReadableLogRecord(log_record=rec, resource=resource, instrumentation_scope=scope))
    return out


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
    """One OTLP gRPC metric exporter (the SDK's), or with `logs` its log record exporter, from config:
    endpoint, insecure, headers, timeout_s.

    `send()` makes one export call (the SDK retries transient errors inside it, within timeout_s)
    and says whether the backend accepted. `shutdown()` interrupts a send in progress.
    """

    def __init__(self, endpoint: str, insecure: bool = False, headers: str = "", timeout_s: float = 10.0,
                 reconnect_backoff_max_s: float = 5.0, exporter=None, logs: bool = False):
        """logs: an exporter of log records (the LogsService on the same endpoint), not of metrics."""
        self.endpoint = endpoint
        self.logs = logs
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            exporter = (OTLPLogExporter if logs else OTLPMetricExporter)(
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
        try:
            if self.logs:   # the log exporter's timeout is its constructor's
                from opentelemetry.sdk._logs.export import LogRecordExportResult
                return self.exporter.export(data) == LogRecordExportResult.SUCCESS
            from opentelemetry.sdk.metrics.export import MetricExportResult
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
        "legacy_names": Key(bool, False, help="export hw.errors, hw.status, hw.gpu.io and the load averages under "
                                              "their xpusense 0.1 names and labels (kept for one release)"),
    }
    if collector:
        schema["queue_batches"] = Key(int, 10_000, positive,
                                      help="without data_dir: batches kept for the backend (oldest dropped, counted)")
        schema["logs"] = Key(bool, True, help="also export events (diagnoses, XIDs, checkpoint requests...) as OTLP "
                                              "log records, to the same endpoint's LogsService")
        schema["queue_events"] = Key(int, 10_000, positive,
                                     help="events waiting for the LogsService (oldest dropped, counted)")
    else:
        schema["queue_points"] = Key(int, 200_000, positive,
                                     help="points kept for the backend (oldest dropped, counted)")
        schema["only"] = Key(bool, False, help="export only over OTLP: no stream to a collector")
    return schema
