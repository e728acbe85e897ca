"""Fixtures: real processes killed at the end of a test; network namespaces for root-only tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid

import pytest
from helpers import FIGURES, Proc

# Ctrl-C reaches the processes the tests start (tests send `top`, agents and collectors SIGINT and
# wait for them to quit): a suite started as a background job of a non-interactive shell (`cmd &`,
# nohup) inherits SIGINT ignored, which exec passes on to every child, and Python leaves it ignored.
# A handler of our own here is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def agent_config_without_ebpf(tmp_path_factory):
    """Agents started without --config get one with the eBPF probes off: only the eBPF tests load
    probes, and they attach tc only inside network namespaces they create."""
    cfg = tmp_path_factory.mktemp("agentcfg") / "agent.toml"
    cfg.write_text("[sources.ebpf]\nenabled = false\n")
    old = os.environ.get("XPUSENSE_AGENT_CONFIG")
    os.environ["XPUSENSE_AGENT_CONFIG"] = str(cfg)
    yield cfg
    if old is None:
        os.environ.pop("XPUSENSE_AGENT_CONFIG", None)
    else:
        os.environ["XPUSENSE_AGENT_CONFIG"] = old


@pytest.fixture(scope="session")
def libdir(tmp_path_factory):
    """The fake libnvidia-ml.so.1 (tests/fakes/nvml), built once per run."""
    from fakes.nvml import fakenvml
    try:
        return fakenvml.build(tmp_path_factory.mktemp("fakenvml"))
    except fakenvml.BuildError as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def own_spool_dir(tmp_path, monkeypatch):
    """Each test's agents spool into a directory of the test's own (env XPUSENSE_SPOOL_DIR)."""
    monkeypatch.setenv("XPUSENSE_SPOOL_DIR", str(tmp_path / "spool"))
    return tmp_path / "spool"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report kept on the test item (`rep_call`...), for fixtures that report on failure."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


LOG_TAIL_LINES = 40


@pytest.fixture
def procs(tmp_path, request):
    """Start real processes; every one is killed at the end of the test. When the test failed, the
    end of each process's log is printed (pytest shows it under the failure)."""
    started: list[Proc] = []

    def start(args: list[str], name: str, env: dict | None = None) -> Proc:
        p = Proc(args, tmp_path / f"{name}-{len(started)}.log", env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill(signal.SIGTERM)
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for p in started:
            lines = p.output().splitlines()[-LOG_TAIL_LINES:]
            print(f"--- last {len(lines)} lines of {p.log_path.name} (exit {p.p.returncode})")
            print("\n".join(line[:400] for line in lines))


def require_root():
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces); CI runs these as root")
    if not shutil.which("ip"):
        pytest.skip("needs iproute2's `ip` (scripts/setup.sh installs it)")


def sh(*args):
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture
def veth_pair():
    """Two namespaces joined by a veth pair: (ns_a, if_a, addr_a, ns_b, if_b, addr_b)."""
    require_root()
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"xps-a-{tag}", f"xps-b-{tag}"
    if_a, if_b = f"xva{tag}", f"xvb{tag}"
    sh("ip", "netns", "add", ns_a)
    sh("ip", "netns", "add", ns_b)
    try:
        sh("ip", "link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
        for ns, ifname, addr in ((ns_a, if_a, "10.231.0.1/30"), (ns_b, if_b, "10.231.0.2/30")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", ifname)
            sh("ip", "-n", ns, "link", "set", ifname, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns_a, if_a, "10.231.0.1", ns_b, if_b, "10.231.0.2"
    finally:
        subprocess.run(["ip", "netns", "del", ns_a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns_b], capture_output=True)


def pytest_terminal_summary(terminalreporter):
    """The fault and attack tests' figures: batches produced, stored, duplicated, dropped; RSS."""
    if FIGURES:
        terminalreporter.section("fault and attack figures (helpers.record_figure)")
        for f in FIGURES:
            terminalreporter.write_line(", ".join(f"{k}={v}" for k, v in f.items()))
