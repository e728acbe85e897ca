"""The agent's NFD feature file from real agent runs: on the fake NVML (8 H100s), on the fake npu-smi
(8 Ascend 910B4), and on a GPU lost mid-run, where the file is written again once and otherwise kept
(same inode) across the agent's checks."""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime

from helpers import BIN, ROOT, wait_until
from nfd_format import feature_file_problems, feature_labels

sys.path.insert(0, str(ROOT / "tests"))
from fakes.nvml import fakenvml  # noqa: E402

NPU_FAKE = ROOT / "tests/fakes/npu-smi/npu-smi"
NPU_SCENARIO = ROOT / "tests/fixtures/npu-smi/scenario-8x910B4"
LEAD_S = 3.0   # scenario second 0 this long after the agent's first nvmlInit (a slow start on a busy machine)

CONFIG = """
[spool]
enabled = false
[tiers]
realtime_s = 1.0
[sources.host]
enabled = false
[sources.ebpf]
enabled = false
[k8s]
nfd_feature_file = "{path}"
nfd_check_s = 1
"""


def run_agent(procs, tmp_path, env, extra=()):
    feature_dir = tmp_path / "features.d"
    feature_dir.mkdir()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(CONFIG.format(path=feature_dir / "xpusense"))
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", "127.0.0.1:1",
                   "--node-id", "nfd-node", "--log-level", "debug", *extra], "agent", env=env)
    return agent, feature_dir / "xpusense"


def labels_when(path, cond, what):
    def ready():
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        return text if cond(feature_labels(text)) else None
    return wait_until(ready, 120, what=what)


def checked_line_by_line(text: str) -> dict[str, str]:
    assert feature_file_problems(text, datetime.now(UTC)) == [], text
    return feature_labels(text)


def test_eight_gpus_on_the_fake_nvml(libdir, procs, tmp_path):
    env = fakenvml.env(libdir, fakenvml.scenario("h100x8"))
    _, path = run_agent(procs, tmp_path, env, ("--npu-smi", "/nonexistent"))
    text = labels_when(path, lambda x: x.get("xpusense.io/gpu.health") == "ok", "the GPUs' labels")
    labels = checked_line_by_line(text)
    assert {k: labels[k] for k in ("nvidia.com/gpu.count", "nvidia.com/gpu.product", "nvidia.com/gpu.memory",
                                   "nvidia.com/gpu.family", "nvidia.com/cuda.driver.major",
                                   "xpusense.io/gpu.interconnect", "xpusense.io/gpu.interconnect-bandwidth",
                                   "xpusense.io/gpu.healthy-count")} == {
        "nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.family": "hopper", "nvidia.com/cuda.driver.major": "550",
        "xpusense.io/gpu.interconnect": "NVLink", "xpusense.io/gpu.interconnect-bandwidth": "900GBps",
        "xpusense.io/gpu.healthy-count": "8"}
    assert not any(k.startswith("xpusense.io/npu.") for k in labels)
    assert os.listdir(path.parent) == ["xpusense"]    # the dot file it wrote first was renamed


def test_eight_npus_on_the_fake_npu_smi(procs, tmp_path):
    env = {"FAKE_NPU_SMI_DIR": str(NPU_SCENARIO), "LD_LIBRARY_PATH": "/nonexistent"}
    _, path = run_agent(procs, tmp_path, env, ("--npu-smi", str(NPU_FAKE)))
    text = labels_when(path, lambda x: x.get("xpusense.io/npu.health") == "ok", "the NPUs' labels")
    labels = checked_line_by_line(text)
    assert {k: v for k, v in labels.items() if k != "xpusense.io/npu.driver-version"} == {
        "xpusense.io/npu.vendor": "huawei", "xpusense.io/npu.model": "Ascend-910B4", "xpusense.io/npu.count": "8",
        "xpusense.io/npu.memory": "32GB", "xpusense.io/npu.interconnect": "HCCS",
        "xpusense.io/npu.health": "ok", "xpusense.io/npu.healthy-count": "8"}
    assert labels["xpusense.io/npu.driver-version"]


def nfd_log(output: str) -> list[str]:
    """The agent's feature-file writes and checks, and the GPU loss, in the order logged."""
    return ["lost" if " is lost" in ln else "written" if "labels written" in ln else "unchanged"
            for ln in output.splitlines() if " is lost" in ln or ("xpusense.agent.nfd" in ln and "labels" in ln)]


def test_rewritten_when_a_gpu_is_lost_and_kept_otherwise(libdir, procs, tmp_path):
    """lost.scn: GPU 1 raises XID 79 at t = 4.5 s and is lost at t = 5 s (an event, at once)."""
    env = fakenvml.env(libdir, fakenvml.scenario("lost"), t0=fakenvml.after_init(LEAD_S), t0_file=tmp_path / "t0")
    agent, path = run_agent(procs, tmp_path, env, ("--npu-smi", "/nonexistent"))
    labels_when(path, lambda x: x.get("xpusense.io/gpu.health") == "ok", "both GPUs healthy")
    before = os.stat(path)
    text = labels_when(path, lambda x: x.get("xpusense.io/gpu.health") == "degraded", "the lost GPU in the labels")
    labels = checked_line_by_line(text)
    assert labels["xpusense.io/gpu.healthy-count"] == "1" and labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    after = os.stat(path)
    assert after.st_ino != before.st_ino
    wait_until(lambda: nfd_log(agent.output())[-3:] == ["unchanged"] * 3, 120, what="three checks after the loss")
    assert os.stat(path).st_ino == after.st_ino and os.stat(path).st_mtime_ns == after.st_mtime_ns
    # Checked every second (nfd_check_s = 1), written only while the first health readings came in
    # and once for the loss: never between, although the XID event at t = 4.5 s made it check too.
    log = nfd_log(agent.output())
    lost = log.index("lost")
    settled = log.index("unchanged")
    assert log[:settled] and set(log[:settled]) == {"written"} and log[settled:lost].count("unchanged") >= 3
    assert "written" not in log[settled:lost] and log[lost + 1:].count("written") == 1
