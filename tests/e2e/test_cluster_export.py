"""Cluster mode, OTLP export as a durable consumer of the streams: with the
backend away, nothing is lost (the streams keep it and the consumer acknowledges only what the
backend accepted); an exporter killed and started again goes on from its consumer; resource and
device attributes come from the inventories (on the stream, else the fleet bucket)."""

from __future__ import annotations

import concurrent.futures
import signal
import threading

import grpc
from cluster_support import SimAgent, cluster_config, module_cmd, nats_cluster, start_gateway  # noqa: F401
from helpers import free_port, wait_until
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self):
        self.requests, self.lock = [], threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def serve(self, port):
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        return server

    def gpu_util(self) -> dict[tuple, dict]:
        """(node, device, time) -> the point's attributes, for hw.gpu.utilization."""
        with self.lock:
            reqs = list(self.requests)
        out = {}
        for req in reqs:
            for rm in req.resource_metrics:
                res = {a.key: a.value.string_value for a in rm.resource.attributes}
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name != "hw.gpu.utilization":
                            continue
                        for dp in m.gauge.data_points:
                            attrs = {a.key: a.value.string_value for a in dp.attributes}
                            out[(res.get("xpusense.node.id"), attrs.get("hw.id"), dp.time_unix_nano)] = attrs
        return out


def test_otlp_export_from_the_streams_loses_nothing(nats_cluster, procs, tmp_path):  # noqa: F811
    port = free_port()
    cfg = cluster_config(tmp_path, nats_cluster, extra=f"""[export.otlp]
enabled = true
endpoint = "127.0.0.1:{port}"
insecure = true
interval_s = 0.2
timeout_s = 2.0
backoff_max_s = 1.0
""")
    _, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    exporter = procs(module_cmd("exporter", "--config", str(cfg)), "exporter-1")
    agent = SimAgent(gw, "export-node", {"region": "r1"})
    for _ in range(30):                        # the backend is away meanwhile
        agent.send()
    wait_until(lambda: agent.acks.qsize() >= 30, 60, what="30 batches acknowledged")
    wait_until(lambda: "OTLP export to" in exporter.output() and "failed" in exporter.output(), 60,
               what="the exporter failing while the backend is away")
    receiver = Receiver()
    server = receiver.serve(port)
    try:
        got = wait_until(lambda: (g := receiver.gpu_util()) and len({k for k in g if k[0] == "export-node"}) >= 30 * 8
                         and g, 90, what="every point of the 30 batches at the backend")
        assert all(a.get("hw.model") == "A100-SXM4-80GB" for a in got.values())   # from the inventory on the stream
        exporter.kill(signal.SIGKILL)          # a new exporter goes on from the durable consumers
        for _ in range(30):
            agent.send()
        wait_until(lambda: agent.acks.qsize() >= 60, 60, what="60 batches acknowledged")
        procs(module_cmd("exporter", "--config", str(cfg)), "exporter-2")
        got = wait_until(lambda: (g := receiver.gpu_util()) and len({k for k in g if k[0] == "export-node"}) >= 60 * 8
                         and g, 90, what="every point of the 60 batches at the backend")
        assert len({k[2] for k in got}) == 60                                 # one time per batch, 8 devices each
        assert all(a.get("hw.model") == "A100-SXM4-80GB" for a in got.values())
    finally:
        server.stop(0)
        agent.close()
