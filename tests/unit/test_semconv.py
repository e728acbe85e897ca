"""common/semconv.py against the semantic conventions' own model files (tests/fixtures/semconv, commit
in COMMIT): every metric exported under a semconv name has the model's unit and instrument, only
attributes the model lists for it (or `xpusense.*` ones, or the pod attribution ones), every
required attribute, and only allowed values; and the conversion (common/otlp.py) does what the
table says, sample by sample."""

from __future__ import annotations

import pathlib
import uuid

import pytest
from fixtures.semconv import table

from xpusense.common import otlp, semconv
from xpusense.common.metric_names import ACCELERATOR_PREFIXES
from xpusense.v1 import telemetry_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Attributes a point may carry beyond the model's list: our own namespace, and pod attribution
# (agent/pods.py: semconv resource attributes, on the series of a pod's process or device).
POD_ATTRIBUTES = {"k8s.pod.uid", "k8s.pod.name", "k8s.namespace.name", "k8s.container.name", "container.id"}


def extra_ok(name: str) -> bool:
    return name.startswith("xpusense.") or name in POD_ATTRIBUTES


def produced(m: semconv.Metric) -> dict[str, set | None]:
    """Attribute -> the values the mapping can give it (None: whatever the wire or inventory says)."""
    out: dict[str, set | None] = {}
    for lab in m.labels.values():
        if lab.to and not lab.resource:
            out[lab.to] = {v for v in lab.values.values() if v is not None} or None
    for k, v in m.const.items():
        out[k] = {v}
    if m.states is not None:
        out[m.states.attribute] = set(m.states.states)
    if m.device == semconv.ACCELERATOR:
        out.update({"hw.id": None, "hw.parent": None, **{a: None for a in m.hw}})
        if "hw.type" in m.hw:
            out["hw.type"] = {"gpu"}
    elif m.device == semconv.SENSOR:
        out.update({"hw.id": None, "hw.parent": None, "hw.sensor_location": None})
    return out


def open_values(m: semconv.Metric) -> set[str]:
    return {lab.to for lab in m.labels.values() if lab.open}


SEMCONV_METRICS = [m for m in semconv.METRICS if m.semconv]


def test_the_model_is_the_pinned_commit_and_schema():
    assert table.COMMIT == semconv.SEMCONV_COMMIT
    assert semconv.SCHEMA_URL == "https://opentelemetry.io/schemas/1.44.0"
    assert len(table.metrics()) > 50 and "hw.gpu.utilization" in table.metrics()


@pytest.mark.parametrize("m", SEMCONV_METRICS, ids=lambda m: m.wire)
def test_each_semconv_name_matches_the_model(m):
    spec = table.spec_for(m.name, {"hw.type": "gpu"} if m.device == semconv.ACCELERATOR else {})
    assert spec is not None, f"{m.name} is not a metric of semantic conventions {semconv.SEMCONV_VERSION}"
    assert m.unit == spec.unit, f"{m.name}: unit {m.unit!r}, the model says {spec.unit!r}"
    assert m.otlp_instrument == spec.instrument, f"{m.name}: {m.otlp_instrument}, the model says {spec.instrument}"
    got = produced(m)
    for attr, values in got.items():
        if attr not in spec.attributes:
            assert extra_ok(attr), f"{m.name}: attribute {attr} is not in the model for it and not xpusense.*"
            continue
        allowed = spec.attributes[attr].allowed
        if allowed is not None and attr not in open_values(m):
            assert values is not None and values <= allowed, f"{m.name}: {attr} may be {values}, allowed {sorted(allowed)}"
    for attr, a in spec.attributes.items():
        if a.requirement == "required":
            assert attr in got, f"{m.name}: required attribute {attr} is never set"
    for lab in m.labels.values():
        if lab.to in spec.attributes:
            assert lab.integer == (spec.attributes[lab.to].type == "int"), f"{m.name}: {lab.to} type"


def test_names_outside_semconv_are_ours():
    for m in semconv.METRICS:
        if not m.semconv:
            assert m.name.startswith("xpusense."), m.name
            assert m.name not in table.metrics()
        for lab in m.labels.values():
            if lab.resource:
                assert lab.to in table.registry(), lab.to


