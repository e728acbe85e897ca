"""The agent as a non-root user with only the capabilities docs/security.md lists, through `setpriv`.

Each test runs the real agent CLI as uid/gid 65534 (nobody) with exactly the ambient (and bounding)
capabilities named, checks the process had those and no others, and checks which sources come up:
the tracepoint probes with CAP_BPF + CAP_PERFMON + CAP_DAC_READ_SEARCH, tc_traffic with
CAP_NET_ADMIN too, cuda_uprobe with CAP_SYS_ADMIN too, and with nothing only the host source.
Skips with the reason when root, setpriv, a matching system Python or eBPF is missing."""

from __future__ import annotations

import json
import os
import shutil
import site
import stat
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from helpers import BIN, ROOT, free_port, nodes_json, wait_until

from xpusense.agent.sources.base import Unavailable
from xpusense.agent.sources.ebpf.family import plans_for, table_from
from xpusense.agent.sources.ebpf.loader import EbpfLoader

pytestmark = pytest.mark.privileged

NOBODY = 65534
SYS_PYTHON = "/usr/bin/python3"
CAP_BITS = {"net_admin": 12, "sys_admin": 21, "dac_read_search": 2, "perfmon": 38, "bpf": 39, "sys_ptrace": 19}
TRACEPOINT_CAPS = ["bpf", "perfmon", "dac_read_search"]
TRACEPOINT_PROBES = ["runqlat", "blkio", "netio", "accel_ioctl"]

WRAPPER = """
import json, os, site, sys
site.addsitedir(sys.argv[1])
caps = {k: int(v, 16) for k, v in (l.split(":") for l in open("/proc/self/status") if l.startswith("Cap"))}
with open(sys.argv[2], "w") as f:
    json.dump({"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(), **caps}, f)
from xpusense.agent.cli import main
sys.exit(main(sys.argv[3:]))
"""


def venv_site() -> str:
    return next(p for p in site.getsitepackages() if p.endswith("site-packages"))


def readable_by_others(path: Path) -> bool:
    """Every directory above `path` searchable and `path` itself readable by a user of no group."""
    path = path.resolve()
    if not path.stat().st_mode & stat.S_IROTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents] if p.is_dir())


# What nobody's copy of the site-packages leaves out: dev tools the agent never imports, and the
# editable install's finder, which points into the checkout.
NOT_COPIED = ("mypy", "ruff", "grpc_tools", "hypothesis", "pip", "setuptools", "_pytest", "pytest",
              "kubernetes_validate", "__editable__")


SITE: dict[str, str] = {}   # where as_nobody's interpreter finds the agent (the agent_site fixture)


