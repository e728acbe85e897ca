"""A real collector and a real agent as separate processes on loopback."""

from __future__ import annotations

import signal

from helpers import BIN, free_port, nodes_json, series, wait_until

from xpusense.collector.store import stored_batches

FAST = """
[tiers]
realtime_s = 0.2
nearline_s = 0.5
offline_s = 2.0
[stream]
flush_s = 0.05
backoff_initial_s = 0.05
backoff_max_s = 0.5
[sources.ebpf]
enabled = false   # tests attach probes only to namespaces they create
"""


def start_pair(procs, tmp_path, data_dir=None, node_id="node-e2e"):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    cfg = tmp_path / "agent.toml"
    cfg.write_text(FAST)
    coll_args = [str(BIN / "xpusense-collector"), "serve", "--listen", addr]
    if data_dir:
        coll_args += ["--data-dir", str(data_dir)]
    coll = procs(coll_args, "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector to answer")
    agent = procs([str(BIN / "xpusense-agent"), "run", "--config", str(cfg), "--collector", addr,
                   "--node-id", node_id], "agent")
    return addr, coll_args, coll, agent


def the_node(addr, node_id="node-e2e"):
    nodes = {n["node_id"]: n for n in nodes_json(addr)["nodes"]}
    return nodes.get(node_id)


def test_node_shows_host_cpu_memory_and_interface_bytes(procs, tmp_path):
    addr, _, _, agent = start_pair(procs, tmp_path)

    def ready():
        n = the_node(addr)
        return n if n and series(n, "system.cpu.utilization") and series(n, "system.network.io") else None

    node = wait_until(ready, what="host series at the collector")
    assert node["connected"] is True and node["stale"] is False
    states = {s["labels"]["state"]: s["value"] for s in series(node, "system.cpu.utilization")}
    assert {"user", "system", "idle"} <= set(states)
    assert abs(sum(v for k, v in states.items() if k not in ("guest", "guest_nice")) - 1.0) < 1e-6
    used = series(node, "system.memory.usage", state="used")[0]
    assert used["unit"] == "By" and used["value"] > 1e6
    lo_rx = series(node, "system.network.io", device="lo", direction="receive")[0]
    # The agent's own gRPC traffic to the collector crosses lo, so its counter is positive.
    assert lo_rx["unit"] == "By" and lo_rx["kind"] == "counter" and lo_rx["value"] > 0
    assert node["inventory"]["resources"][0]["type"] == "CPU"
    assert agent.p.poll() is None


def stored(data_dir) -> list[tuple[str, int]]:
    """(boot, seq) of every batch record in the collector's durable store."""
    return [(b.boot_id, b.seq) for b in stored_batches(str(data_dir))]


def test_collector_killed_and_restarted_agent_reconnects_nothing_stored_twice(procs, tmp_path):
    data = tmp_path / "collector-data"
    addr, coll_args, coll, agent = start_pair(procs, tmp_path, data_dir=data)
    first = wait_until(lambda: (n := the_node(addr)) and n["stored_up_to"] >= 5
                       and series(n, "system.cpu.utilization", state="idle") and n, what="5 batches stored")
    boot = first["boot_id"]

    coll.kill(signal.SIGKILL)
    # The agent keeps measuring while the collector is away; its queue grows.
    coll2 = procs(coll_args, "collector")
    node = wait_until(lambda: (n := the_node(addr)) and n["connected"] and n["stored_up_to"] > first["stored_up_to"] + 5 and n,
                      what="the agent to reconnect and the series to continue")
    assert node["boot_id"] == boot, "the agent process was not restarted: same boot"
    idle_before = series(first, "system.cpu.utilization", state="idle")[0]
    idle_after = series(node, "system.cpu.utilization", state="idle")[0]
    assert idle_after["time"] > idle_before["time"], "the series did not continue after the restart"

    seqs = [seq for b, seq in stored(data) if b == boot]
    assert len(seqs) == len(set(seqs)), "a sequence number was stored twice"
    # Nothing lost either: every batch from 1 to the last stored is there exactly once.
    assert sorted(seqs) == list(range(1, max(seqs) + 1))
    assert agent.p.poll() is None and coll2.p.poll() is None
