"""The pod labels the dashboards' names carry at the collector (collector/compat_pods.py through
collector/prometheus.py): one pod per device, a device shared by pods (each its own utilisation and
memory), a pod whose processes ended, an assignment that ended, MIG instances, and devices with no
pod keeping today's labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from xpusense.collector.inventory_book import InventoryBook
from xpusense.collector.prometheus import FleetCollector
from xpusense.collector.state import FleetState
from xpusense.common import metric_names as m
from xpusense.v1 import telemetry_pb2 as pb

POD = {"train": {"k8s.pod.name": "train-0", "k8s.namespace.name": "ml", "k8s.container.name": "trainer"},
       "infer": {"k8s.pod.name": "infer-1", "k8s.namespace.name": "serving", "k8s.container.name": "server"},
       "side": {"k8s.pod.name": "infer-1", "k8s.namespace.name": "serving", "k8s.container.name": "sidecar"}}

INV = pb.Inventory(hostname="host-a")
INV.resources.add(type="GPU", vendor="nvidia", model="H100-80GB-HBM3", id="gpu0", attributes={"uuid": "GPU-a"})
INV.resources.add(type="GPU", vendor="nvidia", model="H100-80GB-HBM3", id="gpu1", attributes={"uuid": "GPU-b"})
INV.resources.add(type="GPU", vendor="nvidia", model="H100-80GB-HBM3", id="gpu2", attributes={"uuid": "GPU-c"})
INV.resources.add(type="NPU", vendor="huawei", model="Ascend-910B4", id="npu0-0", attributes={"chips_per_card": "1"})


def wire(name, value, t, unit="1", **labels):
    return pb.Sample(name=name, value=value, kind=pb.GAUGE, unit=unit, labels=labels, time_unix_nano=t)


def assigned(t, device, pod, value=1.0):
    return wire("xpusense.k8s.device.assigned", value, t, device=device, device_plugin_id=device, resource="r",
                **POD[pod])


BOOKS: dict[int, InventoryBook] = {}


def fleet(now):
    state = FleetState(clock=lambda: now)
    BOOKS[id(state)] = InventoryBook().watch(state)
    state.hello(pb.Hello(node_id="n1", boot_id="b", inventory=INV))
    return state


def scrape(state, now):
    """The scrape's compat series as (pod, container, value), those with the labels given (None: absent)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(state, BOOKS[id(state)], compat_names=True, max_age_s=600, clock_ns=lambda: now))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}

    def val(fam, **lb):
        return sorted((x.labels.get("pod", x.labels.get("pod_name")) or None,
                       x.labels.get("container", x.labels.get("container_name")) or None, x.value)
                      for x in fams[fam].samples if all(x.labels.get(k) == v for k, v in lb.items()))
    return val


def test_dashboard_names_carry_the_pods_of_each_device():
    now = 10**18 * 2
    state = fleet(now)
    g0, g1, g2 = ({"device": f"gpu{i}", "vendor": "nvidia"} for i in range(3))
    npu = {"device": "npu0-0", "vendor": "huawei"}
    state.ingest(pb.Batch(node_id="n1", boot_id="b", seq=1, samples=[
        # A refresh of the kubelet's assignments: gpu0 shared by two pods' containers (time-slicing),
        # gpu1 one pod's, the NPU one pod's; gpu2 no pod's. An older refresh named an ended pod on gpu2.
        assigned(now - 10, "gpu2", "train"),
        assigned(now, "gpu0", "train"), assigned(now, "gpu0", "infer"), assigned(now, "gpu1", "train"),
        assigned(now, "npu0-0", "infer"), assigned(now, "gpu2", "side", value=0.0),   # ended: sent as 0
        wire(m.GPU_UTILIZATION, 0.9, now, **g0), wire(m.GPU_MEMORY_USAGE, 10 * 2**30, now, "By", **g0),
        wire(m.POWER, 300.0, now, "W", **g0),
        wire(m.GPU_UTILIZATION, 0.4, now, **g1), wire(m.GPU_UTILIZATION, 0.1, now, **g2),
        wire(m.GPU_UTILIZATION, 0.5, now, **npu), wire(m.GPU_MEMORY_USAGE, 8 * 2**20, now, "By", **npu),
        # The roll-ups: on gpu0 only train-0 runs processes now; infer-1's ended a round ago.
        wire(m.POD_UTILIZATION, 0.6, now, engine="sm", **g0, **POD["train"]),
        wire(m.POD_UTILIZATION, 0.3, now - 5, engine="sm", **g0, **POD["infer"]),
        wire(m.POD_MEMORY_USAGE, 6 * 2**30, now, "By", **g0, **POD["train"]),
        wire(m.POD_MEMORY_USAGE, 3 * 2**30, now, "By", **g0, **POD["infer"]),
    ]))
    val = scrape(state, now)
    # A shared GPU: one series per pod, utilisation and memory each pod's own (0 for no process now)...
    assert val("DCGM_FI_DEV_GPU_UTIL", gpu="0") == [("infer-1", "server", 0.0), ("train-0", "trainer", 60.0)]
    assert val("DCGM_FI_DEV_FB_USED", gpu="0") == [("infer-1", "server", 3072.0), ("train-0", "trainer", 6144.0)]
    # ...and what no pod owns, the device's value in each, as dcgm-exporter's time-slicing mode writes.
    assert val("DCGM_FI_DEV_POWER_USAGE", gpu="0") == [("infer-1", "server", 300.0), ("train-0", "trainer", 300.0)]
    assert val("DCGM_FI_DEV_GPU_UTIL", gpu="0", namespace="ml") == [("train-0", "trainer", 60.0)]
    # One pod's GPU: the device's own figure, under the pod.
    assert val("DCGM_FI_DEV_GPU_UTIL", gpu="1") == [("train-0", "trainer", 40.0)]
    # No pod (the ended assignment is not read): no pod labels, as without Kubernetes.
    assert val("DCGM_FI_DEV_GPU_UTIL", gpu="2") == [(None, None, 10.0)]
    # npu-exporter's labels.
    assert val("npu_chip_info_utilization", id="0", namespace="serving") == [("infer-1", "server", 50.0)]
    assert val("npu_chip_info_hbm_used_memory", id="0") == [("infer-1", "server", 8.0)]


