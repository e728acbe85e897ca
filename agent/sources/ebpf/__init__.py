"""Kernel-level measurements from eBPF probes (probes/*.bpf.c), compiled and attached through bcc.

One Source per probe (`ebpf.runqlat`, `ebpf.blkio`, `ebpf.netio`, `ebpf.accel_ioctl`, `ebpf.cuda_uprobe`,
`ebpf.tc_traffic`), all sharing one loader. A short-lived loader process imports bcc, compiles the C
of every probe that passed its feature tests once, as one translation unit (each on its own if that
fails, so one broken probe cannot take the others down), loads and attaches the programs per probe,
and hands the maps', programs' and attachments' fds to the agent over a unix socket; clang and LLVM
leave with it. A probe whose load or attach fails reports Unavailable with the kernel's reason and
the others run. The agent reads the maps with the bpf syscall.

Which maps become which metrics, the tracepoint variants and the attach points are data in
`xpusense.probes.specs`. Counters are read at the realtime tier, histograms (log2 buckets, cumulative
counts) at the nearline tier. Every probe also reports its cost from bpf_stats (enabled for as long
as the agent runs with BPF_ENABLE_STATS, Linux 5.8+, else the kernel.bpf_stats_enabled sysctl):
run_cnt and run_time_ns of its programs, read from /proc/self/fdinfo.

Modules, each importing only those above it:
- caps: this process's capabilities, whether it may load eBPF (imports only os)
- procfs: pure /proc, /sys and header helpers; cgroup id and dev_t names; device path prefixes
- bpf_stats: turning bpf_stats on and off (BPF_ENABLE_STATS, or the sysctl)
- bpfmap: maps through the bpf syscall (batch reads), ctypes types from bcc's descriptions
- links: the interfaces of a network namespace (one rtnetlink dump, no pyroute2 in the agent)
- handoff: JSON messages with fds (SCM_RIGHTS) between the agent and the loader process
- launch: starting the loader process (also early, by the CLI: it imports little), its failures as Unavailable
- handover: ProbeHandle, what the loader process handed over for one probe
- kallsyms: the loader's private view of /proc/kallsyms (the bpf symbols bcc asks about, nothing else)
- loader: Plan (feature tests), render_c, EbpfLoader (one loader process for all probes)
- source: EbpfSource, the base every probe's source is, and the map readers
- loadproc: the loader process itself (imports bcc; compile, load, attach, hand over, exit)
- probes: runqlat, blkio, netio, accel_ioctl, cuda_uprobe; tc: tc_traffic and its netlink code
- family: the [sources.ebpf] schema, build() and FAMILY; plans_for, expected_request
- ahead: the loader process's entry; with the agent's config named, the request compiled before it comes
- __main__: `python -m xpusense.agent.sources.ebpf --print-c` prints the C that will be loaded
"""
