"""Per-pod roll-ups (agent/pod_rollup.py): the agent's sums of each pod container's process series,
per device, MIG instance and engine, for NVML's and npu-smi's process series alike."""

from __future__ import annotations

from xpusense.agent.pod_rollup import pod_rollups
from xpusense.agent.sources.base import GAUGE, Sample
from xpusense.common import metric_names as m

POD = {"train": {"k8s.pod.name": "train-0", "k8s.namespace.name": "ml", "k8s.container.name": "trainer"},
       "infer": {"k8s.pod.name": "infer-1", "k8s.namespace.name": "serving", "k8s.container.name": "server"},
       "side": {"k8s.pod.name": "infer-1", "k8s.namespace.name": "serving", "k8s.container.name": "sidecar"}}
GPU0 = {"device": "gpu0", "vendor": "nvidia"}


def proc(name, value, pid, pod=None, unit="1", t=5, **labels):
    return Sample(name, value, unit, {**labels, "pid": pid, **(POD[pod] if pod else {})}, GAUGE, t)


def by_key(samples):
    return {(s.name, tuple(sorted(s.labels.items()))): s for s in samples}


def key(name, **labels):
    return (name, tuple(sorted(labels.items())))


def test_a_pods_processes_sum_per_device_engine_and_container():
    nan = float("nan")
    got = by_key(pod_rollups([
        proc(m.PROCESS_UTILIZATION, 0.25, "10", "train", engine="sm", **GPU0),
        proc(m.PROCESS_UTILIZATION, 0.5, "11", "train", engine="sm", t=7, **GPU0),       # same container: summed
        proc(m.PROCESS_UTILIZATION, 0.125, "11", "train", engine="memory", **GPU0),
        proc(m.PROCESS_UTILIZATION, 0.75, "20", "infer", engine="sm", **GPU0),          # another pod on the GPU
        proc(m.PROCESS_UTILIZATION, 0.5, "21", "side", engine="sm", **GPU0),            # its other container
        proc(m.PROCESS_UTILIZATION, 0.75, "12", "train", engine="sm", device="gpu1", vendor="nvidia"),
        proc(m.PROCESS_UTILIZATION, 0.75, "13", "train", engine="sm", device="gpu1", vendor="nvidia"),   # capped
        proc(m.PROCESS_UTILIZATION, 0.5, "30", None, engine="sm", **GPU0),              # no pod: left out
        proc(m.PROCESS_UTILIZATION, nan, "14", "train", engine="decoder", **GPU0),      # no reading: left out
        proc(m.PROCESS_MEMORY_USAGE, 2**30, "10", "train", "By", **GPU0),
        proc(m.PROCESS_MEMORY_USAGE, 3 * 2**30, "11", "train", "By", **GPU0),
        proc(m.PROCESS_MEMORY_USAGE, 2**30, "40", "train", "By", device="gpu2", vendor="nvidia", mig_instance="1"),
        proc(m.PROCESS_MEMORY_USAGE, 2**30, "41", "train", "By", device="gpu2", vendor="nvidia", mig_instance="2"),
        proc(m.PROCESS_MEMORY_USAGE, 5 * 2**20, "50", "infer", "By", device="npu3-0", vendor="huawei"),   # npu-smi's
        proc("xpusense.cuda.kernel.launches", 9, "10", "train", **GPU0),                 # not rolled up
    ]))
    sm = key(m.POD_UTILIZATION, engine="sm", **GPU0, **POD["train"])
    assert got[sm].value == 0.75 and got[sm].unit == "1" and got[sm].time_ns == 7 and got[sm].kind == GAUGE
    assert got[key(m.POD_UTILIZATION, engine="memory", **GPU0, **POD["train"])].value == 0.125
    assert got[key(m.POD_UTILIZATION, engine="sm", **GPU0, **POD["infer"])].value == 0.75
    assert got[key(m.POD_UTILIZATION, engine="sm", **GPU0, **POD["side"])].value == 0.5
    assert got[key(m.POD_UTILIZATION, engine="sm", device="gpu1", vendor="nvidia", **POD["train"])].value == 1.0
    mem = got[key(m.POD_MEMORY_USAGE, **GPU0, **POD["train"])]
    assert (mem.value, mem.unit) == (4 * 2**30, "By")
    for gi in ("1", "2"):   # each MIG instance apart
        assert got[key(m.POD_MEMORY_USAGE, device="gpu2", vendor="nvidia", mig_instance=gi, **POD["train"])].value == 2**30
    assert got[key(m.POD_MEMORY_USAGE, device="npu3-0", vendor="huawei", **POD["infer"])].value == 5 * 2**20
    assert len(got) == 9
    assert pod_rollups([proc(m.PROCESS_MEMORY_USAGE, 1.0, "30", None, "By", **GPU0)]) == []
