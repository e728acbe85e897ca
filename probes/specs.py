"""What each eBPF probe in probes/*.bpf.c needs from the kernel and which of its maps become which metrics.

Data only: the eBPF sources (agent/sources/ebpf/: loader.py plans and compiles, source.py and the
probes' modules attach and read maps) use these specs to feature-test, compile, attach and turn map
entries into samples. A probe lists its variants in order of preference; the first whose required
tracepoints all exist is compiled with that variant's defines (features are tested, not kernel
versions). Histograms are log2 buckets of nanoseconds (bcc's bpf_log2l): slot i holds values in
[2^(i-1), 2^i - 1] ns, so its inclusive upper bound is (2^i - 1) ns; the last slot is the overflow.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

PROBES_DIR = Path(__file__).resolve().parent

REALTIME, NEARLINE = "realtime", "nearline"
COUNTER, HISTOGRAM = "counter", "histogram"

# Attach kinds
TRACEPOINT, UPROBE, SCHED_CLS = "tracepoint", "uprobe", "sched_cls"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to build a probe: the tracepoints it needs, the -D defines that select its C, and what
    else the kernel must offer (read from its BTF and /proc at plan time: features, not versions)."""
    name: str
    tracepoints: tuple[str, ...]                    # "category:event", all required
    defines: tuple[tuple[str, str], ...] = ()
    # tracepoints used when present; when absent, define[1] is set to 0 instead of 1
    optional: tuple[tuple[str, str], ...] = ()      # (tracepoint, define)
    note: str = ""
    # of `tracepoints`, those attached as raw tracepoints (function raw_tracepoint__<event>); the
    # kernel's BTF must have their prototype btf_trace_<event>
    raw_tracepoints: tuple[str, ...] = ()
    # -D DEFINE=<byte offset of struct.member.path in the running kernel, from its BTF>
    btf_offsets: tuple[tuple[str, str, str], ...] = ()     # (define, struct, member path)
    btf_functions: tuple[str, ...] = ()             # kernel functions BTF must have (BPF helpers the C calls)
    needs: tuple[str, ...] = ()                     # host checks by name (loader.HOST_CHECKS)


@dataclasses.dataclass(frozen=True)
class Metric:
    """A map value field turned into one series per map key (labels come from the key decoder)."""
    map: str
    field: str                  # value field; for histograms the slots array
    name: str
    unit: str
    kind: str
    tier: str
    labels: tuple[tuple[str, str], ...] = ()        # fixed extra labels, e.g. direction
    scale: float = 1.0          # value * scale (ns -> s)
    sum_field: str = ""         # histograms: the field holding the sum (scaled by `scale`)
    variants: tuple[str, ...] = ()                  # only for these variants (empty: all)


@dataclasses.dataclass(frozen=True)
class Slots:
    """Values kept in per-CPU array slots, one slot per key (a cgroup, a process): the programs find a
    key's slot in `index` (key -> u32 slot, or a struct whose field `slot` it is) and take new slots
    from the queue `free`, which the loader fills with 1..capacity-1 before attaching. Slot 0 is
    shared by keys beyond capacity ("(other)"). The agent reads `array` through `index`, and when a
    key is gone (a removed cgroup, an exited process) reports it once more, deletes it from `index`,
    empties its slot, clears the per-CPU `caches` (a CPU's last key and slot) and pushes the slot back."""
    array: str
    index: str
    free: str
    key: str                    # decoder of the index's keys: cgroup | process
    capacity: int
    caches: tuple[str, ...] = ()
    variants: tuple[str, ...] = ()      # only for these variants (empty: all)


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    summary: str
    variants: tuple[Variant, ...]
    attach_kind: str
    # map name -> key decoder (EbpfSource.key_labels in agent/sources/ebpf/source.py, or the probe's own):
    #   cgroup (u64 cgroup v2 id), disk (dev_t + direction, probes.py), process (u32 tgid, value has comm),
    #   family (array index 0/1 = ipv4/ipv6), netdev (interface name), iface (ifindex + direction, tc.py),
    #   slots (an array of per-key slots, read through its Slots index below)
    maps: tuple[tuple[str, str], ...]
    metrics: tuple[Metric, ...]
    slots: tuple[Slots, ...] = ()       # maps read through a slot index (decoder "slots")

    @property
    def c_file(self) -> Path:
        return PROBES_DIR / f"{self.name}.bpf.c"

    def c_text(self) -> str:
        return self.c_file.read_text()


