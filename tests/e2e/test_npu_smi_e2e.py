"""Agent + collector + the fake npu-smi playing an 8x Ascend 910B4 host."""

from __future__ import annotations

import shutil
import signal

import psutil
from helpers import BIN, ROOT, free_port, nodes_json, series, wait_until

FAKE = ROOT / "tests/fakes/npu-smi/npu-smi"
SCENARIO = ROOT / "tests/fixtures/npu-smi/scenario-8x910B4"

# Long tier periods give a round a budget (timeout_ratio x period) that a busy machine does not
# overrun (a discarded round leaves its series out until the next); the first rounds run at the start.
CONFIG = """
[tiers]
realtime_s = 2.0
nearline_s = 5.0
offline_s = 10.0
timeout_ratio = 1.0
[stream]
flush_s = 0.1
[sources.npu_smi]
timeout_s = 2.0
[sources.nvml]
enabled = false
[sources.ebpf]
enabled = false   # tests attach probes only to namespaces they create
"""


def start(procs, tmp_path, node_id: str, config: str = CONFIG, env: dict | None = None):
    """A collector, and an agent whose npu-smi is the fake over a copy of the 8x 910B4 scenario."""
    scenario = tmp_path / "scenario"
    shutil.copytree(SCENARIO, scenario)
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(config)
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr, "--node-id", node_id,
                   "--npu-smi", str(FAKE)], "agent", env={"FAKE_NPU_SMI_DIR": str(scenario), **(env or {})})
    return addr, scenario, agent


def test_nodes_shows_8_npus_with_utilisation_hbm_and_inventory(procs, tmp_path):
    addr, _, _ = start(procs, tmp_path, "npu-node")

    def node():
        n = next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "npu-node"), None)
        return n if n and len(series(n, "xpusense.accelerator.hbm.bandwidth.utilization")) == 8 \
            and series(n, "hw.power") else None

    n = wait_until(node, timeout_s=90, what="8 NPUs at the collector")
    devices = {f"npu{i}-0" for i in range(8)}
    util = {s["labels"]["device"]: s["value"] for s in series(n, "hw.gpu.utilization", vendor="huawei")}
    assert set(util) == devices and util["npu0-0"] == 0.10   # Aicore Usage Rate(%) 10 in usages-0.txt
    bw = {s["labels"]["device"]: s["value"] for s in series(n, "xpusense.accelerator.hbm.bandwidth.utilization")}
    assert bw["npu0-0"] == 0.03
    limit = {s["labels"]["device"]: s["value"] for s in series(n, "hw.gpu.memory.limit")}
    assert limit["npu0-0"] == 32768 * 2**20 and series(n, "hw.gpu.memory.limit")[0]["unit"] == "By"
    npus = [r for r in n["inventory"]["resources"] if r["type"] == "NPU"]
    assert {r["id"] for r in npus} == devices
    assert {r["vendor"] for r in npus} == {"huawei"} and {r["model"] for r in npus} == {"Ascend-910B4"}
    assert npus[0]["attributes"]["memory"] == "32GB"


def test_a_hanging_npu_smi_does_not_hold_back_the_other_sources(procs, tmp_path):
    """npu-smi hangs in setup (600 s, with a setup budget as long): the host source streams all the
    same (not only after setup_timeout_s), and the agent still stops cleanly on SIGTERM."""
    config = CONFIG.replace("timeout_s = 2.0\n", "timeout_s = 2.0\nsetup_timeout_s = 600\n") + "[spool]\nenabled = false\n"
    addr, scenario, agent = start(procs, tmp_path, "hung-npu", config,
                                  {"FAKE_NPU_SMI_DELAY_S": "600", "FAKE_NPU_SMI_DELAY_ON": "info"})

    def host_series():
        n = next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "hung-npu"), None)
        return n if n and series(n, "system.cpu.utilization") else None

    n = wait_until(host_series, timeout_s=90, what="host series while npu-smi hangs in setup")
    assert not series(n, "hw.gpu.utilization")       # npu-smi has not answered: no NPU yet
    assert "still setting up: npu-smi" in agent.output()
    assert agent.kill(signal.SIGTERM) == 0, agent.output()[-4000:]
    # and the hung npu-smi call went with it (the fake keeps its scenario in its environment)
    def hung_calls():
        return [p for p in psutil.process_iter(["cmdline", "environ"])
                if str(FAKE) in " ".join(p.info["cmdline"] or [])
                and (p.info["environ"] or {}).get("FAKE_NPU_SMI_DIR") == str(scenario)]
    wait_until(lambda: not hung_calls(), what="the hung npu-smi call to be killed")
