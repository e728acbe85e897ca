"""Pod attribution (agent/pods.py): cgroup paths of both kubelet cgroup drivers and three runtimes,
the runtimes' metadata, and the kubelet's pod-resources API served by a fake gRPC server on a unix
socket, over the recorded host view in tests/fixtures/cgroup."""

from __future__ import annotations

import concurrent.futures
import os
import shutil

import grpc
import pytest
from helpers import ROOT

from xpusense.agent import pods
from xpusense.agent.config import load_agent
from xpusense.agent.sources.base import COUNTER, Event, Sample
from xpusense.podresources.v1 import api_pb2, api_pb2_grpc

FIX = ROOT / "tests/fixtures/cgroup"
META = [str(FIX / "run/containerd/io.containerd.runtime.v2.task/k8s.io"),
        str(FIX / "run/containers/storage/overlay-containers"), str(FIX / "var/lib/docker/containers")]
C1 = "aaaaaaaa0123456789abcdef0123456789abcdef0123456789abcdefbbbbbbbb"
C5 = "2" * 64
U1 = "6f1c1a2e-4b7d-4c1e-9a55-0c2f4a9d8e11"
U5 = "5f4e3d2c-1b0a-4998-8776-655443322110"
GPU0_UUID = "GPU-11111111-2222-3333-4444-555555555555"

# The node's inventory as the agent has it: two GPUs (UUIDs from NVML), two Ascend chips.
RESOURCES = [
    {"type": "CPU", "vendor": "x86_64", "model": "Xeon"},
    {"type": "GPU", "vendor": "nvidia", "model": "H100-80GB-HBM3", "id": "gpu0", "attributes": {"uuid": GPU0_UUID}},
    {"type": "GPU", "vendor": "nvidia", "model": "H100-80GB-HBM3", "id": "gpu1",
     "attributes": {"uuid": "GPU-99999999-8888-7777-6666-555555555555"}},
    {"type": "NPU", "vendor": "huawei", "model": "Ascend-910B4", "id": "npu3-0", "attributes": {"chips_per_card": "1"}},
    {"type": "NPU", "vendor": "huawei", "model": "Ascend-910B4", "id": "npu4-0", "attributes": {"phy_id": "4"}},
]


@pytest.mark.parametrize("path,uid,cid", [
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U1.replace('-', '_')}.slice/"
     f"cri-containerd-{C1}.scope", U1, C1),
    (f"/kubepods.slice/kubepods-pod{U1.replace('-', '_')}.slice/crio-{C1}.scope", U1, C1),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U1.replace('-', '_')}.slice/"
     f"docker-{C1}.scope", U1, C1),
    (f"/kubepods/burstable/pod{U1}/{C1}", U1, C1),
    (f"/kubepods/pod{U1}/{C1}", U1, C1),
    (f"/../../kubepods-burstable-pod{U1.replace('-', '_')}.slice/cri-containerd-{C1}.scope", U1, C1),
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U1.replace('-', '_')}.slice", U1, None),
    (f"/kubepods.slice/kubepods-pod{U1.replace('-', '_')}.slice/crio-conmon-{C1}.scope", U1, None),
    ("/system.slice/containerd.service", None, None),
    ("/", None, None),
])
def test_cgroup_paths_of_both_drivers_and_three_runtimes(path, uid, cid):
    got = pods.parse_cgroup_path(path)
    assert got.get(pods.POD_UID) == uid
    assert got.get(pods.CONTAINER_ID) == cid


def test_proc_cgroup_v2_and_v1():
    assert pods.parse_proc_cgroup("0::/system.slice/sshd.service\n") == "/system.slice/sshd.service"
    v1 = (FIX / "proc/1003/cgroup").read_text()
    assert pods.parse_proc_cgroup(v1).startswith("/kubepods/besteffort/pod")
    hybrid = "12:pids:/user.slice\n1:name=systemd:/user.slice\n0::/user.slice/x.scope\n"
    assert pods.parse_proc_cgroup(hybrid) == "/user.slice/x.scope"
    assert pods.parse_proc_cgroup("") == ""


