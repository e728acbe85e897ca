"""`top` refreshes in place and leaves cleanly on Ctrl-C; `sources`, `inventory`, `run --once`."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess

import yaml
from helpers import BIN, free_port, nodes_json, series, wait_until


@contextlib.contextmanager
def top_under_pty(addr: str):
    """`xpusense-collector top` on a pseudo-terminal: yields (process, read), read() -> the screen so
    far; the process is killed and the terminal closed after."""
    master, slave = pty.openpty()
    p = subprocess.Popen([str(BIN / "xpusense-collector"), "top", "--collector", addr, "--interval-s", "0.1"],
                         stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    screen = b""

    def read() -> bytes:
        nonlocal screen
        while select.select([master], [], [], 0)[0]:
            try:
                screen += os.read(master, 65536)
            except OSError:
                break
        return screen
    try:
        yield p, read
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)


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
    with top_under_pty(addr) as (p, read):
        # Two refreshes, each clearing the screen and homing the cursor, showing the node.
        wait_until(lambda: read().count(b"\x1b[H\x1b[2J") >= 2 and b"topnode" in read(), what="two refreshes")
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 0
        out = read().decode(errors="replace")
        assert "Traceback" not in out and "KeyboardInterrupt" not in out
        assert out.rstrip().endswith("\x1b[?25h") or "\x1b[?25h" in out[-20:]  # cursor shown again


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


def test_nodes_and_top_read_a_fleet_larger_than_one_reply(tmp_path):
    """ListNodes answers in pages of at most limits.max_reply_bytes; `nodes` and `top` read them all
    (a fleet state over gRPC's 4 MiB once made both fail for the whole fleet)."""
    from helpers import InProcessCollector

    from xpusense.collector.limits import Limits
    from xpusense.v1 import telemetry_pb2 as pb
    coll = InProcessCollector(limits=Limits(max_reply_bytes=100_000))
    try:
        def fill():
            for k in range(3):
                nid = f"big-{k}"
                coll.state.hello(pb.Hello(node_id=nid, boot_id=f"boot-{k}"))
                coll.state.ingest(pb.Batch(node_id=nid, boot_id=f"boot-{k}", seq=1, samples=[
                    pb.Sample(name="m", labels={"i": str(i), "pad": "p" * 200}, value=i, series_ref=i + 1)
                    for i in range(2000)]))
            return coll.state.view().ByteSize()
        whole = coll.on_loop(fill)
        assert whole > 1_000_000
        out = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", coll.addr, "--format", "json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        nodes = json.loads(out.stdout)["nodes"]
        assert [n["node_id"] for n in nodes] == ["big-0", "big-1", "big-2"]
        assert all(len(n["series"]) == n["series_total"] == 2000 for n in nodes)
        assert sorted(int(s["labels"]["i"]) for s in nodes[1]["series"]) == list(range(2000))
        counters = json.loads(out.stdout).get("counters", {})
        assert counters.get("limits.max_reply_bytes", 0) >= whole // 100_000

        with top_under_pty(coll.addr) as (p, read):
            wait_until(lambda: b"big-2" in read() and read().count(b"\x1b[H\x1b[2J") >= 2, what="top showing every node")
            assert b"unreachable" not in read()
            p.send_signal(signal.SIGINT)
            p.wait(timeout=10)
    finally:
        coll.stop()
