"""The HBM bandwidth watch end to end: fake accelerator ramps, a real training process using the
helper, the agent and the collector as real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import grpc
import pytest
from helpers import BIN, ROOT, free_port, nodes_json, series, wait_until

from xpusense.v1 import telemetry_pb2 as pb
from xpusense.v1 import telemetry_pb2_grpc as pb_grpc

sys.path.insert(0, str(ROOT / "tests"))
from fakes.nvml import fakenvml  # noqa: E402

TRAIN = ROOT / "examples/train_with_checkpoint.py"
NPU_FAKE = ROOT / "tests/fakes/npu-smi/npu-smi"
NPU_SCENARIO = ROOT / "tests/fixtures/npu-smi/scenario-8x910B4"
WINDOW_S = 5.0
# Scenario second 0 lies this far after the agent's first nvmlInit (the fake's FAKE_NVML_T0=init+S),
# or after the agent is seen streaming (the npu-smi ramp), so a ramp at t = 5 is not over before an
# agent that starts slowly reads it: on a loaded 2-core machine, starting the trainer, the
# collector and the agent took 35 s once, past a timeline fixed before them.
LEAD_S = 3.0

CONFIG = """
[tiers]
realtime_s = 1.0
nearline_s = 15.0
offline_s = 300.0
[stream]
flush_s = 0.05
[hbm_watch]
request_dir = "{req}"
[sources.host]
enabled = false
[sources.ebpf]
enabled = false   # tests attach probes only to namespaces they create
"""


def ramp_scenario(tmp_path, keyframes: str):
    text = fakenvml.scenario("ramp").read_text()
    lines = [f"gpm_dram_bw_util = {keyframes}" if ln.startswith("gpm_dram_bw_util") else ln
             for ln in text.splitlines()]
    p = tmp_path / "ramp.scn"
    p.write_text("\n".join(lines) + "\n")
    return p


def start_trainer(procs, tmp_path):
    ckpt, req = tmp_path / "ckpt", tmp_path / "req"
    req.mkdir()
    trainer = procs([sys.executable, str(TRAIN), "--checkpoint-dir", str(ckpt), "--request-dir", str(req)], "trainer")
    wait_until(lambda: "training (pid" in trainer.output(), what="the trainer to install its handler")
    return trainer, ckpt, req


def start_collector(procs):
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector")
    return addr


def history(addr, node, name, labels):
    with grpc.insecure_channel(addr) as ch:
        r = pb_grpc.QueryStub(ch).GetHistory(pb.HistoryRequest(node_id=node, name=name, labels=labels), timeout=5)
    return [(p.time_unix_nano / 1e9, p.value) for p in r.points]


def checkpoints(ckpt):
    return sorted(json.loads(p.read_text()) for p in ckpt.glob("ckpt-*.json")) if ckpt.exists() else []


def requests(req):
    return [json.loads(p.read_text()) for p in req.glob("*.json") if not p.name.endswith(".done.json")]


def nvml_env(libdir, tmp_path, scn):
    """The fake NVML with scenario second 0 LEAD_S after the agent's first nvmlInit."""
    return fakenvml.env(libdir, scn, t0=fakenvml.after_init(LEAD_S), procs=tmp_path / "procs",
                        t0_file=tmp_path / "t0")


def scenario_t0(tmp_path) -> float:
    """The unix time of scenario second 0, once the agent's fake library resolved it."""
    return wait_until(lambda: fakenvml.read_t0(tmp_path / "t0"), 120, what="the agent's first nvmlInit")


def run_agent(procs, tmp_path, addr, req, env, extra=()):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(CONFIG.format(req=req))
    return procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr,
                  "--node-id", "watch-node", *extra], "agent", env=env)


