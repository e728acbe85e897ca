"""Metric names: the contract between the agent's sources and the collector's readers.

Every name that one side writes and the other reads stands here once; docs/metrics.md documents
each (a unit test checks that every name here is in it). Names follow OpenTelemetry semantic
conventions where one exists and `xpusense.*` where none does. What each is called at the OTLP edge
(where some `xpusense.*` names become semconv ones) is common/semconv.py's table.
"""

from __future__ import annotations

# Accelerators: the same name for NVIDIA (NVML) and Ascend (npu-smi), with a `vendor` label.
GPU_UTILIZATION = "hw.gpu.utilization"
# Exported over OTLP as hw.gpu.utilization with hw.gpu.task encoder / decoder (common/semconv.py).
ENCODER_UTILIZATION = "xpusense.accelerator.encoder.utilization"
DECODER_UTILIZATION = "xpusense.accelerator.decoder.utilization"
GPU_MEMORY_USAGE = "hw.gpu.memory.usage"
GPU_MEMORY_LIMIT = "hw.gpu.memory.limit"
GPU_MEMORY_UTILIZATION = "hw.gpu.memory.utilization"
POWER = "hw.power"
ENERGY = "hw.energy"
TEMPERATURE = "hw.temperature"                      # label sensor = chip / hbm
TEMPERATURE_LIMIT = "hw.temperature.limit"          # labels sensor, limit = shutdown / slowdown / max
HBM_BANDWIDTH_UTILIZATION = "xpusense.accelerator.hbm.bandwidth.utilization"
MEMORY_CONTROLLER_UTILIZATION = "xpusense.accelerator.memory_controller.utilization"
SM_UTILIZATION = "xpusense.accelerator.sm.utilization"
GRAPHICS_UTILIZATION = "xpusense.accelerator.graphics.utilization"   # NVML GPM GRAPHICS_UTIL (Hopper and newer)
CUBE_UTILIZATION = "xpusense.accelerator.cube.utilization"
VECTOR_UTILIZATION = "xpusense.accelerator.vector.utilization"
MEMORY_FREE = "xpusense.accelerator.memory.free"
CLOCK_FREQUENCY = "xpusense.accelerator.clock.frequency"   # label clock = sm / memory
REMAPPED_ROWS = "xpusense.accelerator.memory.remapped_rows"
REMAP_FAILED = "xpusense.accelerator.memory.remap_failed"
HEALTH = "xpusense.accelerator.health"              # OTLP: hw.status (common/semconv.py)
ECC_ERRORS = "xpusense.accelerator.ecc.errors"      # OTLP: hw.errors
INTERCONNECT_IO = "xpusense.accelerator.interconnect.io"   # OTLP: hw.gpu.io
PCIE_THROUGHPUT = "xpusense.accelerator.pcie.throughput"   # label direction = transmit / receive
PCIE_LINK_CAPACITY = "xpusense.accelerator.pcie.link.capacity"   # per direction; label pcie_switch
NUMA_NODE = "xpusense.accelerator.numa.node"        # the GPU's NUMA node (its number is the value)

# Per process and per pod (labels pid / k8s.pod.name, k8s.namespace.name, k8s.container.name).
PROCESS_UTILIZATION = "xpusense.accelerator.process.utilization"   # label engine
PROCESS_MEMORY_USAGE = "xpusense.accelerator.process.memory.usage"
POD_UTILIZATION = "xpusense.accelerator.pod.utilization"     # label engine; sum of the pod's processes, capped at 1
POD_MEMORY_USAGE = "xpusense.accelerator.pod.memory.usage"
DEVICE_ASSIGNED = "xpusense.k8s.device.assigned"   # 1 while the kubelet assigns the device to the pod's container

XID_ERRORS = "xpusense.accelerator.xid.errors"     # counter per device and XID code since the agent started
LAST_XID = "xpusense.accelerator.xid.last"         # the last XID code seen on the device, 0 none
NPU_ERROR_CODES = "xpusense.accelerator.npu.errors"   # counter per device and npu-smi error code
NPU_ERROR_CODE = "xpusense.accelerator.npu.error_code"   # the first error code npu-smi lists now, 0 none

# Host.
CPU_UTILIZATION = "system.cpu.utilization"
MEMORY_UTILIZATION = "system.memory.utilization"
NETWORK_IO = "system.network.io"
NETWORK_TCP_RTT = "xpusense.network.tcp.rtt"        # eBPF tcp_rtt, label remote_region (histogram, s)

# What is about an accelerator, by name (the collector's views group these under a device).
ACCELERATOR_PREFIXES = ("hw.gpu.", POWER, TEMPERATURE, "xpusense.accelerator.")
