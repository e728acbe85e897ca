"""eBPF probes loaded into the real kernel, checked against workloads whose figures the test knows.

Each probe test builds the probe's source, attaches it, drives a known workload (sleeps, O_DIRECT
I/O on a loop device, UDP and TCP over a veth pair in namespaces of its own, ioctls on a device
node of its own, calls into a fake libcuda built here) and compares the probe's figure with it.
Skips with the reason when not root or when the kernel lacks a probe's features; a probe that plans
but then fails to compile or attach fails. Tests that need no root: tests/unit/test_ebpf_helpers.py."""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from ebpf_support import own_cgroup, probe_sources, require_ebpf
from helpers import BIN, ROOT, wait_until

from xpusense.agent.sources.base import HISTOGRAM, NEARLINE, REALTIME, Unavailable
from xpusense.agent.sources.ebpf import family, loader_process
from xpusense.agent.sources.ebpf.loader import EbpfLoader
from xpusense.agent.sources.ebpf.procfs import cgroup2_root
from xpusense.agent.sources.ebpf.tc import TC_PARENTS, ours
from xpusense.probes import specs

pytestmark = pytest.mark.privileged

FAKE_CUDA = ROOT / "tests" / "fakes" / "libcuda"


# ------------------------------------------------------------------------------------------ helpers

@pytest.fixture
def probe():
    """probe(name, **cfg) -> a set-up source; closed at the end of the test."""
    with contextlib.ExitStack() as opened:
        def make(name, **cfg):
            [src] = opened.enter_context(probe_sources({"probes": [name], **cfg}))
            return src

        yield make


def find(samples, name, **labels):
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(samples, name, **labels) -> float:
    got = find(samples, name, **labels)
    return sum(s.value for s in got)


def check_histogram(s):
    assert s.kind == HISTOGRAM
    assert len(s.counts) == len(s.bounds) + 1
    assert list(s.counts) == sorted(s.counts), "counts are cumulative over buckets"
    assert list(s.bounds) == sorted(s.bounds)


def sh(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw)


@pytest.fixture
def cgroup():
    """cgroup(name) -> (cgroup.procs path, label as the probes report it); removed at the end."""
    with contextlib.ExitStack() as made:
        def make(name):
            path = made.enter_context(own_cgroup(name, "the per-cgroup probes key by cgroup v2 id", timeout_s=10))
            return str(path / "cgroup.procs"), "/" + path.name

        yield make


# Workload scripts take their cgroup as argv[1] ("-" for none) and join it themselves when run
# directly; under `ip netns exec` (which mounts its own /sys) joining happens before the exec.
JOIN_CGROUP = ("import os, sys\n"
               "if sys.argv[1] != '-' and os.path.exists(sys.argv[1]): open(sys.argv[1], 'w').write(str(os.getpid()))\n")


def ns_python(ns: str, code: str, *args) -> list[str]:
    return (["ip", "netns", "exec", ns] if ns else []) + [sys.executable, "-c", code, *map(str, args)]


def joining(procs: str) -> dict:
    """Popen/run keyword arguments that put the child in the cgroup before it execs anything."""
    if procs == "-":
        return {}
    return {"preexec_fn": lambda: Path(procs).write_text(str(os.getpid()))}


def link_stats(ns: str, ifname: str) -> dict:
    from pyroute2 import IPRoute
    with IPRoute(netns=ns) as ipr:
        [link] = ipr.get_links(ifname=ifname)
        return dict(link.get_attr("IFLA_STATS64"))


def quiet_namespaces(*namespaces):
    """No IPv6 autoconfiguration chatter (router solicitations, DAD) during a byte count."""
    for ns in namespaces:
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")


# ------------------------------------------------------------------------------------------ runqlat

SLEEPER = JOIN_CGROUP + """
import resource, time
for _ in range(int(sys.argv[2])):
    time.sleep(0.0002)
r = resource.getrusage(resource.RUSAGE_SELF)
print(r.ru_nvcsw + r.ru_nivcsw)   # its context switches: each is one stay in the run queue after it
"""


