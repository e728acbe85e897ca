"""A Prometheus endpoint on the collector (`[export.prometheus] listen`): the fleet's latest values
rendered at scrape time under OpenTelemetry's Prometheus names, with `compat_names` also under
dcgm-exporter's and npu-exporter's (docs/export.md). Scrapes run on the HTTP thread: each dict
walked is copied with one C-level call (`list(d.values())`, atomic under the GIL), and the loop
replaces a series' value and time, never mutates them in place."""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from xpusense.common import metric_names as m
from xpusense.common.config import ConfigError, split_host_port
from xpusense.v1 import telemetry_pb2 as pb

from . import diagnoses as dg
from .compat_pods import DevicePods
from .fleet_interface import Fleet
from .inventory_book import InventoryBook
from .prom_names import REASONS, Families, Tally, prom_labels, prom_name

__all__ = ["DCGM", "NPU", "FleetCollector", "PrometheusEndpoint", "npu_id", "prom_labels", "prom_name"]

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

log = logging.getLogger("xpusense.collector.prometheus")

SANITIZED = "xpusense_collector_prometheus_sanitized"
# The families the collector writes itself, by type: a node's series never takes these names.
OWN = {"xpusense_node_connected": "gauge", "xpusense_diagnoses_open": "gauge",
       "xpusense_diagnoses_opened": "counter", SANITIZED: "counter",
       "xpusense_collector_prometheus_refused": "counter"}   # web_config.py's, with a web-config file

# dcgm-exporter's names (NVIDIA/dcgm-exporter etc/default-counters.csv and etc/dcp-metrics-included.csv;
# labels gpu, UUID, device, modelName, Hostname, as dcgm-exporter writes them): our series -> (name,
# scale, type, help). Units are DCGM's: % (0-100), MiB, W, C, mJ, MHz, ratio 0-1 for DCGM_FI_PROF_*.
# A series: (name, its labels that select the mapped name, as (key, value) pairs).
_SeriesKey = tuple[str, tuple[tuple[str, str], ...]]

DCGM: dict[_SeriesKey, tuple[str, float, str, str]] = {
    (m.GPU_UTILIZATION, ()): ("DCGM_FI_DEV_GPU_UTIL", 100.0, "gauge", "GPU utilization (in %)."),
    (m.MEMORY_CONTROLLER_UTILIZATION, ()):
        ("DCGM_FI_DEV_MEM_COPY_UTIL", 100.0, "gauge", "Memory utilization (in %)."),
    (m.GPU_MEMORY_USAGE, ()): ("DCGM_FI_DEV_FB_USED", 1 / 2**20, "gauge", "Framebuffer memory used (in MiB)."),
    (m.MEMORY_FREE, ()): ("DCGM_FI_DEV_FB_FREE", 1 / 2**20, "gauge",
                                               "Framebuffer memory free (in MiB)."),
    (m.POWER, ()): ("DCGM_FI_DEV_POWER_USAGE", 1.0, "gauge", "Power draw (in W)."),
    (m.TEMPERATURE, (("sensor", "chip"),)): ("DCGM_FI_DEV_GPU_TEMP", 1.0, "gauge", "GPU temperature (in C)."),
    (m.TEMPERATURE, (("sensor", "hbm"),)): ("DCGM_FI_DEV_MEMORY_TEMP", 1.0, "gauge", "Memory temperature (in C)."),
    (m.ENERGY, ()): ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1000.0, "counter",
                        "Total energy consumption since boot (in mJ)."),
    # GPM DRAM bandwidth utilisation is the closest we have to DCP's DRAM active ratio (0-1).
    (m.HBM_BANDWIDTH_UTILIZATION, ()):
        ("DCGM_FI_PROF_DRAM_ACTIVE", 1.0, "gauge",
         "Ratio of cycles the device memory interface is active sending or receiving data."),
    (m.SM_UTILIZATION, ()):
        ("DCGM_FI_PROF_SM_ACTIVE", 1.0, "gauge", "The ratio of cycles an SM has at least 1 warp assigned."),
    (m.CUBE_UTILIZATION, ()):
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 1.0, "gauge", "Ratio of cycles the tensor (HMMA) pipe is active."),
    (m.GRAPHICS_UTILIZATION, ()):
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 1.0, "gauge", "Ratio of time the graphics engine is active."),
    (m.CLOCK_FREQUENCY, (("clock", "sm"),)):
        ("DCGM_FI_DEV_SM_CLOCK", 1e-6, "gauge", "SM clock frequency (in MHz)."),
    (m.CLOCK_FREQUENCY, (("clock", "memory"),)):
        ("DCGM_FI_DEV_MEM_CLOCK", 1e-6, "gauge", "Memory clock frequency (in MHz)."),
    (m.REMAPPED_ROWS, (("type", "correctable"),)):
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", 1.0, "counter", "Number of remapped rows for correctable errors"),
    (m.REMAPPED_ROWS, (("type", "uncorrectable"),)):
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 1.0, "counter",
         "Number of remapped rows for uncorrectable errors"),
    (m.REMAP_FAILED, ()):
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", 1.0, "gauge", "Whether remapping of rows has failed"),
    (m.LAST_XID, ()): ("DCGM_FI_DEV_XID_ERRORS", 1.0, "gauge", "Value of the last XID error encountered."),
}

