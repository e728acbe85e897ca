"""Each pod's use of a shared GPU, end to end: the agent on the fake NVML (two pods' processes on
GPU 0 under time-slicing, one pod's on GPU 1) with `[k8s]` on, naming pods from the recorded host
view in tests/fixtures/cgroup and a fake kubelet's pod-resources on a unix socket; the collector's
roll-ups, and Debian's real `prometheus` scraping them under the native names and dcgm-exporter's
(labels pod, namespace, container), where dcgm-exporter's Grafana dashboard queries still answer."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import sys

import grpc
import pytest
import real_prometheus
from helpers import BIN, ROOT, nodes_json, series, wait_until
from real_prometheus import label_values, query

from xpusense.podresources.v1 import api_pb2, api_pb2_grpc

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
from driving import h100s, write_scenario  # noqa: E402
from fakes.nvml import fakenvml  # noqa: E402

FIX = ROOT / "tests/fixtures/cgroup"
# The fixture's processes and the pods their runtime metadata names (tests/unit/test_pods.py).
TRAIN = ("llama-train-0", "ml-research", "trainer")   # pid 1001
SERVE = ("vllm-7b-5d9c", "serving", "server")           # pid 1004
BENCH = ("nccl-test", "default", "bench")               # pid 1003
UUID = "GPU-fa4e0000-0000-4000-8000-{:012x}"             # the fake's GPU UUIDs
SCENARIO = """
[gpu 0]
process = 1001 6GiB python3
process = 1004 3GiB python3
process_util = 1001 60 20 0 0
process_util = 1004 30 10 0 0
[gpu 1]
process = 1003 4GiB python3
process_util = 1003 50 25 0 0
"""
AGENT = f"""
[tiers]
realtime_s = 1.0
nearline_s = 1.0
offline_s = 10.0
timeout_ratio = 1.0
[stream]
flush_s = 0.05
[sources.host]
enabled = false
[sources.ebpf]
enabled = false
[k8s]
enabled = true
procfs = "{FIX / 'proc'}"
metadata_dirs = ["{FIX / 'run/containerd/io.containerd.runtime.v2.task/k8s.io'}",
                 "{FIX / 'run/containers/storage/overlay-containers'}", "{FIX / 'var/lib/docker/containers'}"]
refresh_s = 1.0
pod_resources_socket = "{{socket}}"
"""
GIB = 2**30


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    """pod-resources List: GPU 0 time-sliced between two pods (NVIDIA's `<uuid>::<n>` replicas), GPU 1 whole."""

    def List(self, request, context):
        def pod(names, device_id):
            name, namespace, container = names
            return api_pb2.PodResources(name=name, namespace=namespace, containers=[api_pb2.ContainerResources(
                name=container, devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpu",
                                                                  device_ids=[device_id])])])
        return api_pb2.ListPodResourcesResponse(pod_resources=[
            pod(TRAIN, UUID.format(0) + "::0"), pod(SERVE, UUID.format(0) + "::1"), pod(BENCH, UUID.format(1))])


@pytest.fixture
def kubelet(tmp_path):
    sock = tmp_path / "pod-resources" / "kubelet.sock"
    sock.parent.mkdir()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(Kubelet(), server)
    assert server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield sock
    server.stop(grace=None)


GRAPHICS = "xpusense.accelerator.graphics.utilization"
# NVIDIA's dcgm-exporter Grafana dashboard (NVIDIA/dcgm-exporter grafana/dcgm-exporter-dashboard.json):
# each panel's query as written there, and the labels of the answer for one device.
DASH_GR_ENGINE = ('max(DCGM_FI_PROF_GR_ENGINE_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) '
                  'by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)')
DASH_POWER_TOTAL = 'sum(max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (gpu))'
DASH_FB_USED = 'max(DCGM_FI_DEV_FB_USED{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)'

# The series behind them (name, labels), per device.
DASHBOARD_SOURCES = (("hw.temperature", {"sensor": "chip"}), ("hw.power", {}), ("xpusense.accelerator.memory.free", {}),
                     ("xpusense.accelerator.clock.frequency", {"clock": "sm"}), (GRAPHICS, {}),
                     ("xpusense.accelerator.cube.utilization", {}), ("hw.gpu.memory.usage", {}))


def _by_host_gpu(host: str, gpu: str, pod: str = "") -> tuple:
    return tuple(sorted({"Hostname": host, "gpu": gpu, **({"pod": pod} if pod else {})}.items()))


def _by_uuid(host: str, gpu: str, pod: str = "") -> tuple:
    return tuple(sorted((*_by_host_gpu(host, gpu, pod), ("UUID", UUID.format(int(gpu))))))


def _whole(host: str, gpu: str, pod: str = "") -> tuple:
    return ()   # one answer over every device chosen


