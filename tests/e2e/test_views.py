"""`top` refreshes in place and leaves cleanly on Ctrl-C; `sources`, `inventory`, `run --once`."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess

import yaml
from helpers import BIN, free_port, nodes_json, series, wait_until


def start_collector(procs):
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector to answer")
    return addr


def test_run_once_delivers_one_round_and_exits_0(procs):
    addr = start_collector(procs)
    p = subprocess.run([str(BIN / "xpusense-agent"), "run", "--once", "--collector", addr, "--node-id", "once"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    node = nodes_json(addr)["nodes"][0]
    assert node["node_id"] == "once" and node["connected"] is False
    assert series(node, "system.memory.limit")[0]["value"] > 0
    assert series(node, "xpusense.agent.source.up", source="host")[0]["value"] == 1.0


def test_top_refreshes_in_place_and_exits_cleanly_on_ctrl_c(procs):
    addr = start_collector(procs)
    subprocess.run([str(BIN / "xpusense-agent"), "run", "--once", "--collector", addr, "--node-id", "topnode"],
                   check=True, capture_output=True, timeout=60)
    master, slave = pty.openpty()
    p = subprocess.Popen([str(BIN / "xpusense-collector"), "top", "--collector", addr, "--interval-s", "0.1"],
                         stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    screen = b""

    def read():
        nonlocal screen
        while select.select([master], [], [], 0)[0]:
            try:
                screen += os.read(master, 65536)
            except OSError:
                break
        return screen

    try:
        # Two refreshes, each clearing the screen and homing the cursor, showing the node.
        wait_until(lambda: read().count(b"\x1b[H\x1b[2J") >= 2 and b"topnode" in screen, what="two refreshes")
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 0
        out = read().decode(errors="replace")
        assert "Traceback" not in out and "KeyboardInterrupt" not in out
        assert out.rstrip().endswith("\x1b[?25h") or "\x1b[?25h" in out[-20:]  # cursor shown again
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)


def test_sources_lists_every_source_and_why(tmp_path):
    cfg = tmp_path / "a.toml"
    cfg.write_text('[sources.host]\nnetns = "xps-no-such-ns"\n[sources.ebpf]\nenabled = false\n')
    p = subprocess.run([str(BIN / "xpusense-agent"), "sources", "--format", "json", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert rows["host"]["state"] == "unavailable" and "xps-no-such-ns" in rows["host"]["reason"]
    cfg.write_text('[sources.host]\nenabled = false\n[sources.ebpf]\nenabled = false\n')
    p = subprocess.run([str(BIN / "xpusense-agent"), "sources", "--format", "json", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert rows["host"]["state"] == "disabled"


def test_inventory_yaml_follows_the_schema():
    p = subprocess.run([str(BIN / "xpusense-agent"), "inventory"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    inv = yaml.safe_load(p.stdout)
    cpu = inv["resources"][0]
    assert set(cpu) >= {"type", "vendor", "model", "attributes", "interconnects"}
    assert cpu["type"] == "CPU" and int(cpu["attributes"]["logical_cpus"]) == os.cpu_count()