def log2_bounds_s(slots: int) -> tuple[float, ...]:
    """Inclusive upper bounds in seconds of slots 0..slots-2; slot slots-1 is the overflow bucket."""
    return tuple(((1 << i) - 1) * 1e-9 for i in range(slots - 1))


RUNQLAT_MAX_CGROUPS = 1024     # RUNQLAT_MAX_CGROUPS in runqlat.bpf.c: cgroups with a histogram (slot 0: the rest)

RUNQLAT = Probe(
    name="runqlat",
    summary="run-queue latency per cgroup (wake-up or preemption to on-CPU)",
    variants=(
        Variant("sched_info", ("sched:sched_switch",),
                (("RUNQLAT_SCHED_INFO", "1"), ("RUNQLAT_MAX_CGROUPS", str(RUNQLAT_MAX_CGROUPS))),
                note="raw tracepoint sched_switch reading the scheduler's own sched_info.run_delay and pcount "
                     "(CONFIG_SCHED_INFO) at offsets from the kernel's BTF, state in task storage (Linux 5.11+)",
                raw_tracepoints=("sched:sched_switch",),
                btf_offsets=(("RUNQLAT_PID_OFF", "task_struct", "pid"),
                             ("RUNQLAT_PCOUNT_OFF", "task_struct", "sched_info.pcount"),
                             ("RUNQLAT_RUN_DELAY_OFF", "task_struct", "sched_info.run_delay"),
                             ("RUNQLAT_CGROUPS_OFF", "task_struct", "cgroups"),
                             ("RUNQLAT_DFL_CGRP_OFF", "css_set", "dfl_cgrp"),
                             ("RUNQLAT_CGRP_KN_OFF", "cgroup", "kn"),
                             ("RUNQLAT_KN_ID_OFF", "kernfs_node", "id")),
                btf_functions=("bpf_get_current_task_btf", "bpf_task_storage_get"),
                needs=("sched_info",)),
        Variant("tracepoint", ("sched:sched_wakeup", "sched:sched_wakeup_new", "sched:sched_switch"),
                (("RUNQLAT_SCHED_INFO", "0"), ("RUNQLAT_MAX_CGROUPS", str(RUNQLAT_MAX_CGROUPS))),
                note="tracepoints sched_wakeup/_new and sched_switch, timestamps in a map keyed by pid"),
    ),
    attach_kind=TRACEPOINT,
    maps=(("runqlat_hist", "cgroup"), ("runqlat_slots", "slots")),
    metrics=(
        Metric("runqlat_hist", "slots", "xpusense.sched.runqueue.latency", "s", HISTOGRAM, NEARLINE,
               scale=1e-9, sum_field="sum_ns", variants=("tracepoint",)),
        Metric("runqlat_slots", "slots", "xpusense.sched.runqueue.latency", "s", HISTOGRAM, NEARLINE,
               scale=1e-9, sum_field="sum_ns", variants=("sched_info",)),
    ),
    # a task remembers its cgroup's slot in its task storage: no per-CPU cache to clear
    slots=(Slots("runqlat_slots", "runqlat_cgidx", "runqlat_free", "cgroup", RUNQLAT_MAX_CGROUPS,
                 variants=("sched_info",)),),
)

BLKIO = Probe(
    name="blkio",
    summary="block I/O latency, operations and bytes per disk and direction",
    variants=(
        Variant("raw_done", ("block:block_io_start", "block:block_io_done"),
                (("BLKIO_IO_START", "1"), ("BLKIO_RAW_DONE", "1")),
                note="accounted I/O as in /proc/diskstats (Linux 6.5+): bytes at block_io_start, latency from "
                     "the request's own start_time_ns read at the raw tracepoint block_io_done (BTF offsets)",
                raw_tracepoints=("block:block_io_done",),
                btf_offsets=(("BLKIO_RQ_Q_OFF", "request", "q"), ("BLKIO_RQ_FLAGS_OFF", "request", "cmd_flags"),
                             ("BLKIO_RQ_START_OFF", "request", "start_time_ns"),
                             ("BLKIO_Q_DISK_OFF", "request_queue", "disk"),
                             ("BLKIO_DISK_MAJOR_OFF", "gendisk", "major"),
                             ("BLKIO_DISK_MINOR_OFF", "gendisk", "first_minor"))),
        Variant("io_start", ("block:block_io_start", "block:block_io_done"),
                (("BLKIO_IO_START", "1"), ("BLKIO_RAW_DONE", "0")),
                note="accounted I/O as in /proc/diskstats, queue + device time (Linux 6.5+), timed with an "
                     "in-flight map keyed by (device, sector)"),
        Variant("rq_issue", ("block:block_rq_issue", "block:block_rq_complete"),
                (("BLKIO_IO_START", "0"), ("BLKIO_RAW_DONE", "0")),
                note="dispatch to completion (device time); flushes count as direction flush"),
    ),
    attach_kind=TRACEPOINT,
    maps=(("blkio_hist", "disk"),),
    metrics=(
        Metric("blkio_hist", "count", "xpusense.disk.operations", "{operation}", COUNTER, REALTIME),
        Metric("blkio_hist", "bytes", "xpusense.disk.io", "By", COUNTER, REALTIME),
        Metric("blkio_hist", "errors", "xpusense.disk.errors", "{operation}", COUNTER, REALTIME,
               variants=("rq_issue",)),      # block_io_done has no error field
        Metric("blkio_hist", "slots", "xpusense.disk.operation.latency", "s", HISTOGRAM, NEARLINE,
               scale=1e-9, sum_field="sum_ns"),
    ),
)

