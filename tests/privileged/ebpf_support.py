"""What the privileged eBPF tests share: the checks that skip a test where probes cannot load, probe
sources built, planned and set up for a test, and cgroups of a test's own."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_until

from xpusense.agent.sources.base import Unavailable
from xpusense.agent.sources.ebpf import family
from xpusense.agent.sources.ebpf.loader import EbpfLoader
from xpusense.agent.sources.ebpf.procfs import cgroup2_root


def require_ebpf() -> None:
    """Skip the test, saying why, where eBPF programs cannot be loaded at all."""
    if os.geteuid() != 0:
        pytest.skip("needs root to load eBPF programs; CI runs tests/privileged as root")
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.skip("bcc's Python module is not importable: run scripts/setup.sh (links python3-bpfcc)")
    try:
        EbpfLoader(family.table_from()).check_environment()
    except Unavailable as e:
        pytest.skip(f"eBPF unavailable here: {e}")


@contextlib.contextmanager
def probe_sources(table: dict) -> Iterator[list]:
    """The eBPF sources of `table` ([sources.ebpf] keys), set up; closed on leaving. A probe this
    kernel lacks the features of skips the test; one that plans but fails to compile or attach fails it."""
    require_ebpf()
    srcs = family.build(family.table_from(table))
    try:
        for src in srcs:
            try:
                src.loader.plan(src.probe)
            except Unavailable as e:   # a feature this kernel lacks: not a failure of ours
                pytest.skip(f"probe {src.probe} cannot run on this kernel: {e}")
        for src in srcs:
            src.setup()
        yield srcs
    finally:
        for src in srcs:
            src.close()


@contextlib.contextmanager
def own_cgroup(name: str, why: str, timeout_s: float = 60.0) -> Iterator[Path]:
    """A new cgroup v2 directory (xps-test-NAME-xxxxxx); removed on leaving, once the processes in it
    have left (processes that exited may take a moment). No cgroup2 mount skips the test (`why`:
    what needs one)."""
    root = cgroup2_root("/proc")
    if not root:
        pytest.skip(f"no cgroup2 mount ({why})")
    path = Path(root) / f"xps-test-{name}-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    try:
        yield path
    finally:
        wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), timeout_s, what=f"{path} to empty")
        path.rmdir()