# npu-exporter's names (Ascend/ascend-npu-exporter collector/npu_collector.go; MindX DL docs: % for
# utilisation, MB for memory, W, Celsius, health 1 healthy / 0 unhealthy). Labels: `id` (the chip's
# physical id), `model_name`, and, as its newer versions write them, `container_name`, `namespace`,
# `pod_name` (the pod's the chip is assigned to, else empty: collector/compat_pods.py), plus `node`
# (our node id; one collector serves many nodes where npu-exporter runs per node).
NPU: dict[_SeriesKey, tuple[str, float, str]] = {
    (m.GPU_UTILIZATION, ()): ("npu_chip_info_utilization", 100.0, "the ai core utilization"),
    (m.VECTOR_UTILIZATION, ()):
        ("npu_chip_info_vector_utilization", 100.0, "the vector core utilization"),
    (m.GPU_MEMORY_USAGE, ()): ("npu_chip_info_hbm_used_memory", 1 / 2**20, "the npu hbm used memory"),
    (m.GPU_MEMORY_LIMIT, ()): ("npu_chip_info_hbm_total_memory", 1 / 2**20, "the npu hbm total memory"),
    (m.GPU_MEMORY_UTILIZATION, ()): ("npu_chip_info_hbm_utilization", 100.0, "the npu hbm utilization"),
    (m.HBM_BANDWIDTH_UTILIZATION, ()):
        ("npu_chip_info_hbm_bandwidth_utilization", 100.0, "the npu hbm bandwidth util rate"),
    (m.POWER, ()): ("npu_chip_info_power", 1.0, "the npu power"),
    (m.TEMPERATURE, (("sensor", "chip"),)): ("npu_chip_info_temperature", 1.0, "the npu temperature"),
    (m.TEMPERATURE, (("sensor", "hbm"),)): ("npu_chip_info_hbm_temperature", 1.0, "the npu hbm temperature"),
    (m.HEALTH, ()): ("npu_chip_info_health_status", 1.0, "the npu health status"),
    # The first error code npu-smi lists now, as a number (npu-exporter: the first of its code list).
    (m.NPU_ERROR_CODE, ()): ("npu_chip_info_error_code", 1.0, "the npu error code"),
}

def npu_id(res, index: int) -> str:
    """npu-exporter's `id` is the chip's physical id: from the inventory where npu-smi gave one,
    else the NPU ID for one chip per card (`npuN-0`), else the chip's position among the NPUs."""
    phy = res.attributes.get("phy_id") if res is not None else None
    if phy:
        return phy
    m = re.fullmatch(r"npu(\d+)-(\d+)", res.id if res is not None else "")
    if m and res.attributes.get("chips_per_card", "1") == "1":
        return m.group(1)
    return str(index)


