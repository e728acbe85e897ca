"""The units under a live systemd, the wheel as users install it: a Debian bookworm tree
(tests/privileged/nspawn.py) boots under systemd-nspawn, the wheel built from this checkout is
installed with `scripts/install-host.sh` (README "Install on a host"), and the tests below run in
order through systemctl and journalctl inside the container. It has no GPU/NPU and no bcc: nvml,
npu-smi and the eBPF probes report themselves unavailable, the host and agent sources run. Figures
(cold/warm set-up, restart time, batches made/stored) go to the run's summary. Skips with the
reason without root, systemd-nspawn, debootstrap or the `build` module."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nspawn
import pytest
from helpers import ROOT, free_port, record_figure, wait_until

pytestmark = pytest.mark.privileged

AGENT, COLLECTOR = "xpusense-agent.service", "xpusense-collector.service"
VENV = "/opt/xpusense/venv/bin"
SRC = "/root/xpusense"            # the checkout's files the install script needs, inside
WHEELS = "/root/wheels"
SPOOL = "/var/lib/xpusense/spool"
# The agent's production defaults but for the nearline tier: the host source every second instead
# of every 15 s, so batches come often enough to count in a few minutes.
AGENT_SET = ["tiers.nearline_s=1.0"]
SPOOLED_AT_HANG = 5                # batches waiting in the spool when the agent hangs, resent by the next one
WATCHDOG_MARGIN_S = 60.0           # on top of WatchdogSec: kill, RestartSec=2s, start-up, a busy 2-core host
CAPS = ["CAP_BPF", "CAP_PERFMON", "CAP_NET_ADMIN"]   # not in nspawn's default set; the units ask for them
STOP_LINE = re.compile(r"stopped: boot (\w+) made (\d+) batches, (\d+) acknowledged in this run, (\d+) not acknowledged")
START_LINE = re.compile(r"agent \S+ \(boot (\w+)\) streaming to")
CAP_BITS = {"CAP_DAC_READ_SEARCH": 2, "CAP_KILL": 5, "CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21,
            "CAP_SYS_RESOURCE": 24, "CAP_PERFMON": 38, "CAP_BPF": 39}


def source_files() -> list[str]:
    """The checkout as a fresh clone would have it once committed: tracked and untracked files that
    git does not ignore (and that exist)."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def build_wheel(work: Path, version_suffix: str = "") -> Path:
    """`python -m build` on a copy of the checkout (the checkout itself is left alone); with a
    suffix, the copy's version is raised first (the upgrade's newer wheel)."""
    src = work / f"src{version_suffix}"
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    if version_suffix:
        for f, pattern in (("pyproject.toml", r'(?m)^(version = ")([^"]+)(")'),
                           ("proto/xpusense/__init__.py", r'(?m)^(__version__ = ")([^"]+)(")')):
            text = (src / f).read_text()
            (src / f).write_text(re.sub(pattern, lambda m: m[1] + m[2] + version_suffix + m[3], text, count=1))
    out = subprocess.run([sys.executable, "-m", "build", "--outdir", str(work / f"dist{version_suffix}"), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"python -m build failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    (wheel,) = (work / f"dist{version_suffix}").glob("*.whl")
    return wheel


class Deployment:
    """The booted container with xpusense installed, and what the tests learn on the way."""

    def __init__(self, box: nspawn.Container, address: str, wheels: list[Path]):
        self.box = box
        self.address = address
        self.wheels = wheels
        self.node = box.name
        self.made: dict[str, int] = {}      # agent boot -> batches it made (its stop line, or its spool)
        self.killed: list[str] = []         # boots that ended without a stop line (the watchdog's)

    def install(self, wheel: Path, *extra: str) -> str:
        """README "Install on a host", as its script says, inside the container."""
        out = self.box.run([f"{SRC}/scripts/install-host.sh", "--wheel", f"{WHEELS}/{wheel.name}", "--collector",
                            "--listen", self.address, "--collector-address", self.address,
                            *[a for kv in AGENT_SET for a in ("--agent-set", kv)], *extra],
                           env={"PIP_CERT": "/etc/ssl/certs/ca-certificates.crt"}, timeout=900)
        return out.stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.box.run(["systemctl", "show", unit, *[f"--property={p}" for p in props]]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self, unit: str = AGENT) -> int:
        return int(self.show(unit, "MainPID")["MainPID"])

    def nodes(self) -> dict | None:
        out = self.box.run([f"{VENV}/xpusense-collector", "nodes", "--collector", self.address, "--format", "json"],
                           check=False, timeout=60)
        if out.returncode != 0:
            return None
        return next((n for n in json.loads(out.stdout)["nodes"] if n["node_id"] == self.node), None)

    def stored(self) -> int:
        n = self.nodes()
        return n["batches_stored"] if n else -1

    def journal(self, *args: str) -> list[dict]:
        out = self.box.run(["journalctl", "--no-pager", "-o", "json", *args]).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def messages(self, unit: str = AGENT) -> list[str]:
        return [e.get("MESSAGE", "") for e in self.journal("-u", unit) if isinstance(e.get("MESSAGE"), str)]

    def boots(self) -> list[str]:
        return [m[1] for line in self.messages() if (m := START_LINE.search(line))]

    def current_boot(self) -> str:
        """The boot id of the running agent: its own start line (READY=1 comes just before it)."""
        pid = str(self.main_pid())

        def logged():
            lines = [e["MESSAGE"] for e in self.journal("-u", AGENT, f"_PID={pid}") if isinstance(e.get("MESSAGE"), str)]
            return next((m[1] for line in lines if (m := START_LINE.search(line))), "")
        return wait_until(logged, 60, 0.2, f"the start line of agent pid {pid}")

    def stop_lines(self) -> dict[str, tuple[int, int, int]]:
        return {m[1]: (int(m[2]), int(m[3]), int(m[4])) for line in self.messages() if (m := STOP_LINE.search(line))}

    def spool_keys(self, copy_to: str) -> list[tuple[str, int]]:
        """The agent's unacknowledged batches, read from a copy of its spool."""
        self.box.run(["rm", "-rf", copy_to])
        self.box.run(["cp", "-a", SPOOL, copy_to])
        out = self.box.run([f"{VENV}/python", f"{SRC}/tests/fixtures/systemd/spool_keys.py", copy_to, self.node]).stdout
        return [(b, s) for b, s in json.loads(out)]

    def wait_active(self, unit: str, not_pid: int = 0, timeout_s: float = 120.0) -> int:
        def ready():
            p = self.show(unit, "ActiveState", "SubState", "MainPID")
            pid = int(p["MainPID"])
            return pid if p["ActiveState"] == "active" and p["SubState"] == "running" and pid not in (0, not_pid) else 0
        return wait_until(ready, timeout_s, 0.2, f"{unit} active (main pid other than {not_pid})")

    def wait_delivering(self, at_least: int, timeout_s: float = 120.0) -> int:
        return wait_until(lambda: (s := self.stored()) >= at_least and s, timeout_s, 0.5,
                          f"the collector to have stored {at_least} batches of {self.node}")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    why = nspawn.missing_tools()
    if why:
        pytest.skip(why)
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.skip("needs the `build` module for `python -m build` (the dev extra; scripts/setup.sh installs it)")
    work = tmp_path_factory.mktemp("systemd-units")
    t0 = time.monotonic()
    tree, built_s = nspawn.cached_tree()
    wheel = build_wheel(work)
    newer = build_wheel(work, ".post1")
    wheels_s = time.monotonic() - t0 - built_s
    box = nspawn.Container(tree, nspawn.new_name(), CAPS, work / "nspawn.log")
    try:
        for f in ("scripts/install-host.sh", "README.md", "docs/deploy.md", "systemd", "tests/fixtures/systemd"):
            if (ROOT / f).exists():
                box.put(ROOT / f, f"{SRC}/{f}")
        for w in (wheel, newer):
            box.put(w, f"{WHEELS}/{w.name}")
        boot_s = box.boot()
        d = Deployment(box, f"127.0.0.1:{free_port()}", [wheel, newer])
        t1 = time.monotonic()
        d.install_log = d.install(wheel)
        install_s = time.monotonic() - t1
        record_figure("systemd_units: set-up", tree="cold" if built_s else "warm", debootstrap_s=round(built_s, 1),
                      two_wheels_s=round(wheels_s, 1), boot_s=round(boot_s, 1), install_s=round(install_s, 1))
        yield d
    finally:
        box.close()
    record_figure("systemd_units: whole module", seconds=round(time.monotonic() - t0, 1))


def test_units_active_and_batches_stored(deployed):
    """Both units active; the agent (Type=notify) ready, the collector storing its batches; the
    agent's file system read-only but its spool (ProtectSystem=strict + StateDirectory=)."""
    d = deployed
    assert "xpusense 0.1.0" in d.install_log or "installed" in d.install_log
    d.wait_active(COLLECTOR)
    pid = d.wait_active(AGENT)
    agent = d.show(AGENT, "Type", "WatchdogUSec", "StatusText", "NRestarts")
    assert agent["Type"] == "notify" and agent["NRestarts"] == "0", agent
    assert agent["StatusText"], "the agent sent no STATUS= over sd_notify"
    first = d.wait_delivering(1)
    d.wait_delivering(first + 3)            # and it goes on: batches keep being stored
    # ProtectSystem=strict: the agent sees / read-only, its spool (StateDirectory=) writable.
    mounts = d.box.run(["cat", f"/proc/{pid}/mountinfo"]).stdout.splitlines()
    opts = {f[4]: f[5].split(",") for f in (m.split() for m in mounts)}
    assert "ro" in opts["/"], opts["/"]
    assert "rw" in opts[SPOOL], opts.get(SPOOL)
    assert "ro" in opts.get("/usr", opts["/"])
    segments = d.box.run(["find", SPOOL, "-type", "f"]).stdout
    assert segments.strip(), "the agent wrote nothing to its spool"


def test_journal_fields_operators_filter_on(deployed):
    d = deployed
    warnings = d.journal("_SYSTEMD_UNIT=" + AGENT, "-p", "warning")
    unavailable = {e.get("XPUSENSE_SOURCE") for e in warnings if "unavailable" in e.get("MESSAGE", "")}
    assert {"nvml", "npu-smi"} <= unavailable, unavailable          # no GPU, no NPU in the container
    assert all(int(e["PRIORITY"]) <= 4 for e in warnings)
    nvml = d.journal("-u", AGENT, "XPUSENSE_SOURCE=nvml")
    assert nvml and all(e["_SYSTEMD_UNIT"] == AGENT and e["SYSLOG_IDENTIFIER"] == "xpusense-agent" for e in nvml)
    info = [e for e in d.journal("-u", AGENT, "-p", "info") if START_LINE.search(e.get("MESSAGE", ""))]
    assert info and info[0]["PRIORITY"] == "6" and info[0]["XPUSENSE_LOGGER"] == "xpusense.agent"
    assert not [e for e in warnings if START_LINE.search(e.get("MESSAGE", ""))], "info lines passed -p warning"
    collector = d.journal("-u", COLLECTOR)
    assert any("listening on " + d.address in e.get("MESSAGE", "") for e in collector)
    record_figure("systemd_units: journal", agent_warnings=len(warnings), sources_unavailable=",".join(sorted(unavailable)))


def test_watchdog_restarts_a_hung_agent_and_its_spool_is_replayed(deployed):
    """With the collector stopped (so batches wait in the spool), the agent is frozen with SIGSTOP;
    systemd restarts it within WatchdogSec + a margin, and the new agent resends the frozen one's
    spooled batches."""
    d = deployed
    watchdog_s = watchdog_sec(d)
    old_pid = d.main_pid()
    hung = d.current_boot()
    d.box.run(["systemctl", "stop", COLLECTOR])     # batches now wait in the agent's spool
    wait_until(lambda: sum(b == hung for b, _ in d.spool_keys("/root/spool-waiting")) >= SPOOLED_AT_HANG, 90, 0.5,
               f"the agent to spool {SPOOLED_AT_HANG} batches the stopped collector cannot take")
    d.box.run(["systemctl", "kill", "--kill-who=main", "--signal=SIGSTOP", AGENT])
    t0 = time.monotonic()
    state = d.box.run(["cat", f"/proc/{old_pid}/status"]).stdout
    assert re.search(r"(?m)^State:\s+T", state), "the agent is not stopped by SIGSTOP"
    frozen = [s for b, s in d.spool_keys("/root/spool-frozen") if b == hung]
    assert frozen == list(range(frozen[0], frozen[-1] + 1)), f"gaps in the hung agent's spool: {frozen}"
    d.made[hung] = frozen[-1]                       # every batch is spooled before it is sent
    d.killed.append(hung)
    d.box.run(["systemctl", "start", COLLECTOR])
    new_pid = d.wait_active(AGENT, not_pid=old_pid, timeout_s=watchdog_s + WATCHDOG_MARGIN_S + 30)
    restart_s = time.monotonic() - t0
    assert restart_s <= watchdog_s + WATCHDOG_MARGIN_S, f"restarted after {restart_s:.1f} s (WatchdogSec={watchdog_s})"
    systemd_says = [m for m in d.messages() if "Watchdog timeout" in m]
    assert systemd_says, "systemd logged no watchdog timeout for the agent"
    assert d.show(AGENT, "NRestarts")["NRestarts"] == "1"
    # The new agent found the frozen one's unacknowledged batches and resends them.
    replay = [m for m in d.messages() if "batches from earlier runs to send" in m]
    assert replay and f": {len(frozen)} batches from earlier runs" in replay[-1], (replay, len(frozen))
    wait_until(lambda: not [k for k in d.spool_keys("/root/spool-after") if k[0] == hung], 120, 0.5,
               "the frozen agent's batches to be acknowledged by the collector")
    record_figure("systemd_units: watchdog", watchdog_sec=watchdog_s, restart_after_sigstop_s=round(restart_s, 1),
                  hung_boot_made=frozen[-1], spooled_at_hang=len(frozen), new_pid=new_pid)


def watchdog_sec(d: Deployment) -> int:
    usec = d.box.run(["systemctl", "show", AGENT, "--property=WatchdogUSec", "--value"]).stdout.strip()
    m = re.fullmatch(r"(?:(\d+)min ?)?(?:(\d+)s)?", usec)
    assert m and usec, f"WatchdogUSec={usec!r}"
    return int(m[1] or 0) * 60 + int(m[2] or 0)


def test_stop_drains_every_batch_made(deployed):
    """`systemctl stop`: the agent's stop line counts the batches its boot made, none left
    unacknowledged, and the collector stored them all."""
    d = deployed
    boot = d.current_boot()
    d.wait_delivering(d.stored() + 3)
    t0 = time.monotonic()
    d.box.run(["systemctl", "stop", AGENT], timeout=120)
    stop_s = time.monotonic() - t0
    assert d.show(AGENT, "ActiveState", "Result") == {"ActiveState": "inactive", "Result": "success"}
    made, acked, unacked = d.stop_lines()[boot]
    assert unacked == 0, f"{unacked} batches left unacknowledged at a clean stop"
    n = d.nodes()
    assert n["stored_up_to"] == made, f"boot {boot} made {made} batches, the collector stored up to {n['stored_up_to']}"
    assert d.spool_keys("/root/spool-stopped") == []
    d.made[boot] = made
    record_figure("systemd_units: stop", boot_made=made, acknowledged_in_run=acked, left_unacknowledged=unacked,
                  stop_s=round(stop_s, 1))
    d.box.run(["systemctl", "start", AGENT], timeout=120)
    d.wait_active(AGENT)


def test_upgrade_keeps_spool_and_store(deployed):
    """A newer wheel through the same script (which restarts the units)."""
    d = deployed
    old, newer = d.wheels
    boot = d.current_boot()
    d.wait_delivering(d.stored() + 3)
    spool_inode = d.box.run(["stat", "-c", "%i", SPOOL]).stdout.strip()
    store_files = d.box.run(["find", "/var/lib/private/xpusense/collector", "-type", "f"]).stdout.split()
    stored_before = d.stored()
    out = d.install(newer)
    assert "restarting xpusense-agent.service" in out and "restarting xpusense-collector.service" in out, out
    version = d.box.run([f"{VENV}/python", "-c", "import importlib.metadata as m; print(m.version('xpusense'))"]).stdout
    assert version.strip().endswith(".post1"), version
    d.wait_active(COLLECTOR)
    d.wait_active(AGENT)
    assert d.box.run(["stat", "-c", "%i", SPOOL]).stdout.strip() == spool_inode, "the spool directory was replaced"
    kept = set(d.box.run(["find", "/var/lib/private/xpusense/collector", "-type", "f"]).stdout.split())
    # The log's segments are all kept; snapshots of the fleet state are replaced by newer ones (the
    # stop writes one, and [store] snapshot_keep bounds how many stay).
    segments = {f for f in store_files if "/snapshots/" not in f}
    assert segments <= kept, f"store files gone: {segments - kept}"
    assert any("/snapshots/" in f for f in kept), f"no snapshot of the fleet state after the restart: {sorted(kept)}"
    made, _, unacked = d.stop_lines()[boot]
    d.made[boot] = made
    # The collector read its store back: the node's count carried on from before the restart.
    after = d.wait_delivering(stored_before + 1)
    assert d.current_boot() != boot
    record_figure("systemd_units: upgrade", from_version=old.name.split("-")[1], to_version=version.strip(),
                  boot_made=made, unacknowledged_at_restart=unacked, stored_before=stored_before, stored_after=after)


def documented_caps() -> list[str]:
    """The capability list of docs/security.md's least-privilege drop-in (its ini block)."""
    text = (ROOT / "docs/security.md").read_text()
    lines = re.findall(r"(?m)^AmbientCapabilities=(CAP_.+)$", text)
    assert lines, "docs/security.md has no AmbientCapabilities= list"
    return lines[0].split()


def dropin_properties() -> list[str]:
    """systemd/xpusense-agent-least-privilege.conf's [Service] settings, as systemd-run -p args."""
    props = []
    for line in (ROOT / "systemd/xpusense-agent-least-privilege.conf").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            props.append(f"--property={line}")
    return props


def test_least_privilege_dropin(deployed):
    """The agent as user xpusense with exactly docs/security.md's capabilities, still delivering;
    `xpusense-agent sources` run with the drop-in's identity says which sources that allows here."""
    d = deployed
    boot = d.current_boot()
    caps = documented_caps()
    dropin = (ROOT / "systemd/xpusense-agent-least-privilege.conf").read_text()
    assert f"AmbientCapabilities={' '.join(caps)}" in dropin and f"CapabilityBoundingSet={' '.join(caps)}" in dropin
    d.install(d.wheels[1], "--least-privilege")
    pid = d.wait_active(AGENT)
    status = dict(line.split(":", 1) for line in d.box.run(["cat", f"/proc/{pid}/status"]).stdout.splitlines() if ":" in line)
    uid = d.box.run(["id", "-u", "xpusense"]).stdout.strip()
    assert status["Uid"].split() == [uid] * 4 and uid != "0", status["Uid"]
    want = sum(1 << CAP_BITS[c] for c in caps)
    for field in ("CapEff", "CapPrm", "CapAmb", "CapBnd"):
        assert int(status[field], 16) == want, f"{field}={status[field].strip()}, docs/security.md says {caps}"
    assert d.box.run(["stat", "-c", "%U", SPOOL]).stdout.strip() == "xpusense"
    made, _, _ = d.stop_lines()[boot]
    d.made[boot] = made
    d.wait_delivering(d.stored() + 3)           # still delivering as user xpusense
    # What the drop-in allows here: the same identity and capabilities, through systemd.
    out = d.box.run(["systemd-run", "--wait", "--pipe", "--quiet", "--collect", *dropin_properties(),
                     f"{VENV}/xpusense-agent", "sources", "--format", "json", "--config", "/etc/xpusense/agent.toml"],
                    input="", timeout=180)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["host"]["state"] == "running"
    ebpf = {n: r for n, r in rows.items() if n.startswith("ebpf")}
    assert ebpf and all(r["state"] == "unavailable" and "bcc" in r["reason"] for r in ebpf.values()), ebpf
    record_figure("systemd_units: least privilege", user="xpusense", caps=",".join(caps),
                  running=",".join(n for n, r in rows.items() if r["state"] == "running"),
                  unavailable=",".join(n for n, r in rows.items() if r["state"] != "running"))


def test_every_batch_made_is_stored_once(deployed):
    """Across all of the above, every batch any agent boot made is stored once: made == stored."""
    d = deployed
    boot = d.current_boot()
    d.wait_delivering(d.stored() + 2)
    d.box.run(["systemctl", "stop", AGENT], timeout=120)
    made, _, unacked = d.stop_lines()[boot]
    assert unacked == 0
    d.made[boot] = made
    boots = d.boots()
    assert set(boots) == set(d.made), f"boots {boots}, counted {sorted(d.made)}"
    n = d.nodes()
    assert n["batches_stored"] == sum(d.made.values()), (n["batches_stored"], d.made)
    record_figure("systemd_units: all boots", boots=len(boots), batches_made=sum(d.made.values()),
                  batches_stored=n["batches_stored"], duplicates_dropped=n["batches_duplicate"])