def test_one_name_one_instrument_and_unit_at_the_edge():
    seen: dict[str, tuple] = {}
    for m in semconv.METRICS:
        assert seen.setdefault(m.name, (m.otlp_instrument, m.unit)) == (m.otlp_instrument, m.unit), m.name
    assert len(semconv.BY_WIRE) == len(semconv.METRICS)


def test_accelerator_names_have_a_device_role():
    for m in semconv.METRICS:
        if m.wire.startswith(ACCELERATOR_PREFIXES) and not m.wire.startswith(("xpusense.accelerator.ioctl.",)):
            assert m.device, m.wire


# -- the conversion, sample by sample -----------------------------------------------------------------

INV = pb.Inventory(hostname="host-a", labels={"cloud": "aws"})
INV.resources.add(type="GPU", vendor="nvidia", model="H100-80GB-HBM3", id="gpu0",
                  attributes={"uuid": "GPU-abc", "driver": "550.54.15"})
INV.resources.add(type="NPU", vendor="huawei", model="Ascend-910B4", id="npu0-0", attributes={"driver_version": "24.1"})
INV.resources.add(type="HOST", id="host", attributes={"host_id": "abc123", "arch": "x86_64", "os_type": "linux"})
DEV = otlp.device_attributes(INV)


def s(name, value=1.0, kind=pb.GAUGE, unit="1", t=1_000, **labels):
    return pb.Sample(name=name, value=value, kind=kind, unit=unit, labels=labels, time_unix_nano=t)


def one(sample, legacy=False):
    got = otlp.map_sample(sample, DEV, legacy)
    assert len(got) == 1, got
    return got[0]


def test_cpu_modes_renamed_irq_and_softirq_interrupt_guest_left_out():
    t = [s("system.cpu.time", v, pb.COUNTER, "s", state=k) for k, v in
         (("user", 10), ("irq", 2), ("softirq", 3), ("guest", 4), ("guest_nice", 1), ("idle", 50))]
    data = otlp.metrics_data([(otlp.resource_attributes("n", INV), DEV, t)], otlp.StartTimes())
    (m,) = data.resource_metrics[0].scope_metrics[0].metrics
    got = {tuple(sorted(p.attributes.items())): p.value for p in m.data.data_points}
    # irq and softirq are both `interrupt`, kept apart (a sum by cpu.mode adds them, whatever request
    # each arrives in); guest time is inside user already.
    assert got == {(("cpu.mode", "user"),): 10, (("cpu.mode", "idle"),): 50,
                   (("cpu.mode", "interrupt"), ("xpusense.cpu.interrupt", "irq")): 2,
                   (("cpu.mode", "interrupt"), ("xpusense.cpu.interrupt", "softirq")): 3}
    assert m.data.is_monotonic


def test_host_attributes_renamed_per_metric_as_the_model_has_them():
    p = one(s("system.network.io", 5, pb.COUNTER, "By", device="eth0", direction="receive"))
    assert p.attributes == {"network.interface.name": "eth0", "network.io.direction": "receive"}
    p = one(s("system.network.packet.count", 5, pb.COUNTER, "{packet}", device="eth0", direction="transmit"))
    assert p.attributes == {"system.device": "eth0", "network.io.direction": "transmit"}
    p = one(s("system.disk.io", 5, pb.COUNTER, "By", device="vda", direction="write"))
    assert p.attributes == {"system.device": "vda", "disk.io.direction": "write"}
    p = one(s("system.memory.usage", 5, unit="By", state="cached"))
    assert (p.name, p.instrument, p.attributes) == ("system.memory.usage", "updowncounter", {"system.memory.state": "cached"})
    p = one(s("system.cpu.frequency", 2e9, unit="Hz", cpu="3"))
    assert p.attributes == {"cpu.logical_number": 3}
    assert one(s("system.cpu.load_average.1m", 0.5, unit="{thread}")).name == "xpusense.cpu.load_average.1m"
    assert one(s("system.cpu.load_average.1m", 0.5, unit="{thread}"), legacy=True).name == "system.cpu.load_average.1m"


