"""Diagnosis events at the collector, end to end on loopback: the real collector gRPC
server (in-process: Ingest, Query, Scheduler) with its real exporters (a Prometheus endpoint scraped
over HTTP, OTLP to a real gRPC receiver serving MetricsService and LogsService) receives a simulated
agent's open and close events on the real Ingest stream; the node view, `xpusense-collector nodes`
(JSON and table, the real CLI), the Prometheus text, the OTLP log records, and the scheduler's Place
answer follow them. Also: the per-node bound and its counter, and a new agent boot closing the last
boot's diagnoses."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from helpers import BIN, free_port, nodes_json, wait_until
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from test_place_grpc import Collector, SimAgent

from xpusense.collector.config import load_collector
from xpusense.collector.exporters import Exporters
from xpusense.collector.scheduler.inventory import parse_memory
from xpusense.v1 import scheduler_pb2 as spb
from xpusense.v1 import telemetry_pb2 as pb

NODE = "diag-node-1"
CAUSE = "PCIe bandwidth contention"


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer, logs_service_pb2_grpc.LogsServiceServicer):
    """An OTLP gRPC receiver (metrics and logs) that keeps every log request."""

    def __init__(self):
        self.logs: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        if isinstance(request, logs_service_pb2.ExportLogsServiceRequest):
            with self.lock:
                self.logs.append(request)
            return logs_service_pb2.ExportLogsServiceResponse()
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def serve(self, port: int) -> grpc.Server:
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(4), options=[("grpc.so_reuseport", 0)])
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(self, server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        server.start()
        return server

    def records(self) -> list[tuple[dict, object]]:
        """(resource attributes, LogRecord) of every record received."""
        with self.lock:
            reqs = list(self.logs)
        out = []
        for req in reqs:
            for rl in req.resource_logs:
                res = {a.key: a.value.string_value for a in rl.resource.attributes}
                for sl in rl.scope_logs:
                    out.extend((res, r) for r in sl.log_records)
        return out


def prom(text: str, name: str) -> dict[tuple, float]:
    """Samples of `name` in a Prometheus text page: sorted label pairs -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    return {tuple(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name}


def attrs_of(record) -> dict[str, str]:
    return {a.key: a.value.string_value for a in record.attributes}


def diagnosis(did: str, state: str, device: str = "gpu0", rule: str = "pcie_contention",
              opened_ns: int | None = None) -> pb.Event:
    opened_ns = opened_ns or time.time_ns()
    evidence = [{"series": "hw.gpu.utilization", "labels": {"device": device}, "values": [0.1, 0.9, 0.2],
                 "window_s": 60, "summary": "utilisation swings (CV 0.8) with PCIe at 95% of the link"}]
    return pb.Event(id=f"{did}-{state}-{time.monotonic_ns()}", type="diagnosis", severity="warning", device=device,
                    message=f"GPU utilisation swings: {CAUSE}; remedy: bind to the GPU's NUMA node",
                    time_unix_nano=time.time_ns(), attributes={
                        "diagnosis.id": did, "diagnosis.state": state, "diagnosis.rule": rule,
                        "diagnosis.symptom": "GPU utilisation swings", "diagnosis.cause": CAUSE,
                        "diagnosis.remedy": "bind to the GPU's NUMA node, spread PCIe",
                        "diagnosis.evidence": json.dumps(evidence), "diagnosis.opened_unix_nano": str(opened_ns),
                        "process.pid": "4242", "process.executable.name": "python3", "k8s.pod.name": "train-0"})


@pytest.fixture
def rig(tmp_path):
    """A collector with Prometheus and OTLP (memory queue) exporters and a receiver; agents on it."""
    made: dict = {"agents": [], "coll": None, "exporters": None, "server": None}

    class Rig:
        def __call__(self, max_open: int = 64):
            self.otlp_port, self.prom = free_port(), f"127.0.0.1:{free_port()}"
            self.receiver = Receiver()
            made["server"] = self.receiver.serve(self.otlp_port)
            cfg_path = tmp_path / "collector.toml"
            cfg_path.write_text(f'[state]\nmax_open_diagnoses_per_node = {max_open}\n'
                                f'[export.otlp]\nenabled = true\nendpoint = "127.0.0.1:{self.otlp_port}"\n'
                                f'interval_s = 0.1\ntimeout_s = 5.0\nbackoff_max_s = 1.0\n'
                                f'[export.prometheus]\nenabled = true\nlisten = "{self.prom}"\n')
            cfg = load_collector(str(cfg_path), env={})
            self.coll = made["coll"] = Collector(cfg)
            ex = made["exporters"] = Exporters.from_config(cfg, self.coll.state)
            ex.start()
            return self

        def agent(self, node_id: str = NODE) -> SimAgent:
            a = SimAgent(self.coll.addr, node_id, "a100", 8, region="r1", zone="z1", price=2.0)
            made["agents"].append(a)
            a.send()   # readings: every device free
            return a

        def view(self, node_id: str = NODE) -> pb.ListNodesReply:
            from xpusense.v1 import telemetry_pb2_grpc as pb_grpc
            return pb_grpc.QueryStub(self.coll.channel).ListNodes(pb.ListNodesRequest(node_id=node_id), timeout=10)

        def scrape(self) -> str:
            with urllib.request.urlopen(f"http://{self.prom}/metrics", timeout=10) as r:
                return r.read().decode()

        def penalties(self, node_id: str = NODE) -> list:
            reply = self.coll.place(accelerator=spb.ACCELERATOR_ANY, memory_bytes=parse_memory("10GB"), count=8)
            (cand,) = [c for c in reply.candidates if c.node_id == node_id]
            return list(cand.penalties)

    yield Rig()
    for a in made["agents"]:
        a.close()
    if made["exporters"] is not None:
        made["exporters"].stop()
    if made["coll"] is not None:
        made["coll"].stop()
    if made["server"] is not None:
        made["server"].stop(0)


def test_an_open_diagnosis_reaches_every_reader_and_its_close_takes_it_away(rig):
    r = rig()
    agent = r.agent()
    assert r.penalties() == [], "a healthy node is not penalised"
    opened_ns = time.time_ns() - 30 * 10**9
    agent.send(samples=[], events=[diagnosis("d-pcie-1", "open", opened_ns=opened_ns),
                                   pb.Event(id="note-1", type="note", severity="info", message="a note",
                                            time_unix_nano=time.time_ns()),
                                   pb.Event(id="alarm-1", type="alarm", severity="critical", device="",
                                            message="an alarm", time_unix_nano=time.time_ns())])

    # The node view: the open event, as sent.
    (nv,) = r.view().nodes
    assert [(d.device, d.attributes["diagnosis.id"], d.attributes["diagnosis.state"]) for d in nv.diagnoses] == [
        ("gpu0", "d-pcie-1", "open")]

    # `nodes --format json` (the real CLI): device, rule, cause, since, evidence, what it concerns.
    node = nodes_json(r.coll.addr)["nodes"][0]
    (d,) = node["diagnoses"]
    assert (d["id"], d["device"], d["rule"], d["cause"]) == ("d-pcie-1", "gpu0", "pcie_contention", CAUSE)
    assert d["since"].startswith(time.strftime("%Y-%m-%dT%H:%M", time.gmtime(opened_ns / 1e9)))
    assert d["open_for_s"] >= 29
    assert d["evidence"][0]["series"] == "hw.gpu.utilization" and d["evidence"][0]["window_s"] == 60
    assert d["concerns"] == {"process.pid": "4242", "process.executable.name": "python3", "k8s.pod.name": "train-0"}
    table = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", r.coll.addr],
                           capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    (line,) = [x for x in table.stdout.splitlines() if x.lstrip().startswith("? diagnosis")]
    assert line.split()[2:4] == ["gpu0", "pcie_contention"] and line.endswith(CAUSE), line

    # Prometheus: open per node, rule and device; opened per rule.
    text = r.scrape()
    assert prom(text, "xpusense_diagnoses_open") == {
        (("device", "gpu0"), ("node", NODE), ("rule", "pcie_contention")): 1.0}
    assert prom(text, "xpusense_diagnoses_opened_total") == {(("rule", "pcie_contention"),): 1.0}

    # The scheduler: gpu0 penalised, explained; no other device.
    (p,) = r.penalties()
    assert (p.reason, p.device) == ("diagnosis", "gpu0")
    assert p.detail.startswith("open diagnosis pcie_contention (opened ") and p.detail.endswith(CAUSE), p.detail
    assert 0 < p.factor < 1

    # OTLP: the three events as log records, severity mapped, the node's resource.
    got = wait_until(lambda: (recs := r.receiver.records()) and len(recs) >= 3 and recs, what="3 log records")
    by_id = {attrs_of(rec)["xpusense.event.id"]: (res, rec) for res, rec in got}
    res, rec = next(v for k, v in by_id.items() if k.startswith("d-pcie-1-open"))
    a = attrs_of(rec)
    assert res["xpusense.node.id"] == NODE and res["service.name"] == "xpusense"
    assert (rec.severity_number, rec.severity_text, rec.body.string_value) == (13, "WARN", diagnosis("x", "open").message)
    assert a["event.name"] == "xpusense.diagnosis" and rec.event_name == "xpusense.diagnosis"
    assert (a["diagnosis.id"], a["diagnosis.state"], a["diagnosis.rule"], a["hw.id"]) == (
        "d-pcie-1", "open", "pcie_contention", "gpu0")
    assert json.loads(a["diagnosis.evidence"])[0]["summary"].startswith("utilisation swings")
    assert by_id["note-1"][1].severity_number == 9 and attrs_of(by_id["note-1"][1])["event.name"] == "xpusense.note"
    assert by_id["alarm-1"][1].severity_number == 17 and by_id["alarm-1"][1].severity_text == "ERROR"

    # The close: gone from the view, the CLI, the gauge and the scheduler; still counted as opened.
    agent.send(samples=[], events=[diagnosis("d-pcie-1", "closed")])
    assert list(r.view().nodes[0].diagnoses) == []
    assert nodes_json(r.coll.addr)["nodes"][0]["diagnoses"] == []
    text = r.scrape()
    assert prom(text, "xpusense_diagnoses_open") == {}
    assert prom(text, "xpusense_diagnoses_opened_total") == {(("rule", "pcie_contention"),): 1.0}
    assert r.penalties() == []
    closed = wait_until(lambda: [rec for _, rec in r.receiver.records()
                                 if attrs_of(rec).get("diagnosis.state") == "closed"], what="the close as a log record")
    assert attrs_of(closed[0])["diagnosis.id"] == "d-pcie-1"


def test_open_diagnoses_per_node_are_bounded_the_oldest_let_go_and_counted(rig):
    r = rig(max_open=2)
    agent = r.agent()
    agent.send(samples=[], events=[diagnosis(f"d{i}", "open", device=f"gpu{i}", rule=rule)
                                   for i, rule in enumerate(("pcie_contention", "numa_misplacement", "a_new_rule"))])
    reply = r.view()
    assert [d.attributes["diagnosis.id"] for d in reply.nodes[0].diagnoses] == ["d1", "d2"]
    assert reply.counters["state.max_open_diagnoses_per_node"] == 1
    text = r.scrape()
    assert prom(text, "xpusense_diagnoses_open") == {
        (("device", "gpu1"), ("node", NODE), ("rule", "numa_misplacement")): 1.0,
        (("device", "gpu2"), ("node", NODE), ("rule", "a_new_rule")): 1.0}
    assert prom(text, "xpusense_diagnoses_opened_total") == {
        (("rule", r),): 1.0 for r in ("pcie_contention", "numa_misplacement", "a_new_rule")}
    assert {p.device for p in r.penalties()} == {"gpu1", "gpu2"}
    # Opening one more lets the next oldest go.
    agent.send(samples=[], events=[diagnosis("d3", "open", device="gpu3")])
    reply = r.view()
    assert [d.attributes["diagnosis.id"] for d in reply.nodes[0].diagnoses] == ["d2", "d3"]
    assert reply.counters["state.max_open_diagnoses_per_node"] == 2


def test_a_new_agent_boot_closes_the_last_boots_diagnoses(rig):
    r = rig()
    old = r.agent()
    old.send(samples=[], events=[diagnosis("d-old", "open", device="gpu5", rule="clocks_held_down")])
    assert [d.device for d in r.view().nodes[0].diagnoses] == ["gpu5"]
    assert [p.device for p in r.penalties()] == ["gpu5"]
    old.close()
    wait_until(lambda: not r.view().nodes[0].connected, what="the old boot's stream to end")
    new = r.agent()   # the same node, a new boot id: Hello, then a batch of readings
    assert new.boot != old.boot
    reply = r.view()
    assert list(reply.nodes[0].diagnoses) == []
    assert reply.counters["diagnoses.closed_by_new_boot"] == 1
    assert r.penalties() == []
    assert prom(r.scrape(), "xpusense_diagnoses_open") == {}
    # The new boot's own diagnoses are kept.
    new.send(samples=[], events=[diagnosis("d-new", "open", device="gpu6", rule="cpu_starvation")])
    assert [d.attributes["diagnosis.id"] for d in r.view().nodes[0].diagnoses] == ["d-new"]