def test_runtime_metadata_of_containerd_crio_and_docker():
    for pid, want in (("1001", ("llama-train-0", "ml-research", "trainer")),
                      ("1002", ("mindspore-job-1", "ascend-jobs", "worker")),
                      ("1003", ("nccl-test", "default", "bench")),
                      ("1004", ("vllm-7b-5d9c", "serving", "server"))):
        cid = pods.parse_cgroup_path(pods.parse_proc_cgroup((FIX / "proc" / pid / "cgroup").read_text()))[pods.CONTAINER_ID]
        got = pods.read_runtime_metadata(META, cid)
        assert (got[pods.POD_NAME], got[pods.NAMESPACE], got[pods.CONTAINER]) == want, pid
    assert pods.read_runtime_metadata(META, C5) == {}
    # Docker's pause container is named POD: not a container name.
    assert pods.CONTAINER not in pods.parse_runtime_metadata(
        {"Config": {"Labels": {"io.kubernetes.container.name": "POD", "io.kubernetes.pod.name": "p"}}})


def test_device_plugin_ids_for_nvidia_uuids_and_ascend_physical_ids():
    ids = pods.device_plugin_ids(RESOURCES)
    assert pods.our_device(GPU0_UUID, ids) == "gpu0"
    assert pods.our_device("Ascend910-3", ids) == "npu3-0"     # one chip per card: NPU ID
    assert pods.our_device("Ascend910-4", ids) == "npu4-0"     # npu-smi's physical id
    assert pods.our_device("Ascend910-7", ids) == ""
    assert pods.our_device("GPU-unknown", ids) == ""


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's pod-resources service, answering List from a table the test sets."""

    def __init__(self):
        self.calls = 0
        self.pods = [
            api_pb2.PodResources(name="llama-train-0", namespace="ml-research", containers=[
                api_pb2.ContainerResources(name="trainer", devices=[
                    api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[GPU0_UUID])])]),
            api_pb2.PodResources(name="infer-x", namespace="serving", containers=[
                api_pb2.ContainerResources(name="server", devices=[
                    api_pb2.ContainerDevices(resource_name="huawei.com/Ascend910", device_ids=["Ascend910-3"])]),
                api_pb2.ContainerResources(name="sidecar")]),
        ]

    def List(self, request, context):
        self.calls += 1
        return api_pb2.ListPodResourcesResponse(pod_resources=self.pods)


@pytest.fixture
def kubelet(tmp_path):
    sock_dir = tmp_path / "pod-resources"
    sock_dir.mkdir()
    sock = sock_dir / "kubelet.sock"
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    fake = FakeKubelet()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(fake, server)
    assert server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield fake, str(sock)
    server.stop(grace=None)


def sample(name, **labels):
    return Sample(name, 1.0, "By", labels, COUNTER, 1)