DASHBOARD = {
    'max(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)': _by_host_gpu,
    'avg(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"})': _whole,
    'max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)': _by_host_gpu,
    DASH_POWER_TOTAL: _whole,
    'max(DCGM_FI_DEV_SM_CLOCK{Hostname=~"$Hostname", gpu=~"$gpu"} * 1000000) by (Hostname, UUID, gpu)': _by_uuid,
    DASH_GR_ENGINE: _by_host_gpu,
    'max(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) '
    'by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)': _by_host_gpu,
    DASH_FB_USED: _by_host_gpu,
}


def fill(expr: str, pod: str = "") -> str:
    """A dashboard query as Grafana sends it with "All" chosen; with `pod`, that pod's panel (its
    selector narrowed to the pod and `pod` in its `by`)."""
    expr = expr.replace("$Hostname", ".*").replace("$gpu", ".*")
    if pod:
        expr = expr.replace('gpu=~".*"}', f'gpu=~".*", pod=~"{pod}"}}')
        expr = re.sub(r"by \(([^)]*)\)", r"by (\1, pod)", expr)
    return expr


def labelsets(result: list[dict]) -> set[tuple]:
    """The label sets of a query's answer (a vector: each set once)."""
    return {tuple(sorted(r["metric"].items())) for r in result}


def by_gpu(prom: str, q: str) -> dict[str, float]:
    return {r["metric"].get("gpu", ""): float(r["value"][1]) for r in query(prom, q)}


def by_pod(prom: str, q: str, key: str = "pod") -> dict[str, float]:
    return {r["metric"].get(key, ""): float(r["value"][1]) for r in query(prom, q)}


def pod_labels(names) -> dict[str, str]:
    return dict(zip(("k8s.pod.name", "k8s.namespace.name", "k8s.container.name"), names))