def test_nvml_ramp_one_request_checkpoint_in_time_second_ramp_in_cooldown(libdir, procs, tmp_path):
    trainer, ckpt, req = start_trainer(procs, tmp_path)
    (tmp_path / "procs").write_text(f"0 {trainer.p.pid} 8589934592\n")
    # 40% -> 92% at t=5 for 8 s -> 40%; again 92% from t=15 to 23 (inside the 10 min cooldown).
    scn = ramp_scenario(tmp_path, "0:40 5:40 5:92 13:92 13:40 15:40 15:92 23:92 23:40")
    addr = start_collector(procs)
    agent = run_agent(procs, tmp_path, addr, req, nvml_env(libdir, tmp_path, scn))
    t0 = scenario_t0(tmp_path)

    wait_until(lambda: checkpoints(ckpt), what="the trainer's checkpoint")
    labels = {"device": "gpu0", "vendor": "nvidia"}
    name = "xpusense.accelerator.hbm.bandwidth.utilization"
    # Wait past the second ramp (the value back at 40% after t=23), then count.
    wait_until(lambda: any(t > t0 + 24 and v < 0.5 for t, v in history(addr, "watch-node", name, labels)),
               what="the end of the second ramp")
    cps, reqs = checkpoints(ckpt), requests(req)
    assert len(reqs) == 1 and len(cps) == 1, (reqs, cps)
    r, cp = reqs[0], cps[0]
    assert cp["request"] == r["id"] and r["pids"] == [trainer.p.pid] and r["accelerator"] == "gpu0"
    # Crossed: the first 1 s sample at or above 85%, as the collector stored it.
    crossed = next(t for t, v in history(addr, "watch-node", name, labels) if v >= 0.85)
    assert r["crossed_time"] == pytest.approx(crossed, abs=1e-6)
    # Sent at the window's end (JITTER_NS, agent/hbm_watch.py: the sample due then may be stamped
    # 50 ms early), while the ramp was still on (it ends at t = 13); the checkpoint after it.
    assert crossed + WINDOW_S - 0.05 <= r["time"] < t0 + 13 and cp["time"] >= r["time"]
    node = next(n for n in nodes_json(addr)["nodes"] if n["node_id"] == "watch-node")
    evs = [e for e in node["events"] if e["type"] == "checkpoint_request"]
    assert [e["attributes"]["request_id"] for e in evs] == [r["id"]] and evs[0]["device"] == "gpu0"
    assert "in cooldown" in agent.output()
    assert "checkpoint request " + r["id"] in agent.output()  # said at info level, with what was sent


def test_dip_below_the_lower_mark_inside_the_window_does_not_fire_early(libdir, procs, tmp_path):
    trainer, ckpt, req = start_trainer(procs, tmp_path)
    (tmp_path / "procs").write_text(f"0 {trainer.p.pid} 8589934592\n")
    # above from t=5, one second at 60% at t=7..8, above again until 16
    scn = ramp_scenario(tmp_path, "0:40 5:40 5:92 7:92 7:60 8:60 8:92 16:92 16:40")
    addr = start_collector(procs)
    run_agent(procs, tmp_path, addr, req, nvml_env(libdir, tmp_path, scn))
    t0 = scenario_t0(tmp_path)
    wait_until(lambda: checkpoints(ckpt), what="the checkpoint")
    r = requests(req)[0]
    # The window restarted after the dip: crossed no earlier than t=8, fired no earlier than t=13.
    assert r["crossed_time"] >= t0 + 8.0
    assert checkpoints(ckpt)[0]["time"] >= t0 + 13.0 - 0.05