def test_labels_from_cgroups_metadata_and_pod_resources(kubelet):
    fake, sock = kubelet
    got = pods.list_pod_resources(sock)
    assert [(a.namespace, a.pod, a.container, a.resource, a.device_ids) for a in got] == [
        ("ml-research", "llama-train-0", "trainer", "nvidia.com/gpu", [GPU0_UUID]),
        ("serving", "infer-x", "server", "huawei.com/Ascend910", ["Ascend910-3"])]

    p = pods.PodLabeler(procfs=str(FIX / "proc"), pod_resources_socket=sock, metadata_dirs=META,
                        resources=lambda: RESOURCES)
    p.refresh()
    assert fake.calls == 2   # the direct List above, and the refresh
    samples = [
        sample("xpusense.accelerator.process.memory.usage", pid="1001", device="gpu0", vendor="nvidia"),
        sample("xpusense.cuda.memcpy.io", pid="1002", process="python3", direction="host_to_device"),
        sample("xpusense.accelerator.ioctl.calls", pid="1003", process="nccl"),
        sample("xpusense.cgroup.network.io", cgroup=f"/kubepods/burstable/pod{'0a1b2c3d-4e5f-4061-8273-94a5b6c7d8e9'}/{'1' * 64}",
               direction="transmit"),
        sample("xpusense.accelerator.process.memory.usage", pid="1005", device="gpu1"),
        sample("xpusense.accelerator.process.memory.usage", pid="1007", device="npu3-0", vendor="huawei"),
        sample("xpusense.accelerator.process.memory.usage", pid="99999", device="gpu0"),   # exited
        sample("system.cpu.time", state="user"),
    ]
    out = p.label(samples)
    by = {(s.name, s.labels.get("pid") or s.labels.get("cgroup") or s.labels.get("state")): s.labels for s in out}
    l1 = by[("xpusense.accelerator.process.memory.usage", "1001")]
    assert (l1[pods.POD_NAME], l1[pods.NAMESPACE], l1[pods.CONTAINER]) == ("llama-train-0", "ml-research", "trainer")
    assert l1[pods.POD_UID] == U1 and l1[pods.CONTAINER_ID] == C1 and l1["device"] == "gpu0"
    l2 = by[("xpusense.cuda.memcpy.io", "1002")]
    assert (l2[pods.POD_NAME], l2[pods.NAMESPACE], l2[pods.CONTAINER]) == ("mindspore-job-1", "ascend-jobs", "worker")
    l3 = by[("xpusense.accelerator.ioctl.calls", "1003")]
    assert (l3[pods.POD_NAME], l3[pods.CONTAINER]) == ("nccl-test", "bench")
    l4 = next(v for (n, k), v in by.items() if n == "xpusense.cgroup.network.io")
    assert (l4[pods.POD_NAME], l4[pods.NAMESPACE], l4[pods.CONTAINER]) == ("vllm-7b-5d9c", "serving", "server")
    # Not a pod: untouched.
    assert pods.POD_NAME not in by[("xpusense.accelerator.process.memory.usage", "1005")]
    assert pods.POD_UID not in by[("xpusense.accelerator.process.memory.usage", "1005")]
    # No runtime metadata: named through the kubelet's assignment of its device (Ascend910-3 -> npu3-0).
    l7 = by[("xpusense.accelerator.process.memory.usage", "1007")]
    assert (l7[pods.POD_NAME], l7[pods.NAMESPACE], l7[pods.CONTAINER]) == ("infer-x", "serving", "server")
    assert l7[pods.POD_UID] == U5 and l7[pods.CONTAINER_ID] == C5
    # A pid whose /proc entry is gone: its device's assignment names it.
    assert by[("xpusense.accelerator.process.memory.usage", "99999")][pods.POD_NAME] == "llama-train-0"
    assert by[("system.cpu.time", "user")] == {"state": "user"}

    assigned = [s for s in out if s.name == "xpusense.k8s.device.assigned"]
    assert {(s.labels["device"], s.labels["device_plugin_id"], s.labels[pods.POD_NAME], s.labels[pods.CONTAINER],
             s.labels["resource"]) for s in assigned} == {
        ("gpu0", GPU0_UUID, "llama-train-0", "trainer", "nvidia.com/gpu"),
        ("npu3-0", "Ascend910-3", "infer-x", "server", "huawei.com/Ascend910")}
    assert all(s.value == 1.0 and s.time_ns > 0 for s in assigned)
    # Assignment samples go out once per refresh, not with every batch.
    assert not [s for s in p.label([sample("x", pid="1001")]) if s.name == "xpusense.k8s.device.assigned"]
    assert p.assignments()[0]["device"] == "gpu0"


def test_time_sliced_replicas_and_an_assignment_that_ends(kubelet):
    fake, sock = kubelet
    assert pods.our_device(f"{GPU0_UUID}::3", pods.device_plugin_ids(RESOURCES)) == "gpu0"
    assert pods.our_device("GPU-unknown::3", pods.device_plugin_ids(RESOURCES)) == ""
    share = lambda pod, ctr, replica: api_pb2.PodResources(name=pod, namespace="ml", containers=[
        api_pb2.ContainerResources(name=ctr, devices=[api_pb2.ContainerDevices(
            resource_name="nvidia.com/gpu", device_ids=[f"{GPU0_UUID}::{replica}"])])])
    fake.pods = [share("a-0", "main", 0), share("b-0", "main", 1)]   # NVIDIA's time-slicing: one GPU, two pods
    p = pods.PodLabeler(procfs=str(FIX / "proc"), pod_resources_socket=sock, metadata_dirs=META,
                        resources=lambda: RESOURCES)
    p.refresh()
    sent = lambda: {(s.labels["device"], s.labels[pods.POD_NAME], s.value) for s in p.label([])
                    if s.name == "xpusense.k8s.device.assigned"}
    assert sent() == {("gpu0", "a-0", 1.0), ("gpu0", "b-0", 1.0)}
    fake.pods = fake.pods[1:]   # a-0 ended: its assignment is sent once more as 0, then no more
    p.refresh()
    assert sent() == {("gpu0", "a-0", 0.0), ("gpu0", "b-0", 1.0)}
    p.refresh()
    assert sent() == {("gpu0", "b-0", 1.0)}
    fake.pods = []
    p.refresh()
    assert sent() == {("gpu0", "b-0", 0.0)}


