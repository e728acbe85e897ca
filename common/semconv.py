"""The names at the OTLP edge, as data: for every metric on the wire, the OpenTelemetry semantic
conventions' name, instrument, unit and attributes it is exported with (Metric).

The wire, the collector's views and the Prometheus endpoint keep the sources' short names and
labels; OTLP export (common/otlp.py) renames through this table and nothing else. docs/metrics.md
"Names at each edge" and the conventions' model files (tests/fixtures/semconv) are checked against
it. Targeted conventions: v1.44.0 (SEMCONV_COMMIT); SCHEMA_URL goes on every resource and scope."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from . import metric_names as n
from .measures import COUNTER, GAUGE, HISTOGRAM

SEMCONV_VERSION = "1.44.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"
SEMCONV_COMMIT = "384d66161cb18704c729645fa8136a148df9571c"

# OTLP instruments (the model's names): an UpDownCounter is a non-monotonic cumulative Sum.
UPDOWNCOUNTER = "updowncounter"
INSTRUMENTS = (GAUGE, COUNTER, UPDOWNCOUNTER, HISTOGRAM)

ACCELERATOR, SENSOR = "accelerator", "sensor"
SEMCONV_PREFIXES = ("hw.", "system.", "process.")

_EMPTY: Mapping = MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Label:
    to: str                                                  # attribute name at the OTLP edge ("": left out)
    # wire value -> attribute value (None: the point is left out); values not listed pass unchanged
    values: Mapping[str, str | None] = dataclasses.field(default_factory=lambda: _EMPTY)
    integer: bool = False                                    # sent as an integer (process.pid, cpu.logical_number)
    resource: bool = False                                   # an attribute of the resource, not of the point
    # values beyond the model's well-known ones are sent (semconv enums are open): system.filesystem.type
    open: bool = False
    # where several wire values become one attribute value, this attribute keeps the wire's, so the
    # points stay apart (irq and softirq are both cpu.mode interrupt: a sum by cpu.mode adds them)
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class StateSet:
    label: str                                               # the wire label holding the state
    attribute: str                                           # hw.state
    states: tuple[str, ...]                                  # one point each
    values: Mapping[str, str | None]                         # wire value -> state (None: none is 1)


@dataclasses.dataclass(frozen=True)
class Metric:
    """How one wire metric becomes OTLP points (common/otlp.py applies it). `labels`: wire label ->
    Label; labels not listed pass unchanged. `device` ACCELERATOR: the `device` label names an
    inventory resource, and the point gets its `hw.id` and the attributes in `hw`; a `mig_instance`
    makes it its MIG instance's (`hw.id` gpu0/gi1, `hw.parent` gpu0). SENSOR: the point is a sensor's
    own (`hw.id` gpu0/temperature/hbm, `hw.parent` the device, `hw.sensor_location` the wire's
    `sensor`). `states`: one point per state, 1 for the one the wire value names. `legacy`: the OTLP
    name is new in this release; `[export.otlp] legacy_names = true` exports the wire name and labels
    (with the new device attributes) for one more release."""

    wire: str                                                # name on the wire, in the collector, for Prometheus
    unit: str
    kind: str                                                # on the wire: gauge / counter / histogram
    otlp: str = ""                                           # name at the OTLP edge ("": the wire name)
    instrument: str = ""                                     # OTLP instrument ("": the wire kind)
    labels: Mapping[str, Label] = dataclasses.field(default_factory=lambda: _EMPTY)
    device: str = ""                                         # "", ACCELERATOR, SENSOR
    hw: tuple[str, ...] = ()                                 # device attributes the points get
    const: Mapping[str, str] = dataclasses.field(default_factory=lambda: _EMPTY)   # attributes every point gets
    states: StateSet | None = None
    legacy: bool = False                                     # adopted name, old one behind legacy_names
    note: str = ""

    @property
    def name(self) -> str:
        return self.otlp or self.wire

    @property
    def otlp_instrument(self) -> str:
        return self.instrument or self.kind

    @property
    def semconv(self) -> bool:
        """The OTLP name is one of the semantic conventions' (checked against the model)."""
        return self.name.startswith(SEMCONV_PREFIXES)