def test_npu_smi_ramp_sends_one_request(procs, tmp_path):
    trainer, ckpt, req = start_trainer(procs, tmp_path)
    scenario = tmp_path / "scenario"
    shutil.copytree(NPU_SCENARIO, scenario)
    info = (scenario / "info.txt").read_text().replace(
        "| No running processes found in NPU 0                                                            |",
        f"| 0       0                 | {trainer.p.pid:<13} | python3                  | 2048                    |")
    (scenario / "info.txt").write_text(info)
    addr = start_collector(procs)
    cfg_extra = ("--npu-smi", str(NPU_FAKE))
    run_agent(procs, tmp_path, addr, req, {"FAKE_NPU_SMI_DIR": str(scenario), "LD_LIBRARY_PATH": "/nonexistent"},
              cfg_extra)
    wait_until(lambda: any(n["node_id"] == "watch-node" for n in nodes_json(addr)["nodes"]), 120,
               what="the agent streaming")
    # The ramp starts LEAD_S after it is written (the fake's second 0 is ramp.json's mtime).
    (scenario / "ramp.json").write_text(json.dumps({"type": "usages", "key": "HBM Bandwidth Usage Rate(%)",
                                                    "npus": [0], "points": [[0, 40], [LEAD_S, 40], [LEAD_S + 0.01, 92],
                                                                            [LEAD_S + 8, 92], [LEAD_S + 8.01, 40]]}))
    t0 = (scenario / "ramp.json").stat().st_mtime + LEAD_S
    wait_until(lambda: checkpoints(ckpt), what="the checkpoint on the NPU")
    r = requests(req)[0]
    assert r["accelerator"] == "npu0-0" and r["vendor"] == "huawei" and r["pids"] == [trainer.p.pid]
    # Sent at the window's end, while the ramp was still on (it ends 8 s after it began at t0).
    assert r["crossed_time"] + WINDOW_S - 0.05 <= r["time"] < t0 + 8 and checkpoints(ckpt)[0]["time"] >= r["time"]
    node = wait_until(lambda: next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "watch-node"
                                    and any(e["type"] == "checkpoint_request" for e in n["events"])), None),
                      what="the event at the collector")
    assert series(node, "xpusense.accelerator.hbm.bandwidth.utilization", device="npu0-0")
    name, labels = "xpusense.accelerator.hbm.bandwidth.utilization", {"device": "npu0-0", "vendor": "huawei"}
    wait_until(lambda: any(t > t0 + 9 and v < 0.5 for t, v in history(addr, "watch-node", name, labels)),
               what="the end of the NPU ramp")
    assert len(requests(req)) == 1 and len(checkpoints(ckpt)) == 1


def test_nan_from_the_driver_never_sends_a_checkpoint_request(libdir, procs, tmp_path):
    trainer, ckpt, req = start_trainer(procs, tmp_path)
    (tmp_path / "procs").write_text(f"0 {trainer.p.pid} 8589934592\n")
    # 92 % from t=5 to 7, then the driver answers NaN (with a success code) until t=12, then 40 %:
    # NaN read as "not below the threshold" would complete the 5 s window at t=10.
    scn = ramp_scenario(tmp_path, "0:40 5:40 5:92 7:92 7:40")
    scn.write_text(scn.read_text() + "gpm_nan = 10 7 12\n")
    addr = start_collector(procs)
    agent = run_agent(procs, tmp_path, addr, req, nvml_env(libdir, tmp_path, scn))
    t0 = scenario_t0(tmp_path)
    labels = {"device": "gpu0", "vendor": "nvidia"}
    name = "xpusense.accelerator.hbm.bandwidth.utilization"
    wait_until(lambda: any(t > t0 + 13 and v < 0.5 for t, v in history(addr, "watch-node", name, labels)),
               what="values after the NaN window")
    points = history(addr, "watch-node", name, labels)
    assert not [(t, v) for t, v in points if t0 + 7.5 < t < t0 + 11.5]    # nothing was sent for the NaNs
    assert any(v >= 0.85 for _, v in points)                                # the 92 % before them was
    assert requests(req) == [] and checkpoints(ckpt) == []
    assert "checkpoint request" not in agent.output()