NETIO_SOCK_VARIANTS = ("sock_cgroup", "sock")     # the variants counting socket bytes per cgroup

NETIO = Probe(
    name="netio",
    summary="network bytes per cgroup (per interface on kernels without sock tracepoints), TCP retransmits",
    variants=(
        Variant("sock_cgroup", ("sock:sock_send_length", "sock:sock_recv_length", "tcp:tcp_retransmit_skb"),
                (("NETIO_SOCK", "1"), ("NETIO_RETRANS_CGROUP", "1")),
                note="socket payload bytes per cgroup (Linux 6.3+); retransmits per cgroup of the socket "
                     "(sk_cgrp_data at offsets from the kernel's BTF)",
                btf_offsets=(("NETIO_SK_CGRP_OFF", "sock", "sk_cgrp_data.cgroup"),
                             ("NETIO_CGRP_KN_OFF", "cgroup", "kn"),
                             ("NETIO_KN_ID_OFF", "kernfs_node", "id"))),
        Variant("sock", ("sock:sock_send_length", "sock:sock_recv_length", "tcp:tcp_retransmit_skb"),
                (("NETIO_SOCK", "1"), ("NETIO_RETRANS_CGROUP", "0")),
                note="socket payload bytes per cgroup (Linux 6.3+); retransmits per address family only"),
        Variant("netdev", ("net:net_dev_xmit", "net:netif_receive_skb", "tcp:tcp_retransmit_skb"),
                (("NETIO_SOCK", "0"), ("NETIO_RETRANS_CGROUP", "0")),
                note="frame bytes per interface; receive excludes the link-layer header; no cgroup"),
    ),
    attach_kind=TRACEPOINT,
    maps=(("netio_cgroup", "cgroup"), ("netio_device", "netdev"), ("netio_retransmits", "family"),
          ("netio_retrans_cgroup", "cgroup_family")),
    metrics=(
        Metric("netio_cgroup", "tx_bytes", "xpusense.cgroup.network.io", "By", COUNTER, REALTIME,
               (("direction", "transmit"),), variants=NETIO_SOCK_VARIANTS),
        Metric("netio_cgroup", "rx_bytes", "xpusense.cgroup.network.io", "By", COUNTER, REALTIME,
               (("direction", "receive"),), variants=NETIO_SOCK_VARIANTS),
        Metric("netio_cgroup", "tx_calls", "xpusense.cgroup.network.calls", "{call}", COUNTER, REALTIME,
               (("direction", "transmit"),), variants=NETIO_SOCK_VARIANTS),
        Metric("netio_cgroup", "rx_calls", "xpusense.cgroup.network.calls", "{call}", COUNTER, REALTIME,
               (("direction", "receive"),), variants=NETIO_SOCK_VARIANTS),
        Metric("netio_device", "tx_bytes", "xpusense.network.device.io", "By", COUNTER, REALTIME,
               (("direction", "transmit"),), variants=("netdev",)),
        Metric("netio_device", "rx_bytes", "xpusense.network.device.io", "By", COUNTER, REALTIME,
               (("direction", "receive"),), variants=("netdev",)),
        Metric("netio_device", "tx_calls", "xpusense.network.device.packets", "{packet}", COUNTER, REALTIME,
               (("direction", "transmit"),), variants=("netdev",)),
        Metric("netio_device", "rx_calls", "xpusense.network.device.packets", "{packet}", COUNTER, REALTIME,
               (("direction", "receive"),), variants=("netdev",)),
        Metric("netio_retransmits", "value", "xpusense.network.tcp.retransmits", "{segment}", COUNTER, REALTIME,
               variants=("sock", "netdev")),
        Metric("netio_retrans_cgroup", "value", "xpusense.network.tcp.retransmits", "{segment}", COUNTER, REALTIME,
               variants=("sock_cgroup",)),
    ),
)