def _m(*args, **kw) -> Metric:
    for k in ("labels", "const"):
        if k in kw:
            kw[k] = MappingProxyType(dict(kw[k]))
    return Metric(*args, **kw)


def same(*values: str) -> Mapping[str, str | None]:
    """Wire values that are already the attribute's values (listed, so the tests can check them)."""
    return MappingProxyType({v: v for v in values})


def _l(to: str, values: Mapping[str, str | None] | None = None, **kw) -> Label:
    return Label(to, MappingProxyType(dict(values or {})), **kw)


# -- labels used by several metrics -------------------------------------------------------------------
CPU_MODE = _l("cpu.mode", {**same("user", "nice", "system", "idle", "iowait", "steal"),
                           "irq": "interrupt", "softirq": "interrupt",
                           # Linux counts guest time in user and guest_nice in nice
                           "guest": None, "guest_nice": None}, detail="xpusense.cpu.interrupt")
PROCESS_MODE = _l("cpu.mode", same("user", "system"))
NET_DIRECTION = {"direction": _l("network.io.direction", same("receive", "transmit"))}
DISK = {"device": Label("system.device"), "direction": _l("disk.io.direction", same("read", "write"))}
NET = {"device": Label("network.interface.name"), **NET_DIRECTION}
PROCESS = {"pid": Label("process.pid", integer=True), "process": Label("process.executable.name")}
# `process` (always xpusense-agent) is said by service.name; the executable is the interpreter's.
AGENT_PROCESS = {"pid": Label("process.pid", integer=True, resource=True), "process": Label(""),
                 "executable": Label("process.executable.name", resource=True),
                 "started": Label("process.creation.time", resource=True)}
FILESYSTEM = {"device": Label("system.device"), "type": Label("system.filesystem.type", open=True),
              "mode": Label("system.filesystem.mode"), "mountpoint": Label("system.filesystem.mountpoint")}

# Device attributes (common/otlp.py device_attributes) by what the model lists for the metric.
UUID = "xpusense.accelerator.uuid"
GPU = ("hw.model", "hw.vendor", "hw.driver_version", "hw.firmware_version", "hw.serial_number", UUID)
TYPED = ("hw.type", UUID)
TYPED_GPU = ("hw.type", *GPU)
HW_STATES = ("ok", "degraded", "failed", "predicted_failure")