class FleetCollector:
    """prometheus-client custom collector over the fleet."""

    def __init__(self, state: Fleet, book: InventoryBook, compat_names: bool = False, max_age_s: float = 900.0,
                 clock_ns=time.time_ns):
        self.state = state
        self.clock_ns = clock_ns
        self.book = book
        self.compat_names = compat_names
        self.max_age_s = max_age_s
        self.scrapes = 0
        self.sanitized: dict[str, int] = dict.fromkeys(REASONS, 0)   # since start, per reason (prom_names.py)
        self._lock = threading.Lock()

    def describe(self):
        return []   # unchecked collector: the set of names depends on the fleet

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import Metric
        self.scrapes += 1
        tally = Tally()
        families = self._families(tally)
        now_ns = self.clock_ns()
        cutoff = now_ns - int(self.max_age_s * 1e9)
        emit = families.add

        def compat(name: str, kind: str, help_: str, labels: dict, value: float) -> None:
            families.add(name, kind, help_, labels, value, own=True)

        up = Metric("xpusense_node_connected", "1 while the node's agent has a stream open", "gauge")
        for n in list(self.state.nodes.values()):
            up.add_sample("xpusense_node_connected", {"node": n.node_id}, 1.0 if n.streams > 0 else 0.0)
            inv = self.book.get(n.node_id)
            host = inv.hostname if inv is not None else ""
            resources = {r.id: r for r in inv.resources} if inv is not None else {}
            npus = [r.id for r in resources.values() if r.type == "NPU"]
            all_series = list(n.series.values())
            pods = DevicePods(all_series, cutoff) if self.compat_names else None
            for ser in all_series:
                t, value = ser.recv_ns, ser.value   # its age: since it arrived (collector/clock.py)
                if t < cutoff or math.isnan(value):
                    continue
                tally.where = (ser.name, n.node_id)
                name = prom_name(ser.name, ser.unit, ser.kind, tally)
                if not name:
                    continue
                labels = {**prom_labels(ser.labels, tally=tally), "node": n.node_id, "host_name": host}
                help_ = f"{ser.name} ({ser.unit})"
                h = ser.histogram
                if ser.kind == pb.COUNTER:
                    emit(name, "counter", help_, labels, value)
                elif ser.kind == pb.HISTOGRAM and h is not None:
                    counts = list(h.counts)
                    total = float(h.count or (counts[-1] if counts else 0))
                    buckets = [(_le(b), float(c)) for b, c in zip(h.bounds, counts)] + [("+Inf", total)]
                    emit(name, "histogram", help_, labels, value, (buckets, total, float(h.sum or value)))
                else:
                    emit(name, "gauge", help_, labels, value)
                if self.compat_names and "device" in ser.labels:
                    dev = ser.labels["device"]
                    self._compat(compat, ser, value, n.node_id, host, resources.get(dev),
                                 npus.index(dev) if dev in npus else 0, pods)
        yield up
        yield from families.metrics.values()
        yield from self._diagnoses()
        yield self._sanitized(tally)

    def _families(self, tally: Tally) -> Families:
        """This scrape's families, with the names the collector writes itself kept from the nodes'
        series: its own metrics and, with compat_names, the dashboards' names."""
        families = Families(tally)
        for name, kind in OWN.items():
            families.reserve(name, kind)
        if self.compat_names:
            for dcgm_name, _, kind, _ in DCGM.values():
                families.reserve(dcgm_name, "unknown" if kind == "counter" else kind)
            for npu_name, _, _ in NPU.values():
                families.reserve(npu_name, "gauge")
        return families

    def _sanitized(self, tally: Tally) -> Metric:
        """What the scrapes renamed or left out, per reason, since start (each scrape adds its own);
        the first time a reason happens it is logged with its first case."""
        from prometheus_client.metrics_core import Metric
        with self._lock:
            new = [r for r in tally.counts if self.sanitized[r] == 0]
            for r, k in tally.counts.items():
                self.sanitized[r] += k
            counts = dict(self.sanitized)
        for r in new:
            log.warning("Prometheus: %s, first %s (counted in %s_total{reason=%r}; docs/export.md)",
                        REASONS[r], tally.first[r], SANITIZED, r)
        m = Metric(SANITIZED, "label keys and series renamed or left out so that Prometheus accepts the "
                              "scrape, per reason (docs/export.md)", "counter")
        for r, k in counts.items():
            m.add_sample(SANITIZED + "_total", {"reason": r}, float(k))
        return m

    def _diagnoses(self) -> Iterator[Metric]:
        """Open diagnoses per node, rule and device (a gauge; a closed one is no longer written) and
        diagnoses opened per rule since the collector started (collector/diagnoses.py)."""
        from prometheus_client.metrics_core import Metric
        open_ = Metric("xpusense_diagnoses_open", "diagnoses open now (docs/diagnosis.md)", "gauge")
        count: dict[tuple[str, str, str], int] = {}
        for n in list(self.state.nodes.values()):
            for e in list(n.diagnoses.values()):
                key = (n.node_id, e.attributes.get(dg.RULE, "") or "unknown", e.device)
                count[key] = count.get(key, 0) + 1
        for (node, rule, device), k in sorted(count.items()):
            open_.add_sample("xpusense_diagnoses_open", {"node": node, "rule": rule, "device": device}, float(k))
        yield open_
        opened = Metric("xpusense_diagnoses_opened", "diagnoses opened since the collector started", "counter")
        for rule, k in sorted(list(self.state.diagnoses.opened.items())):
            opened.add_sample("xpusense_diagnoses_opened_total", {"rule": rule}, float(k))
        yield opened

    def _compat(self, emit, ser, value, node_id, host, res, npu_idx, pods: DevicePods | None = None) -> None:
        vendor = ser.labels.get("vendor", res.vendor if res is not None else "")
        extra = tuple((k, v) for k, v in ser.labels.items() if k in ("sensor", "clock", "type"))
        if vendor == "nvidia":
            dcgm_spec = DCGM.get((ser.name, extra))
            if dcgm_spec is None:
                return
            name, scale, kind, help_ = dcgm_spec
            dev = ser.labels["device"]
            num = dev[3:] if dev.startswith("gpu") else dev
            labels = {"gpu": num, "UUID": res.attributes.get("uuid", "") if res is not None else "",
                      "device": f"nvidia{num}", "modelName": res.model if res is not None else "",
                      "Hostname": host or node_id}
            if "mig_instance" in ser.labels:
                labels["GPU_I_ID"] = ser.labels["mig_instance"]
            pod_keys = ("pod", "namespace", "container")   # dcgm-exporter's Kubernetes labels
        elif vendor == "huawei":
            npu_spec = NPU.get((ser.name, extra))
            if npu_spec is None:
                return
            name, scale, help_ = npu_spec
            kind = "gauge"
            labels = {"id": npu_id(res, npu_idx), "model_name": res.model if res is not None else "",
                      "container_name": "", "namespace": "", "pod_name": "", "node": node_id}
            pod_keys = ("pod_name", "namespace", "container_name")
        else:
            return
        if kind == "counter":
            kind = "unknown"   # dcgm-exporter writes its counters without `_total`: keep the exact name
        dev, mig = ser.labels["device"], ser.labels.get("mig_instance", "")
        on = pods.pods(dev, mig) if pods is not None else []
        if not on:   # no pod: the labels as without Kubernetes
            emit(name, kind, help_, labels, value * scale)
            return
        for pod in on:   # one series per pod on the device (compat_pods.py)
            own = pods.share(ser.name, dev, mig, pod) if pods is not None and len(on) > 1 else None
            emit(name, kind, help_, {**labels, **dict(zip(pod_keys, pod))}, (value if own is None else own) * scale)


