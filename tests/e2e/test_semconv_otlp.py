"""OTLP that observability stacks understand: every metric a real OTLP gRPC receiver gets, checked
against a table derived from the semantic conventions' own model files (tests/fixtures/semconv):
name, unit, instrument, attributes (required, listed, types, allowed values) and the resource.
Metrics outside the conventions must be `xpusense.*` and carry none of the wire's short labels.
Two paths, the same check: a collector fed by an agent on 8 fake H100s (fake libnvidia-ml) and one
on 8 fake Ascend 910B4s (fake npu-smi); and an agent exporting directly (`[export.otlp] only`)."""

from __future__ import annotations

import shutil

import psutil
from e2e.test_otlp import Receiver
from fixtures.semconv import table
from helpers import BIN, ROOT, free_port, nodes_json, record_figure, wait_until

from xpusense.agent.sources.host import FILESYSTEM_EXCLUDE
from xpusense.common import semconv

NPU_SMI = ROOT / "tests/fakes/npu-smi/npu-smi"
NPU_SCENARIO = ROOT / "tests/fixtures/npu-smi/scenario-8x910B4"

TIERS = """
[tiers]
realtime_s = 0.25
nearline_s = 0.5
offline_s = 1.0
[stream]
flush_s = 0.05
[sources.ebpf]
enabled = false
[hbm_watch]
enabled = false
[labels]
cloud = "aws"
region = "eu-west-1"
"""
POD_ATTRIBUTES = {"k8s.pod.uid", "k8s.pod.name", "k8s.namespace.name", "k8s.container.name", "container.id"}
# Short wire labels that must not reach OTLP: each has a semconv name (common/semconv.py).
WIRE_ONLY = {"device", "vendor", "state", "direction", "pid", "mig_instance", "sensor", "hw.uuid", "status"}
# Resource attributes whose registries are not among the fixture's files (cloud, k8s).
OTHER_RESOURCE = {"cloud.provider", "cloud.region", "cloud.availability_zone", "k8s.node.name"}
OPEN = {lab.to for m in semconv.METRICS for lab in m.labels.values() if lab.open}

GPU_METRICS = {"hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.memory.utilization",
               "hw.power", "hw.energy", "hw.temperature", "hw.temperature.limit", "hw.errors", "hw.status", "hw.gpu.io"}
NPU_METRICS = {"hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.memory.utilization",
               "hw.power", "hw.temperature", "hw.status"}


def host_metrics() -> set[str]:
    """What the host and agent sources give on this machine."""
    out = {"system.cpu.time", "system.cpu.utilization", "system.cpu.logical.count", "system.memory.usage",
           "system.memory.limit", "system.memory.utilization", "system.uptime", "system.paging.usage",
           "system.network.io", "system.network.packet.count", "system.network.errors", "system.network.packet.dropped",
           "process.cpu.time", "process.cpu.utilization", "process.memory.usage", "process.thread.count",
           "xpusense.cpu.load_average.1m"}
    if psutil.disk_io_counters(perdisk=True):
        out |= {"system.disk.operations", "system.disk.io"}
    import re
    if any(not re.match(FILESYSTEM_EXCLUDE, p.mountpoint) for p in psutil.disk_partitions(all=False)):
        out |= {"system.filesystem.usage", "system.filesystem.limit"}
    return out


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def instrument(m) -> str:
    kind = m.WhichOneof("data")
    if kind == "sum":
        assert m.sum.aggregation_temporality == 2, f"{m.name}: not cumulative"
        return "counter" if m.sum.is_monotonic else "updowncounter"
    return kind


def type_ok(spec: table.AttrSpec, v) -> bool:
    if spec.type == "int" or (spec.type == "enum" and spec.value_type == "int"):
        return isinstance(v, int)
    if spec.type == "double":
        return isinstance(v, float)
    return isinstance(v, str)