@pytest.mark.parametrize("variant", [v.name for v in specs.RUNQLAT.variants])
def test_runqlat_counts_every_wakeup_of_a_sleeping_process_in_its_cgroup(probe, cgroup, variant):
    src = probe("runqlat", variants={"runqlat": variant})
    assert src.plan_.variant.name == variant
    procs, label = cgroup("runqlat")
    n = 200
    out = subprocess.run(ns_python("", SLEEPER, procs, n), check=True, timeout=60, capture_output=True, text=True)
    switches = int(out.stdout.split()[-1])   # n sleeps, plus preemptions: many more on a busy machine

    def hist():
        got = find(src.collect(NEARLINE), "xpusense.sched.runqueue.latency", cgroup=label)
        return got[0] if got and got[0].counts[-1] >= n else None

    h = wait_until(hist, 10, what=f"{n} run-queue latencies in {label}")
    check_histogram(h)
    # every wake-up from the sleeps, and not many more than the process's own switches (a few more:
    # the first run after joining, exit, a wait split by a migration between CPUs)
    assert n <= h.counts[-1] <= switches + switches // 8 + 10, (h.counts, switches)
    assert 0 < h.value < h.counts[-1] * 1.0, "mean run-queue latency between 0 and 1 s"
    assert h.unit == "s" and h.bounds[1] == pytest.approx(1e-9)

    # Cost self-metrics from bpf_stats: sched_switch alone fires far more often than our sleeps.
    rt = src.collect(REALTIME)
    events = value(rt, "xpusense.ebpf.probe.events", probe="runqlat")
    assert events >= n
    rt2 = wait_until(lambda: find(src.collect(REALTIME), "xpusense.ebpf.probe.ns_per_event", probe="runqlat"), 10,
                     what="a second bpf_stats reading")
    assert rt2[0].value > 0
    assert value(rt, "xpusense.ebpf.probe.run_time", probe="runqlat") > 0


def test_runqlat_hands_a_removed_cgroups_slot_back_after_reporting_it_once_more(probe):
    src = probe("runqlat")
    if src.plan_.variant.name != "sched_info":
        pytest.skip("the slots are the sched_info variant's")
    root = cgroup2_root("/proc")
    if not root:
        pytest.skip("no cgroup2 mount")
    path = Path(root) / f"xps-test-slot-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    try:
        label, cgid = "/" + path.name, path.stat().st_ino
        subprocess.run(ns_python("", SLEEPER, str(path / "cgroup.procs"), 50), check=True, timeout=60)
        wait_until(lambda: find(src.collect(NEARLINE), "xpusense.sched.runqueue.latency", cgroup=label), 10,
                   what=f"a histogram for {label}")
        index = src.table("runqlat_cgidx")
        slot = int(index[ctypes.c_uint64(cgid)].value)
        assert slot > 0
        wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), 10, what=f"{path} to empty")
    finally:
        path.rmdir()
    assert find(src.collect(NEARLINE), "xpusense.sched.runqueue.latency", cgroup=label), "reported once more"
    with pytest.raises(KeyError):
        index[ctypes.c_uint64(cgid)]
    assert not any(src.table("runqlat_slots")[ctypes.c_uint32(slot)][0].slots), "the slot is emptied"
    assert not find(src.collect(NEARLINE), "xpusense.sched.runqueue.latency", cgroup=label)


# ------------------------------------------------------------------------------------------ blkio

@pytest.fixture
def loop_device(tmp_path):
    if not shutil.which("losetup"):
        pytest.skip("needs losetup (util-linux)")
    backing = tmp_path / "disk.img"
    with open(backing, "wb") as f:
        f.truncate(16 << 20)
    try:
        dev = sh("losetup", "--find", "--show", str(backing)).stdout.strip()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot set up a loop device: {e.stderr.strip()}")
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


@pytest.mark.parametrize("variant", [v.name for v in specs.BLKIO.variants])
def test_blkio_counts_direct_io_on_a_loop_device(probe, loop_device, variant):
    src = probe("blkio", variants={"blkio": variant})
    name = os.path.basename(loop_device)
    writes, reads, block = 64, 32, 4096
    buf = mmap.mmap(-1, block)      # page-aligned, as O_DIRECT wants
    buf.write(b"x" * block)
    fd = os.open(loop_device, os.O_RDWR | os.O_DIRECT)
    try:
        for i in range(writes):
            assert os.pwrite(fd, buf, i * block) == block
        for i in range(reads):
            assert os.preadv(fd, [buf], (writes + i) * block) == block
    finally:
        os.close(fd)

    def counts():
        rt = src.collect(REALTIME)
        w = value(rt, "xpusense.disk.operations", device=name, direction="write")
        r = value(rt, "xpusense.disk.operations", device=name, direction="read")
        return (w, r, rt) if w >= writes and r >= reads else None

    w, r, rt = wait_until(counts, 10, what=f"{writes} writes and {reads} reads on {name}")
    assert w == writes          # nothing else writes to a loop device nobody has mounted
    assert reads <= r <= reads + 8   # udev may probe a new loop device with a few reads
    assert value(rt, "xpusense.disk.io", device=name, direction="write") == writes * block
    [h] = find(src.collect(NEARLINE), "xpusense.disk.operation.latency", device=name, direction="write")
    check_histogram(h)
    assert h.counts[-1] == writes and h.value > 0
    if variant == "raw_done":
        return      # no in-flight map: the request carries its own start time
    # A request whose completion was missed stays in the in-flight map until it is a minute old.
    inflight = src.table("blkio_start")
    k, v = inflight.Key(), inflight.Leaf()
    k.dev, k.sector, v.ts_ns = 1, 12345, time.monotonic_ns()
    inflight[k] = v
    assert src.drop_stale() == 0
    assert src.drop_stale(now_ns=time.monotonic_ns() + 61 * 10**9) >= 1
    with pytest.raises(KeyError):
        inflight[k]


