"""The collector's Prometheus endpoint scraped by Debian's real `prometheus` server (loopback ports,
a temporary TSDB), read back through Prometheus's HTTP query API: every series of two nodes (8 fake
H100s, 8 fake Ascend 910B4s) under its native name, and the dcgm-exporter / npu-exporter names with
their units and labels, equal to what the collector holds; and a node sending names and labels
Prometheus would refuse, which must not fail the scrape (promtool reads the same text)."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import grpc
import pytest
import real_prometheus
from helpers import BIN, FAST_HOST_ONLY, ROOT, nodes_json, series, wait_until
from real_prometheus import query

from xpusense.collector.prometheus import prom_labels, prom_name
from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

sys.path.insert(0, str(ROOT / "tests"))
from fakes.nvml import fakenvml  # noqa: E402

FAKE_NPU_SMI = ROOT / "tests/fakes/npu-smi/npu-smi"
NPU_SCENARIO = ROOT / "tests/fixtures/npu-smi/scenario-8x910B4"
# Each tier's first round runs at the start, so long periods cost the test nothing, and they give a
# round a budget (timeout_ratio x period) that a busy machine does not overrun: a discarded round
# would leave its series out until the next one.
AGENT = """
[tiers]
realtime_s = 2.0
nearline_s = 5.0
offline_s = 10.0
timeout_ratio = 1.0
[stream]
flush_s = 0.05
[sources.npu_smi]
timeout_s = 2.0
nearline_timeout_s = 5.0
offline_timeout_s = 10.0
[sources.ebpf]
enabled = false
"""
KINDS = {"gauge": pb.GAUGE, "counter": pb.COUNTER, "histogram": pb.HISTOGRAM}


@pytest.fixture(scope="module")
def prometheus_bin():
    return real_prometheus.binary()


def one(prom: str, q: str) -> float:
    got = query(prom, q)
    assert len(got) == 1, (q, got)
    return float(got[0]["value"][1])


def test_prometheus_scrapes_native_and_dashboard_names(procs, tmp_path, prometheus_bin, libdir):
    addr, metrics = real_prometheus.collector_with_metrics(procs, tmp_path)
    acfg = tmp_path / "agent.toml"
    acfg.write_text(AGENT)
    npu_dir = tmp_path / "npu-scenario"
    shutil.copytree(NPU_SCENARIO, npu_dir)
    gpu_agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", addr,
                       "--node-id", "gpu-node"], "agent-gpu",
                      env=fakenvml.env(libdir, fakenvml.scenario("h100x8"), t0=fakenvml.t0_at(5.0)))
    npu_agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", addr,
                       "--node-id", "npu-node", "--npu-smi", str(FAKE_NPU_SMI)], "agent-npu",
                      env={"FAKE_NPU_SMI_DIR": str(npu_dir)})

    want = {"gpu-node": ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.power", "hw.temperature", "hw.energy",
                         "xpusense.accelerator.clock.frequency", "xpusense.accelerator.hbm.bandwidth.utilization",
                         "system.cpu.time"),
            "npu-node": ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.power", "hw.temperature",
                         "xpusense.accelerator.health")}

    def missing() -> dict[str, list[str]]:
        nodes = {n["node_id"]: n for n in nodes_json(addr)["nodes"]}
        return {node: [x for x in names if node not in nodes or not series(nodes[node], x)]
                for node, names in want.items()}

    def missing_said() -> str:
        try:
            return f"GPU and NPU series at the collector; missing: {missing()}"
        except Exception as e:
            return f"GPU and NPU series at the collector (which are missing is unknown: {e})"
    wait_until(lambda: not any(missing().values()), timeout_s=300, what=missing_said)
    # The agents stop: the collector's latest values stand still, so Prometheus must show exactly them.
    gpu_agent.kill(signal.SIGTERM)
    npu_agent.kill(signal.SIGTERM)
    nodes = {n["node_id"]: n for n in nodes_json(addr)["nodes"]}

    prom = real_prometheus.start(procs, tmp_path, real_prometheus.SCRAPE_1S + "scrape_configs:\n"
                                  + real_prometheus.scrape_job(metrics))
    wait_until(lambda: one(prom, 'up{job="xpusense"}') == 1.0, timeout_s=120, what="Prometheus to scrape the collector")
    wait_until(lambda: query(prom, "DCGM_FI_DEV_GPU_UTIL") and query(prom, "npu_chip_info_utilization"),
               timeout_s=120, what="the dashboard names in Prometheus")

    # Every series the collector holds, under its native name, with the same value.
    everything = query(prom, '{job="xpusense"}')
    in_prom = {}
    for r in everything:
        m = dict(r["metric"])
        name = m.pop("__name__")
        for k in ("job", "instance"):
            m.pop(k, None)
        in_prom[(name, tuple(sorted(m.items())))] = float(r["value"][1])
    compared = 0
    for node_id, node in nodes.items():
        host = node["inventory"]["hostname"]
        for s in node["series"]:
            if s["value"] is None or s["kind"] == "histogram":
                continue
            name = prom_name(s["name"], s["unit"], KINDS[s["kind"]]) + ("_total" if s["kind"] == "counter" else "")
            labels = {**prom_labels(s["labels"]), "node": node_id, "host_name": host}
            key = (name, tuple(sorted(labels.items())))
            assert key in in_prom, f"{s['name']} {s['labels']} on {node_id} not in Prometheus as {key}"
            assert in_prom[key] == s["value"], (key, in_prom[key], s["value"])
            compared += 1
    assert compared > 200

    g = nodes["gpu-node"]
    gpu0 = next(r for r in g["inventory"]["resources"] if r.get("id") == "gpu0")
    util = series(g, "hw.gpu.utilization", device="gpu0")[0]["value"]
    assert one(prom, 'hw_gpu_utilization_ratio{node="gpu-node",device="gpu0"}') == util
    # dcgm-exporter's names, units (%, MiB, W, C, mJ, MHz) and labels (gpu, UUID, device, modelName, Hostname).
    dcgm = query(prom, 'DCGM_FI_DEV_GPU_UTIL{gpu="0"}')
    assert len(dcgm) == 1
    lb = dcgm[0]["metric"]
    assert (lb["UUID"], lb["device"], lb["modelName"], lb["Hostname"]) == (
        gpu0["attributes"]["uuid"], "nvidia0", gpu0["model"], g["inventory"]["hostname"])
    assert float(dcgm[0]["value"][1]) == util * 100.0
    used = series(g, "hw.gpu.memory.usage", device="gpu0")[0]["value"]
    assert one(prom, 'DCGM_FI_DEV_FB_USED{gpu="0"}') == used / 2**20
    assert one(prom, 'DCGM_FI_DEV_POWER_USAGE{gpu="0"}') == series(g, "hw.power", device="gpu0")[0]["value"]
    assert one(prom, 'DCGM_FI_DEV_GPU_TEMP{gpu="0"}') == series(g, "hw.temperature", device="gpu0", sensor="chip")[0]["value"]
    assert one(prom, 'DCGM_FI_DEV_MEMORY_TEMP{gpu="0"}') == series(g, "hw.temperature", device="gpu0", sensor="hbm")[0]["value"]
    assert one(prom, 'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0"}') == series(g, "hw.energy", device="gpu0")[0]["value"] * 1000.0
    assert one(prom, 'DCGM_FI_DEV_SM_CLOCK{gpu="0"}') == series(
        g, "xpusense.accelerator.clock.frequency", device="gpu0", clock="sm")[0]["value"] * 1e-6
    assert one(prom, 'DCGM_FI_PROF_DRAM_ACTIVE{gpu="0"}') == series(
        g, "xpusense.accelerator.hbm.bandwidth.utilization", device="gpu0")[0]["value"]
    assert one(prom, 'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0"}') == series(   # GPM, from the same round
        g, "xpusense.accelerator.graphics.utilization", device="gpu0")[0]["value"]
    assert len(query(prom, "DCGM_FI_DEV_GPU_UTIL")) == 8

    # npu-exporter's names (%, MB, W, C, health 1/0) and labels (id, model_name, ...).
    n = nodes["npu-node"]
    npu0 = next(r for r in n["inventory"]["resources"] if r.get("type") == "NPU")
    dev = npu0["id"]
    got = query(prom, 'npu_chip_info_utilization{node="npu-node"}')
    assert len(got) == 8 and {r["metric"]["model_name"] for r in got} == {npu0["model"]}
    nid = next(r["metric"]["id"] for r in got if r["metric"]["id"] == dev[3:].split("-")[0])
    assert one(prom, f'npu_chip_info_utilization{{id="{nid}"}}') == series(n, "hw.gpu.utilization", device=dev)[0]["value"] * 100.0
    assert one(prom, f'npu_chip_info_hbm_used_memory{{id="{nid}"}}') == series(n, "hw.gpu.memory.usage", device=dev)[0]["value"] / 2**20
    assert one(prom, f'npu_chip_info_hbm_total_memory{{id="{nid}"}}') == series(n, "hw.gpu.memory.limit", device=dev)[0]["value"] / 2**20
    assert one(prom, f'npu_chip_info_power{{id="{nid}"}}') == series(n, "hw.power", device=dev)[0]["value"]
    assert one(prom, f'npu_chip_info_temperature{{id="{nid}"}}') == series(n, "hw.temperature", device=dev, sensor="chip")[0]["value"]
    assert one(prom, f'npu_chip_info_health_status{{id="{nid}"}}') == series(n, "xpusense.accelerator.health", device=dev)[0]["value"]
    # NVIDIA series do not take npu-exporter names, nor the other way round.
    assert not query(prom, 'npu_chip_info_utilization{node="gpu-node"}')
    assert not query(prom, 'DCGM_FI_DEV_GPU_UTIL{Hostname="npu-node"}') or g["inventory"]["hostname"] == "npu-node"
    assert one(prom, 'xpusense_node_connected{node="gpu-node"}') == 0.0


def sample(name: str, value: float, kind=pb.GAUGE, unit: str = "1", **labels) -> pb.Sample:
    return pb.Sample(name=name, value=value, kind=kind, unit=unit, labels=labels, time_unix_nano=time.time_ns())


def odd_samples() -> list[pb.Sample]:
    """What one careless or hostile node sends (docs/export.md "Names Prometheus accepts" says how
    each reads in Prometheus)."""
    return [
        sample("odd.empty.key", 1.0, **{"": "x", "device": "gpu0"}),
        sample("odd.name.key", 2.0, __name__="spoof"),
        sample("odd.chars", 3.0, **{"a-b": "1", "a.b": "2", "clé": "3", "9lives": "4", "node": "spoof", "le": "0.5",
                                    "quoted": 'a "b" \\ c\nd'}),
        sample("odd.requests", 5.0, pb.COUNTER, "{request}"),
        sample("odd.requests.total", 6.0, pb.GAUGE, "{request}"),       # the counter's exposed name, as a gauge
        sample("xpusense.node.connected", 7.0, unit="{x}"),             # the collector's own name
        sample("odd-metric.é", 8.0),
        sample("odd.dup", 9.0, **{"a.b": "1"}),
        sample("odd.dup", 10.0, **{"a-b": "1"}),                        # the same series once renamed
        sample("odd.dup", 11.0),
        sample("odd.dup", 12.0, x=""),                                  # to Prometheus, the same as no label
    ]


# promtool's lint warnings that are accepted, all about names kept as they are: OpenTelemetry's
# (units other than the base one, as `_milliseconds`; gauges such as `system.cpu.logical.count`)
# and the dashboards' (dcgm-exporter's camelCase labels). Parse errors never are.
ACCEPTED_LINT = re.compile(r"^\S+ (use base unit \"\w+\" instead of \"\w+\"|metric names should not contain "
                           r"abbreviated units|label names should be written in 'snake_case' not 'camelCase'"
                           r"|non-histogram and non-summary metrics should not have \"_count\" suffix)$")


def test_one_nodes_names_cannot_fail_the_scrape(procs, tmp_path, prometheus_bin):
    addr, metrics = real_prometheus.collector_with_metrics(procs, tmp_path)
    acfg = tmp_path / "agent.toml"
    acfg.write_text(FAST_HOST_ONLY)
    procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", addr, "--node-id", "plain"],
          "agent")
    odd = odd_samples()
    with grpc.insecure_channel(addr) as ch:
        acks = list(pb_grpc.IngestStub(ch).Stream(iter([
            pb.AgentMessage(hello=pb.Hello(node_id="odd", boot_id="b")),
            pb.AgentMessage(batch=pb.Batch(node_id="odd", boot_id="b", seq=1, samples=odd))]), timeout=30))
    assert any(a.HasField("ack") for a in acks), acks

    def held() -> dict | None:
        nodes = {n["node_id"]: n for n in nodes_json(addr)["nodes"]}
        if "odd" in nodes and len(nodes["odd"]["series"]) == len(odd) and series(nodes.get("plain", {"series": []}),
                                                                                  "system.cpu.time"):
            return nodes
        return None
    nodes = wait_until(held, what="both nodes' series at the collector")

    # The text Prometheus's own parser reads (promtool: the 0.0.4 text format).
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    check = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"], input=text,
                           capture_output=True, text=True)
    said = (check.stdout + check.stderr).strip()
    assert check.returncode in (0, 3), said          # 3: lint warnings only; 1: the text does not parse
    assert all(ACCEPTED_LINT.match(line) for line in said.splitlines()), said

    prom = real_prometheus.start(procs, tmp_path, real_prometheus.SCRAPE_1S + "scrape_configs:\n"
                                  + real_prometheus.scrape_job(metrics))
    up = wait_until(lambda: query(prom, 'up{job="xpusense"}'), timeout_s=120, what="Prometheus to scrape once")
    assert float(up[0]["value"][1]) == 1.0, "Prometheus refused the scrape"
    wait_until(lambda: query(prom, '{node="odd"}'), timeout_s=60, what="the odd node's series in Prometheus")

    # The plain node is all there, under its usual names.
    for s in nodes["plain"]["series"]:
        if s["value"] is not None and s["kind"] != "histogram":
            name = prom_name(s["name"], s["unit"], KINDS[s["kind"]]) + ("_total" if s["kind"] == "counter" else "")
            assert query(prom, f'{name}{{node="plain"}}'), name

    def only(q: str) -> tuple[dict, float]:
        got = query(prom, q)
        assert len(got) == 1, (q, got)
        lb = {k: v for k, v in got[0]["metric"].items() if k not in ("job", "instance")}
        return lb, float(got[0]["value"][1])
    # (Prometheus keeps no label with an empty value: the odd node sent no hostname.)
    assert only('odd_empty_key_ratio') == ({"__name__": "odd_empty_key_ratio", "device": "gpu0", "node": "odd"}, 1.0)
    assert only('odd_name_key_ratio')[0]["key__name__"] == "spoof"
    lb, v = only('odd_chars_ratio')
    assert v == 3.0 and lb == {"__name__": "odd_chars_ratio", "a_b": "1;2", "cl_": "3", "key_9lives": "4",
                               "exported_node": "spoof", "exported_le": "0.5", "quoted": 'a "b" \\ c\nd',
                               "node": "odd"}
    assert only('odd_requests_total') == ({"__name__": "odd_requests_total", "node": "odd"}, 5.0)
    assert only('xpusense_node_connected{node="odd"}')[0] == {"__name__": "xpusense_node_connected", "node": "odd"}
    assert only('odd_metric___ratio')[1] == 8.0
    dup = sorted(float(r["value"][1]) for r in query(prom, 'odd_dup_ratio'))
    assert dup == [9.0, 11.0], dup                  # the first of each pair that Prometheus would see as one
    # What was renamed or left out is counted (per scrape), by reason.
    counted = {r["metric"]["reason"]: float(r["value"][1])
               for r in query(prom, "xpusense_collector_prometheus_sanitized_total")}
    assert {k for k, v in counted.items() if v > 0} == {
        "label_empty", "label_renamed", "label_merged", "name_renamed", "name_taken", "series_duplicate"}, counted
    # Prometheus itself saw no duplicate series in any scrape.
    with urllib.request.urlopen(f"http://{prom}/metrics", timeout=10) as r:
        own = r.read().decode()
    dups = re.search(r"^prometheus_target_scrapes_sample_duplicate_timestamp_total (\S+)$", own, re.M)
    assert dups is not None and float(dups.group(1)) == 0.0, dups