def check_resource(res: dict, names: set[str]) -> list[str]:
    bad = []
    reg = table.registry()
    for k in ("telemetry.sdk.name", "telemetry.sdk.language", "telemetry.sdk.version", "service.name", "service.version",
              "service.instance.id", "host.name", "host.id"):
        if not res.get(k):
            bad.append(f"resource lacks {k}")
    for k, v in res.items():
        if k.startswith("xpusense.") or k in OTHER_RESOURCE:
            continue
        if k not in reg:
            bad.append(f"resource attribute {k} is not in the registry")
        elif not type_ok(reg[k], v) or (reg[k].allowed is not None and str(v) not in reg[k].allowed):
            bad.append(f"resource {k}={v!r} not allowed")
    if any(n.startswith("process.") for n in names):
        for k in ("process.pid", "process.executable.name", "process.creation.time"):
            if k not in res:
                bad.append(f"process resource lacks {k}")
    elif "process.pid" in res:
        bad.append("process.pid on a resource with other than process.* metrics")
    return bad


def check_metric(m, points: list[dict]) -> list[str]:
    """What is wrong with one OTLP metric (empty: it conforms)."""
    bad = []
    if not m.name.startswith(semconv.SEMCONV_PREFIXES):
        if not m.name.startswith("xpusense."):
            bad.append("neither a semconv name nor xpusense.*")
        for attrs in points:
            if WIRE_ONLY & set(attrs):
                bad.append(f"wire labels {sorted(WIRE_ONLY & set(attrs))}")
                break
        return bad
    for attrs in points:
        spec = table.spec_for(m.name, attrs)
        if spec is None:
            return [f"not a metric of the model ({table.COMMIT[:7]})"]
        if m.unit != spec.unit:
            bad.append(f"unit {m.unit!r}, model {spec.unit!r}")
        if instrument(m) != spec.instrument:
            bad.append(f"instrument {instrument(m)}, model {spec.instrument}")
        for k, a in spec.attributes.items():
            if a.requirement == "required" and k not in attrs:
                bad.append(f"required attribute {k} missing")
        for k, v in attrs.items():
            a = spec.attributes.get(k)
            if a is None:
                if not (k.startswith("xpusense.") or k in POD_ATTRIBUTES):
                    bad.append(f"attribute {k} not in the model for it")
            elif not type_ok(a, v):
                bad.append(f"{k}={v!r}: not of type {a.type}")
            elif a.allowed is not None and k not in OPEN and str(v) not in a.allowed:
                bad.append(f"{k}={v!r} not one of {sorted(a.allowed)}")
        if bad:
            break
    return sorted(set(bad))


def verdicts(receiver: Receiver) -> tuple[dict[str, list[str]], dict]:
    """metric name -> problems, over every request the receiver kept; and a few points to look at."""
    with receiver.lock:
        reqs = list(receiver.requests)
    out: dict[str, list[str]] = {}
    seen: dict = {}
    for req in reqs:
        for rm in req.resource_metrics:
            res = {a.key: value(a.value) for a in rm.resource.attributes}
            names = {m.name for sm in rm.scope_metrics for m in sm.metrics}
            res_bad = check_resource(res, names)
            if rm.schema_url != semconv.SCHEMA_URL:
                res_bad.append(f"schema_url {rm.schema_url!r}")
            for sm in rm.scope_metrics:
                if sm.schema_url != semconv.SCHEMA_URL:
                    res_bad.append(f"scope schema_url {sm.schema_url!r}")
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    pts = [{a.key: value(a.value) for a in dp.attributes} for dp in getattr(m, kind).data_points]
                    problems = check_metric(m, pts) + res_bad
                    out.setdefault(m.name, [])
                    out[m.name] = sorted(set(out[m.name]) | set(problems))
                    for dp, attrs in zip(getattr(m, kind).data_points, pts):
                        seen.setdefault((m.name, tuple(sorted(attrs.items()))), (res, dp))
    return out, seen


def ids(seen: dict, name: str) -> set[str]:
    return {dict(k[1]).get("hw.id") for k in seen if k[0] == name}


