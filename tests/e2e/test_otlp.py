"""OTLP export end to end: a real agent (fake NVML: 8 H100s) and a real collector with a durable
store export to a real OTLP gRPC receiver (opentelemetry-proto's MetricsService, served by grpc in
this test). Names, units, kinds, values and attributes arrive as docs/metrics.md says (renamed at the
OTLP edge by common/semconv.py; test_semconv_otlp.py checks every metric against the semantic
conventions' model); then the receiver is down while the collector stores 30 s of batches, comes
back, and every point the collector stored arrives (the store is the export queue: nothing missing)."""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import sys
import threading
import time

import grpc
from helpers import BIN, ROOT, free_port, nodes_json, wait_until
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

from xpusense.collector.store import stored_batches
from xpusense.common.otlp import map_sample
from xpusense.v1 import telemetry_pb2 as pb

sys.path.insert(0, str(ROOT / "tests"))
from fakes.nvml import fakenvml  # noqa: E402

NODE = "node-otlp"
AGENT_CFG = """
[labels]
cloud = "aws"
region = "eu-west-1"
k8s_node = "gpu-node-7"
[tiers]
realtime_s = 0.25
nearline_s = 0.5
offline_s = 1.0
[stream]
flush_s = 0.05
backoff_initial_s = 0.05
backoff_max_s = 0.5
[sources.ebpf]
enabled = false
"""


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP gRPC metrics receiver that keeps every request."""

    def __init__(self):
        self.requests: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def serve(self, port: int) -> grpc.Server:
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(4),
                             options=[("grpc.max_receive_message_length", 64 * 2**20), ("grpc.so_reuseport", 0)])
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        server.start()
        return server

    def points(self) -> dict[tuple, tuple]:
        """(node, name, attributes without the inventory's, time) -> (value, unit, kind, attrs, resource)."""
        with self.lock:
            reqs = list(self.requests)
        out = {}
        for req in reqs:
            for rm in req.resource_metrics:
                res = {a.key: any_value(a.value) for a in rm.resource.attributes}
                node = res.get("xpusense.node.id", "")
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        dps = getattr(m, kind).data_points
                        for dp in dps:
                            attrs = {a.key: any_value(a.value) for a in dp.attributes}
                            labels = tuple(sorted((k, v) for k, v in attrs.items() if k not in FROM_INVENTORY))
                            value = dp.sum if kind == "histogram" else dp.as_double
                            out[(node, m.name, labels, dp.time_unix_nano)] = (value, m.unit, kind, attrs, res, m, dp)
        return out


# Point attributes that come from the node's inventory rather than from the sample.
FROM_INVENTORY = {"hw.model", "hw.vendor", "hw.type", "hw.driver_version", "hw.firmware_version", "hw.serial_number",
                  "xpusense.accelerator.uuid"}


def any_value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def stored_points(data_dir) -> dict[tuple, float]:
    """What the collector stored, as the OTLP points it must become (the same semconv mapping)."""
    out = {}
    for b in stored_batches(str(data_dir)):
        for s in b.samples:
            for p in map_sample(s, {}):
                attrs = tuple(sorted((k, v) for k, v in p.attributes.items() if k not in FROM_INVENTORY))
                out[(b.node_id, p.name, attrs, s.time_unix_nano)] = p.value if s.kind != pb.HISTOGRAM else s.value
    return out


def test_otlp_export_from_the_durable_store_survives_a_receiver_outage(procs, tmp_path, libdir):
    otlp_port, port = free_port(), free_port()
    addr = f"127.0.0.1:{port}"
    receiver = Receiver()
    server = receiver.serve(otlp_port)
    data = tmp_path / "data"
    ccfg = tmp_path / "collector.toml"
    ccfg.write_text(f'[export.otlp]\nenabled = true\nendpoint = "127.0.0.1:{otlp_port}"\ninsecure = true\n'
                    f'interval_s = 0.2\ntimeout_s = 2.0\nbackoff_max_s = 2.0\n')
    coll = procs([str(BIN / "xpusense-collector"), "serve", "--config", str(ccfg), "--listen", addr,
                  "--data-dir", str(data)], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector to answer")
    acfg = tmp_path / "agent.toml"
    acfg.write_text(AGENT_CFG)
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", addr, "--node-id", NODE],
                  "agent", env=fakenvml.env(libdir, fakenvml.scenario("h100x8"), t0=fakenvml.t0_at(5.0)))

    def have(*names):
        got = receiver.points()
        return got if all(any(k[1] == n for k in got) for n in names) else None

    got = wait_until(lambda: have("hw.gpu.utilization", "hw.gpu.memory.usage", "system.cpu.time", "hw.energy",
                                  "hw.temperature"), timeout_s=60, what="GPU and host series at the receiver")

    # Resource: one per node, made by the SDK, with the inventory's host name and the agent's cloud/k8s labels.
    # gpu0 has one utilization series per engine (general, encoder, decoder); take the SM's.
    util = [v for k, v in got.items() if k[1] == "hw.gpu.utilization" and ("hw.id", "gpu0") in k[2]
            and ("hw.gpu.task", "general") in k[2]]
    value, unit, kind, attrs, res, metric, dp = util[0]
    assert {k: res[k] for k in ("service.name", "xpusense.node.id", "host.name", "cloud.provider", "cloud.region",
                                "k8s.node.name")} == {
        "service.name": "xpusense", "xpusense.node.id": NODE, "host.name": socket.gethostname(),
        "cloud.provider": "aws", "cloud.region": "eu-west-1", "k8s.node.name": "gpu-node-7"}
    assert res["telemetry.sdk.language"] == "python" and res["service.instance.id"] and res["service.version"]
    # Names and units of docs/metrics.md; device attributes from the inventory, not the wire's labels.
    assert (unit, kind) == ("1", "gauge") and 0.0 <= value <= 1.0
    assert "device" not in attrs and "vendor" not in attrs
    assert attrs["hw.id"] == "gpu0" and attrs["hw.vendor"] == "nvidia" and attrs["hw.driver_version"] == "550.54.15"
    assert attrs["hw.model"] == "H100-80GB-HBM3" and attrs["xpusense.accelerator.uuid"].startswith("GPU-")
    mem = next(v for k, v in got.items() if k[1] == "hw.gpu.memory.usage")
    assert mem[1:3] == ("By", "sum") and mem[0] > 2**30 and not mem[5].sum.is_monotonic   # an UpDownCounter
    temp = next(v for k, v in got.items() if k[1] == "hw.temperature")
    assert temp[1] == "Cel" and temp[3]["hw.sensor_location"] in ("chip", "hbm")
    # Counters: cumulative monotonic sums with a start time.
    cpu = next(v for k, v in got.items() if k[1] == "system.cpu.time")
    _, unit, kind, _, _, metric, dp = cpu
    assert (unit, kind) == ("s", "sum") and metric.sum.is_monotonic
    assert metric.sum.aggregation_temporality == 2   # AGGREGATION_TEMPORALITY_CUMULATIVE
    assert 0 < dp.start_time_unix_nano <= dp.time_unix_nano
    energy = next(v for k, v in got.items() if k[1] == "hw.energy")
    assert energy[1:3] == ("J", "sum") and energy[0] > 0
    # Values: what the collector stored for the same series and time.
    stored = stored_points(data)
    common = [k for k in got if k in stored]
    assert len(common) > 100
    assert all(got[k][0] == stored[k] for k in common)

    # The receiver goes away while the collector stores 30 s of batches.
    server.stop(grace=None)
    down_ns = time.time_ns()
    wait_until(lambda: "OTLP export to" in coll.output() and "failed" in coll.output(), timeout_s=90,
               what="the collector to notice the receiver is down")

    def stored_through(t_ns):
        return any(b.sent_unix_nano >= t_ns for b in stored_batches(str(data)))
    wait_until(lambda: stored_through(down_ns + 30 * 10**9), timeout_s=90, interval_s=0.5,
               what="30 s of batches stored during the outage")
    before_back = len(receiver.points())

    server = receiver.serve(otlp_port)
    try:
        agent.kill(signal.SIGTERM)      # the store stops growing: a fixed set of points to compare
        stored = stored_points(data)
        assert any(k[3] > down_ns + 29 * 10**9 for k in stored)

        def all_arrived():
            got = receiver.points()
            return not (set(stored) - set(got))
        wait_until(all_arrived, timeout_s=90, interval_s=0.2,
                   what="every stored point at the receiver after it came back")
        got = receiver.points()
        assert len(got) > before_back
        missing = set(stored) - set(got)
        assert not missing, f"{len(missing)} stored points never exported, e.g. {sorted(missing)[:3]}"
        assert set(got) == set(stored)   # nothing invented either
        assert all(got[k][0] == v for k, v in stored.items())
        assert (data / "cursor-otlp.json").exists()
        assert "works again" in coll.output()
    finally:
        server.stop(grace=None)


def test_agent_exports_directly_without_a_collector(procs, tmp_path):
    """[export.otlp] on the agent with `only`: observability without a collector."""
    otlp_port = free_port()
    receiver = Receiver()
    server = receiver.serve(otlp_port)
    try:
        cfg = tmp_path / "agent.toml"
        cfg.write_text(AGENT_CFG + f'[export.otlp]\nenabled = true\nonly = true\nendpoint = "127.0.0.1:{otlp_port}"\n'
                       f'interval_s = 0.2\n[spool]\nenabled = false\n')
        agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--node-id", "solo",
                       "--collector", f"127.0.0.1:{free_port()}"], "agent")   # nothing listens there
        got = wait_until(lambda: (p := receiver.points()) and any(k[1] == "system.cpu.time" for k in p) and p,
                         timeout_s=60, what="the agent's points at the receiver")
        cpu = next(v for k, v in got.items() if k[1] == "system.cpu.time")
        assert cpu[4]["xpusense.node.id"] == "solo" and cpu[4]["cloud.provider"] == "aws"
        assert cpu[1:3] == ("s", "sum")
        assert all(k[0] == "solo" for k in got)
        assert agent.p.poll() is None
    finally:
        server.stop(grace=None)
