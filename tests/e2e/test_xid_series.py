"""XIDs as series: the NVML source counts the fake's XID events per GPU and code (through pynvml's
ctypes code and the event thread), an agent sends them to the collector, and Debian's real
Prometheus, scraping the collector with the alert rules shipped in deploy/prometheus/, fires the
alerts, critical for a hardware XID and warning for an application one; dcgm-exporter's
DCGM_FI_DEV_XID_ERRORS is the last XID. promtool checks the shipped rules."""

from __future__ import annotations

import subprocess
import sys

import real_prometheus
import yaml
from helpers import BIN, ROOT, nodes_json, series, wait_until
from real_prometheus import api, query

from xpusense.common import metric_names as m

sys.path.insert(0, str(ROOT / "tests/fakes/nvml"))
import fakenvml  # noqa: E402
from driving import drive, h100s, pick, write_scenario  # noqa: E402

RULES = ROOT / "deploy/prometheus/xpusense-alerts.yaml"
AGENT = """
[tiers]
realtime_s = 0.5
nearline_s = 5.0
offline_s = 10.0
[stream]
flush_s = 0.05
[sources.ebpf]
enabled = false
"""


def test_the_event_thread_counts_each_xid_once_per_gpu_and_code(libdir, tmp_path):
    scn = write_scenario(tmp_path, h100s(3) + """
[gpu 0]
event = 0.5 xid 79
event = 0.6 xid 13
event = 0.7 xid 79
[gpu 1]
mig_mode = 1
mig = 1 40GiB 1GiB 3g.40gb
event = 0.6 xid 31 1 0    # in GPU instance 1: counted for the GPU
""")
    out = drive(libdir, scn, "realtime", until_t=1.6)
    last = out["rounds"][-1]
    assert pick(last, m.XID_ERRORS, xid="79") == {"gpu0": 2.0}
    assert pick(last, m.XID_ERRORS, xid="13") == {"gpu0": 1.0}
    assert pick(last, m.XID_ERRORS, xid="31") == {"gpu1": 1.0}
    assert pick(last, m.LAST_XID) == {"gpu0": 79.0, "gpu1": 31.0, "gpu2": 0.0}
    kinds = {s["kind"] for r in out["rounds"] for s in r["samples"] if s["name"] == m.XID_ERRORS}
    assert kinds == {"counter"}
    seen = [pick(r, m.XID_ERRORS, xid="79").get("gpu0", 0.0) for r in out["rounds"]]
    assert seen == sorted(seen) and seen[0] == 0.0   # from nothing, never down, one per event
    assert len([e for e in out["events"] if e["type"] == "xid"]) == 4   # the events still come
    # Without the event set nothing is known of XIDs: no count, and no last XID of 0 that would say "none".
    quiet = drive(libdir, scn, "realtime", until_t=0.8, extra=("--no-events",))
    assert not any(s["name"] in (m.XID_ERRORS, m.LAST_XID) for r in quiet["rounds"] for s in r["samples"])


