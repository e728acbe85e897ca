"""Agent clocks far off the collector's, end to end: a node whose clock ran a year ahead and is then
stepped back, and a node a day behind, each a simulated agent on the real Ingest stream stamping
its Hello, batches, samples and events with its own clock. The collector judges by when things
arrived: after the step the node's new (busy) readings are its latest, in Place and in `nodes`; the
day-behind node's XID 79 on every GPU keeps it out of Place, and its series are on /metrics; each
skewed node gets a `clock_offset` diagnosis naming its offset. Once against one collector process,
once in cluster mode (gateway, worker and scheduler replica on a real 3-server JetStream cluster)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

from cluster_support import SimAgent, cluster_config, module_cmd, nats_cluster, start_gateway  # noqa: F401
from helpers import BIN, free_port, nodes_json, series, wait_until
from test_cluster_scheduler import place, start_scheduler
from test_diagnosis_collector import prom

from xpusense.v1 import telemetry_pb2 as pb

GiB = 2**30
DAY_S = 86400
YEAR_S = 365 * DAY_S
LABELS = {"region": "cn-beijing", "zone": "a", "price": "2.0"}
AHEAD, BEHIND = "skew-ahead", "skew-behind"


def _offered(addr: str) -> set[str]:
    return {c["node_id"] for c in place(addr)["candidates"]}   # 2 A100s with 40GB free each


def _excluded(addr: str) -> dict[str, str]:
    return {e["node_id"]: e["reason"] for e in place(addr)["excluded"]}


def _node(addr: str, node_id: str) -> dict:
    (n,) = [n for n in nodes_json(addr)["nodes"] if n["node_id"] == node_id]
    return n


def _clock_diagnosis(addr: str, node_id: str) -> dict | None:
    got = [d for d in _node(addr, node_id)["diagnoses"] if d["rule"] == "clock_offset"]
    return got[0] if got else None


def _offset_s(d: dict) -> float:
    """The signed offset the diagnosis names: '... N s (D days) ahead of / behind the collector's'."""
    m = re.search(r"clock is ([0-9.]+) s .*(ahead of|behind) the collector's", d["cause"])
    assert m, d["cause"]
    return float(m.group(1)) * (1 if m.group(2) == "ahead of" else -1)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def _skewed_fleet(ingest: str, place_at: str, nodes_at: str, metrics_port: int) -> None:
    """The whole story against a fleet whose agents stream to `ingest`, asked through `place_at`
    (Place), `nodes_at` (ListNodes) and the Prometheus endpoint on `metrics_port`."""
    ahead_by = [YEAR_S * 10**9]
    ahead = SimAgent(ingest, AHEAD, LABELS, clock=lambda: time.time_ns() + ahead_by[0])
    behind = SimAgent(ingest, BEHIND, LABELS, clock=lambda: time.time_ns() - DAY_S * 10**9)
    readings = {AHEAD: {}, BEHIND: {}}
    stop = threading.Event()

    def report():   # both report every 0.3 s, as live agents do (they stay fresh)
        while not stop.wait(0.3):
            ahead.send(**readings[AHEAD])
            behind.send(**readings[BEHIND])
    ahead.send()
    behind.send()
    threading.Thread(target=report, daemon=True).start()
    try:
        # Idle, both take 2 x 40GB, and each has its clock_offset diagnosis naming the offset.
        wait_until(lambda: _offered(place_at) == {AHEAD, BEHIND}, 60, what="both nodes offered")
        d = wait_until(lambda: _clock_diagnosis(nodes_at, AHEAD), 60, what="the year-ahead node's diagnosis")
        assert abs(_offset_s(d) - YEAR_S) < 60 and d["device"] == "" and "chrony" in d["remedy"], d
        d = wait_until(lambda: _clock_diagnosis(nodes_at, BEHIND), 60, what="the day-behind node's diagnosis")
        assert abs(_offset_s(d) + DAY_S) < 60, d

        # The year-ahead clock is stepped back, and the node is busy now: 79 GiB used on every GPU.
        ahead_by[0] = 0
        readings[AHEAD] = {"util": 0.95, "used": 79 * GiB}
        wait_until(lambda: _excluded(place_at).get(AHEAD) == "memory", 30,
                   what="the stepped-back node's new readings in Place (not offered as idle)")
        assert AHEAD not in _offered(place_at)
        wait_until(lambda: series(_node(nodes_at, AHEAD), "hw.gpu.memory.usage", device="gpu0")[0]["value"] == 79 * GiB,
                   30, what="the new reading as the latest in `nodes`")

        # The day-behind node: an XID 79 on every GPU, stamped by its clock, takes it out of Place.
        stamp = time.time_ns() - DAY_S * 10**9
        behind.send(events=[pb.Event(id=f"xid-{i}", type="xid", severity="critical", device=f"gpu{i}",
                                     message="XID 79: GPU has fallen off the bus", attributes={"xid": "79"},
                                     time_unix_nano=stamp) for i in range(8)])
        wait_until(lambda: _excluded(place_at).get(BEHIND) == "xid", 30, what="the XIDs in Place")
        assert BEHIND not in _offered(place_at)

        # /metrics has the day-behind node's series (their age is since they arrived), and the
        # diagnoses of both nodes.
        def scraped():
            text = _scrape(metrics_port)
            return text if prom(text, "hw_gpu_utilization_ratio").get(
                (("device", "gpu0"), ("host_name", BEHIND), ("node", BEHIND), ("vendor", "nvidia"))) == 0.1 else None
        text = wait_until(scraped, 30, what="the day-behind node's series on /metrics")
        open_ = prom(text, "xpusense_diagnoses_open")
        assert open_.get((("device", ""), ("node", BEHIND), ("rule", "clock_offset"))) == 1.0, open_
    finally:
        stop.set()
        ahead.close()
        behind.close()


def test_a_skewed_agent_clock_does_not_decide_for_the_collector(procs, tmp_path):
    metrics_port = free_port()
    cfg = tmp_path / "collector.toml"
    cfg.write_text(f'[export.prometheus]\nenabled = true\nlisten = "127.0.0.1:{metrics_port}"\n')
    addr = f"127.0.0.1:{free_port()}"
    procs([str(BIN / "xpusense-collector"), "serve", "--config", str(cfg), "--listen", addr], "collector")
    wait_until(lambda: nodes_json(addr) is not None, 60, what="the collector to answer")
    _skewed_fleet(addr, addr, addr, metrics_port)


def test_a_skewed_agent_clock_does_not_decide_in_cluster_mode(nats_cluster, procs, tmp_path):  # noqa: F811
    cfg = cluster_config(tmp_path, nats_cluster)
    _, gw = start_gateway(procs, cfg)
    procs(module_cmd("worker", "--config", str(cfg)), "worker")
    metrics_port = free_port()
    scfg = cluster_config(tmp_path, nats_cluster, name="scheduler.toml", extra=f"""[export.prometheus]
enabled = true
listen = "127.0.0.1:{metrics_port}"
""")
    _, sched = start_scheduler(procs, scfg, "scheduler")
    _skewed_fleet(gw, sched, gw, metrics_port)
