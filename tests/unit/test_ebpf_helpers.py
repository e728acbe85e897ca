"""The eBPF sources' parts that need no root: feature-test fallbacks on a fake tracefs, the missing
library case, the privilege check, config errors, the pure helpers, the loader process's hand-over
(fds over a socket; a loader that exits, is killed or hangs) and the map type decoding. (Loading
probes into the kernel: tests/privileged/test_ebpf_probes.py.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
import tempfile

import pytest

from xpusense.agent.sources.base import COUNTER, HISTOGRAM, Sample, Unavailable
from xpusense.agent.sources.ebpf import bpfmap, btf, caps, family, fd_channel, links, loader_process, procfs
from xpusense.agent.sources.ebpf.loader import render_c
from xpusense.agent.sources.ebpf.source import EbpfSource, hist_sample, sum_percpu
from xpusense.agent.tiers import ChangeFilter
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
    assert (blk.variant.name, blk.cflags()) == ("rq_issue", ["-DBLKIO_IO_START=0", "-DBLKIO_RAW_DONE=0"])
    assert net.variant.name == "netdev" and "sock:sock_send_length" in net.notes[0]
    with pytest.raises(Unavailable, match="sched:sched_switch"):
        ldr.plan("runqlat")
    text = render_c([blk, net])
    assert "-DNETIO_SOCK=0" in text and '#line 1 "blkio.bpf.c"' in text


def test_without_privileges_every_probe_is_unavailable_with_what_to_do(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(caps, "read_cap_eff", lambda procfs="/proc": 0)
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


# ------------------------------------------------------------------------------------------ the loader process

def test_handoff_carries_a_message_and_its_fds_in_order_past_one_message_worth():
    a, b = fd_channel.pair()
    pipes = [os.pipe() for _ in range(3)]
    # 3 pipes' write ends, each repeated: more fds than one message may carry
    fds = [w for _r, w in pipes] * ((fd_channel.FDS_PER_MESSAGE // 3) + 10)
    try:
        fd_channel.send(a, {"hello": [1, 2]}, fds)
        data, got = fd_channel.recv(b, 5.0)
        assert data == {"hello": [1, 2]} and len(got) == len(fds) > fd_channel.FDS_PER_MESSAGE
        for i, fd in enumerate(got):        # the i-th fd received writes into the i-th pipe sent
            os.write(fd, bytes([i % 3]))
        for k, (r, _w) in enumerate(pipes):
            assert set(os.read(r, 4096)) == {k}
        assert all(os.get_inheritable(fd) is False for fd in got), "close-on-exec, not leaked to children"
    finally:
        for fd in locals().get("got", []):
            os.close(fd)
        for r, w in pipes:
            os.close(r)
            os.close(w)
        a.close()
        b.close()


def test_handoff_times_out_and_sees_a_closed_peer():
    a, b = fd_channel.pair()
    with pytest.raises(fd_channel.ChannelError, match="timed out"):
        fd_channel.recv(b, 0.2)
    a.close()
    with pytest.raises(fd_channel.ChannelError, match="closed"):
        fd_channel.recv(b, 1.0)
    b.close()


def loader_running(code):
    """A run_loader argv function: `python -c code FD` instead of the real loader."""
    return lambda fd: [sys.executable, "-c", code, str(fd)]


def test_a_loader_that_exits_or_is_killed_gives_the_reason_and_no_fds():
    with pytest.raises(Unavailable, match=r"exited with status 3 before handing over the probes; it said: .*no headers here"):
        loader_process.run_loader(loader_running("import sys; print('no headers here', file=sys.stderr); sys.exit(3)"),
                            {"probes": []}, 30)
    with pytest.raises(Unavailable, match="killed by SIGKILL before handing over"):
        loader_process.run_loader(loader_running("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), {"probes": []}, 30)


def test_a_loader_that_hangs_is_killed_at_the_deadline():
    pidfile = tempfile.mktemp()
    code = f"import os, time; open({pidfile!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    with pytest.raises(Unavailable, match=r"handed nothing over within 1 s and was killed"):
        loader_process.run_loader(loader_running(code), {"probes": []}, 1.0)
    pid = int(open(pidfile).read())
    os.unlink(pidfile)
    with pytest.raises(ProcessLookupError):   # reaped, not left running
        os.kill(pid, 0)


def test_map_types_decode_from_bccs_descriptions():
    # As libbcc describes accel_ioctl.bpf.c's and tc_traffic.bpf.c's types (recorded).
    stats = bpfmap.ctype_of(["accel_stats", [["calls", "unsigned long long"], ["errors", "unsigned long long"],
                                             ["sum_ns", "unsigned long long"], ["slots", "unsigned long long", [40]],
                                             ["comm", "char", [16]]], "struct_packed"])
    assert ctypes.sizeof(stats) == 8 * 43 + 16
    v = stats.from_buffer_copy(struct.pack("=43Q16s", 5, 1, 99, *range(40), b"python3"))
    assert (v.calls, v.errors, v.sum_ns, v.slots[39], v.comm) == (5, 1, 99, 39, b"python3")
    key = bpfmap.ctype_of(["accel_fd_key", [["tgid", "unsigned int"], ["fd", "unsigned int"]], "struct_packed"])
    assert bytes(key(7, 3)) == struct.pack("=II", 7, 3)
    assert bpfmap.ctype_of("unsigned long long") is ctypes.c_ulonglong
    nested = bpfmap.ctype_of(["o", [["a", "int"], ["", [["x", "short"], ["y", "int"]], "union"]], "struct"])
    assert ctypes.sizeof(nested) == 8 and nested(a=1, x=2).x == 2
    with pytest.raises(ValueError, match="unknown C type"):
        bpfmap.ctype_of("struct task_struct")
    assert bpfmap.parse_cpu_list("0-3,5") == 6 and bpfmap.parse_cpu_list("0") == 1


def test_per_cpu_values_are_summed_field_by_field_arrays_too():
    hist = bpfmap.ctype_of(["h", [["sum_ns", "unsigned long long"], ["slots", "unsigned long long", [3]]], "struct"])
    summed = sum_percpu([hist(10, (1, 2, 3)), hist(5, (0, 1, 0))])
    assert summed.sum_ns == 15 and summed.slots == [1, 3, 3]
    assert sum_percpu([ctypes.c_ulonglong(4), ctypes.c_ulonglong(6)]).value == 10


def synthetic_btf(path):
    """A small BTF blob laid out as the kernel's: struct outer {u64 x; union {u64 y;}; struct inner
    {u64 a; u64 b;} inner_m;}, typedef void (*btf_trace_x)(void *, u64), function bpf_helper."""
    names = b"\0u64\0inner\0a\0b\0outer\0x\0inner_m\0y\0btf_trace_x\0bpf_helper\0ctx\0"
    off = {n: names.index(b"\0" + n.encode() + b"\0") + 1 for n in
           ("u64", "inner", "a", "b", "outer", "x", "inner_m", "y", "btf_trace_x", "bpf_helper")}

    def rec(name, kind, vlen, size_type, extra=b""):
        return struct.pack("<III", name, (kind << 24) | vlen, size_type) + extra

    types = b"".join([
        rec(off["u64"], btf.INT, 0, 8, struct.pack("<I", 64)),                                    # 1
        rec(off["inner"], btf.STRUCT, 2, 16, struct.pack("<6I", off["a"], 1, 0, off["b"], 1, 64)),  # 2
        rec(off["outer"], btf.STRUCT, 3, 40, struct.pack("<9I", off["x"], 1, 0, 0, 4, 64,           # 3
                                                         off["inner_m"], 2, 128)),
        rec(0, btf.UNION, 1, 8, struct.pack("<3I", off["y"], 1, 0)),                              # 4
        rec(0, btf.FUNC_PROTO, 2, 0, struct.pack("<4I", 0, 0, 0, 1)),                             # 5
        rec(0, btf.PTR, 0, 5),                                                                    # 6
        rec(off["btf_trace_x"], btf.TYPEDEF, 0, 6),                                               # 7
        rec(off["bpf_helper"], btf.FUNC, 0, 5),                                                   # 8
    ])
    hdr = struct.pack("<HBBIIIII", btf.MAGIC, 1, 0, 24, 0, len(types), len(types), len(names))
    path.write_bytes(hdr + types + names)
    return str(path)


def test_struct_offsets_and_functions_come_from_btf(tmp_path):
    with btf.Btf(synthetic_btf(tmp_path / "vmlinux")) as b:
        assert b.member_offset("outer", "x") == 0
        assert b.member_offset("outer", "y") == 8                 # inside an anonymous union
        assert b.member_offset("outer", "inner_m.b") == 16 + 8
        assert b.func_params("btf_trace_x") == 2
        assert b.has(btf.FUNC, "bpf_helper") and not b.has(btf.FUNC, "outer")
        with pytest.raises(btf.BtfError, match="struct outer.inner_m has no member c"):
            b.member_offset("outer", "inner_m.c")
        with pytest.raises(btf.BtfError, match="no struct task_struct"):
            b.member_offset("task_struct", "pid")
    with pytest.raises(btf.BtfError, match="CONFIG_DEBUG_INFO_BTF"):
        btf.Btf(str(tmp_path / "none"))


def test_btf_is_walked_only_as_far_as_a_question_needs_and_answers_as_a_full_walk(tmp_path):
    """A plan asks a few names: the walk stops at the first type that answers, goes on from there
    for the next question, and gives the first id of a name as a walk of every type does."""
    with btf.Btf(synthetic_btf(tmp_path / "vmlinux")) as b:
        assert b.find(btf.STRUCT, "inner") == 2 and len(b._index) == 3      # ids 0..2 walked, no more
        assert not b.has(btf.STRUCT, "nope") and len(b._index) == 3        # a name not in the strings
        assert b.member_offset("outer", "inner_m.b") == 24
        assert b.find(btf.FUNC, "bpf_helper") == 8
    if not os.path.exists(btf.VMLINUX):
        return
    full = btf.Btf()
    full._walk()
    n = len(full._index)
    fresh = btf.Btf()
    for tid in range(1, n, max(1, n // 300)):
        key = full._named[tid]
        if key >> 5:
            first = full._named.index(key)
            assert fresh.find(key & 31, full.name(key >> 5)) == first, (tid, full.name(key >> 5))


def test_links_come_from_one_rtnetlink_dump():
    """tc_traffic's plan: each link's name, index, kind and loopback flag, without pyroute2."""
    def rta(kind, body):
        return struct.pack("=HH", 4 + len(body), kind) + body + b"\0" * (-len(body) % 4)
    body = struct.pack("=BxHiII", 0, 1, 7, 0x1043, 0) + rta(links.IFLA_IFNAME, b"veth7\0") + \
        rta(links.IFLA_LINKINFO | 0x8000, rta(links.IFLA_INFO_KIND, b"veth\0"))
    assert links.parse_link(body, 0, len(body)) == {"ifname": "veth7", "index": 7, "kind": "veth", "loopback": False}
    lo = struct.pack("=BxHiII", 0, 772, 1, 0x49, 0) + rta(links.IFLA_IFNAME, b"lo\0")
    assert links.parse_link(lo, 0, len(lo)) == {"ifname": "lo", "index": 1, "kind": None, "loopback": True}
    got = links.list_links("")
    assert sorted(link["ifname"] for link in got) == sorted(os.listdir("/sys/class/net"))
    for link in got:
        with open(f"/sys/class/net/{link['ifname']}/ifindex") as f:
            assert int(f.read()) == link["index"]
    with pytest.raises(links.LinksError, match="No such file"):
        links.list_links("/nonexistent/netns")


def test_runqlat_falls_back_to_tracepoints_without_the_schedulers_accounting(tmp_path):
    tfs = fake_tracefs(tmp_path / "tracing", "sched:sched_wakeup", "sched:sched_wakeup_new", "sched:sched_switch")
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "schedstat").write_text("0 0 0\n")    # CONFIG_SCHED_INFO without accounting
    sysfs = tmp_path / "sys"
    (sysfs / "kernel" / "btf").mkdir(parents=True)
    synthetic_btf(sysfs / "kernel" / "btf" / "vmlinux")                 # a BTF without task_struct
    ldr = sources(probes=["runqlat"], tracefs=tfs, procfs=str(tmp_path / "proc"), sysfs=str(sysfs))[0].loader
    plan = ldr.plan("runqlat")
    assert plan.variant.name == "tracepoint" and "-DRUNQLAT_SCHED_INFO=0" in plan.cflags()
    assert "does not account run-queue time" in plan.notes[0] and "no struct task_struct" in plan.notes[0]
    assert plan.attach == {"tracepoints": ["sched:sched_wakeup", "sched:sched_wakeup_new", "sched:sched_switch"]}
    assert procfs.parse_schedstat("1200 340 7\n") == (1200, 340, 7)


def test_runqlat_plans_its_raw_tracepoint_variant_with_offsets_from_btf(tmp_path):
    if not os.path.exists("/sys/kernel/btf/vmlinux") or procfs.sched_info_off("/proc"):
        pytest.skip("this kernel has no BTF or no sched_info accounting")
    tfs = fake_tracefs(tmp_path, "sched:sched_switch")
    ldr = sources(probes=["runqlat"], tracefs=tfs)[0].loader
    plan = ldr.plan("runqlat")
    assert plan.variant.name == "sched_info"
    offsets = dict(plan.defines)
    assert int(offsets["RUNQLAT_RUN_DELAY_OFF"]) > int(offsets["RUNQLAT_PCOUNT_OFF"]) > 0
    assert plan.attach == {"raw_tracepoints": {"sched_switch": "raw_tracepoint__sched_switch"},
                           "map_init": {"runqlat_free": {"push": list(range(1, 1024))}}}


def test_a_probes_unchanged_series_are_sent_again_only_after_a_while():
    """The tier loop's ChangeFilter, as the eBPF sources use it (resend_unchanged_s): a change, the
    first flat point after it (a rate from the last two points falls to 0), then silence until the
    last point sent is resend_s old."""
    f = ChangeFilter(15.0)

    def round_(t, **values):
        return {(s.name, s.labels.get("d")): s.value
                for s in f.keep([Sample("c", v, "1", {"d": k}, COUNTER) for k, v in values.items()], t)}

    assert round_(0, a=1, b=5) == {("c", "a"): 1, ("c", "b"): 5}         # new series: sent
    assert round_(1, a=2, b=5) == {("c", "a"): 2}                        # b stands still
    assert round_(2, a=2, b=5) == {("c", "a"): 2}                        # a stopped: one flat point
    assert round_(3, a=2, b=5) == {}
    assert round_(15.5, a=2, b=5) == {("c", "b"): 5}                     # b's last point is 15.5 s old
    assert round_(17.5, a=2, b=5) == {("c", "a"): 2}                     # a's (sent at 2) now too
    h1 = Sample("h", 1.0, "s", {}, HISTOGRAM, bounds=(1.0,), counts=(1, 1))
    h2 = Sample("h", 1.0, "s", {}, HISTOGRAM, bounds=(1.0,), counts=(0, 1))
    assert f.keep([h1], 20) == [h1] and f.keep([h2], 21) == [h2], "a histogram changes with its buckets"
    assert EbpfSource.resend_unchanged_s == 15.0


def test_the_loaders_kallsyms_keeps_the_bpf_symbols_bcc_asks_about_and_only_those():
    from xpusense.agent.sources.ebpf import kallsyms
    text = (b"ffffffff81000000 T _stext\n"
            b"ffffffff814b98b0 T bpf_probe_read_kernel\n"
            b"ffffffff814b9900 t xbpf_lookalike\n"
            b"ffffffff814bc2f0 T bpf_probe_read_user\n"
            b"ffffffff81200000 T __x64_sys_bpf\n"
            b"ffffffff81200100 T __x64_sys_bpf_other\n"
            b"ffffffffc0001000 t bpf_mod_helper\t[some_module]\n"
            b"ffffffffc0002000 t helper_of_bpf_prog\t[bpf_mod]\n"
            b"ffffffff81300000 T bpf_last_without_newline")
    got = kallsyms.bpf_lines(text).decode().splitlines()
    assert got == ["ffffffff814b98b0 T bpf_probe_read_kernel", "ffffffff814bc2f0 T bpf_probe_read_user",
                   "ffffffff81200000 T __x64_sys_bpf", "ffffffffc0001000 t bpf_mod_helper\t[some_module]",
                   "ffffffff81300000 T bpf_last_without_newline"]
    assert kallsyms.bpf_lines(b"") == b""


def test_the_loaders_preload_lets_the_compile_go_on_whatever_fails(monkeypatch):
    import threading

    from xpusense.agent.sources.ebpf import loader_main

    def refused():
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(loader_main.kallsyms_mod, "bind_bpf_symbols", refused)
    ready, compiling, kallsyms = threading.Event(), threading.Event(), {"note": ""}
    t = threading.Thread(target=loader_main.preload, args=(kallsyms, ready, compiling), daemon=True)
    t.start()
    assert ready.wait(60) and "Read-only file system" in kallsyms["note"]
    # pyroute2's import (Python, holding the GIL) waits until clang runs, not to slow the guess down
    t.join(0.2)
    assert t.is_alive()
    compiling.set()
    t.join(60)
    assert not t.is_alive()


def test_the_loader_maps_libbcc_before_bccs_import_asks_for_it():
    """map_libbcc dlopens libbcc (without the GIL), so bcc's own CDLL finds it loaded."""
    import subprocess

    if ctypes.util.find_library("bcc") is None:
        pytest.skip("libbcc is not installed (scripts/setup.sh installs it)")
    code = ("from xpusense.agent.sources.ebpf import loader_main\n"
            "before = 'libbcc.so' in open('/proc/self/maps').read()\n"
            "loader_main.map_libbcc()\n"
            "print(before, 'libbcc.so' in open('/proc/self/maps').read())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
