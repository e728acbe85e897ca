"""A diagnosis end to end, as deployed: the agent process over the fake NVML opens one when its
GPU's memory stays near full, the collector process keeps it open in `nodes` (JSON and table) with
its evidence and the process holding the memory, and both close it once the memory is freed."""

from __future__ import annotations

import subprocess
import sys
import time

from helpers import BIN, ROOT, free_port, nodes_json, wait_until

sys.path.insert(0, str(ROOT / "tests"))
from fakes.nvml import fakenvml  # noqa: E402

HIGH_UNTIL_S = 70

CONFIG = """
[tiers]
realtime_s = 1.0
[stream]
flush_s = 0.05
[hbm_watch]
enabled = false
[sources.host]
enabled = false
[sources.ebpf]
enabled = false   # tests attach probes only to namespaces they create
[diagnosis]
open_after_s = 2.0
close_after_s = 3.0
check_every_s = 1.0
keep_s = 60.0
[diagnosis.device_memory_pressure]
window_s = 4.0
"""


def memory_scenario(tmp_path, keyframes: str):
    text = fakenvml.scenario("ramp").read_text()
    lines = [f"mem_used = {keyframes}" if ln.startswith("mem_used") else ln for ln in text.splitlines()]
    p = tmp_path / "memory.scn"
    p.write_text("\n".join(lines) + "\n")
    return p


def node_of(addr: str) -> dict | None:
    return next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "diag-node"), None)


def test_memory_pressure_opens_in_the_agent_shows_at_the_collector_and_closes(libdir, procs, tmp_path):
    holder = procs([sys.executable, "-c", "import time; time.sleep(3600)"], "holder")
    (tmp_path / "procs").write_text(f"0 {holder.p.pid} 80000000000\n")
    # 40 GiB until t = 8, then 78 of the 79.1 GiB usable (98.6%) until t = 70, then 30 GiB: an agent
    # that starts slowly on a loaded machine still sees the high phase for its whole window.
    scn = memory_scenario(tmp_path, f"0:40GiB 8:40GiB 8:78GiB {HIGH_UNTIL_S}:78GiB {HIGH_UNTIL_S}:30GiB")
    t0 = time.time() - 2.0
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(CONFIG)
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr,
                   "--node-id", "diag-node"], "agent",
                  env=fakenvml.env(libdir, scn, t0=t0, procs=tmp_path / "procs"))

    try:
        opened = wait_until(lambda: (n := node_of(addr)) and n["diagnoses"] and n, timeout_s=HIGH_UNTIL_S + 30,
                            what="the memory-pressure diagnosis open at the collector")
    except AssertionError as e:   # say what the agent did
        raise AssertionError(f"{e}; agent log tail: {agent.output()[-3000:]}") from None
    [d] = opened["diagnoses"]
    assert d["rule"] == "device_memory_pressure" and d["device"] == "gpu0", d
    assert d["concerns"].get("process.pid") == str(holder.p.pid), d
    assert f"pid {holder.p.pid}" in d["cause"] and "pooling allocator" in d["remedy"]
    [ev] = [e for e in d["evidence"] if e["series"] == "hw.gpu.memory.utilization"]
    assert ev["window_s"] == 4.0 and ev["values"] and min(ev["values"]) >= 0.95, ev
    # The memory was high from t = 8: nothing can have opened before t = 8 + window + open_after.
    opened_at = next(e["time"] for e in opened["events"]
                     if e["type"] == "diagnosis" and e["attributes"]["diagnosis.state"] == "open")
    assert opened_at is not None
    table = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", addr, "--timeout-s", "5"],
                           capture_output=True, text=True, timeout=30).stdout
    assert "device_memory_pressure" in table and "gpu0" in table, table

    closed = wait_until(lambda: (n := node_of(addr)) and not n["diagnoses"] and n, timeout_s=HIGH_UNTIL_S + 60,
                        what=f"the diagnosis closed once the memory was freed (t = {HIGH_UNTIL_S})")
    states = [(e["attributes"]["diagnosis.state"], e["attributes"]["diagnosis.id"])
              for e in reversed(closed["events"]) if e["type"] == "diagnosis"]
    assert states == [("open", d["id"]), ("closed", d["id"])], states
    out = agent.output()
    assert "diagnosis opened: device_memory_pressure gpu0" in out and "diagnosis closed" in out
    assert "Traceback" not in out
