"""The eBPF sources' parts that need no root: feature-test fallbacks on a fake tracefs, the missing
library case, the privilege check, config errors, the pure helpers. (Loading probes into the kernel:
tests/privileged/test_ebpf_probes.py.)
"""

from __future__ import annotations

import os

import pytest

from xpusense.agent.sources.base import Unavailable
from xpusense.agent.sources.ebpf import family, loader, procfs
from xpusense.agent.sources.ebpf.loader import render_c
from xpusense.agent.sources.ebpf.source import hist_sample
from xpusense.common.config import ConfigError, load

SCHEMA_WRAPPER = {"sources": {"ebpf": family.SCHEMA}}


def sources(**keys):
    return family.build(family.table_from(keys))


def test_cuda_uprobe_without_the_library_is_unavailable_with_the_config_key(tmp_path):
    [src] = sources(probes=["cuda_uprobe"], cuda_library=str(tmp_path / "libcuda.so.1"))
    with pytest.raises(Unavailable, match="cuda_library"):
        src.loader.plan("cuda_uprobe")


def fake_tracefs(tmp_path, *tracepoints):
    for tp in tracepoints:
        cat, ev = tp.split(":")
        (tmp_path / "events" / cat / ev).mkdir(parents=True)
    return str(tmp_path)


def test_feature_tests_pick_the_fallback_variant_and_say_why(tmp_path):
    tfs = fake_tracefs(tmp_path, "block:block_rq_issue", "block:block_rq_complete", "net:net_dev_xmit",
                       "net:netif_receive_skb", "tcp:tcp_retransmit_skb")
    ldr = sources(probes=["blkio", "netio", "runqlat"], tracefs=tfs)[0].loader
    blk, net = ldr.plan("blkio"), ldr.plan("netio")
    assert (blk.variant.name, blk.cflags()) == ("rq_issue", ["-DBLKIO_IO_START=0"])
    assert net.variant.name == "netdev" and "sock:sock_send_length" in net.notes[0]
    with pytest.raises(Unavailable, match="sched:sched_switch"):
        ldr.plan("runqlat")
    text = render_c([blk, net])
    assert "-DNETIO_SOCK=0" in text and '#line 1 "blkio.bpf.c"' in text


def test_without_privileges_every_probe_is_unavailable_with_what_to_do(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(loader, "read_cap_eff", lambda procfs="/proc": 0)
    for src in sources():
        with pytest.raises(Unavailable, match="root or CAP_BPF"):
            src.setup()


def test_config_errors_name_the_key(tmp_path):
    def load_ebpf(body: str):
        path = tmp_path / "agent.toml"
        path.write_text("[sources.ebpf]\n" + body)
        return family.build(load(SCHEMA_WRAPPER, str(path)).sources.ebpf)

    with pytest.raises(ConfigError, match=r"'sources.ebpf.probes' has unknown probe\(s\) nope"):
        load_ebpf('probes = ["nope"]\n')
    with pytest.raises(ConfigError, match="sources.ebpf.variants.netio"):
        load_ebpf('variants = {netio = "carrier-pigeon"}\n')
    with pytest.raises(ConfigError, match="sources.ebpf.device_globs"):
        load_ebpf('device_globs = ["/dev/a*", "/dev/b*", "/dev/c*", "/dev/d*", "/dev/e*"]\n')
    with pytest.raises(ConfigError, match="unknown key"):
        load_ebpf('tc_interface = ["eth0"]\n')
    assert load_ebpf("enabled = false\n") == []


def test_pure_helpers():
    h = hist_sample("x", "s", {}, [0, 2, 3, 0, 1], 7e9, 1e-9)
    assert h.counts == (0, 2, 5, 5, 6) and h.value == pytest.approx(7.0)
    assert h.bounds == pytest.approx((0.0, 1e-9, 3e-9, 7e-9))
    info = procfs.parse_fdinfo("pos:\t0\nflags:\t02000002\nprog_type:\t5\nprog_id:\t42\nrun_time_ns:\t1234\n"
                               "run_cnt:\t7\n")
    assert (info["prog_id"], info["run_time_ns"], info["run_cnt"]) == (42, 1234, 7)
    assert procfs.device_prefixes(["/dev/nvidia*", "/dev/nvidia[0-9]*", "/dev/davinci?"]) == ["/dev/nvidia",
                                                                                              "/dev/davinci"]
    words, masks = procfs.prefix_words("/dev/nv")
    assert masks[0] == (1 << 56) - 1 and masks[1:] == [0, 0, 0]
    assert procfs.decode_dev((7 << 20) | 3) == (7, 3)
    mi = "30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n"
    cgroup_v1 = "29 25 0:25 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    assert procfs.cgroup2_mount(cgroup_v1 + mi) == "/sys/fs/cgroup/unified"
    assert procfs.physical_links([{"ifname": "lo", "loopback": True}, {"ifname": "eth0"},
                                  {"ifname": "veth1", "kind": "veth"}]) == ["eth0"]