@pytest.fixture(scope="module")
def agent_site():
    """site-packages holding the agent that nobody can read: the virtualenv's where the checkout is
    readable by others, else a copy (with the project's packages laid out as the wheel would).

    The virtualenv's Python lives under /root (mode 0700 on CI), which nobody cannot enter, so the
    tests run the system's Python of the same version over these site-packages (the same agent code
    and C extensions); the copy, made once, keeps the test independent of where the checkout lives."""
    here = Path(venv_site())
    if readable_by_others(here) and readable_by_others(ROOT / "agent" / "cli.py"):
        SITE["dir"] = str(here)
        yield SITE["dir"]
        return
    d = Path(tempfile.mkdtemp(prefix="xps-lp-site-", dir="/tmp"))
    try:
        shutil.copytree(here, d / "site", symlinks=True,
                        ignore=lambda _dir, names: [n for n in names if n.startswith(NOT_COPIED)])
        dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
        for package, folder in sorted(dirs.items()):   # parents first: "xpusense" before "xpusense.agent"
            shutil.copytree(ROOT / folder, d / "site" / package.replace(".", "/"), dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["chmod", "-R", "a+rX", str(d)], check=True)
        SITE["dir"] = str(d / "site")
        yield SITE["dir"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def can_drop(agent_site):
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another uid with chosen capabilities")
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux) to run the agent with chosen ambient capabilities")
    if not os.path.exists(SYS_PYTHON):
        pytest.skip(f"needs {SYS_PYTHON} (the virtualenv's interpreter is not reachable by other users)")
    ver = subprocess.run([SYS_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                         text=True).stdout.strip()
    if ver != str(sys.version_info[:2]):
        pytest.skip(f"{SYS_PYTHON} is {ver}, the virtualenv {sys.version_info[:2]}: C extensions would not load")
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.skip("bcc's Python module is not importable: run scripts/setup.sh (links python3-bpfcc)")
    try:
        EbpfLoader(table_from()).check_environment()
    except Unavailable as e:
        pytest.skip(f"eBPF unavailable here even as root: {e}")


@pytest.fixture
def home():
    """A directory nobody owns: HOME, config, spool, fake devices (pytest's tmp_path is root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="xps-lp-", dir="/tmp"))
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(home: Path, caps: list[str], argv: list[str], netns: str = "", timeout: float = 120):
    """Run `xpusense-agent ARGV` as uid 65534 with exactly `caps`; return (process, its identity)."""
    capset = "-all" + "".join(f",+{c}" for c in caps)
    report = home / "identity.json"
    cmd = (["nsenter", f"--net=/run/netns/{netns}"] if netns else []) + [
        "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", f"--inh-caps={capset}",
        f"--ambient-caps={capset}", f"--bounding-set={capset}", "--",
        SYS_PYTHON, "-c", WRAPPER, SITE["dir"], str(report), *argv]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "XPUSENSE_SPOOL_DIR": str(home / "spool"),
           "LANG": "C.UTF-8"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd="/", env=env)
    ident = json.loads(report.read_text()) if report.exists() else {}
    return p, ident


def assert_exactly(ident: dict, caps: list[str]) -> None:
    want = sum(1 << CAP_BITS[c] for c in caps)
    assert ident["uid"] == ident["euid"] == NOBODY and ident["gid"] == NOBODY and ident["groups"] == []
    assert ident["CapEff"] == ident["CapPrm"] == ident["CapAmb"] == want, ident
    assert ident["CapBnd"] == want, ident


def write_config(home: Path, ebpf_keys: dict) -> Path:
    cfg = home / "agent.toml"
    body = "[sources.ebpf]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in ebpf_keys.items())
    body += "[tiers]\nrealtime_s = 0.5\nnearline_s = 0.5\noffline_s = 5.0\n[stream]\nflush_s = 0.05\n"
    cfg.write_text(body)
    os.chmod(cfg, 0o644)
    return cfg


def sources(home: Path, caps: list[str], ebpf_keys: dict, netns: str = "") -> tuple[dict, dict]:
    cfg = write_config(home, ebpf_keys)
    p, ident = as_nobody(home, caps, ["sources", "--config", str(cfg), "--format", "json"], netns)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    rows = got["sources"] if isinstance(got, dict) else got
    return {r["name"]: r for r in rows}, ident


@pytest.fixture
def accel_glob(home):
    d = home / "dev"
    d.mkdir()
    os.mknod(d / "accel0", 0o666 | 0o020000, os.makedev(1, 3))
    return str(d / "accel*")


def test_tracepoint_probes_run_as_nobody_with_bpf_perfmon_dac_read_search(can_drop, home, accel_glob):
    keys = {"probes": TRACEPOINT_PROBES, "device_globs": [accel_glob]}
    _, not_here = plans_for(table_from(keys))      # as root: what this kernel cannot run anyway
    rows, ident = sources(home, TRACEPOINT_CAPS, keys)
    assert_exactly(ident, TRACEPOINT_CAPS)
    assert len(not_here) < len(TRACEPOINT_PROBES), not_here
    for probe in TRACEPOINT_PROBES:
        row = rows[f"ebpf.{probe}"]
        if probe not in not_here:
            assert row["state"] == "running", (probe, row.get("reason"))
    assert rows["host"]["state"] == "running"


def test_without_capabilities_every_probe_is_unavailable_and_the_rest_runs(can_drop, home):
    rows, ident = sources(home, [], {"probes": TRACEPOINT_PROBES})
    assert_exactly(ident, [])
    for probe in TRACEPOINT_PROBES:
        row = rows[f"ebpf.{probe}"]
        assert row["state"] == "unavailable" and "CAP_BPF" in row["reason"], row
    assert rows["host"]["state"] == "running"


def test_tc_traffic_needs_net_admin_as_well(can_drop, home, veth_pair):
    ns_a, if_a, *_ = veth_pair
    keys = {"probes": ["tc_traffic"], "tc_interfaces": [if_a]}
    rows, ident = sources(home, TRACEPOINT_CAPS, keys, netns=ns_a)
    assert rows["ebpf.tc_traffic"]["state"] == "unavailable"
    rows, ident = sources(home, TRACEPOINT_CAPS + ["net_admin"], keys, netns=ns_a)
    assert_exactly(ident, TRACEPOINT_CAPS + ["net_admin"])
    assert rows["ebpf.tc_traffic"]["state"] == "running", rows["ebpf.tc_traffic"].get("reason")
    left = subprocess.run(["tc", "-n", ns_a, "filter", "show", "dev", if_a, "ingress"], capture_output=True, text=True)
    assert "xpusense" not in left.stdout, "the filter was not removed when the agent closed the source"


def test_cuda_uprobe_runs_with_sys_admin(can_drop, home):
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.skip("needs a C compiler for the fake libcuda")
    lib = home / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(ROOT / "tests/fakes/libcuda/fakecuda.c")],
                   check=True)
    os.chmod(lib, 0o755)
    caps = TRACEPOINT_CAPS + ["sys_admin"]
    rows, ident = sources(home, caps, {"probes": ["cuda_uprobe"], "cuda_library": str(lib)})
    assert_exactly(ident, caps)
    assert rows["ebpf.cuda_uprobe"]["state"] == "running", rows["ebpf.cuda_uprobe"].get("reason")


def test_the_agent_as_nobody_streams_probe_samples_to_the_collector(can_drop, home, procs):
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="the collector to answer")
    cfg = write_config(home, {"probes": ["runqlat", "netio"]})
    p, ident = as_nobody(home, TRACEPOINT_CAPS, ["run", "--config", str(cfg), "--collector", addr,
                                                 "--node-id", "least-privilege", "--once"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert_exactly(ident, TRACEPOINT_CAPS)
    [node] = [n for n in nodes_json(addr)["nodes"] if n["node_id"] == "least-privilege"]
    up = {s["labels"]["source"]: s["value"] for s in node["series"] if s["name"] == "xpusense.agent.source.up"}
    assert up.get("ebpf.runqlat") == 1.0 and up.get("ebpf.netio") == 1.0, up
    assert any(s["name"].startswith(("xpusense.sched.", "xpusense.cgroup.network", "xpusense.network."))
               for s in node["series"]), "no probe samples reached the collector"