ACCEL_IOCTL = Probe(
    name="accel_ioctl",
    summary="ioctl calls, errors and latency per process on accelerator device files",
    variants=(
        Variant("syscalls", ("syscalls:sys_enter_openat", "syscalls:sys_exit_openat", "syscalls:sys_enter_close",
                             "syscalls:sys_enter_ioctl", "syscalls:sys_exit_ioctl"),
                optional=(("syscalls:sys_enter_open", "ACCEL_HAVE_OPEN"), ("syscalls:sys_exit_open", "ACCEL_HAVE_OPEN"))),
    ),
    attach_kind=TRACEPOINT,
    maps=(("accel_stats", "process"),),
    metrics=(
        Metric("accel_stats", "calls", "xpusense.accelerator.ioctl.calls", "{call}", COUNTER, REALTIME),
        Metric("accel_stats", "errors", "xpusense.accelerator.ioctl.errors", "{call}", COUNTER, REALTIME),
        Metric("accel_stats", "slots", "xpusense.accelerator.ioctl.latency", "s", HISTOGRAM, NEARLINE,
               scale=1e-9, sum_field="sum_ns"),
    ),
)
ACCEL_MAX_PREFIXES = 4      # ACCEL_MAX_PREFIXES in accel_ioctl.bpf.c
ACCEL_PREFIX_LEN = 32       # ACCEL_PREFIX_LEN
DEFAULT_DEVICE_GLOBS = ("/dev/nvidia*", "/dev/davinci*")

# symbol in libcuda.so -> BPF function in cuda_uprobe.bpf.c. Symbols the library lacks are skipped
# (older drivers have no cuLaunchKernelEx, for example); _ptsz/_ptds are the per-thread-stream entries.
CUDA_SYMBOLS = {
    "cuLaunchKernel": "cuda_launch",
    "cuLaunchKernel_ptsz": "cuda_launch",
    "cuLaunchKernelEx": "cuda_launch",
    "cuLaunchKernelEx_ptsz": "cuda_launch",
    "cuLaunchCooperativeKernel": "cuda_launch",
    "cuMemcpyHtoD_v2": "cuda_memcpy_htod",
    "cuMemcpyHtoD_v2_ptds": "cuda_memcpy_htod",
    "cuMemcpyHtoDAsync_v2": "cuda_memcpy_htod",
    "cuMemcpyHtoDAsync_v2_ptsz": "cuda_memcpy_htod",
    "cuMemcpyDtoH_v2": "cuda_memcpy_dtoh",
    "cuMemcpyDtoH_v2_ptds": "cuda_memcpy_dtoh",
    "cuMemcpyDtoHAsync_v2": "cuda_memcpy_dtoh",
    "cuMemcpyDtoHAsync_v2_ptsz": "cuda_memcpy_dtoh",
    "cuMemcpyDtoD_v2": "cuda_memcpy_dtod",
    "cuMemcpyDtoD_v2_ptds": "cuda_memcpy_dtod",
    "cuMemcpyDtoDAsync_v2": "cuda_memcpy_dtod",
    "cuMemcpyDtoDAsync_v2_ptsz": "cuda_memcpy_dtod",
    "cuMemAlloc_v2": "cuda_alloc",
    "cuMemAllocManaged": "cuda_alloc",
    "cuMemAllocAsync": "cuda_alloc",
    "cuMemAllocAsync_ptsz": "cuda_alloc",
    "cuMemFree_v2": "cuda_free",
    "cuMemFreeAsync": "cuda_free",
    "cuMemFreeAsync_ptsz": "cuda_free",
}
CUDA_LIBRARY_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1",
)

CUDA_MAX_PROCS = 4096      # CUDA_MAX_PROCS in cuda_uprobe.bpf.c