def test_a_misread_process_list_never_names_a_wrong_pid(libdir, procs, tmp_path):
    trainer, ckpt, req = start_trainer(procs, tmp_path)
    # A driver of R535.43-535.86 (32-byte _v3 entries): read as pynvml reads them, the pids after the
    # first are 0 and 4294967295. The list also holds a pid 0 and a process that has ended.
    (tmp_path / "procs").write_text(f"0 0 1073741824\n0 {2**22 + 1} 1073741824\n0 {trainer.p.pid} 8589934592\n")
    scn = ramp_scenario(tmp_path, "0:40 5:40 5:92 13:92 13:40")
    scn.write_text("process_info_size = 32\nmissing_symbols = nvmlDeviceGetRunningProcessDetailList\n"
                   + scn.read_text())
    addr = start_collector(procs)
    agent = run_agent(procs, tmp_path, addr, req, nvml_env(libdir, tmp_path, scn))
    wait_until(lambda: checkpoints(ckpt), what="the trainer's checkpoint")
    reqs = requests(req)
    assert len(reqs) == 1 and reqs[0]["pids"] == [trainer.p.pid], reqs
    assert agent.p.poll() is None          # the agent did not signal its own process group
    assert "impossible pids" in agent.output()


def write_procs(tmp_path, pids):
    """The fake NVML's process list (re-read on each call): each pid on GPU 0, written in one step."""
    tmp = tmp_path / "procs.tmp"
    tmp.write_text("".join(f"0 {pid} 1073741824\n" for pid in pids))
    tmp.replace(tmp_path / "procs")


def test_only_a_process_with_a_handler_is_signalled_never_one_without_nor_the_agents_threads(libdir, procs, tmp_path):
    """On the GPU: the trainer (the helper's SIGUSR1 handler), a server with no handler (SIGUSR1's
    default action would end it), and, once the agent runs, the ids of the agent's own threads."""
    trainer, ckpt, req = start_trainer(procs, tmp_path)
    server = procs([sys.executable, "-c", "import time; print('serving', flush=True); time.sleep(600)"], "server")
    wait_until(lambda: "serving" in server.output(), what="the server to start")
    write_procs(tmp_path, [trainer.p.pid, server.p.pid])
    scn = ramp_scenario(tmp_path, "0:40 5:40 5:92 13:92 13:40")
    addr = start_collector(procs)
    agent = run_agent(procs, tmp_path, addr, req, nvml_env(libdir, tmp_path, scn))
    scenario_t0(tmp_path)   # the ramp starts 5 s after this: the threads are listed well before it
    threads = [int(t) for t in os.listdir(f"/proc/{agent.p.pid}/task") if int(t) != agent.p.pid]
    assert threads
    write_procs(tmp_path, [trainer.p.pid, server.p.pid, *threads])

    wait_until(lambda: checkpoints(ckpt), what="the trainer's checkpoint")
    node = wait_until(lambda: next((n for n in nodes_json(addr)["nodes"] if n["node_id"] == "watch-node"
                                    and any(e["type"] == "checkpoint_request" for e in n["events"])), None),
                      what="the checkpoint request event at the collector")
    ev = next(e for e in node["events"] if e["type"] == "checkpoint_request")
    assert server.p.poll() is None, f"the server without a handler exited {server.p.returncode}"
    assert agent.p.poll() is None, f"the agent exited {agent.p.returncode}"
    # One job (one process group): its request file names both; the signal went to the trainer only.
    r = requests(req)
    assert len(r) == 1 and sorted(r[0]["pids"]) == sorted([trainer.p.pid, server.p.pid]), r
    assert f"SIGUSR1 to pids [{trainer.p.pid}]" in ev["attributes"]["actions"]
    assert f"not signalled: {server.p.pid} (no_handler)" in ev["attributes"]["actions"]
    out = agent.output()
    assert f"pid {server.p.pid} has no SIGUSR1 handler" in out
    assert "is a thread of the agent" in out   # the agent's threads: left out of the request, said why


def test_agent_refuses_a_request_dir_anyone_can_write_without_the_sticky_bit(procs, tmp_path):
    req = tmp_path / "req"
    req.mkdir()
    req.chmod(0o777)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(CONFIG.format(req=req) + "[sources.nvml]\nenabled = false\n[sources.npu_smi]\nenabled = false\n")
    addr = start_collector(procs)
    run = [str(BIN / "xpusense-agent"), "run", "--once", "--config", str(cfg), "--collector", addr]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"{req} has mode 0777" in out.stderr and "sticky" in out.stderr, out.stderr
    req.chmod(0o1777)   # the sticky bit: anyone may add files, only their owner rename them
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