def test_namespaced_cgroup_path_and_conmon(tmp_path):
    p = pods.PodLabeler(procfs=str(FIX / "proc"), pod_resources_socket="", metadata_dirs=META)
    l6 = p.label([sample("a", pid="1006")])[0].labels
    assert (l6[pods.POD_NAME], l6[pods.CONTAINER]) == ("llama-train-0", "trainer")
    l8 = p.label([sample("a", pid="1008")])[0].labels
    assert l8[pods.POD_UID] == U1 and pods.CONTAINER not in l8 and pods.CONTAINER_ID not in l8


def test_without_the_socket_names_come_from_metadata_only(tmp_path):
    p = pods.PodLabeler(procfs=str(FIX / "proc"), pod_resources_socket=str(tmp_path / "absent.sock"),
                        metadata_dirs=META, resources=lambda: RESOURCES)
    p.start()
    try:
        out = p.label([sample("a", pid="1001", device="gpu0"), sample("a", pid="1007", device="npu3-0")])
        assert out[0].labels[pods.POD_NAME] == "llama-train-0"
        assert pods.POD_NAME not in out[1].labels and out[1].labels[pods.POD_UID] == U5
        assert p.last_error == "missing"
    finally:
        p.close()


def test_cache_expires_so_a_reused_pid_is_read_again(tmp_path):
    procfs = tmp_path / "proc"
    shutil.copytree(FIX / "proc", procfs)
    now = [0.0]
    p = pods.PodLabeler(procfs=str(procfs), metadata_dirs=META, refresh_s=10.0, clock=lambda: now[0])
    assert p.label([sample("a", pid="1001")])[0].labels[pods.POD_NAME] == "llama-train-0"
    (procfs / "1001/cgroup").write_text("0::/system.slice/cron.service\n")   # pid reused by another process
    assert p.label([sample("a", pid="1001")])[0].labels[pods.POD_NAME] == "llama-train-0"   # cached
    now[0] = 11.0
    assert pods.POD_NAME not in p.label([sample("a", pid="1001")])[0].labels


def test_config_k8s_table_and_node_name_label(tmp_path, kubelet):
    _, sock = kubelet
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text(f'[labels]\ncloud = "aws"\n[k8s]\nenabled = true\nprocfs = "{FIX / "proc"}"\n'
                        f'pod_resources_socket = "{sock}"\nmetadata_dirs = {META!r}\nrefresh_s = 0.5\n'.replace("'", '"'))
    cfg = load_agent(str(cfg_file), env={"XPUSENSE_K8S_NODE_NAME": "gpu-node-17"})
    p = pods.build_pod_labeler(cfg, lambda: RESOURCES)
    try:
        assert cfg.labels == {"cloud": "aws", "k8s_node": "gpu-node-17"}
        assert p.label([sample("a", pid="1001")])[0].labels[pods.CONTAINER] == "trainer"
    finally:
        p.close()
    off = load_agent(None, env={})
    assert off.k8s.enabled is False and pods.build_pod_labeler(off, lambda: []) is None
    assert os.path.isabs(off.k8s.pod_resources_socket)


def test_a_diagnosis_names_the_pod_of_its_process_its_cgroup_or_its_device(kubelet):
    _, sock = kubelet
    p = pods.PodLabeler(procfs=str(FIX / "proc"), pod_resources_socket=sock, metadata_dirs=META,
                        resources=lambda: RESOURCES)
    p.refresh()

    def diagnosis(device="", **attrs):
        return Event("diagnosis", "m", "warning", device, {"diagnosis.rule": "r", **attrs})
    by_pid = p.label_event(diagnosis("gpu0", **{"process.pid": "1001"})).attributes
    assert (by_pid[pods.POD_NAME], by_pid[pods.NAMESPACE], by_pid[pods.CONTAINER]) == \
        ("llama-train-0", "ml-research", "trainer")
    cgroup = f"/kubepods/burstable/pod{'0a1b2c3d-4e5f-4061-8273-94a5b6c7d8e9'}/{'1' * 64}"
    assert p.label_event(diagnosis(cgroup=cgroup)).attributes[pods.POD_NAME] == "vllm-7b-5d9c"
    # About a device only (PCIe contention): the pod the kubelet assigned it to.
    assert p.label_event(diagnosis("npu3-0")).attributes[pods.POD_NAME] == "infer-x"
    # Nothing known: unchanged; the event's own attributes are never overwritten.
    assert p.label_event(diagnosis("gpu1")).attributes == {"diagnosis.rule": "r"}
    own = p.label_event(diagnosis("gpu0", **{"process.pid": "1001", pods.POD_NAME: "as-sent"})).attributes
    assert own[pods.POD_NAME] == "as-sent" and own[pods.NAMESPACE] == "ml-research"