CUDA_UPROBE = Probe(
    name="cuda_uprobe",
    summary="CUDA driver API calls per process (launches, memcpy bytes by direction, allocations)",
    variants=(Variant("uprobe", (), (("CUDA_MAX_PROCS", str(CUDA_MAX_PROCS)),)),),
    attach_kind=UPROBE,
    maps=(("cuda_slots", "slots"),),
    metrics=(
        Metric("cuda_slots", "launches", "xpusense.cuda.kernel.launches", "{launch}", COUNTER, REALTIME),
        Metric("cuda_slots", "htod_bytes", "xpusense.cuda.memcpy.io", "By", COUNTER, REALTIME,
               (("direction", "host_to_device"),)),
        Metric("cuda_slots", "dtoh_bytes", "xpusense.cuda.memcpy.io", "By", COUNTER, REALTIME,
               (("direction", "device_to_host"),)),
        Metric("cuda_slots", "dtod_bytes", "xpusense.cuda.memcpy.io", "By", COUNTER, REALTIME,
               (("direction", "device_to_device"),)),
        Metric("cuda_slots", "htod_calls", "xpusense.cuda.memcpy.calls", "{call}", COUNTER, REALTIME,
               (("direction", "host_to_device"),)),
        Metric("cuda_slots", "dtoh_calls", "xpusense.cuda.memcpy.calls", "{call}", COUNTER, REALTIME,
               (("direction", "device_to_host"),)),
        Metric("cuda_slots", "dtod_calls", "xpusense.cuda.memcpy.calls", "{call}", COUNTER, REALTIME,
               (("direction", "device_to_device"),)),
        Metric("cuda_slots", "allocs", "xpusense.cuda.memory.allocations", "{allocation}", COUNTER, REALTIME),
        Metric("cuda_slots", "alloc_bytes", "xpusense.cuda.memory.allocated", "By", COUNTER, REALTIME),
        Metric("cuda_slots", "frees", "xpusense.cuda.memory.frees", "{free}", COUNTER, REALTIME),
    ),
    slots=(Slots("cuda_slots", "cuda_procs", "cuda_free_slots", "process", CUDA_MAX_PROCS, caches=("cuda_cpu",)),),
)

# tc filters we own carry this name, priority and handle, so a restarted agent can find and remove
# the ones a crashed run left behind without touching anyone else's.
TC_FILTER_NAME = "xpusense_tc_traffic"
TC_FILTER_PRIO = 0xC0DE & 0xFFFF    # 49374
TC_FILTER_HANDLE = 0x7870           # "xp"
TC_INGRESS_FN, TC_EGRESS_FN = "tc_traffic_ingress", "tc_traffic_egress"

TC_TRAFFIC = Probe(
    name="tc_traffic",
    summary="ingress and egress bytes and packets per interface from a clsact SCHED_CLS program",
    variants=(Variant("clsact", ()),),
    attach_kind=SCHED_CLS,
    maps=(("tc_traffic", "iface"),),
    metrics=(
        Metric("tc_traffic", "bytes", "xpusense.network.tc.io", "By", COUNTER, REALTIME),
        Metric("tc_traffic", "packets", "xpusense.network.tc.packets", "{packet}", COUNTER, REALTIME),
    ),
)

TCP_RTT_MAX_REMOTES = 4096     # TCP_RTT_MAX_REMOTES in tcp_rtt.bpf.c: remote addresses with a histogram

TCP_RTT = Probe(
    name="tcp_rtt",
    summary="TCP smoothed round-trip time per remote network (region from a CIDR table)",
    variants=(
        Variant("tcp_probe", ("tcp:tcp_probe",), (("TCP_RTT_MAX_REMOTES", str(TCP_RTT_MAX_REMOTES)),),
                note="the socket's srtt at every segment an established socket receives (Linux 4.16+)"),
    ),
    attach_kind=TRACEPOINT,
    # remote: IPv6 address (IPv4-mapped for IPv4) -> region, aggregated in the agent (TcpRttSource)
    maps=(("tcp_rtt_remote", "remote"), ("tcp_rtt_missed", "total")),
    metrics=(
        Metric("tcp_rtt_remote", "slots", "xpusense.network.tcp.rtt", "s", HISTOGRAM, NEARLINE,
               scale=1e-9, sum_field="sum_ns"),
        Metric("tcp_rtt_missed", "value", "xpusense.network.tcp.rtt.untracked", "{sample}", COUNTER, REALTIME),
    ),
)

PROBES: dict[str, Probe] = {p.name: p for p in (RUNQLAT, BLKIO, NETIO, ACCEL_IOCTL, CUDA_UPROBE, TC_TRAFFIC,
                                                TCP_RTT)}
