"""The eBPF benches (bench/footprint.py, bench/ebpf_cost.py) run once at a small size, as root: each
finishes and its JSON summary says it measured the agent's probes under its workload (no figure is
asserted: tests do not time things). The other benches: tests/e2e/test_benches_run.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ebpf_support import require_ebpf

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _summary(*args: str) -> dict:
    require_ebpf()
    r = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:], "--json"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_footprint_bench_measures_the_agent_with_its_probes_beside_node_exporter():
    got = _summary("footprint.py", "--seconds", "3", "--warmup-s", "1", "--load-seconds", "0")
    assert got["start"]["probes"], got["start"]   # some probe planned and attached here
    assert got["start"]["exec_to_probes_held_s"] > 0, got["start"]
    quiet = got["quiet"]
    assert quiet["agent"]["rss_peak_mb"] > 0 and quiet["node_exporter"]["rss_peak_mb"] > 0, quiet
    assert quiet["scrapes"] > 0, quiet   # node_exporter was scraped as a Prometheus would


def test_ebpf_cost_bench_counts_events_of_the_agents_programs():
    got = _summary("ebpf_cost.py", "--seconds", "2", "--round-trips", "2000")
    assert got["workload"]["context_switches_per_s"] > 0, got["workload"]
    counted = [r for r in got["programs"] if "missing" not in r and r["events"] > 0]
    assert counted, got["programs"]
