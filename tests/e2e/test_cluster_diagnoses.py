"""Cluster mode, diagnoses: a node's open diagnosis event goes through a
gateway into the stream; the worker owning its partition keeps it open (collector/diagnoses.py) in
the node's summary; `nodes` through the gateway shows it, a scheduler replica's Place penalises the
device and says why, and the replica's Prometheus endpoint counts it. Its close takes it away from
all three. Real processes on a real 3-server JetStream cluster on loopback."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.request

from cluster_support import SimAgent, cluster_config, module_cmd, nats_cluster, start_gateway  # noqa: F401
from helpers import BIN, free_port, nodes_json, wait_until
from test_cluster_scheduler import place, start_scheduler
from test_diagnosis_collector import CAUSE, diagnosis, prom

NODE = "diag-cl-1"
LABELS = {"region": "cn-beijing", "zone": "a", "price": "2.0"}
PCIE = (("device", "gpu3"), ("node", NODE), ("rule", "pcie_contention"))


def _node(addr: str) -> dict:
    (n,) = [n for n in nodes_json(addr)["nodes"] if n["node_id"] == NODE]
    return n


def _penalties(addr: str) -> list[dict] | None:
    """The Place answer's penalties on NODE (all 8 devices asked for, so a penalised one is chosen)."""
    cands = [c for c in place(addr, "--count", "8", "--memory", "10GB")["candidates"] if c["node_id"] == NODE]
    return cands[0].get("penalties", []) if cands else None


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_a_diagnosis_opens_and_closes_through_the_cluster(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    metrics_port = free_port()
    scfg = cluster_config(tmp_path, nats_cluster, name="scheduler.toml", extra=f"""[export.prometheus]
enabled = true
listen = "127.0.0.1:{metrics_port}"
""")
    _, sched = start_scheduler(procs, scfg, "scheduler")
    agent = SimAgent(gw, NODE, LABELS)
    stop = threading.Event()

    def report():   # readings every 0.5 s, as a live agent sends them (the node stays fresh)
        while not stop.wait(0.5):
            agent.send()
    threading.Thread(target=report, daemon=True).start()
    try:
        # The node is placeable, unpenalised, with nothing open, before the diagnosis.
        wait_until(lambda: _penalties(sched) == [], 90, what="the node in the replica's index, unpenalised")
        assert _node(gw)["diagnoses"] == []

        opened_ns = time.time_ns() - 30 * 10**9
        agent.send(events=[diagnosis("d-cl-1", "open", device="gpu3", opened_ns=opened_ns)])

        # nodes through the gateway: the open diagnosis, its rule, device and cause (from the summary)
        got = wait_until(lambda: (d := _node(gw)["diagnoses"]) and d, 60, what="the open diagnosis in `nodes`")
        (d,) = got
        assert (d["id"], d["device"], d["rule"], d["cause"]) == ("d-cl-1", "gpu3", "pcie_contention", CAUSE)
        assert d["open_for_s"] >= 29 and d["evidence"][0]["series"] == "hw.gpu.utilization"
        table = subprocess.run([str(BIN / "xpusense-collector"), "nodes", "--collector", gw], capture_output=True,
                               text=True, timeout=30, env={**os.environ, "COLUMNS": "200"})
        assert table.returncode == 0, table.stderr
        (line,) = [x for x in table.stdout.splitlines() if x.lstrip().startswith("? diagnosis")]
        assert line.split()[2:4] == ["gpu3", "pcie_contention"] and line.endswith(CAUSE), line

        # Place through the replica: gpu3 penalised for the diagnosis, and no other device
        (p,) = wait_until(lambda: (ps := _penalties(sched)) and ps, 60, what="the diagnosis penalty in Place")
        assert (p["reason"], p["device"]) == ("diagnosis", "gpu3")
        assert p["detail"].startswith("open diagnosis pcie_contention (opened ") and p["detail"].endswith(CAUSE), p
        assert 0 < p["factor"] < 1

        # the replica's Prometheus endpoint: open now, and opened per rule
        text = _scrape(metrics_port)
        assert prom(text, "xpusense_diagnoses_open") == {PCIE: 1.0}
        assert prom(text, "xpusense_diagnoses_opened_total") == {(("rule", "pcie_contention"),): 1.0}

        # The close: gone from `nodes`, Place and the gauge; still counted as opened.
        agent.send(events=[diagnosis("d-cl-1", "closed", device="gpu3")])
        wait_until(lambda: _node(gw)["diagnoses"] == [], 60, what="the diagnosis gone from `nodes`")
        wait_until(lambda: _penalties(sched) == [], 60, what="the penalty gone from Place")
        text = wait_until(lambda: (t := _scrape(metrics_port)) and not prom(t, "xpusense_diagnoses_open") and t, 60,
                          what="the open gauge gone")
        assert prom(text, "xpusense_diagnoses_opened_total") == {(("rule", "pcie_contention"),): 1.0}
        assert _node(sched)["diagnoses"] == []   # the replica's own Query agrees
    finally:
        stop.set()
        agent.close()
