"""A simulated fleet for the scheduler tests: node inventories, realtime accelerator readings and
events as the NVML / npu-smi sources and the HBM watch send them."""

from __future__ import annotations

import time

from xpusense.v1 import telemetry_pb2 as pb

GiB = 2**30

# kind -> (type, vendor, model, memory attribute, HBM bytes, interconnect)
KINDS = {
    "a100": ("GPU", "nvidia", "A100-SXM4-80GB", "80GB", 80 * GiB, "NVLink"),
    "a100pcie": ("GPU", "nvidia", "A100-PCIE-40GB", "40GB", 40 * GiB, ""),
    "910b": ("NPU", "huawei", "Ascend-910B", "64GB", 64 * GiB, "HCCS"),
    "910b4": ("NPU", "huawei", "Ascend-910B4", "32GB", 32 * GiB, "HCCS"),
    "910a": ("NPU", "huawei", "Ascend-910A", "32GB", 32 * GiB, "HCCS"),
}


def dev_id(kind: str, i: int) -> str:
    return f"gpu{i}" if KINDS[kind][0] == "GPU" else f"npu{i}-0"


def inventory(kind: str, devices: int = 8, **labels) -> pb.Inventory:
    rtype, vendor, model, mem, _, link = KINDS[kind]
    inv = pb.Inventory(hostname=f"host-{kind}", labels={k: str(v) for k, v in labels.items()})
    for i in range(devices):
        attrs = {"memory": mem}
        if rtype == "GPU":
            attrs["nvlink_count"] = "12" if link else "0"
        r = inv.resources.add(type=rtype, vendor=vendor, model=model, id=dev_id(kind, i), attributes=attrs)
        if link:
            r.interconnects.add(type=link)
    inv.resources.add(type="CPU", vendor="intel", model="Xeon", id="cpu0")
    return inv


def readings(kind: str, devices: int = 8, util=0.0, used_gib=0.0, bw=0.0, health=None, t_ns=None) -> list[pb.Sample]:
    """Realtime accelerator samples as the NVML / npu-smi sources name them; util/used/bw per device
    as a number or a dict {device index: value}."""
    t = t_ns or time.time_ns()
    _, vendor, _, _, hbm, _ = KINDS[kind]
    out = []
    for i in range(devices):
        lab = {"device": dev_id(kind, i), "vendor": vendor}
        pick = (lambda v, i=i: v.get(i, 0.0) if isinstance(v, dict) else v)
        for name, unit, value in (("hw.gpu.utilization", "1", pick(util)),
                                  ("hw.gpu.memory.usage", "By", pick(used_gib) * GiB),
                                  ("hw.gpu.memory.limit", "By", float(hbm)),
                                  ("xpusense.accelerator.hbm.bandwidth.utilization", "1", pick(bw))):
            out.append(pb.Sample(name=name, unit=unit, kind=pb.GAUGE, labels=lab, value=value, time_unix_nano=t))
        if health is not None and i in health:
            ok = health[i] == "OK"
            out.append(pb.Sample(name="xpusense.accelerator.health", unit="1", kind=pb.GAUGE,
                                 labels={**lab, "status": health[i]}, value=1.0 if ok else 0.0, time_unix_nano=t))
    out.append(pb.Sample(name="system.memory.limit", unit="By", kind=pb.GAUGE, value=1e12, time_unix_nano=t))
    return out


def event(kind: str, device: str, t_ns=None, **attrs) -> pb.Event:
    return pb.Event(id=f"{kind}-{device}-{time.monotonic_ns()}", type=kind, severity="critical", device=device,
                    message=f"{kind} on {device}", attributes=attrs, time_unix_nano=t_ns or time.time_ns())


def assert_same_answer(fast, ref, where: str) -> None:
    """The indexed search's PlaceReply against the scan's (the reference): counts, candidates in
    order with their scores and devices, and the excluded nodes."""
    assert fast.nodes_feasible == ref.nodes_feasible, where
    assert dict(fast.excluded_counts) == dict(ref.excluded_counts), where
    assert [(round(c.score, 9), c.node_id, list(c.devices)) for c in fast.candidates] == \
        [(round(c.score, 9), c.node_id, list(c.devices)) for c in ref.candidates], where
    assert sorted((e.node_id, e.reason) for e in fast.excluded) == \
        sorted((e.node_id, e.reason) for e in ref.excluded), where


def apply_fit_op(r, ref: list, op: str, v: float, pick: int) -> None:
    """One step of a random sequence of changes to a `ranked.Ranked` `r` and the plain list `ref`
    it must count as: "add" `v` (also whenever `ref` is empty), or "remove", "replace" (by `v`),
    "replace_each" (by `v`, the bulk call) or "replace_same" (by itself) the value `pick` chooses."""
    if op == "add" or not ref:
        r.add(v)
        ref.append(v)
        return
    old = ref[pick % len(ref)]
    ref.remove(old)
    if op == "remove":
        r.remove(old)
        return
    if op == "replace":
        r.replace(old, v)
    elif op == "replace_each":
        type(r).replace_each([r], [old], [v])
    else:   # a value replaced by itself: nothing changes
        type(r).replace_each([r], [old], [old])
        v = old
    ref.append(v)
