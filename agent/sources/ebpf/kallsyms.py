"""bcc's view of /proc/kallsyms in the loader process: only the kernel's bpf symbols.

bcc's clang frontend reads the whole of /proc/kallsyms at each compile only to learn whether a few
bpf helpers exist. The loader takes a private mount namespace (private_mounts, while it is still
single-threaded) and binds over kallsyms a file with just those symbols' lines (bind_bpf_symbols);
nothing outside the loader sees it. Without CAP_SYS_ADMIN bcc reads the real file.
"""

from __future__ import annotations

import ctypes
import os
import re
import tempfile

CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x00020000, 4096, 16384, 1 << 18
# One kallsyms line, "ADDR TYPE NAME" or "ADDR TYPE NAME\t[MODULE]", whose NAME is bpf_* or *sys_bpf:
# what bcc looks up (bpf_probe_read_kernel and bpf_probe_read_user while compiling; raw tracepoint,
# kfunc and LSM support and the syscall prefix from Python).
_BPF_SYMBOL = re.compile(rb"[0-9a-fA-F]+ \S (?:bpf_\S*|\S*sys_bpf)(?:\t[^\n]*)?\n?")


def bpf_lines(text: bytes) -> bytes:
    """The lines of a kallsyms text whose symbol is bpf_* or *sys_bpf, in their order."""
    lines = {}
    for needle in (b" bpf_", b"sys_bpf"):       # found at C speed: ~1,600 of ~120,000 lines match here
        at = text.find(needle)
        while at >= 0:
            start = text.rfind(b"\n", 0, at) + 1
            end = text.find(b"\n", at)
            end = len(text) if end < 0 else end + 1
            if _BPF_SYMBOL.fullmatch(text, start, end):
                lines[start] = text[start:end].rstrip(b"\n") + b"\n"
            at = text.find(needle, end)
    return b"".join(lines[k] for k in sorted(lines))


def _libc_call(what: str, ret: int) -> str:
    return f"{what}: {os.strerror(ctypes.get_errno())}" if ret != 0 else ""


def private_mounts() -> str:
    """A mount namespace of this process's own, its mounts private (nothing propagates back). Call
    before a second thread starts. '' when done, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    return (_libc_call("unshare(CLONE_NEWNS)", libc.unshare(CLONE_NEWNS))
            or _libc_call("making the mounts private", libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)))


def bind_bpf_symbols(procfs: str = "/proc") -> str:
    """Over <procfs>/kallsyms, in this process's private mount namespace, the bpf lines of the real one.
    '' when done, else why not."""
    kallsyms = os.path.join(procfs, "kallsyms")
    try:
        with open(kallsyms, "rb") as f:
            small = bpf_lines(f.read())
    except OSError as e:
        return f"cannot read {kallsyms}: {e}"
    try:
        fd, path = tempfile.mkstemp(prefix="xpusense-kallsyms.", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    except OSError as e:
        return f"no file to hold the bpf symbols: {e}"
    try:
        os.write(fd, small)
        libc = ctypes.CDLL(None, use_errno=True)
        return _libc_call(f"bind mount over {kallsyms}", libc.mount(path.encode(), kallsyms.encode(), None, MS_BIND, None))
    except OSError as e:
        return f"writing the bpf symbols to {path}: {e}"
    finally:
        os.close(fd)
        os.unlink(path)         # the mount keeps the file for as long as this process lives
