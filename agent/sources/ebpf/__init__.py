"""Kernel-level measurements from eBPF probes (probes/*.bpf.c): one Source per probe (`ebpf.runqlat`,
`ebpf.blkio`, ...), all sharing one loader. A short-lived loader process compiles and attaches them
with bcc and hands their fds to the agent, which reads the maps with the bpf syscall; clang and LLVM
never enter the agent. How it works, and its settings: docs/ebpf.md.
"""
