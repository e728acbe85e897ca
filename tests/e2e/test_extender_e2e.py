"""kube-scheduler's extender against a collector fed by real agents on the fakes: an idle 8-GPU node
(fake NVML), a node whose 8 GPUs are full, an 8-NPU node (fake npu-smi) and a Kubernetes node with
no agent. ExtenderArgs are v1 Pods and NodeLists as the API server serialises them (the kubernetes
client's models), posted over HTTP in both nodeCacheCapable forms; the same against a cluster-mode
scheduler replica."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from cluster_support import cluster_config, module_cmd, nats_cluster, start_gateway  # noqa: F401
from fakes.nvml import fakenvml
from helpers import BIN, ROOT, free_port, nodes_json, wait_until

k8s = pytest.importorskip("kubernetes.client")

FAKE_NPU_SMI = ROOT / "tests/fakes/npu-smi/npu-smi"
NPU_SCENARIO = ROOT / "tests/fixtures/npu-smi/scenario-8x910B4"
AGENT_CONFIG = """
[tiers]
realtime_s = 1.0
nearline_s = 5.0
offline_s = 10.0
timeout_ratio = 1.0
[stream]
flush_s = 0.1
[sources.host]
enabled = false
[sources.ebpf]
enabled = false   # tests attach probes only to namespaces they create
[sources.{off}]
enabled = false
[labels]
region = "cn-beijing"
zone = "bj-a"
price = "4.0"
{k8s_node}
"""
# Kubernetes node name -> fleet node id (the idle GPU and NPU nodes carry the inventory label k8s_node)
K8S_NODES = {"k8s-gpu-idle": "gpu-idle", "gpu-full": "gpu-full", "k8s-npu": "npu-node", "k8s-ghost": None}
API = k8s.ApiClient()


def start_agents(procs, tmp_path, addr: str, libdir) -> None:
    """The idle GPU node (1 GiB used of each 80 GB), the full one (79 GiB used), the NPU node."""
    for node, used in (("gpu-idle", "1GiB"), ("gpu-full", "79GiB")):
        text = fakenvml.scenario("h100x8").read_text()
        scn = tmp_path / f"{node}.scn"
        scn.write_text("\n".join(f"mem_used = 0:{used} 60:{used}" if ln.startswith("mem_used") else ln
                                 for ln in text.splitlines()) + "\n")
        label = 'k8s_node = "k8s-gpu-idle"' if node == "gpu-idle" else ""
        _agent(procs, tmp_path, addr, node, AGENT_CONFIG.format(off="npu_smi", k8s_node=label),
               fakenvml.env(libdir, scn), [])
    scenario = tmp_path / "npu-scenario"
    shutil.copytree(NPU_SCENARIO, scenario)
    _agent(procs, tmp_path, addr, "npu-node", AGENT_CONFIG.format(off="nvml", k8s_node='k8s_node = "k8s-npu"'),
           {"FAKE_NPU_SMI_DIR": str(scenario)}, ["--npu-smi", str(FAKE_NPU_SMI)])


def _agent(procs, tmp_path, addr, node, config, env, extra):
    cfg = tmp_path / f"{node}.toml"
    cfg.write_text(config)
    procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr, "--node-id", node, *extra],
          node, env=env)


def pod(resources: dict | None = None, annotations: dict | None = None) -> dict:
    containers = [k8s.V1Container(name="main", image="trainer:1", resources=k8s.V1ResourceRequirements(
        limits=resources, requests=resources) if resources else None),
        k8s.V1Container(name="sidecar", image="log:1", resources=k8s.V1ResourceRequirements(
            requests={"cpu": "100m", "memory": "64Mi"}))]
    p = k8s.V1Pod(api_version="v1", kind="Pod",
                  metadata=k8s.V1ObjectMeta(name="job-0", namespace="ml", uid="0d3c", annotations=annotations),
                  spec=k8s.V1PodSpec(containers=containers, scheduler_name="xpusense-scheduler"))
    return API.sanitize_for_serialization(p)


def args(p: dict, cache_capable: bool) -> dict:
    """ExtenderArgs as kube-scheduler sends them: NodeNames (nodeCacheCapable) or a v1 NodeList."""
    if cache_capable:
        return {"Pod": p, "Nodes": None, "NodeNames": list(K8S_NODES)}
    nodes = k8s.V1NodeList(api_version="v1", kind="NodeList", metadata=k8s.V1ListMeta(resource_version="42"), items=[
        k8s.V1Node(api_version="v1", kind="Node", metadata=k8s.V1ObjectMeta(name=n, labels={"kubernetes.io/hostname": n}),
                   status=k8s.V1NodeStatus(allocatable={"cpu": "96", "nvidia.com/gpu": "8"}))
        for n in K8S_NODES])
    return {"Pod": p, "Nodes": API.sanitize_for_serialization(nodes), "NodeNames": None}


def post(ext: str, verb: str, doc) -> tuple[int, object]:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    req = urllib.request.Request(f"http://{ext}/{verb}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def passed(result: dict) -> list[str]:
    if result["NodeNames"] is not None:
        return result["NodeNames"]
    return [n["metadata"]["name"] for n in result["Nodes"]["items"]]


GPU_POD = ({"nvidia.com/gpu": "4"}, {"xpusense.io/memory-per-device": "40GB"})


def settled(ext: str) -> bool:
    """Every agent's readings are in: the 4 x 40 GB pod fits the idle node only, the full one for memory."""
    _, r = post(ext, "filter", args(pod(*GPU_POD), True))
    return isinstance(r, dict) and r["NodeNames"] == ["k8s-gpu-idle"] and "memory" in r["FailedNodes"].get("gpu-full", "")