def wait_for(receiver: Receiver, names: set[str], what: str, also=lambda seen: True):
    def have():
        got, seen = verdicts(receiver)
        return got if names <= set(got) and also(seen) else None
    try:
        return wait_until(have, timeout_s=90, interval_s=0.5, what=what)
    except AssertionError:
        got, _ = verdicts(receiver)
        raise AssertionError(f"{what}: never arrived: {sorted(names - set(got))}") from None


def report(path: str, got: dict[str, list[str]]) -> None:
    sem = sorted(n for n in got if n.startswith(semconv.SEMCONV_PREFIXES))
    ok = [n for n in sem if not got[n]]
    record_figure(f"semconv conformance ({path})", semconv_metrics=len(sem), conforming=len(ok),
                  xpusense_metrics=len(got) - len(sem), names=",".join(sem))
    wrong = {n: p for n, p in got.items() if p}
    assert not wrong, "metrics that do not conform:\n" + "\n".join(f"  {n}: {p}" for n, p in sorted(wrong.items()))


def test_collector_export_of_gpu_and_npu_fleet_conforms(procs, tmp_path, libdir):
    from fakes.nvml import fakenvml
    otlp_port, port = free_port(), free_port()
    receiver = Receiver()
    server = receiver.serve(otlp_port)
    try:
        addr = f"127.0.0.1:{port}"
        ccfg = tmp_path / "collector.toml"
        ccfg.write_text(f'[export.otlp]\nenabled = true\nendpoint = "127.0.0.1:{otlp_port}"\ninterval_s = 0.2\n')
        procs([str(BIN / "xpusense-collector"), "serve", "--config", str(ccfg), "--listen", addr], "collector")
        wait_until(lambda: nodes_json(addr) is not None, what="collector to answer")
        gcfg = tmp_path / "gpu.toml"
        gcfg.write_text(TIERS + "[sources.npu_smi]\nenabled = false\n")
        procs([str(BIN / "xpusense-agent"), "run", "--config", str(gcfg), "--collector", addr, "--node-id", "h100-node"],
              "gpu-agent", env=fakenvml.env(libdir, fakenvml.scenario("h100x8"), t0=fakenvml.t0_at(5.0)))
        scenario = tmp_path / "npu-scenario"
        shutil.copytree(NPU_SCENARIO, scenario)
        ncfg = tmp_path / "npu.toml"
        # npu-smi answers in tens of ms per call: the tiers of tests/e2e/test_npu_smi_e2e.py
        ncfg.write_text(TIERS.replace("realtime_s = 0.25\nnearline_s = 0.5\noffline_s = 1.0",
                                      "realtime_s = 1.0\nnearline_s = 2.0\noffline_s = 2.0")
                        + "[sources.nvml]\nenabled = false\n")
        procs([str(BIN / "xpusense-agent"), "run", "--config", str(ncfg), "--collector", addr, "--node-id", "npu-node",
               "--npu-smi", str(NPU_SMI)], "npu-agent", env={"FAKE_NPU_SMI_DIR": str(scenario)})

        want = GPU_METRICS | NPU_METRICS | host_metrics()
        wait_for(receiver, want, "every metric of both nodes at the receiver",
                 lambda seen: {"npu0-0", "gpu0"} <= ids(seen, "hw.power") and "npu7-0" in ids(seen, "hw.status")
                 and {"npu0-0", "gpu0"} <= ids(seen, "hw.gpu.utilization")
                 and len({k[1] for k in seen if k[0] == "hw.gpu.utilization" and ("hw.id", "gpu3") in k[1]}) == 3)
        got, seen = verdicts(receiver)
        # Both vendors under the same names, told apart by hw.vendor; sensors and their parents.
        vendors = {dict(k[1]).get("hw.vendor") for k in seen if k[0] == "hw.gpu.utilization"}
        assert vendors == {"nvidia", "huawei"}
        temps = {dict(k[1])["hw.id"]: dict(k[1]) for k in seen if k[0] == "hw.temperature"}
        assert temps["gpu0/temperature/hbm"]["hw.parent"] == "gpu0"
        assert temps["npu0-0/temperature/chip"]["hw.sensor_location"] == "chip"
        # A sensor's limits are points of the same hw.id; NVENC/NVDEC are hw.gpu.utilization tasks.
        limits = {(dict(k[1])["hw.id"], dict(k[1])["hw.limit_type"]) for k in seen if k[0] == "hw.temperature.limit"}
        assert {("gpu0/temperature/chip", "high.critical"), ("gpu0/temperature/hbm", "max")} <= limits
        tasks = {dict(k[1])["hw.gpu.task"] for k in seen if k[0] == "hw.gpu.utilization" and ("hw.id", "gpu3") in k[1]}
        assert tasks == {"general", "encoder", "decoder"}
        res = next(r for (name, _), (r, _) in seen.items() if name == "hw.power")
        assert res["cloud.provider"] == "aws" and res["service.name"] == "xpusense"
        report("collector", got)
    finally:
        server.stop(grace=None)


