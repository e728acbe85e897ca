"""Every bench that no other test runs, run once at a small size: it finishes and its JSON summary
says it measured what it names (figures are never asserted: tests do not time things), so that a
bench that stops running is found here, not when its figure is next wanted. The restart bench:
tests/e2e/test_bench_restart.py; the eBPF benches, which need root: tests/privileged/test_benches_ebpf.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _summary(*args: str, timeout_s: float = 600) -> dict:
    r = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:]], capture_output=True, text=True,
                       timeout=timeout_s)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_agent_overhead_bench_measures_an_agent_that_streamed():
    got = _summary("agent_overhead.py", "--seconds", "2", "--warmup-s", "1", "--tiers-fast")
    assert got["bench"] == "agent_overhead" and got["batches_stored"] >= 1, got
    assert got["peak_rss_mb"] > 0 and got["series"] > 0, got


def test_extender_bench_measures_both_paths_on_its_fleet():
    got = _summary("extender_latency.py", "--nodes", "300", "--seconds", "1", "--warmup-s", "0.5")
    assert got["bench"] == "extender_latency" and got["extender_pair"]["n"] > 0 and got["grpc_place"]["n"] > 0, got
    assert got["extender_round_trips"]["n"] == got["extender_pair"]["n"], got
    assert got["passed_per_pod"] == [100, 100, 25, 50], got   # the seeded fleet's nodes that fit each pod


def test_extender_bench_measures_both_paths_on_a_cluster_replica():
    got = _summary("extender_latency.py", "--replica", "--nodes", "200", "--seconds", "1")
    assert got["replica"] and got["extender_pair"]["n"] > 0 and got["grpc_place"]["n"] > 0, got
    assert got["summary_updates_s"] == 200 and all(got["passed_per_pod"]), got   # each pod fits somewhere


def test_nvml_round_bench_reads_every_gpu_of_its_scenario():
    got = _summary("nvml_round.py", "--rounds", "3", "--gap-s", "0.15")
    assert got["bench"] == "nvml_round" and got["rounds"] == 3, got
    assert got["samples_per_round"] > 0 and got["nvml_calls_per_round"] > 0, got


def test_hbm_trigger_bench_sees_each_ramp_asked_to_checkpoint():
    got = _summary("hbm_trigger.py", "--cycles", "2")   # its ramp is high for half of --period-s (8 s): past the window
    assert got["bench"] == "hbm_trigger" and got["requests"] == 2, got
    assert got["p50_ms"] >= got["window_s"] * 1e3, got   # never before the window could have passed


def test_wire_bytes_bench_counts_the_points_and_bytes_of_an_agent_through_its_relay(tmp_path):
    """bench/wire_bytes.py, its four runs at a small size without eBPF: the relay carried the agent's
    stream both ways and was cut once (a second connection), every point the collector serves was
    counted, both processes' disk writes were read, the upstream bytes were read apart by message kind,
    and --record appended the line printed."""
    record = tmp_path / "wire_bytes.jsonl"
    got = _summary("wire_bytes.py", "--seconds", "6", "--cut-at", "3", "--no-ebpf", "--record", str(record))
    assert got["bench"] == "wire_bytes" and set(got["runs"]) == {"before", "columns-1", "after", "chained"}, got
    for run in got["runs"].values():
        assert run["points"] > 0 and run["series"] > 0 and run["batches"] > 0, run
        assert run["wire_up_bytes"] > 0 and run["wire_down_bytes"] > 0 and run["reconnects"] >= 1, run
        assert run["collector_disk_bytes_per_point"] > 0 and run["agent_spool_bytes_per_point"] > 0, run
        # the upstream bytes read apart into messages and framing, every byte in one part
        assert sum(run["wire_up_parts"].values()) == run["wire_up_bytes"], run
        assert run["wire_up_parts"]["batch"] > 0 and run["wire_up_parts"]["hello"] > 0, run
    assert all(got["runs"][r]["wire_up_parts"]["series"] > 0 for r in ("columns-1", "after", "chained"))
    assert "series" not in got["runs"]["before"]["wire_up_parts"]
    assert [got["runs"][r]["encoding"] for r in ("columns-1", "after", "chained")] == [
        "columns-zlib-1", "columns-zlib-2", "columns-zlib-2-chained"]
    # offering the compact encoding, the agent's Hellos (one a connection) went gzip'd, its batches as they are
    assert got["runs"]["after"]["wire_up_compressed"].get("hello", 0) >= 2, got["runs"]["after"]
    assert "batch" not in got["runs"]["after"]["wire_up_compressed"] and not got["runs"]["before"]["wire_up_compressed"]
    assert got["runs"]["before"]["encoding"] == "samples" and set(got["goals"]) and got["cpu_model"] is not None, got
    assert [json.loads(line) for line in record.read_text().splitlines()] == [got]


def test_grpc_floor_server_is_a_collector_the_ingest_bench_can_measure():
    """bench/grpc_floor.py (the server that only speaks the stream) through collector_ingest.py:
    every batch its agents counted as acknowledged, it says it stored."""
    floor = f"{sys.executable} {BENCH / 'grpc_floor.py'}"
    got = _summary("collector_ingest.py", "--agents", "20", "--rate", "4", "--seconds", "3", "--warmup-s", "2",
                   "--collector-cmd", floor)
    assert got["errors"] == 0 and got["cross_check_ok"], got
    assert got["acked"] >= 20 * 10, got



def test_fleet_scale_bench_runs_each_role_with_its_own_certificate(tmp_path):
    """bench/fleet_scale.py at a small size on the cluster as deployed (TLS, a certificate and its
    permissions per role): every step gets through with its role's identity, and the JSON line it
    records says the mode, the date and the CPU it ran on."""
    record = tmp_path / "fleet_scale.jsonl"
    got = _summary("fleet_scale.py", "--seconds", "1", "--agents", "2", "--fleet", "20", "--mem-nodes", "20",
                   "--place-nodes", "200", "--updates-s", "50", "--bytes-per-point", "3", "--compact",
                   "--record", str(record))
    assert got["nats"] == "tls" and got["errors"] == 0 and got["compact"], got
    assert got["projection"]["stream_mb_s_per_replica_measured"] > 0, got["projection"]
    # JetStream keeps the compact batches as sent, and some bytes of its own a message
    assert 100 < got["stored_bytes_per_message"] < 2000, got
    assert got["gateway_acked_s"] > 0 and got["worker_handled"] > 0 and got["worker_read"][0] > 0 and got["place_nodes"] >= 200, got
    assert got["date"].endswith("+00:00") and isinstance(got["cpu_model"], str), got
    assert [json.loads(line) for line in record.read_text().splitlines()] == [got]
