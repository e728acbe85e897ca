"""The exporters' parts: OTLP conversion (gauges, cumulative sums with start times and resets,
histograms), the in-memory queue's bound, the collector exporter committing the store cursor only
after the backend accepted, the agent's direct exporter, and the Prometheus rendering with the
dcgm-exporter / npu-exporter names (text parsed by prometheus-client's own parser)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from xpusense import __version__
from xpusense.agent.config import load_agent
from xpusense.agent.otlp_export import AgentOtlpExporter
from xpusense.agent.sources.base import COUNTER, GAUGE, HISTOGRAM, Sample
from xpusense.collector.config import load_collector
from xpusense.collector.inventory_book import InventoryBook
from xpusense.collector.otlp_export import MemoryQueue, OtlpExport, StoreQueue
from xpusense.collector.prometheus import FleetCollector, prom_name
from xpusense.collector.state import FleetState
from xpusense.collector.store import Store
from xpusense.common.otlp import (
    StartTimes,
    device_attributes,
    endpoint_check,
    metrics_data,
    parse_headers,
    resource_attributes,
)
from xpusense.v1 import telemetry_pb2 as pb

INV = pb.Inventory(hostname="host-a", labels={"cloud": "huawei_cloud", "region": "cn-north-4", "k8s_node": "n1",
                                              "price": "3.2"})
INV.resources.add(type="GPU", vendor="nvidia", model="H100-80GB-HBM3", id="gpu0", attributes={"uuid": "GPU-abc"})
INV.resources.add(type="NPU", vendor="huawei", model="Ascend-910B4", id="npu0-0", attributes={"chips_per_card": "1"})


def s(name, value, kind=pb.GAUGE, unit="1", t=1_000, **labels):
    return pb.Sample(name=name, value=value, kind=kind, unit=unit, labels=labels, time_unix_nano=t)


def hist(t, counts, total_sum):
    m = s("xpusense.disk.operation.latency", total_sum, pb.HISTOGRAM, "s", t, device="vda", direction="read")
    m.histogram.bounds.extend([0.001, 0.01, 0.1])
    m.histogram.counts.extend(counts)
    m.histogram.sum = total_sum
    m.histogram.count = counts[-1]
    return m


def points(data):
    out = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = (m, dict(rm.resource.attributes))
    return out


def test_resource_and_device_attributes():
    got = resource_attributes("n-1", INV)
    assert got.pop("service.instance.id") != resource_attributes("n-2", INV)["service.instance.id"]
    assert got == {"service.name": "xpusense", "service.version": __version__, "xpusense.node.id": "n-1",
                   "host.name": "host-a", "cloud.provider": "huawei_cloud", "cloud.region": "cn-north-4",
                   "k8s.node.name": "n1"}
    assert set(resource_attributes("n-2", None)) == {"service.name", "service.version", "service.instance.id",
                                                      "xpusense.node.id"}
    d = device_attributes(INV)
    assert d["gpu0"] == {"hw.id": "gpu0", "hw.type": "gpu", "hw.vendor": "nvidia", "hw.model": "H100-80GB-HBM3",
                         "xpusense.accelerator.uuid": "GPU-abc"}
    # semconv has no npu hw.type: an Ascend chip reports hw.gpu.* as a gpu, told apart by vendor and model
    assert d["npu0-0"]["hw.type"] == "gpu" and d["npu0-0"]["hw.vendor"] == "huawei"


def test_gauges_sums_and_histograms():
    starts = StartTimes()
    samples = [s("hw.gpu.utilization", 0.5, device="gpu0", vendor="nvidia"),
               s("hw.energy", 100.0, pb.COUNTER, "J", 1_000, device="gpu0"),
               s("hw.energy", 130.0, pb.COUNTER, "J", 2_000, device="gpu0"),
               hist(1_000, [1, 3, 3, 4], 0.25)]
    data = metrics_data([(resource_attributes("n", INV), device_attributes(INV), samples)], starts)
    got = points(data)
    g, res = got["hw.gpu.utilization"]
    assert res["host.name"] == "host-a" and g.unit == "1"
    dp = g.data.data_points[0]
    assert dp.value == 0.5 and dict(dp.attributes)["hw.model"] == "H100-80GB-HBM3"
    assert dict(dp.attributes)["hw.id"] == "gpu0" and "device" not in dp.attributes and "vendor" not in dp.attributes
    e, _ = got["hw.energy"]
    assert e.unit == "J" and e.data.is_monotonic and e.data.aggregation_temporality.name == "CUMULATIVE"
    assert [(p.start_time_unix_nano, p.time_unix_nano, p.value) for p in e.data.data_points] == [
        (1_000, 1_000, 100.0), (1_000, 2_000, 130.0)]
    h, _ = got["xpusense.disk.operation.latency"]
    hp = h.data.data_points[0]
    # Our cumulative counts -> OTLP per-bucket counts; len(bounds) + 1 buckets.
    assert list(hp.bucket_counts) == [1, 2, 0, 1] and list(hp.explicit_bounds) == [0.001, 0.01, 0.1]
    assert hp.count == 4 and hp.sum == 0.25 and hp.min is None
    # Through the real OTLP encoder.
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics
    req = encode_metrics(data)
    names = {m.name: m for m in req.resource_metrics[0].scope_metrics[0].metrics}
    assert names["xpusense.disk.operation.latency"].histogram.data_points[0].bucket_counts == [1, 2, 0, 1]
    assert not names["xpusense.disk.operation.latency"].histogram.data_points[0].HasField("max")


def test_counter_reset_moves_the_start():
    st = StartTimes()
    assert st.start(("k",), 1_000, 5.0) == 1_000
    assert st.start(("k",), 2_000, 9.0) == 1_000
    assert st.start(("k",), 3_000, 2.0) == 2_001     # fell: a new run began after the last point
    assert st.start(("k",), 4_000, 4.0) == 2_001


def test_headers_and_endpoint_checks():
    assert parse_headers("Authorization=Bearer x, tenant=a") == {"authorization": "Bearer x", "tenant": "a"}
    for good in ("127.0.0.1:4317", "https://otel.example:4317", "http://[::1]:4317", "otel-collector.obs.svc:4317"):
        assert endpoint_check(good) is None, good
    for bad in ("otel", "ftp://x:1", "x:y"):
        assert endpoint_check(bad), bad


def test_memory_queue_is_bounded_and_counts_drops():
    q = MemoryQueue(max_batches=3)
    node = SimpleNamespace(node_id="n")
    for i in range(5):
        q._on_batch(node, pb.Batch(node_id="n", seq=i + 1, samples=[s("x", i)] * 2))
    assert q.dropped_batches == 2 and q.dropped_points == 4
    batches, token = q.peek(max_points=4)
    assert [b.seq for b in batches] == [3, 4]
    q.commit(token)
    batches, token = q.peek(max_points=100)
    assert [b.seq for b in batches] == [5]
    q._on_batch(node, None)   # an inventory change is not a batch
    assert q.status()["queued_batches"] == 1


class FakeSender:
    def __init__(self, results):
        self.results = list(results)
        self.sent = []

    def send(self, data):
        ok = self.results.pop(0) if self.results else True
        if ok:
            self.sent.append(data)
        return ok

    def shutdown(self):
        pass


def otlp_cfg(**over):
    c = load_collector(None, env={}).export.otlp
    for k, v in over.items():
        setattr(c, k, v)
    return c


def test_store_cursor_moves_only_after_the_backend_accepted(tmp_path):
    state = FleetState()
    store = Store(str(tmp_path / "data"), fsync=False)
    book = InventoryBook().watch(state)
    queue = StoreQueue(store)          # before open: registered for the replay
    store.open(state)
    state.hello(pb.Hello(node_id="n", boot_id="b", inventory=INV))

    async def put(n):
        for i in range(n):
            b = pb.Batch(node_id="n", boot_id="b", seq=i + 1, samples=[s("hw.gpu.utilization", i / 10, t=i + 1,
                                                                           device="gpu0")])
            state.ingest(b)
            await store.append(["b", b.SerializeToString()])
    asyncio.run(put(5))
    sender = FakeSender([False, False, True])
    exp = OtlpExport(otlp_cfg(max_request_points=3), book, queue, sender=sender)
    assert exp.export_once() is False and exp.export_once() is False
    assert queue.reader.cursor == (0, 0) or not (tmp_path / "data/cursor-otlp.json").exists()
    assert exp.export_once() is True
    first = sender.sent[0]
    pts = [p for rm in first.resource_metrics for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points]
    assert [p.value for p in pts] == [0.0, 0.1, 0.2]      # at most max_request_points per request
    assert dict(first.resource_metrics[0].resource.attributes)["host.name"] == "host-a"
    assert (tmp_path / "data/cursor-otlp.json").exists()
    assert exp.export_once() is True and exp.export_once() is None
    assert exp.exported_points == 5 and exp.failures == 2
    # A new reader with the committed cursor (a restart) has nothing left to send.
    store.close()
    store2 = Store(str(tmp_path / "data"), fsync=False)
    q2 = StoreQueue(store2)
    store2.open(FleetState())
    assert q2.peek(100)[0] == []
    store2.close()


def test_agent_direct_exporter_keeps_points_until_accepted(tmp_path):
    cfg = load_agent(None, env={})
    cfg.export.otlp.queue_points = 4
    sender = FakeSender([False, True, True])
    exp = AgentOtlpExporter(cfg.export.otlp, "n", lambda: INV, sender=sender)
    exp.put([Sample("hw.power", float(i), "W", {"device": "gpu0"}, GAUGE, 10 + i) for i in range(3)])
    assert exp.flush() is False and len(exp.queue) == 3
    exp.put([Sample("hw.energy", 5.0, "J", {"device": "gpu0"}, COUNTER, 20),
             Sample("x.hist", 1.0, "s", {}, HISTOGRAM, 20, bounds=(0.1,), counts=(1, 2))])
    assert exp.dropped == 1 and len(exp.queue) == 4           # bounded: the oldest went
    assert exp.flush() is True and len(exp.queue) == 0
    names = {m.name for rm in sender.sent[0].resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert names == {"hw.power", "hw.energy", "x.hist"}


def test_prometheus_rendering_native_and_compat_names():
    now = 10**18 * 2
    clock = [now - 700 * 10**9]   # the collector's: a series' age is since its point arrived
    state = FleetState(clock=lambda: clock[0])
    book = InventoryBook().watch(state)
    state.hello(pb.Hello(node_id="n1", boot_id="b", inventory=INV))
    state.ingest(pb.Batch(node_id="n1", boot_id="b", seq=1, samples=[s("old.one", 1.0, t=now)]))
    clock[0] = now
    state.ingest(pb.Batch(node_id="n1", boot_id="b", seq=2, samples=[
        s("hw.gpu.utilization", 0.42, t=now, device="gpu0", vendor="nvidia"),
        s("hw.gpu.memory.usage", 3 * 2**30, unit="By", t=now, device="gpu0", vendor="nvidia"),
        s("hw.energy", 12.5, pb.COUNTER, "J", now, device="gpu0", vendor="nvidia"),
        s("hw.gpu.utilization", 0.9, t=now, device="npu0-0", vendor="huawei"),
        s("xpusense.accelerator.health", 1.0, t=now, device="npu0-0", vendor="huawei", status="OK"),
        s("xpusense.agent.source.errors", 3, pb.COUNTER, "{error}", now, source="host"),
        hist(now, [1, 3, 3, 4], 0.25),
        s("k8s.thing", 1.0, t=now, **{"k8s.pod.name": "p"}),
    ]))
    state.nodes["n1"].streams = 1
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(state, book, compat_names=True, max_age_s=600, clock_ns=lambda: now))
    text = generate_latest(reg).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    val = lambda fam, sample_name, **lb: next(x.value for x in fams[fam].samples if x.name == sample_name
                                              and all(x.labels.get(k) == v for k, v in lb.items()))
    assert val("hw_gpu_utilization_ratio", "hw_gpu_utilization_ratio", device="gpu0", node="n1", host_name="host-a") == 0.42
    assert val("hw_gpu_memory_usage_bytes", "hw_gpu_memory_usage_bytes", device="gpu0") == 3 * 2**30
    assert fams["hw_energy_joules"].type == "counter"
    assert val("hw_energy_joules", "hw_energy_joules_total", device="gpu0") == 12.5
    assert val("xpusense_agent_source_errors", "xpusense_agent_source_errors_total", source="host") == 3
    assert "old_one_ratio" not in fams                       # arrived longer than max_age_s ago
    assert val("xpusense_disk_operation_latency_seconds", "xpusense_disk_operation_latency_seconds_bucket",
               le="0.01") == 3
    assert val("k8s_thing_ratio", "k8s_thing_ratio", k8s_pod_name="p") == 1.0
    assert val("xpusense_node_connected", "xpusense_node_connected", node="n1") == 1.0
    # dcgm-exporter names and labels
    assert val("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL", gpu="0", UUID="GPU-abc", device="nvidia0",
               modelName="H100-80GB-HBM3", Hostname="host-a") == 42.0
    assert val("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_USED", gpu="0") == 3072.0
    assert val("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu="0") == 12500.0
    # npu-exporter names and labels
    assert val("npu_chip_info_utilization", "npu_chip_info_utilization", id="0", model_name="Ascend-910B4",
               node="n1") == 90.0
    assert val("npu_chip_info_health_status", "npu_chip_info_health_status", id="0") == 1.0
    assert not any(x.labels.get("device") == "npu0-0" for x in fams["DCGM_FI_DEV_GPU_UTIL"].samples)


def test_prometheus_names():
    assert prom_name("hw.gpu.memory.usage", "By", pb.GAUGE) == "hw_gpu_memory_usage_bytes"
    assert prom_name("system.cpu.time", "s", pb.COUNTER) == "system_cpu_time_seconds"
    assert prom_name("system.network.io", "By", pb.COUNTER) == "system_network_io_bytes"
    assert prom_name("xpusense.accelerator.processes", "{process}", pb.GAUGE) == "xpusense_accelerator_processes"
    assert prom_name("hw.temperature", "Cel", pb.GAUGE) == "hw_temperature_celsius"
    assert prom_name("xpusense.accelerator.pcie.throughput", "By/s", pb.GAUGE) == \
        "xpusense_accelerator_pcie_throughput_bytes_per_second"