def test_accelerator_points_carry_the_models_hw_attributes_not_device_and_vendor():
    p = one(s("hw.gpu.utilization", 0.5, device="gpu0", vendor="nvidia"))
    assert p.attributes == {"hw.id": "gpu0", "hw.model": "H100-80GB-HBM3", "hw.vendor": "nvidia",
                            "hw.driver_version": "550.54.15", "xpusense.accelerator.uuid": "GPU-abc",
                            "hw.gpu.task": "general"}
    p = one(s("xpusense.accelerator.encoder.utilization", 0.1, device="gpu0", vendor="nvidia"))
    assert (p.name, p.attributes["hw.gpu.task"]) == ("hw.gpu.utilization", "encoder")
    p = one(s("hw.power", 300, unit="W", device="npu0-0", vendor="huawei"))
    assert p.attributes == {"hw.id": "npu0-0", "hw.type": "gpu"}
    p = one(s("hw.gpu.memory.usage", 2**30, unit="By", device="gpu0", vendor="nvidia"))
    assert p.instrument == "updowncounter" and "hw.type" not in p.attributes   # not in the model for hw.gpu.*
    # A device the inventory does not (yet) name: its id and vendor from the labels.
    p = one(s("hw.power", 300, unit="W", device="gpu7", vendor="nvidia"))
    assert p.attributes == {"hw.id": "gpu7", "hw.type": "gpu"}


def test_mig_instances_and_sensors_are_their_own_hw_id_with_a_parent():
    p = one(s("hw.gpu.memory.usage", 2**30, unit="By", device="gpu0", vendor="nvidia", mig_instance="1"))
    assert p.attributes == {"hw.id": "gpu0/gi1", "hw.parent": "gpu0", "hw.vendor": "nvidia",
                            "hw.driver_version": "550.54.15"}
    chip = one(s("hw.temperature", 60, unit="Cel", device="gpu0", vendor="nvidia", sensor="chip"))
    hbm = one(s("hw.temperature", 70, unit="Cel", device="gpu0", vendor="nvidia", sensor="hbm"))
    assert chip.attributes == {"hw.id": "gpu0/temperature/chip", "hw.parent": "gpu0", "hw.sensor_location": "chip"}
    assert hbm.attributes["hw.id"] == "gpu0/temperature/hbm" != chip.attributes["hw.id"]
    lim = one(s("hw.temperature.limit", 90, unit="Cel", device="gpu0", vendor="nvidia", sensor="chip", limit="slowdown"))
    assert lim.attributes == {**chip.attributes, "hw.limit_type": "throttled"}


def test_adopted_names_and_their_legacy_switch():
    p = one(s("xpusense.accelerator.ecc.errors", 3, pb.COUNTER, "{error}", device="gpu0", vendor="nvidia",
              type="corrected"))
    assert (p.name, p.attributes["error.type"], p.attributes["hw.type"]) == ("hw.errors", "corrected", "gpu")
    p = one(s("xpusense.accelerator.interconnect.io", 9, pb.COUNTER, "By", device="gpu0", vendor="nvidia",
              link_type="NVLink", direction="receive"))
    assert p.name == "hw.gpu.io" and p.attributes["network.io.direction"] == "receive"
    assert p.attributes["xpusense.interconnect.type"] == "NVLink"
    old = one(s("xpusense.accelerator.ecc.errors", 3, pb.COUNTER, "{error}", device="gpu0", vendor="nvidia",
                type="corrected"), legacy=True)
    assert old.name == "xpusense.accelerator.ecc.errors" and old.attributes["type"] == "corrected"
    assert old.attributes["hw.id"] == "gpu0" and "device" not in old.attributes


@pytest.mark.parametrize("status,value,state", [("ok", 1.0, "ok"), ("reset_required", 0.0, "failed"),
                                                ("Warning", 0.0, "degraded"), ("UNKNOWN", 0.0, None)])