# ------------------------------------------------------------------------------------------ netio

UDP_RECV = JOIN_CGROUP + """
import json, socket
n, port = int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)   # SO_RCVBUFFORCE: past rmem_max, no drops
s.bind(("0.0.0.0", port))
s.settimeout(10)
print("ready", flush=True)
got = count = 0
try:
    while count < n:
        got += len(s.recv(65536))
        count += 1
except socket.timeout:
    pass
print(json.dumps({"bytes": got, "count": count}), flush=True)
"""

UDP_SEND = JOIN_CGROUP + """
import json, socket
n, addr, port = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = sum(s.sendto(b"x" * 1000, (addr, port)) for _ in range(n))
print(json.dumps({"bytes": sent}), flush=True)
"""


def start_receiver(ns, procs, n, port):
    p = subprocess.Popen(ns_python(ns, UDP_RECV, procs, n, port), stdout=subprocess.PIPE, text=True, **joining(procs))
    assert p.stdout.readline().strip() == "ready"
    return p


def test_netio_counts_udp_bytes_per_cgroup_over_a_veth_pair(probe, veth_pair, cgroup):
    ns_a, _if_a, _addr_a, ns_b, _if_b, addr_b = veth_pair
    src = probe("netio")
    if src.plan_.variant.name not in specs.NETIO_SOCK_VARIANTS:
        pytest.skip("kernel without sock:sock_send_length; the netdev fallback is tested below")
    (procs_tx, cg_tx), (procs_rx, cg_rx) = cgroup("tx"), cgroup("rx")
    n, port = 200, 9100
    rx = start_receiver(ns_b, procs_rx, n, port)
    out = sh(*ns_python(ns_a, UDP_SEND, procs_tx, n, addr_b, port), timeout=60, **joining(procs_tx)).stdout
    sent = json.loads(out)["bytes"]
    got = json.loads(rx.communicate(timeout=30)[0])
    assert sent == n * 1000 and got["bytes"] > 0

    def figures():
        rt = src.collect(REALTIME)
        tx = value(rt, "xpusense.cgroup.network.io", cgroup=cg_tx, direction="transmit")
        r = value(rt, "xpusense.cgroup.network.io", cgroup=cg_rx, direction="receive")
        return (tx, r, rt) if tx >= sent and r >= got["bytes"] else None

    tx, r, rt = wait_until(figures, 10, what="socket bytes of both cgroups")
    assert tx == sent                   # payload bytes sendto() returned, exactly
    assert r == got["bytes"]            # and what recv() returned in the other namespace
    assert value(rt, "xpusense.cgroup.network.calls", cgroup=cg_tx, direction="transmit") == n
    assert value(rt, "xpusense.cgroup.network.io", cgroup=cg_tx, direction="receive") == 0


def test_netio_netdev_fallback_counts_frames_per_interface(probe, veth_pair):
    ns_a, if_a, _addr_a, ns_b, _if_b, addr_b = veth_pair
    quiet_namespaces(ns_a, ns_b)
    src = probe("netio", variants={"netio": "netdev"})
    assert src.plan_.variant.name == "netdev"
    n = 150
    before = link_stats(ns_a, if_a)
    first = value(src.collect(REALTIME), "xpusense.network.device.io", device=if_a, direction="transmit")
    sh(*ns_python(ns_a, UDP_SEND, "-", n, addr_b, 9), timeout=60)
    after = link_stats(ns_a, if_a)
    link_tx = after["tx_bytes"] - before["tx_bytes"]
    assert link_tx >= n * 1042
    tx = value(src.collect(REALTIME), "xpusense.network.device.io", device=if_a, direction="transmit") - first
    assert tx == link_tx                # the same frames the interface counted, header included


TCP_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
sys.stdin.readline()      # hold the connection open, never read
"""

TCP_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.sendall(b"a" * 1000)
print("connected", flush=True)
sys.stdin.readline()
c.sendall(b"b" * 10000)   # into a peer that no longer answers: retransmitted on timeout
print("sent", flush=True)
sys.stdin.readline()
"""