def place(collector: str, *extra: str) -> list[tuple[str, float]]:
    out = subprocess.run([str(BIN / "xpusense-collector"), "place", "--collector", collector, "--format", "json",
                          "--limit", "10", *extra], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [(c["node_id"], c["score"]) for c in json.loads(out.stdout)["candidates"]]


def check_extender(ext: str, collector: str) -> None:
    wait_until(lambda: settled(ext), 120, what="the three agents' readings at the extender")
    for cache_capable in (True, False):
        # 4 GPUs x 40 GB: only the idle node; every other node fails with its reason
        status, r = post(ext, "filter", args(pod(*GPU_POD), cache_capable))
        assert status == 200 and r["Error"] == "", r
        assert passed(r) == ["k8s-gpu-idle"]
        if not cache_capable:   # the Node objects come back as they were sent
            assert r["Nodes"]["kind"] == "NodeList" and r["Nodes"]["items"][0]["status"]["allocatable"]["cpu"] == "96"
        assert list(r["FailedNodes"]) == ["gpu-full"]
        assert r["FailedNodes"]["gpu-full"].startswith("xpusense memory: 4 device(s) with 40.0GiB free needed")
        assert r["FailedAndUnresolvableNodes"]["k8s-npu"] == "xpusense type: no GPU on the node"
        assert r["FailedAndUnresolvableNodes"]["k8s-ghost"].startswith("xpusense unknown: no agent")
        # an NPU pod (the Ascend device plugin's resource): only the NPU node
        status, r = post(ext, "filter", args(pod({"huawei.com/Ascend910": "2"}), cache_capable))
        assert passed(r) == ["k8s-npu"], r
        assert set(r["FailedAndUnresolvableNodes"]) == {"k8s-gpu-idle", "gpu-full", "k8s-ghost"}
        # a plain pod: every node, untouched
        status, r = post(ext, "filter", args(pod({"cpu": "2"}), cache_capable))
        assert passed(r) == list(K8S_NODES) and r["FailedNodes"] == {} and r["FailedAndUnresolvableNodes"] == {}
    # prioritize ranks as Place does: one GPU, both GPU nodes fit; Place's scores mapped to 0-10
    one_gpu = args(pod({"nvidia.com/gpu": "1"}), True)

    def agree():
        ranked = dict(place(collector, "--accelerator", "gpu"))
        status, prios = post(ext, "prioritize", one_gpu)
        assert status == 200, prios
        best = max(ranked.values())
        want = [{"Host": n, "Score": round(10 * ranked[f] / best) if f in ranked else 0}
                for n, f in K8S_NODES.items()]
        return prios == want and ranked and prios or None
    prios = wait_until(agree, 30, what="prioritize answering as Place ranks")
    scores = {p["Host"]: p["Score"] for p in prios}
    assert scores["k8s-gpu-idle"] == 10 and 0 < scores["gpu-full"] < 10 and scores["k8s-npu"] == 0
    status, r = post(ext, "prioritize", args(pod(), True))   # no accelerator: no opinion
    assert status == 200 and {p["Score"] for p in r} == {0}
    # a pod the extender cannot read: Error names it (kube-scheduler reports it on the pod)
    _, r = post(ext, "filter", args(pod(*GPU_POD[:1], {"xpusense.io/memory": "40GB"}), True))
    assert "unknown annotation xpusense.io/memory" in r["Error"] and r["NodeNames"] is None
    status, r = post(ext, "prioritize", args(pod({"nvidia.com/gpu": "two"}), True))
    assert status == 400 and "nvidia.com/gpu = 'two' is not a whole number" in r


def test_extender_on_the_single_collector(libdir, procs, tmp_path):
    addr, ext = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "collector.toml"
    cfg.write_text("[kubernetes.extender]\nmax_request_bytes = 1000000\n")
    procs([str(BIN / "xpusense-collector"), "serve", "--config", str(cfg), "--listen", addr,
           "--extender-listen", ext], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector")
    start_agents(procs, tmp_path, addr, libdir)
    check_extender(ext, addr)
    # a body over [kubernetes.extender] max_request_bytes: 413, counted with the collector's counters
    status, r = post(ext, "filter", b"[" + b" " * 1_000_000 + b"]")
    assert status == 413 and "kubernetes.extender.max_request_bytes" in r
    assert nodes_json(addr)["counters"]["kubernetes.extender.max_request_bytes"] == 1


def test_extender_on_a_cluster_scheduler_replica(libdir, nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    addr, ext = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    s = procs(module_cmd("scheduler", "--config", str(cfg), "--listen", addr, "--extender-listen", ext), "scheduler")
    wait_until(lambda: "scheduler listening" in s.output() or s.p.poll() is not None, 60, what="scheduler")
    assert s.p.poll() is None, s.output()
    start_agents(procs, tmp_path, gw, libdir)
    check_extender(ext, addr)
    counters = nodes_json(addr)["counters"]   # the replica's extender counted, shown with its ListNodes
    assert counters["kubernetes.extender.requests"] >= 10 and counters["kubernetes.extender.errors"] == 2, counters