def test_without_assignments_the_pods_using_a_device_label_it():
    now = 10**18 * 2
    state = fleet(now)
    g0 = {"device": "gpu0", "vendor": "nvidia"}
    state.ingest(pb.Batch(node_id="n1", boot_id="b", seq=1, samples=[
        wire(m.GPU_UTILIZATION, 0.9, now, **g0), wire(m.GPU_UTILIZATION, 0.2, now, device="gpu1", vendor="nvidia"),
        wire(m.POD_UTILIZATION, 0.5, now, engine="sm", mig_instance="1", **g0, **POD["train"]),
        wire(m.POD_UTILIZATION, 0.7, now, engine="sm", mig_instance="2", **g0, **POD["train"]),
        wire(m.POD_UTILIZATION, 0.25, now, engine="sm", mig_instance="2", **g0, **POD["infer"]),
        wire(m.GPU_UTILIZATION, 0.8, now, mig_instance="2", **g0),
    ]))
    val = scrape(state, now)
    # The whole GPU: both pods, each its instances' sum (capped at 1); an instance: the pods in it.
    assert val("DCGM_FI_DEV_GPU_UTIL", gpu="0", GPU_I_ID=None) == [("infer-1", "server", 25.0),
                                                                    ("train-0", "trainer", 100.0)]
    assert val("DCGM_FI_DEV_GPU_UTIL", gpu="0", GPU_I_ID="2") == [("infer-1", "server", 25.0),
                                                                   ("train-0", "trainer", 70.0)]
    assert val("DCGM_FI_DEV_GPU_UTIL", gpu="1") == [(None, None, 20.0)]


def test_once_the_kubelet_assigns_a_device_to_no_pod_it_carries_none():
    now = 10**18 * 2
    state = fleet(now)
    g0 = {"device": "gpu0", "vendor": "nvidia"}
    state.ingest(pb.Batch(node_id="n1", boot_id="b", seq=1, samples=[
        assigned(now - 10, "gpu0", "train"), wire(m.GPU_UTILIZATION, 0.2, now - 10, **g0),
        wire(m.POD_UTILIZATION, 0.5, now - 10, engine="sm", **g0, **POD["train"])]))
    assert scrape(state, now)("DCGM_FI_DEV_GPU_UTIL", gpu="0") == [("train-0", "trainer", 20.0)]
    # The pod left: the next List no longer has it (sent as 0); its last roll-up is still held.
    state.ingest(pb.Batch(node_id="n1", boot_id="b", seq=2, samples=[
        assigned(now, "gpu0", "train", value=0.0), wire(m.GPU_UTILIZATION, 0.2, now, **g0)]))
    assert scrape(state, now)("DCGM_FI_DEV_GPU_UTIL", gpu="0") == [(None, None, 20.0)]