def test_agent_direct_export_conforms(procs, tmp_path, libdir):
    from fakes.nvml import fakenvml
    otlp_port = free_port()
    receiver = Receiver()
    server = receiver.serve(otlp_port)
    try:
        cfg = tmp_path / "agent.toml"
        cfg.write_text(TIERS + f'[sources.npu_smi]\nenabled = false\n[spool]\nenabled = false\n'
                       f'[export.otlp]\nenabled = true\nonly = true\nendpoint = "127.0.0.1:{otlp_port}"\ninterval_s = 0.2\n')
        procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--node-id", "solo",
               "--collector", f"127.0.0.1:{free_port()}"], "agent",
              env=fakenvml.env(libdir, fakenvml.scenario("h100x8"), t0=fakenvml.t0_at(5.0)))
        wait_for(receiver, GPU_METRICS | host_metrics(), "every metric of the agent at the receiver")
        got, seen = verdicts(receiver)
        res = next(r for (name, _), (r, _) in seen.items() if name == "process.cpu.time")
        assert isinstance(res["process.pid"], int) and res["xpusense.node.id"] == "solo"
        report("agent direct", got)
    finally:
        server.stop(grace=None)


def test_mig_instances_are_their_own_hw_id_in_the_agents_direct_export(procs, tmp_path, libdir):
    """A MIG GPU: each instance's points are its own hw.id (gpu0/gi1) with hw.parent gpu0, and conform."""
    import sys
    sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
    from driving import h100s, write_scenario
    from fakes.nvml import fakenvml
    scn = write_scenario(tmp_path, h100s(2) + "[gpu 0]\nmig_mode = 1\nmig = 1 40GiB 10GiB 3g.40gb\n"
                                               "mig = 2 20GiB 2GiB 2g.20gb\n")
    otlp_port = free_port()
    receiver = Receiver()
    server = receiver.serve(otlp_port)
    try:
        cfg = tmp_path / "agent.toml"
        cfg.write_text(TIERS + f'[sources.npu_smi]\nenabled = false\n[spool]\nenabled = false\n'
                       f'[export.otlp]\nenabled = true\nonly = true\nendpoint = "127.0.0.1:{otlp_port}"\ninterval_s = 0.2\n')
        procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--node-id", "mig",
               "--collector", f"127.0.0.1:{free_port()}"], "agent", env=fakenvml.env(libdir, scn, t0=fakenvml.t0_at(5.0)))
        got = wait_for(receiver, {"hw.gpu.memory.usage", "hw.power"}, "MIG instances at the receiver",
                       lambda seen: {"gpu0/gi1", "gpu0/gi2", "gpu1"} <= ids(seen, "hw.gpu.memory.usage"))
        _, seen = verdicts(receiver)
        mem = {dict(k[1])["hw.id"]: dict(k[1]) for k in seen if k[0] == "hw.gpu.memory.usage"}
        assert mem["gpu0/gi1"]["hw.parent"] == "gpu0" and "hw.parent" not in mem["gpu1"]
        assert mem["gpu0/gi2"]["hw.vendor"] == "nvidia" and "hw.model" not in mem["gpu0/gi2"]
        report("agent direct, MIG", got)
    finally:
        server.stop(grace=None)