def test_netio_counts_tcp_retransmits_when_the_peer_goes_silent(probe, veth_pair, cgroup):
    ns_a, _if_a, _addr_a, ns_b, if_b, addr_b = veth_pair
    src = probe("netio")
    procs, label = cgroup("retrans")
    before = value(src.collect(REALTIME), "xpusense.network.tcp.retransmits", family="ipv4")
    server = subprocess.Popen(ns_python(ns_b, TCP_SERVER, 9200), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.Popen(ns_python(ns_a, TCP_CLIENT, addr_b, 9200), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, **joining(procs))
        assert client.stdout.readline().strip() == "connected"
        # ns_b stops owning the address: segments still arrive but are dropped without a reply.
        sh("ip", "-n", ns_b, "addr", "flush", "dev", if_b)
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "sent"
        wait_until(lambda: value(src.collect(REALTIME), "xpusense.network.tcp.retransmits", family="ipv4") > before,
                   20, what="a TCP retransmission to be counted")
        if src.plan_.variant.name == "sock_cgroup":
            # charged to the cgroup of the client's socket, though the retransmit timer ran elsewhere
            mine = value(src.collect(REALTIME), "xpusense.network.tcp.retransmits", family="ipv4", cgroup=label)
            assert mine >= 1, find(src.collect(REALTIME), "xpusense.network.tcp.retransmits")
    finally:
        for p in (client, server):
            if p:
                p.kill()
                p.wait()


# ------------------------------------------------------------------------------------------ tc_traffic

def our_filters(ns, ifname):
    from pyroute2 import IPRoute
    with IPRoute(netns=ns) as ipr:
        idx = ipr.link_lookup(ifname=ifname)[0]
        out = []
        for direction, parent in TC_PARENTS.items():
            for m in ipr.get_filters(index=idx, parent=parent):
                if m["handle"] and ours(m):
                    out.append((direction, (m["info"] >> 16) & 0xFFFF, m["handle"]))
        return out


def test_tc_traffic_counts_both_directions_and_passes_every_packet(probe, veth_pair):
    ns_a, if_a, addr_a, ns_b, _if_b, addr_b = veth_pair
    quiet_namespaces(ns_a, ns_b)
    src = probe("tc_traffic", tc_netns=ns_a, tc_interfaces=[if_a])
    assert sorted(d for d, _, _ in our_filters(ns_a, if_a)) == ["egress", "ingress"]

    def tc(direction):
        return value(src.collect(REALTIME), "xpusense.network.tc.io", device=if_a, direction=direction)

    n = 200
    before, tx0, rx0 = link_stats(ns_a, if_a), tc("transmit"), tc("receive")
    rx = start_receiver(ns_b, "-", n, 9300)
    sh(*ns_python(ns_a, UDP_SEND, "-", n, addr_b, 9300), timeout=60)
    got = json.loads(rx.communicate(timeout=30)[0])
    assert got["count"] == n, "every datagram passed the filter"
    sh(*ns_python(ns_b, UDP_SEND, "-", 100, addr_a, 9), timeout=60)   # and some the other way

    def settled():
        link = link_stats(ns_a, if_a)
        d_tx, d_rx = link["tx_bytes"] - before["tx_bytes"], link["rx_bytes"] - before["rx_bytes"]
        # ingress runs in the receiver's softirq, just after the sender's veth counted the frame
        return (d_tx, d_rx) if (tc("transmit") - tx0, tc("receive") - rx0) == (d_tx, d_rx) else None

    d_tx, d_rx = wait_until(settled, 10, what="tc counters to equal the interface's IFLA_STATS64")
    assert d_tx >= n * 1042 and d_rx >= 100 * 1042
    packets = value(src.collect(REALTIME), "xpusense.network.tc.packets", device=if_a, direction="transmit")
    assert packets >= n
    src.close()
    assert our_filters(ns_a, if_a) == [], "close() removes our filters"


AGENT_LIKE = """
import json, sys
from xpusense.agent.sources.ebpf.family import build, table_from
[src] = build(table_from({"probes": ["tc_traffic"], "tc_netns": sys.argv[1], "tc_interfaces": [sys.argv[2]],
                          "bpf_stats": False}))
src.setup()
with open(sys.argv[3] + ".tmp", "w") as f:
    json.dump(src.describe(), f)
import os; os.rename(sys.argv[3] + ".tmp", sys.argv[3])
sys.stdin.readline()
src.close()
"""


def test_tc_traffic_after_sigkill_a_restart_leaves_no_duplicate_filter(veth_pair, tmp_path):
    require_ebpf()
    ns_a, if_a, *_ = veth_pair

    def start(tag):
        ready = tmp_path / f"{tag}.json"
        p = subprocess.Popen([sys.executable, "-c", AGENT_LIKE, ns_a, if_a, str(ready)], stdin=subprocess.PIPE,
                             text=True)
        wait_until(lambda: ready.exists() or p.poll() is not None, 60, what=f"{tag} agent to attach")
        assert p.poll() is None, f"{tag} agent exited with {p.returncode}"
        return p, json.loads(ready.read_text())

    first, _ = start("first")
    assert len(our_filters(ns_a, if_a)) == 2
    first.send_signal(signal.SIGKILL)
    first.wait()
    stale = our_filters(ns_a, if_a)
    assert len(stale) == 2, "a SIGKILLed agent cannot clean up: its filters stay"

    second, info = start("second")
    try:
        assert info["stale_filters_removed"] == 2
        now = our_filters(ns_a, if_a)
        assert sorted(d for d, _, _ in now) == ["egress", "ingress"], now   # one each, not two
    finally:
        second.stdin.write("stop\n")
        second.stdin.flush()
        assert second.wait(timeout=30) == 0
    assert our_filters(ns_a, if_a) == [], "a clean stop removes its filters"


# ------------------------------------------------------------------------------------------ accel_ioctl

IOCTLER = JOIN_CGROUP + """
import errno, fcntl, json, os, sys, termios
path, n = sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_RDWR)
if len(sys.argv) > 4:
    print("ready", flush=True)
    sys.stdin.readline()
errors = 0
for _ in range(n):
    try:
        fcntl.ioctl(fd, termios.TCGETS, bytes(64))
    except OSError as e:
        errors += e.errno == errno.ENOTTY
os.close(fd)
print(json.dumps({"pid": os.getpid(), "errors": errors}), flush=True)
"""


@pytest.fixture
def accel_device():
    """A character device node of our own (the numbers of /dev/null) under a short path."""
    d = tempfile.mkdtemp(prefix="xpa", dir="/tmp")
    path = os.path.join(d, "accel0")
    os.mknod(path, 0o600 | 0o020000, os.makedev(1, 3))
    try:
        yield path, os.path.join(d, "accel*")
    finally:
        shutil.rmtree(d)


def test_accel_ioctl_counts_ioctls_per_process_on_matching_device_files(probe, accel_device):
    path, glob = accel_device
    n = 300
    # One process opened the device before the probe existed (found in /proc), one after (openat).
    early = subprocess.Popen([sys.executable, "-c", IOCTLER, "-", path, str(n), "wait"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert early.stdout.readline().strip() == "ready"
    src = probe("accel_ioctl", device_globs=[glob])
    assert src.describe()["fds_found_in_proc"] >= 1
    early.stdin.write("go\n")
    early.stdin.flush()
    runs = [json.loads(early.communicate(timeout=30)[0])]
    runs.append(json.loads(sh(sys.executable, "-c", IOCTLER, "-", path, str(n), timeout=60).stdout))
    # ioctls on a file that does not match the glob are not counted.
    other = json.loads(sh(sys.executable, "-c", IOCTLER, "-", "/dev/null", "50", timeout=60).stdout)

    rt = src.collect(REALTIME)
    for run in runs:
        pid = str(run["pid"])
        assert run["errors"] == n                        # ENOTTY from /dev/null's driver, every time
        assert value(rt, "xpusense.accelerator.ioctl.calls", pid=pid) == n
        assert value(rt, "xpusense.accelerator.ioctl.errors", pid=pid) == n
        assert find(rt, "xpusense.accelerator.ioctl.calls", pid=pid)[0].labels["process"].startswith("python")
    assert not find(rt, "xpusense.accelerator.ioctl.calls", pid=str(other["pid"]))

    nl = src.collect(NEARLINE)
    for run in runs:
        [h] = find(nl, "xpusense.accelerator.ioctl.latency", pid=str(run["pid"]))
        check_histogram(h)
        assert h.counts[-1] == n and h.value > 0
    # The processes have exited: reported once more at that round, then dropped from the map.
    assert not find(src.collect(REALTIME), "xpusense.accelerator.ioctl.calls", pid=str(runs[1]["pid"]))


# ------------------------------------------------------------------------------------------ cuda_uprobe

@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.skip("needs a C compiler for the fake libcuda (scripts/setup.sh installs gcc)")
    out = tmp_path_factory.mktemp("libcuda") / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(FAKE_CUDA / "fakecuda.c")], check=True)
    return str(out)


def test_cuda_uprobe_counts_calls_into_libcuda_per_process(probe, fake_libcuda):
    driver = str(FAKE_CUDA / "driver.py")
    # Loaded the library before the probe attached: uprobes apply to existing mappings too.
    early = subprocess.Popen([sys.executable, driver, fake_libcuda, "40", "--wait"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert early.stdout.readline().strip() == "ready"
    src = probe("cuda_uprobe", cuda_library=fake_libcuda)
    assert {t for k, t in src._attached} >= {"cuLaunchKernel", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemAlloc_v2"}
    early.stdin.write("go\n")
    early.stdin.flush()
    did_early = json.loads(early.communicate(timeout=30)[0])
    did_late = json.loads(sh(sys.executable, driver, fake_libcuda, "75", timeout=60).stdout)

    rt = src.collect(REALTIME)
    for did in (did_early, did_late):
        pid = str(did["pid"])
        assert value(rt, "xpusense.cuda.kernel.launches", pid=pid) == did["launches"] == did["lib_launches"]
        for direction, key in (("host_to_device", "htod"), ("device_to_host", "dtoh"), ("device_to_device", "dtod")):
            assert value(rt, "xpusense.cuda.memcpy.io", pid=pid, direction=direction) == did[f"{key}_bytes"]
            assert value(rt, "xpusense.cuda.memcpy.calls", pid=pid, direction=direction) == did[f"{key}_calls"]
        assert value(rt, "xpusense.cuda.memory.allocations", pid=pid) == did["allocs"]
        assert value(rt, "xpusense.cuda.memory.allocated", pid=pid) == did["alloc_bytes"]
        assert value(rt, "xpusense.cuda.memory.frees", pid=pid) == did["frees"]
    # Both have exited: reported once more in that round, then their slots went back to the programs,
    # and a new process starts from zero in a recycled slot.
    index = src.table("cuda_procs")
    assert {int(k.value) for k, _v in index.items()} & {did_early["pid"], did_late["pid"]} == set()
    src._forgot.clear()
    again = json.loads(sh(sys.executable, driver, fake_libcuda, "5", timeout=60).stdout)
    rt = src.collect(REALTIME)
    assert not find(rt, "xpusense.cuda.kernel.launches", pid=str(did_late["pid"]))
    assert value(rt, "xpusense.cuda.kernel.launches", pid=str(again["pid"])) == again["launches"]


def test_a_probe_whose_programs_did_not_run_gives_its_last_read_again_and_reads_once_they_ran(probe, fake_libcuda):
    src = probe("cuda_uprobe", cuda_library=fake_libcuda)
    if not src.loader.stats.state.startswith("on (BPF_ENABLE_STATS"):
        pytest.skip(f"bpf_stats not held on by BPF_ENABLE_STATS here ({src.loader.stats.state})")
    driver = str(FAKE_CUDA / "driver.py")
    first = json.loads(sh(sys.executable, driver, fake_libcuda, "6", timeout=60).stdout)
    src.collect(REALTIME)            # reports the exited process once more and gives its slot back
    second = src.collect(REALTIME)   # read again (the round before wrote the maps)
    reused = src.reads_reused
    third = src.collect(REALTIME)    # nothing called into the library since: the maps are not read
    assert src.reads_reused == reused + 1

    def maps_part(samples):
        return sorted((s.name, sorted(s.labels.items()), s.value, s.counts) for s in samples
                      if not s.name.startswith("xpusense.ebpf.probe."))
    assert maps_part(third) == maps_part(second)
    assert not find(third, "xpusense.cuda.kernel.launches", pid=str(first["pid"]))
    did = json.loads(sh(sys.executable, driver, fake_libcuda, "9", timeout=60).stdout)
    fourth = src.collect(REALTIME)   # the programs ran: read
    assert src.reads_reused == reused + 1
    assert value(fourth, "xpusense.cuda.kernel.launches", pid=str(did["pid"])) == did["launches"] > 0


# ------------------------------------------------------------------------------------------ isolation

def test_a_probe_that_does_not_compile_does_not_take_the_others_down(monkeypatch):
    require_ebpf()
    from xpusense.agent.sources.ebpf import loader as loader_module
    monkeypatch.setattr(loader_module, "LOADER_PROCESSES", 1)     # both in one loader: the combined compile fails
    orig = specs.Probe.c_text
    monkeypatch.setattr(specs.Probe, "c_text",
                        lambda self: orig(self) + ("\n#error broken on purpose\n" if self.name == "netio" else ""))
    runq, net = family.build(family.table_from({"probes": ["runqlat", "netio"]}))
    try:
        with pytest.raises(Unavailable, match="broken on purpose"):
            net.setup()
        runq.setup()
        assert runq.describe()["compile"] == "per probe"
        assert find(runq.collect(REALTIME), "xpusense.ebpf.probe.events", probe="runqlat")
    finally:
        runq.close()
        net.close()



# ------------------------------------------------------------------------------------------ the loader process

AGENT_NO_LLVM = """
import json, os, sys, time
from xpusense.agent.sources.base import NEARLINE
from xpusense.agent.sources.ebpf.family import build, table_from
def switches():   # this process's context switches so far, every thread (each is a run-queue wait after)
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(l.split()[1]) for l in f if l.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
        except OSError:
            pass
    return total
srcs = build(table_from({"probes": ["runqlat", "netio", "blkio"]}))
for s in srcs:
    s.setup()
# Into the cgroup once set up: the loader process, preempted often on a busy machine, stays outside.
if sys.argv[1] != '-' and os.path.exists(sys.argv[1]): open(sys.argv[1], 'w').write(str(os.getpid()))
before = switches()
for _ in range(int(sys.argv[2])):
    time.sleep(0.0002)
time.sleep(0.2)
switched = switches() - before
runq = srcs[0].collect(NEARLINE)
maps = open("/proc/self/maps").read()
print(json.dumps({"bcc_imported": any(m == "bcc" or m.startswith("bcc.") for m in sys.modules),
                  "llvm_mapped": [l.split()[-1] for l in maps.splitlines() if "LLVM" in l or "libbcc" in l or "clang" in l][:3],
                  "loader": srcs[0].describe().get("loader", {}),
                  "runqlat": [[s.labels.get("cgroup"), s.counts[-1]] for s in runq], "switches": switched}))
for s in srcs:
    s.close()
"""


def test_the_agent_holds_the_probes_without_bcc_or_llvm_and_reads_the_same_figures(cgroup):
    """The loader process compiled and attached; the agent process never imported bcc, has no LLVM
    mapped, and reads its own sleeps from runqlat's map through the bpf syscall."""
    require_ebpf()
    procs, label = cgroup("nollvm")
    n = 150
    out = sh(sys.executable, "-c", AGENT_NO_LLVM, procs, str(n), timeout=120, cwd=str(ROOT)).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["bcc_imported"] is False and got["llvm_mapped"] == []
    assert got["loader"]["pids"] and min(got["loader"]["peak_rss_mb"]) > 0    # the processes that had them, gone
    for pid in got["loader"]["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    counts = dict(got["runqlat"])
    # Each sleep is a wait on the run queue once woken; a loaded machine adds preemptions, as many
    # as the process's context switches say (+10: threads that ended before they were counted).
    assert n <= counts.get(label, 0) <= max(n + n // 4, got["switches"]) + 10, (counts, got["switches"])


def test_maps_read_in_one_batch_call_or_key_by_key_agree(probe, loop_device):
    src = probe("blkio")
    fd = os.open(loop_device, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, 4096)
    try:
        for i in range(16):
            os.pwrite(fd, buf, i * 4096)
    finally:
        os.close(fd)
    table = src.table("blkio_hist")
    wait_until(lambda: table.raw_items()[0] > 0, 10, what="blkio_hist entries")
    rdev = os.stat(loop_device).st_rdev
    ours = (os.major(rdev) << 20) | os.minor(rdev)      # the kernel's dev_t, as the block tracepoints give it

    def by_key(batch):                                  # the loop device's entries: nobody else does I/O on it
        n, keys, values = table.raw_items(batch)
        ks, vs = table.key_size, len(values) // max(1, n)
        return {bytes(keys[i * ks:(i + 1) * ks]): bytes(values[i * vs:(i + 1) * vs]) for i in range(n)
                if table.Key.from_buffer_copy(keys, i * ks).dev == ours}

    calls = table.batch_calls
    batched = by_key(True)
    assert table.batch_calls == calls + 1 and table.batch_ok, "one BPF_MAP_LOOKUP_BATCH call for the whole map"
    assert batched and by_key(False) == batched    # per-CPU values too, byte for byte
    name = os.path.basename(loop_device)
    assert any(s.labels["device"] == name for s in find(src.collect(REALTIME), "xpusense.disk.operations"))


def test_a_loader_killed_before_it_hands_over_makes_every_probe_unavailable_with_the_reason(monkeypatch):
    require_ebpf()
    monkeypatch.setattr(EbpfLoader, "loader_argv",
                        lambda self, fd: [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    sources = family.build(family.table_from({"probes": ["runqlat", "netio"]}))
    for src in sources:
        with pytest.raises(Unavailable, match="eBPF loader process .* killed by SIGKILL before handing over"):
            src.setup()
        src.close()


def test_a_loader_that_hangs_is_killed_and_the_probes_say_so(monkeypatch):
    require_ebpf()
    from xpusense.agent.sources.ebpf import loader as loader_module
    monkeypatch.setattr(loader_module, "LOADER_TIMEOUT_S", 2.0)
    monkeypatch.setattr(EbpfLoader, "loader_argv",
                        lambda self, fd: [sys.executable, "-c", "import time; time.sleep(600)", str(fd)])
    [src] = family.build(family.table_from({"probes": ["runqlat"]}))
    with pytest.raises(Unavailable, match="handed nothing over within 2 s and was killed"):
        src.setup()


def early_loader_config(tmp_path, probes: list[str]) -> str:
    path = tmp_path / "agent.toml"
    path.write_text(f"[sources.ebpf]\nprobes = {json.dumps(probes)}\n")
    return str(path)


def loader_info_of_running_probes(probes: list[str]) -> dict:
    """Set up `probes` (taking any early loader), check each counts events, close them: the loader's figures."""
    sources = family.build(family.table_from({"probes": probes}))
    try:
        for src in sources:
            src.setup()
        for src in sources:
            assert find(src.collect(REALTIME), "xpusense.ebpf.probe.events", probe=src.probe)
        info: dict = sources[0].describe()["loader"]
        return info
    finally:
        for src in sources:
            src.close()
        loader_process.discard_early()


def test_a_loader_started_early_compiles_ahead_what_the_config_asks_and_leaves_the_hosts_kallsyms_alone(tmp_path):
    """`xpusense-agent run` starts the loader before its own imports (loader_process.start_early), naming its
    config: the loader compiles what the config asks for while the agent starts, and the agent's
    request finds it compiled. bcc saw a kallsyms of the loader's own mount namespace, never the host."""
    require_ebpf()
    loader_process.start_early(early_loader_config(tmp_path, ["runqlat", "netio"]))
    info = loader_info_of_running_probes(["runqlat", "netio"])
    assert info["compiled_ahead"] is True, info
    assert info["kallsyms"] == "private (bpf symbols only)", info
    with open("/proc/kallsyms") as f:
        names = {line.split()[2] for line in f}
    assert "schedule" in names and len(names) > 10_000      # the host's own file, whole


def test_the_agent_run_from_its_cli_finds_its_probes_compiled_ahead(tmp_path):
    """The whole path: `xpusense-agent run` starts the loader first, the loader guesses the request
    from the agent's config, and the agent's real request asks for exactly that (a guess that
    differed would cost the time it was meant to save, silently)."""
    require_ebpf()
    config = tmp_path / "agent.toml"
    config.write_text(f'[spool]\ndir = "{tmp_path}/spool"\n[sources.nvml]\nenabled = false\n'
                      f'[sources.npu_smi]\nenabled = false\n[sources.ebpf]\nprobes = ["runqlat", "netio", "accel_ioctl"]\n')
    log = tmp_path / "agent.log"
    with socket.socket() as s:      # no collector there: the agent runs on, spooling
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        agent = subprocess.Popen([str(BIN / "xpusense-agent"), "run", "--config", str(config), "--collector",
                                  f"127.0.0.1:{port}", "--log-level", "info"], stdout=out, stderr=subprocess.STDOUT)
    try:
        line = wait_until(lambda: next((x for x in log.read_text().splitlines() if "eBPF loader process" in x), None),
                          timeout_s=120, what=lambda: log.read_text()[-2000:])
        assert "compiling ahead: compiled" in line, line
    finally:
        agent.terminate()
        agent.wait(timeout=60)


def test_a_loader_that_compiled_other_probes_ahead_compiles_what_the_agent_asks(tmp_path):
    require_ebpf()
    loader_process.start_early(early_loader_config(tmp_path, ["runqlat"]))
    info = loader_info_of_running_probes(["runqlat", "netio"])
    assert info["compiled_ahead"] is False and "other probes or flags" in info["ahead"], info


def test_an_early_loader_is_not_started_for_a_config_without_probes_and_one_nobody_takes_ends(tmp_path):
    require_ebpf()
    off = tmp_path / "off.toml"
    off.write_text("[sources.ebpf]\nenabled = false\n")
    loader_process.start_early(str(off))
    assert loader_process.take_early() is None
    loader_process.start_early(early_loader_config(tmp_path, ["runqlat"]))
    early = loader_process.take_early()
    assert early is not None
    early.close()           # EOF on its socket: it leaves without compiling anything it was not asked for
    assert early.proc.returncode == 0


def test_probes_shared_out_between_two_loader_processes_all_run(monkeypatch):
    require_ebpf()
    from xpusense.agent.sources.ebpf import loader as loader_module
    monkeypatch.setattr(loader_module, "LOADER_PROCESSES", 2)
    sources = family.build(family.table_from({"probes": ["runqlat", "netio", "blkio"]}))
    try:
        for src in sources:
            src.setup()
        info = sources[0].describe()["loader"]
        assert info["processes"] == 2 and len(set(info["pids"])) == 2
        for src in sources:
            assert find(src.collect(REALTIME), "xpusense.ebpf.probe.events", probe=src.probe)
    finally:
        for src in sources:
            src.close()