def test_the_shipped_rules_fire_for_a_new_code_and_a_repeat_not_for_old_counts(tmp_path):
    """promtool's rule tests on the shipped expressions (annotations left out: they are text)."""
    rules = yaml.safe_load(RULES.read_text())
    for rule in rules["groups"][0]["rules"]:
        rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    xid = "xpusense_accelerator_xid_errors_total"

    def expect(at: str, name: str, *labels: dict) -> dict:
        return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": lb} for lb in labels]}
    gpu0 = {"node": "n1", "device": "gpu0", "xid": "79"}
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            # XID 79 first counted at minute 2, again at minute 12; XID 13 counted before Prometheus
            # started (there at its first scrape); an Ascend code at minute 4.
            {"series": f'{xid}{{node="n1",device="gpu0",xid="79"}}', "values": "_ _ 1+0x9 2+0x12"},
            {"series": f'{xid}{{node="n1",device="gpu1",xid="13"}}', "values": "1+0x24"},
            {"series": 'xpusense_accelerator_npu_errors_total{node="n2",device="npu3-0",code="A4025021"}',
             "values": "_ _ _ _ 1+0x20"},
        ],
        "alert_rule_test": [
            expect("3m", "AcceleratorXidError", {**gpu0, "severity": "critical"}),
            expect("3m", "AcceleratorApplicationXid",   # a fresh Prometheus fires once for old counts
                   {"node": "n1", "device": "gpu1", "xid": "13", "severity": "warning"}),
            expect("10m", "AcceleratorXidError"),          # no new XID for 5 minutes: resolved
            expect("10m", "AcceleratorApplicationXid"),    # counted long ago: quiet
            expect("13m", "AcceleratorXidError", {**gpu0, "severity": "critical"}),   # the repeat
            expect("5m", "AscendNpuErrorCode",
                   {"node": "n2", "device": "npu3-0", "code": "A4025021", "severity": "warning"}),
            expect("12m", "AscendNpuErrorCode"),
        ]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    r = subprocess.run([real_prometheus.binary("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def firing(prom: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for a in api(prom, "/api/v1/alerts")["alerts"]:
        if a["state"] == "firing":
            out.setdefault(a["labels"]["alertname"], []).append(a["labels"])
    return out


def test_an_xid_from_the_fake_fires_the_shipped_alert_in_prometheus(procs, tmp_path, libdir):
    real_prometheus.binary()
    check = subprocess.run([real_prometheus.binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 3 rules found" in check.stdout, check.stdout + check.stderr

    addr, metrics = real_prometheus.collector_with_metrics(procs, tmp_path)
    acfg = tmp_path / "agent.toml"
    acfg.write_text(AGENT)
    scn = write_scenario(tmp_path, h100s(3) + """
[gpu 0]
event = 1 xid 79          # fallen off the bus: hardware
[gpu 1]
event = 1 xid 13          # graphics engine exception: the application's
""")
    t0_file = tmp_path / "t0"
    procs([str(BIN / "xpusense-agent"), "run", "--config", str(acfg), "--collector", addr, "--node-id", "gpu-node"],
          "agent", env=fakenvml.env(libdir, scn, t0=fakenvml.after_init(2.0), t0_file=t0_file))

    def node() -> dict:
        return next(n for n in nodes_json(addr)["nodes"] if n["node_id"] == "gpu-node")

    def counted() -> bool:
        n = node()
        return bool(series(n, m.XID_ERRORS, device="gpu0", xid="79") and series(n, m.XID_ERRORS, device="gpu1"))
    wait_until(counted, timeout_s=120, what=lambda: f"XID counters at the collector (t0 {fakenvml.read_t0(t0_file)})")
    n = node()
    assert [(s["labels"]["device"], s["labels"]["xid"], s["value"], s["kind"]) for s in
            sorted(series(n, m.XID_ERRORS), key=lambda s: s["labels"]["device"])] == [
        ("gpu0", "79", 1.0, "counter"), ("gpu1", "13", 1.0, "counter")]
    assert {s["labels"]["device"]: s["value"] for s in series(n, m.LAST_XID)} == {"gpu0": 79.0, "gpu1": 13.0, "gpu2": 0.0}

    prom = real_prometheus.start(procs, tmp_path, real_prometheus.SCRAPE_1S + f"rule_files: ['{RULES}']\n"
                                 + "scrape_configs:\n" + real_prometheus.scrape_job(metrics))

    def both_firing() -> dict | None:
        f = firing(prom)
        return f if "AcceleratorXidError" in f and "AcceleratorApplicationXid" in f else None
    alerts = wait_until(both_firing, timeout_s=120, what=lambda: f"both XID alerts firing (alerts now: {firing(prom)})")
    [hw] = alerts["AcceleratorXidError"]
    assert (hw["device"], hw["xid"], hw["node"], hw["severity"]) == ("gpu0", "79", "gpu-node", "critical")
    [app] = alerts["AcceleratorApplicationXid"]
    assert (app["device"], app["xid"], app["severity"]) == ("gpu1", "13", "warning")
    assert "AscendNpuErrorCode" not in alerts

    dcgm = {r["metric"]["gpu"]: float(r["value"][1])
            for r in query(prom, "DCGM_FI_DEV_XID_ERRORS")}
    assert dcgm == {"0": 79.0, "1": 13.0, "2": 0.0}
    got = query(prom, 'xpusense_accelerator_xid_errors_total{device="gpu0"}')
    assert [(r["metric"]["xid"], float(r["value"][1])) for r in got] == [("79", 1.0)]
