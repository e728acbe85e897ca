"""The `[sources.ebpf]` table: its keys (SCHEMA, checked by xpusense.common.config) and how the probes'
sources are built from it, one per enabled probe, all sharing one loader (one compilation).

Keys are documented in docs/ebpf.md. The checks say what is wrong; the config loader adds the file
and the key (e.g. `agent.toml: 'sources.ebpf.probes' has unknown probe(s) nope (known: ...)`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from xpusense.common.config import Key, Table, load
from xpusense.probes import specs

from ..base import Source, SourceFamily, Unavailable
from .loader import EbpfLoader, Plan
from .probes import AccelIoctlSource, BlkioSource, CudaUprobeSource, NetioSource, RunqlatSource
from .procfs import device_prefixes
from .source import EbpfSource
from .tc import TcTrafficSource
from .tcp_rtt import TcpRttSource, regions_check


def known_probes(names: list[str]) -> str | None:
    bad = [p for p in names if p not in specs.PROBES]
    return f"has unknown probe(s) {', '.join(bad)} (known: {', '.join(specs.PROBES)})" if bad else None


def usable_device_globs(globs: list[str]) -> str | None:
    try:
        device_prefixes(globs)
    except ValueError as e:
        return f"cannot be matched in the kernel: {e}"
    return None


def variant_of(probe: str) -> Callable[[str], str | None]:
    """The check of [sources.ebpf.variants] PROBE: empty (feature tests choose) or one of its variants."""
    names = [v.name for v in specs.PROBES[probe].variants]

    def check(v: str) -> str | None:
        return None if not v or v in names else f"is not a variant of {probe} (its variants: {', '.join(names)})"
    return check


SCHEMA: dict[str, Any] = {
    "enabled": Key(bool, True, help="false: no eBPF source at all (nothing is compiled or loaded)"),
    "probes": Key(list, list(specs.PROBES), known_probes, help="which probes to run (default: all of them)"),
    "tc_interfaces": Key(list, [], help="interfaces tc_traffic counts; [] = the namespace's physical ones"),
    "tc_netns": Key(str, "", help="network namespace for tc_traffic (name under /run/netns or a path); "
                                  "empty: the agent's own"),
    "cuda_library": Key(str, "", help="libcuda.so.1 for cuda_uprobe; empty: the usual places, then ldconfig"),
    "device_globs": Key(list, list(specs.DEFAULT_DEVICE_GLOBS), usable_device_globs,
                        help="device files whose ioctls accel_ioctl counts"),
    "bpf_stats": Key(bool, True, help="turn on bpf_stats while running and report each probe's cost"),
    "combined_compile": Key(bool, True, help="one clang run for all probes (false: one per probe)"),
    "tcp_rtt": {"regions": Key(Table, Table(), regions_check,
                               help='remote networks -> region names for tcp_rtt, e.g. {"10.20.0.0/16" = '
                                    '"cn-north-1"}; addresses matching none: region "other"')},
    "variants": {p: Key(str, "", variant_of(p), help=f"force a variant of {p} (empty: the feature tests choose)")
                 for p in specs.PROBES},
    "procfs": Key(str, "/proc"),
    "sysfs": Key(str, "/sys"),
    "tracefs": Key(str, "", help="empty: the one bcc uses"),
    "cgroupfs": Key(str, "", help="empty: the cgroup2 mount from /proc/self/mountinfo"),
    "modules_dir": Key(str, "/lib/modules", help="where kernel headers are looked for (<release>/build)"),
}


def table_from(keys: dict[str, Any] | None = None) -> SimpleNamespace:
    """[sources.ebpf] keys given as a dict (the CLI's --config-json, tests) -> the checked table, defaults
    filled in; raises xpusense.common.config.ConfigError naming the key as `sources.ebpf.KEY`."""
    flags = {f"sources.ebpf.{k}": v for k, v in (keys or {}).items()}
    checked = load({"sources": {"ebpf": SCHEMA}}, None, env={}, flags=flags)
    table: SimpleNamespace = checked.sources.ebpf
    return table


SOURCE_CLASSES: dict[str, type[EbpfSource]] = {
    c.probe: c for c in (RunqlatSource, BlkioSource, NetioSource, AccelIoctlSource, CudaUprobeSource, TcTrafficSource,
                          TcpRttSource)
}


def ebpf_sources(table: SimpleNamespace) -> list[EbpfSource]:
    """One source per enabled probe, in the specs' order, sharing one loader."""
    if not table.enabled:
        return []
    loader = EbpfLoader(table)
    return [SOURCE_CLASSES[p](loader) for p in specs.PROBES if p in table.probes]


def build(table: SimpleNamespace) -> list[Source]:
    """The checked [sources.ebpf] table -> the probes' sources (none when enabled = false)."""
    sources: list[Source] = [*ebpf_sources(table)]
    return sources


def build_and_prestart(table: SimpleNamespace) -> list[Source]:
    """build(), and the loader process started at once where eBPF can run here: it imports bcc while the
    agent goes on starting (the agent's FAMILY; the sources' setup then finds it waiting)."""
    sources = ebpf_sources(table)
    if sources:
        try:
            sources[0].loader.check_environment()
            sources[0].loader.prestart()
        except Unavailable:
            pass            # each source's setup says why
    out: list[Source] = [*sources]
    return out


def plans_for(table: SimpleNamespace) -> tuple[list[Plan], dict[str, str]]:
    """Plans of the enabled probes on this host and, for the others, why not (no compiling)."""
    plans, why = [], {}
    for s in ebpf_sources(table):
        try:
            plans.append(s.loader.plan(s.probe))
        except Unavailable as e:
            why[s.probe] = str(e)
    return plans, why


def expected_request(table: SimpleNamespace) -> dict | None:
    """The request this host's agent will send its loader for `table` (see EbpfLoader.request), or None
    where eBPF cannot run (the environment check's reason is then the agent's to give)."""
    sources = ebpf_sources(table)
    if not sources:
        return None
    loader = sources[0].loader
    try:
        loader.check_environment()
    except Unavailable:
        return None
    return loader.request(loader.planned())


FAMILY = SourceFamily("ebpf", SCHEMA, build_and_prestart)