def test_each_pods_share_of_a_gpu_at_the_collector_and_in_prometheus(procs, tmp_path, libdir, kubelet):
    real_prometheus.binary()
    addr, metrics = real_prometheus.collector_with_metrics(procs, tmp_path)
    acfg = tmp_path / "agent.toml"
    acfg.write_text(AGENT.format(socket=kubelet))
    scn = write_scenario(tmp_path, h100s(2) + SCENARIO)
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", addr,
                   "--node-id", "pod-node", "--npu-smi", "/nonexistent"], "agent", env=fakenvml.env(libdir, scn))

    # Each pod's roll-ups on each GPU: sm and memory utilisation (NVML's percent / 100) and memory.
    want = {("gpu0", TRAIN): (0.6, 0.2, 6 * GIB), ("gpu0", SERVE): (0.3, 0.1, 3 * GIB),
            ("gpu1", BENCH): (0.5, 0.25, 4 * GIB)}

    seen: dict = {}

    def rollups() -> dict | None:
        node = next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "pod-node"), None)
        if node is None:
            return None
        got = {}
        for (dev, pod) in want:
            lb = {"device": dev, **pod_labels(pod)}
            got[(dev, pod)] = tuple(s[0]["value"] if len(s) == 1 else None for s in (
                series(node, "xpusense.accelerator.pod.utilization", engine="sm", **lb),
                series(node, "xpusense.accelerator.pod.utilization", engine="memory", **lb),
                series(node, "xpusense.accelerator.pod.memory.usage", **lb)))
        # The kubelet's assignments named by our device ids (the inventory may come after the first List).
        assigned = sorted((s["labels"]["device"], s["labels"]["k8s.pod.name"]) for s in node["series"]
                          if s["name"] == "xpusense.k8s.device.assigned" and s["value"] == 1.0)
        # What the dashboard's panels read, on both GPUs (GPM's graphics utilisation from the second round on).
        dashboard = sorted(name for name, lb in DASHBOARD_SOURCES
                           if {s["labels"]["device"] for s in series(node, name, **lb)} != {"gpu0", "gpu1"})
        seen.update(rollups=got, assigned=assigned, dashboard_missing=dashboard)
        return node if got == want and not dashboard and assigned == [
            ("gpu0", TRAIN[0]), ("gpu0", SERVE[0]), ("gpu1", BENCH[0])] else None
    node = wait_until(rollups, timeout_s=120, what=lambda: f"the pods' roll-ups and assignments at the collector "
                                                          f"(want {want}, seen {seen})")
    agent.kill(signal.SIGTERM)   # the collector's latest values stand still from here on

    prom = real_prometheus.start(procs, tmp_path, real_prometheus.SCRAPE_1S + "scrape_configs:\n"
                                 + real_prometheus.scrape_job(metrics))
    wait_until(lambda: query(prom, "DCGM_FI_DEV_GPU_UTIL{pod!=''}"), timeout_s=120,
               what="Prometheus to scrape the pods' series")

    # Native names: the roll-ups with their pod labels.
    assert by_pod(prom, 'xpusense_accelerator_pod_utilization_ratio{engine="sm"}', "k8s_pod_name") == {
        TRAIN[0]: 0.6, SERVE[0]: 0.3, BENCH[0]: 0.5}
    assert by_pod(prom, "xpusense_accelerator_pod_memory_usage_bytes", "k8s_pod_name") == {
        TRAIN[0]: 6 * GIB, SERVE[0]: 3 * GIB, BENCH[0]: 4 * GIB}
    # ...and each process's own utilisation, with its pod.
    assert {(r["metric"]["pid"], r["metric"].get("k8s_pod_name")): float(r["value"][1]) for r in
            query(prom, 'xpusense_accelerator_process_utilization_ratio{engine="sm"}')} == {
        ("1001", TRAIN[0]): 0.6, ("1004", SERVE[0]): 0.3, ("1003", BENCH[0]): 0.5}
    # dcgm-exporter's names: the shared GPU once per pod, each with its own utilisation and memory...
    assert by_pod(prom, 'DCGM_FI_DEV_GPU_UTIL{gpu="0"}') == {TRAIN[0]: 60.0, SERVE[0]: 30.0}
    assert by_pod(prom, 'DCGM_FI_DEV_MEM_COPY_UTIL{gpu="0"}') == {TRAIN[0]: 20.0, SERVE[0]: 10.0}
    assert by_pod(prom, 'DCGM_FI_DEV_FB_USED{gpu="0"}') == {TRAIN[0]: 6144.0, SERVE[0]: 3072.0}
    one = query(prom, f'DCGM_FI_DEV_GPU_UTIL{{pod="{TRAIN[0]}"}}')[0]["metric"]
    assert (one["namespace"], one["container"], one["UUID"], one["Hostname"]) == (
        TRAIN[1], TRAIN[2], UUID.format(0), node["inventory"]["hostname"])
    # ...the rest the device's value in each, as dcgm-exporter's time-slicing mode; the whole GPU its own.
    power = series(node, "hw.power", device="gpu0")[0]["value"]
    assert by_pod(prom, 'DCGM_FI_DEV_POWER_USAGE{gpu="0"}') == {TRAIN[0]: power, SERVE[0]: power}
    util1 = series(node, "hw.gpu.utilization", device="gpu1")[0]["value"]
    assert by_pod(prom, 'DCGM_FI_DEV_GPU_UTIL{gpu="1"}') == {BENCH[0]: util1 * 100.0}

    # dcgm-exporter's Grafana dashboard with "All" chosen: its variables, then every panel's query.
    host = node["inventory"]["hostname"]
    assert label_values(prom, "Hostname", "DCGM_FI_DEV_FB_FREE") == [host]
    assert label_values(prom, "gpu", 'DCGM_FI_DEV_FB_FREE{Hostname=~".*"}') == ["0", "1"]
    assert label_values(prom, "pod", "DCGM_FI_DEV_FB_FREE") == sorted((TRAIN[0], SERVE[0], BENCH[0]))
    for expr, labels in DASHBOARD.items():
        assert labelsets(query(prom, fill(expr))) == {labels(host, gpu) for gpu in ("0", "1")}, expr
    graphics = {g: series(node, GRAPHICS, device=f"gpu{g}")[0]["value"] for g in ("0", "1")}
    assert by_gpu(prom, fill(DASH_GR_ENGINE)) == graphics and 0.0 < graphics["0"] <= 1.0
    watts = [series(node, "hw.power", device=f"gpu{g}")[0]["value"] for g in ("0", "1")]
    assert float(query(prom, fill(DASH_POWER_TOTAL))[0]["value"][1]) == sum(watts)   # the shared GPU counted once
    # The same panels per pod: the pod's selector and `pod` in every `by`, one pod's devices each.
    for pod, gpu in ((TRAIN, "0"), (SERVE, "0"), (BENCH, "1")):
        for expr, labels in DASHBOARD.items():
            assert labelsets(query(prom, fill(expr, pod[0]))) == {labels(host, gpu, pod[0])}, (pod, expr)
        assert by_gpu(prom, fill(DASH_GR_ENGINE, pod[0])) == {gpu: graphics[gpu]}
        # Memory: the pod's own on the shared GPU, the device's on the GPU the pod has whole.
        used = (series(node, "xpusense.accelerator.pod.memory.usage", device="gpu0", **pod_labels(pod)) if gpu == "0"
                else series(node, "hw.gpu.memory.usage", device="gpu1"))[0]["value"]
        assert by_gpu(prom, fill(DASH_FB_USED, pod[0])) == {gpu: used / 2**20}
    assert by_pod(prom, "sum by (pod) (DCGM_FI_DEV_GPU_UTIL)") == {TRAIN[0]: 60.0, SERVE[0]: 30.0,
                                                                  BENCH[0]: util1 * 100.0}
    assert by_pod(prom, f'sum by (pod) (DCGM_FI_DEV_FB_USED{{namespace="{SERVE[1]}"}})') == {SERVE[0]: 3072.0}