METRICS: tuple[Metric, ...] = (
    # -- host (agent/sources/host.py) ---------------------------------------------------------------
    _m("system.cpu.utilization", "1", GAUGE, labels={"state": CPU_MODE}),
    _m("system.cpu.time", "s", COUNTER, labels={"state": CPU_MODE}),
    _m("system.cpu.logical.count", "{cpu}", GAUGE, instrument=UPDOWNCOUNTER),
    _m("system.cpu.frequency", "Hz", GAUGE, labels={"cpu": Label("cpu.logical_number", integer=True)}),
    *(_m(f"system.cpu.load_average.{w}", "{thread}", GAUGE, otlp=f"xpusense.cpu.load_average.{w}", legacy=True,
         note="not a semantic convention (the OpenTelemetry Collector's hostmetrics receiver uses the wire name)")
      for w in ("1m", "5m", "15m")),
    _m("system.uptime", "s", GAUGE),
    _m("system.memory.usage", "By", GAUGE, instrument=UPDOWNCOUNTER,
       labels={"state": _l("system.memory.state", same("used", "free", "buffers", "cached"))}),
    _m("system.memory.limit", "By", GAUGE, instrument=UPDOWNCOUNTER),
    _m(n.MEMORY_UTILIZATION, "1", GAUGE),
    _m("system.paging.usage", "By", GAUGE, instrument=UPDOWNCOUNTER,
       labels={"state": _l("system.paging.state", same("used", "free"))}),
    _m("system.paging.utilization", "1", GAUGE, labels={"state": _l("system.paging.state", same("used", "free"))}),
    _m("system.paging.faults", "{fault}", COUNTER, labels={"type": _l("system.paging.fault.type", same("major", "minor"))}),
    _m("system.paging.operations", "{operation}", COUNTER,
       labels={"direction": _l("system.paging.direction", same("in", "out"))}),
    _m("system.disk.operations", "{operation}", COUNTER, labels=DISK),
    _m("system.disk.io", "By", COUNTER, labels=DISK),
    _m("system.disk.operation_time", "s", COUNTER, labels=DISK),
    _m("system.disk.io_time", "s", COUNTER, labels={"device": Label("system.device")}),
    _m("system.filesystem.usage", "By", GAUGE, instrument=UPDOWNCOUNTER,
       labels={**FILESYSTEM, "state": _l("system.filesystem.state", same("used", "free", "reserved"))}),
    _m("system.filesystem.limit", "By", GAUGE, instrument=UPDOWNCOUNTER, labels=FILESYSTEM),
    _m("system.filesystem.utilization", "1", GAUGE, labels=FILESYSTEM),
    _m(n.NETWORK_IO, "By", COUNTER, labels=NET),
    # The model gives this one system.device, not network.interface.name (v1.44.0).
    _m("system.network.packet.count", "{packet}", COUNTER,
       labels={"device": Label("system.device"), **NET_DIRECTION}),
    _m("system.network.errors", "{error}", COUNTER, labels=NET),
    _m("system.network.packet.dropped", "{packet}", COUNTER, labels=NET),
    _m("xpusense.network.interface.up", "1", GAUGE, labels={"device": Label("network.interface.name")}),
    # -- the agent itself (agent/sources/agent_self.py): a process resource --------------------------
    _m("process.cpu.time", "s", COUNTER, labels={**AGENT_PROCESS, "state": PROCESS_MODE}),
    _m("process.cpu.utilization", "1", GAUGE, labels={**AGENT_PROCESS, "state": PROCESS_MODE}),
    _m("process.memory.usage", "By", GAUGE, instrument=UPDOWNCOUNTER, labels=AGENT_PROCESS),
    _m("process.thread.count", "{thread}", GAUGE, instrument=UPDOWNCOUNTER, labels=AGENT_PROCESS),
    _m("xpusense.agent.stream.pending", "{batch}", GAUGE),
    _m("xpusense.agent.stream.dropped", "{sample}", COUNTER),
    _m("xpusense.agent.stream.dropped_batches", "{batch}", COUNTER),
    _m("xpusense.agent.stream.reconnects", "{connection}", COUNTER),
    _m("xpusense.agent.stream.series", "{series}", GAUGE),
    _m("xpusense.agent.stream.series_retired", "{series}", COUNTER),
    _m("xpusense.agent.stream.series_unnumbered", "{series}", COUNTER),
    _m("xpusense.agent.stream.impossible_acks", "{message}", COUNTER),
    _m("xpusense.agent.spool.usage", "By", GAUGE),
    _m("xpusense.agent.spool.writable", "1", GAUGE),
    _m("xpusense.agent.spool.write_failures", "{batch}", COUNTER),
    _m("xpusense.agent.spool.damaged", "{record}", COUNTER),
    _m("xpusense.agent.nfd.writes", "{write}", COUNTER),
    _m("xpusense.agent.nfd.write_failures", "{write}", COUNTER),
    _m("xpusense.agent.nfd.oversized", "{write}", COUNTER),
    _m("xpusense.agent.source.duration", "s", GAUGE),
    _m("xpusense.agent.source.up", "1", GAUGE),
    _m("xpusense.agent.source.errors", "{error}", COUNTER),
    _m("xpusense.agent.source.timeouts", "{round}", COUNTER),
    _m("xpusense.agent.source.skipped", "{round}", COUNTER),
    _m("xpusense.agent.task.restarts", "{restart}", COUNTER),
    # -- accelerators (NVML, npu-smi) ------------------------------------------------------------------
    _m(n.GPU_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=GPU, const={"hw.gpu.task": "general"}),
    _m(n.ENCODER_UTILIZATION, "1", GAUGE, otlp=n.GPU_UTILIZATION, device=ACCELERATOR, hw=GPU,
       const={"hw.gpu.task": "encoder"}),
    _m(n.DECODER_UTILIZATION, "1", GAUGE, otlp=n.GPU_UTILIZATION, device=ACCELERATOR, hw=GPU,
       const={"hw.gpu.task": "decoder"}),
    _m(n.GPU_MEMORY_USAGE, "By", GAUGE, instrument=UPDOWNCOUNTER, device=ACCELERATOR, hw=GPU),
    _m(n.GPU_MEMORY_LIMIT, "By", GAUGE, instrument=UPDOWNCOUNTER, device=ACCELERATOR, hw=GPU),
    _m(n.GPU_MEMORY_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=GPU),
    _m(n.POWER, "W", GAUGE, device=ACCELERATOR, hw=TYPED),
    _m(n.ENERGY, "J", COUNTER, device=ACCELERATOR, hw=TYPED),
    _m(n.TEMPERATURE, "Cel", GAUGE, device=SENSOR),
    _m(n.TEMPERATURE_LIMIT, "Cel", GAUGE, device=SENSOR,
       labels={"limit": _l("hw.limit_type", {"shutdown": "high.critical", "slowdown": "throttled", "max": "max"})}),
    _m(n.ECC_ERRORS, "{error}", COUNTER, otlp="hw.errors", device=ACCELERATOR, hw=TYPED_GPU, legacy=True,
       labels={"type": _l("error.type", same("corrected", "uncorrected"))}),
    _m(n.HEALTH, "1", GAUGE, otlp="hw.status", instrument=UPDOWNCOUNTER, device=ACCELERATOR, hw=TYPED_GPU,
       legacy=True, states=StateSet("status", "hw.state", HW_STATES, MappingProxyType({
           # NVML (agent/sources/nvml/health.py)
           "ok": "ok", "reset_required": "failed", "lost": "failed",
           # npu-smi, as printed
           "OK": "ok", "Warning": "degraded", "Alarm": "degraded", "Critical": "failed", "UNKNOWN": None}))),
    _m(n.INTERCONNECT_IO, "By", COUNTER, otlp="hw.gpu.io", device=ACCELERATOR, hw=GPU, legacy=True,
       labels={**NET_DIRECTION, "link_type": Label("xpusense.interconnect.type")}),
    _m(n.HBM_BANDWIDTH_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.MEMORY_CONTROLLER_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.SM_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.GRAPHICS_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.CUBE_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.VECTOR_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.MEMORY_FREE, "By", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.memory.reserved", "By", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.interconnect.throughput", "By/s", GAUGE, device=ACCELERATOR, hw=TYPED_GPU,
       labels={**NET_DIRECTION, "link_type": Label("xpusense.interconnect.type")}),
    _m("xpusense.accelerator.mig.instances", "{instance}", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.pcie.throughput", "By/s", GAUGE, device=ACCELERATOR, hw=TYPED_GPU, labels=NET_DIRECTION),
    _m(n.PCIE_LINK_CAPACITY, "By/s", GAUGE, device=ACCELERATOR, hw=TYPED_GPU,
       labels={"pcie_switch": _l("xpusense.pcie.switch", open=True)}),
    _m(n.NUMA_NODE, "{node}", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.CLOCK_FREQUENCY, "Hz", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.process.memory.usage", "By", GAUGE, device=ACCELERATOR, hw=TYPED_GPU,
       labels={"pid": Label("process.pid", integer=True)}),
    _m(n.PROCESS_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU,
       labels={"pid": Label("process.pid", integer=True),
               "engine": _l("xpusense.gpu.engine", same("sm", "memory", "encoder", "decoder"))}),
    _m("xpusense.nvml.process_utilization.left_out", "{process}", COUNTER, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.processes", "{process}", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.POD_UTILIZATION, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU,
       labels={"engine": _l("xpusense.gpu.engine", same("sm", "memory", "encoder", "decoder"))}),
    _m(n.POD_MEMORY_USAGE, "By", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.power.limit", "W", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.energy.efficiency", "TFLOP/J", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.throttle", "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.REMAPPED_ROWS, "{row}", GAUGE, device=ACCELERATOR, hw=TYPED_GPU,
       labels={"type": _l("error.type", {"correctable": "corrected", "uncorrectable": "uncorrected"})}),
    _m("xpusense.accelerator.memory.remap_pending", "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.REMAP_FAILED, "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.XID_ERRORS, "{error}", COUNTER, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.LAST_XID, "{xid}", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.NPU_ERROR_CODES, "{error}", COUNTER, device=ACCELERATOR, hw=TYPED_GPU),
    _m(n.NPU_ERROR_CODE, "{code}", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.accelerator.error_codes.over_limit", "{error}", COUNTER, device=ACCELERATOR, hw=TYPED_GPU),
    _m("xpusense.npu_smi.rounds.skipped", "{round}", COUNTER),
    _m("xpusense.npu_smi.calls.oversized", "{call}", COUNTER),
    # -- Kubernetes (agent/pods.py) --------------------------------------------------------------------
    _m("xpusense.k8s.device.assigned", "1", GAUGE, device=ACCELERATOR, hw=TYPED_GPU),
    # -- eBPF probes (probes/specs.py, agent/sources/ebpf/) --------------------------------------------
    _m("xpusense.sched.runqueue.latency", "s", HISTOGRAM),
    _m("xpusense.disk.operations", "{operation}", COUNTER, labels=DISK),
    _m("xpusense.disk.io", "By", COUNTER, labels=DISK),
    _m("xpusense.disk.errors", "{operation}", COUNTER, labels=DISK),
    _m("xpusense.disk.operation.latency", "s", HISTOGRAM, labels=DISK),
    _m("xpusense.cgroup.network.io", "By", COUNTER, labels=NET_DIRECTION),
    _m("xpusense.cgroup.network.calls", "{call}", COUNTER, labels=NET_DIRECTION),
    _m("xpusense.network.device.io", "By", COUNTER, labels=NET),
    _m("xpusense.network.device.packets", "{packet}", COUNTER, labels=NET),
    _m("xpusense.network.tcp.retransmits", "{segment}", COUNTER,
       labels={"family": _l("network.type", same("ipv4", "ipv6"))}),
    _m("xpusense.accelerator.ioctl.calls", "{call}", COUNTER, labels=PROCESS),
    _m("xpusense.accelerator.ioctl.errors", "{call}", COUNTER, labels=PROCESS),
    _m("xpusense.accelerator.ioctl.latency", "s", HISTOGRAM, labels=PROCESS),
    _m("xpusense.cuda.kernel.launches", "{launch}", COUNTER, labels=PROCESS),
    _m("xpusense.cuda.memcpy.io", "By", COUNTER, labels={**PROCESS, "direction": Label("xpusense.memcpy.direction")}),
    _m("xpusense.cuda.memcpy.calls", "{call}", COUNTER,
       labels={**PROCESS, "direction": Label("xpusense.memcpy.direction")}),
    _m("xpusense.cuda.memory.allocations", "{allocation}", COUNTER, labels=PROCESS),
    _m("xpusense.cuda.memory.allocated", "By", COUNTER, labels=PROCESS),
    _m("xpusense.cuda.memory.frees", "{free}", COUNTER, labels=PROCESS),
    _m("xpusense.network.tc.io", "By", COUNTER, labels=NET),
    _m("xpusense.network.tc.packets", "{packet}", COUNTER, labels=NET),
    _m("xpusense.network.interface.driver_errors", "{event}", COUNTER,
       labels={"device": Label("network.interface.name"), "counter": Label("xpusense.network.driver.counter")}),
    _m("xpusense.network.interface.driver_errors.omitted", "{counter}", GAUGE,
       labels={"device": Label("network.interface.name")}),
    _m(n.NETWORK_TCP_RTT, "s", HISTOGRAM, labels={"remote_region": Label("xpusense.network.remote_region")}),
    _m("xpusense.network.tcp.rtt.untracked", "{sample}", COUNTER),
    _m("xpusense.ebpf.probe.events", "{event}", COUNTER),
    _m("xpusense.ebpf.probe.ns_per_event", "ns", GAUGE),
    _m("xpusense.ebpf.probe.run_time", "s", COUNTER),
)

BY_WIRE: Mapping[str, Metric] = MappingProxyType({m.wire: m for m in METRICS})

# Labels that describe a device and are replaced by its hw.* attributes at the OTLP edge.
DEVICE_LABELS = ("device", "vendor", "mig_instance", "sensor")
# What a point of a metric this table does not list keeps: its labels, with `device`/`vendor` of an
# inventory accelerator replaced as for ACCELERATOR.
DEFAULT_HW = TYPED_GPU


def lookup(wire_name: str) -> Metric | None:
    return BY_WIRE.get(wire_name)