def test_health_becomes_an_hw_status_state_set(status, value, state):
    pts = otlp.map_sample(s("xpusense.accelerator.health", value, device="gpu0", vendor="nvidia", status=status), DEV)
    assert {p.name for p in pts} == {"hw.status"} and all(p.instrument == "updowncounter" for p in pts)
    got = {p.attributes["hw.state"]: p.value for p in pts}
    assert set(got) == {"ok", "degraded", "failed", "predicted_failure"}
    assert [k for k, v in got.items() if v == 1.0] == ([state] if state else [])
    assert all(p.attributes["hw.type"] == "gpu" and "status" not in p.attributes for p in pts)


def test_process_metrics_get_a_process_resource():
    labels = {"process": "xpusense-agent", "pid": "4242", "executable": "python3.11", "started": "2026-01-01T00:00:00.000Z"}
    samples = [s("process.cpu.time", 1.5, pb.COUNTER, "s", state="user", **labels),
               s("process.memory.usage", 2**20, unit="By", **labels), s("system.uptime", 9, unit="s")]
    data = otlp.metrics_data([(otlp.resource_attributes("n", INV), DEV, samples)], otlp.StartTimes())
    by = {tuple(sorted(m.name for m in rm.scope_metrics[0].metrics)): dict(rm.resource.attributes)
          for rm in data.resource_metrics}
    proc = by[("process.cpu.time", "process.memory.usage")]
    assert proc["process.pid"] == 4242 and proc["process.executable.name"] == "python3.11"
    assert proc["process.creation.time"] == "2026-01-01T00:00:00.000Z" and proc["xpusense.node.id"] == "n"
    assert "process.pid" not in by[("system.uptime",)]
    cpu = next(m for rm in data.resource_metrics for m in rm.scope_metrics[0].metrics if m.name == "process.cpu.time")
    assert dict(cpu.data.data_points[0].attributes) == {"cpu.mode": "user"}
    mem = next(m for rm in data.resource_metrics for m in rm.scope_metrics[0].metrics if m.name == "process.memory.usage")
    assert not mem.data.is_monotonic


def test_ebpf_pid_is_process_pid_as_an_integer():
    p = one(s("xpusense.cuda.kernel.launches", 7, pb.COUNTER, "{launch}", pid="1234", process="python3"))
    assert p.attributes == {"process.pid": 1234, "process.executable.name": "python3"}


def test_resource_from_the_sdk_with_schema_url_and_identity(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=prod,service.name=other")
    attrs = otlp.resource_attributes("node-1", INV)
    assert attrs["service.instance.id"] == str(uuid.uuid5(uuid.UUID("4d63009a-8d0f-11ee-aad7-4c796ed8e320"), "node-1"))
    assert attrs["host.id"] == "abc123" and attrs["host.arch"] == "amd64" and attrs["os.type"] == "linux"
    assert attrs["service.version"] and attrs["cloud.provider"] == "aws"
    r = otlp.Resources().get(attrs)
    assert r.schema_url == semconv.SCHEMA_URL
    assert r.attributes["telemetry.sdk.name"] == "opentelemetry" and r.attributes["telemetry.sdk.language"] == "python"
    assert r.attributes["deployment.environment.name"] == "prod"    # the operator's, through the SDK's detector
    assert r.attributes["service.name"] == "xpusense"               # ours win over the environment's
    data = otlp.metrics_data([(attrs, DEV, [s("system.uptime", 1, unit="s")])], otlp.StartTimes())
    rm = data.resource_metrics[0]
    assert rm.schema_url == rm.scope_metrics[0].schema_url == rm.scope_metrics[0].scope.schema_url == semconv.SCHEMA_URL


def test_updowncounter_start_stays_when_the_value_falls():
    st = otlp.StartTimes()
    assert st.start(("k",), 1_000, 5.0, resets=False) == 1_000
    assert st.start(("k",), 2_000, 1.0, resets=False) == 1_000


def test_unlisted_metric_passes_through_with_device_attributes():
    p = one(s("xpusense.accelerator.something.new", 2.0, device="gpu0", vendor="nvidia", x="y"))
    assert p.name == "xpusense.accelerator.something.new" and p.attributes["x"] == "y"
    assert p.attributes["hw.id"] == "gpu0" and "device" not in p.attributes and "vendor" not in p.attributes