def _le(bound: float) -> str:
    return repr(float(bound))


class PrometheusEndpoint:
    def __init__(self, cfg, state: Fleet, book: InventoryBook):
        """cfg: the [export.prometheus] table; book: inventories, watching the state."""
        self.cfg = cfg
        self.book = book
        self.collector = FleetCollector(state, book, compat_names=cfg.compat_names, max_age_s=cfg.max_age_s)
        self.server: WSGIServer | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen on `listen` (HOST:PORT); raises BindError-like OSError with a message to act on."""
        from prometheus_client import CollectorRegistry, make_wsgi_app

        from . import web_config
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        host, port = split_host_port(self.cfg.listen)
        try:   # TLS and basic auth from [export.prometheus] web_config_file (collector/web_config.py)
            web = web_config.load(self.cfg.web_config_file) if self.cfg.web_config_file else None
        except ConfigError as e:
            raise OSError(f"cannot serve Prometheus metrics on {self.cfg.listen}: {e}") from None
        if web is not None:
            registry.register(web)
        try:
            self.server, self.thread = web_config.serve(host, port, make_wsgi_app(registry), web, self.cfg.timeout_s)
        except OSError as e:
            raise OSError(f"cannot serve Prometheus metrics on {self.cfg.listen}: {e.strerror}; choose another "
                          f"address with [export.prometheus] listen") from None
        log.info("Prometheus metrics on %s://%s/metrics%s%s", "https" if web and web.ssl_context else "http",
                 self.cfg.listen, " with basic auth" if web and web.users else "",
                 " (with dcgm-exporter / npu-exporter names)" if self.cfg.compat_names else "")

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
