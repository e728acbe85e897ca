"""The benches' C load generator (bench/loadgen/ingest_agents.c through bench/load_agents.py): it
sends the bytes the Python agent template makes, reports a collector it cannot reach by name, and
drives a real collector through bench/collector_ingest.py with every acknowledged batch stored."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import load_agents  # noqa: E402
from collector_ingest import SimAgent  # noqa: E402


@pytest.fixture(scope="module")
def binary():
    try:
        return load_agents.build_c()
    except SystemExit as e:   # no gcc or no libnghttp2-dev: scripts/setup.sh installs both
        pytest.fail(str(e))


@pytest.mark.parametrize("index,vendor,idle,compact", [(0, "nvidia", False, 0), (1, "huawei", False, 0),
                                                     (37, "nvidia", True, 0), (0, "nvidia", False, 1),
                                                     (1, "huawei", False, 2)])
def test_c_agents_send_the_bytes_of_the_python_agent(binary, tmp_path, index, vendor, idle, compact):
    """Twenty batches in a row (gauges wobbling with seq, counters counting, times stamped) are
    byte for byte the Python generator's, as Sample messages and in the compact encoding (zlib's
    own compression on both sides; 2: chained): the C generator offers the collector what it was
    measured on."""
    from xpusense.common.compact_chain import Chain
    reader = Chain(5000)
    ag = SimAgent(index, vendor)
    ag.idle = idle
    ag.compact_mode = compact
    ag.phase_s = 0.0
    plan = tmp_path / "plan"
    load_agents.write_plan(str(plan), [ag], "127.0.0.1:1", 1.0, 8, 10_000)
    now = time.time_ns()
    out = subprocess.run([binary, str(plan), "--dump", "20", str(now)], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    assert len(out) == 20
    for k, line in enumerate(out):
        assert bytes.fromhex(line) == ag.next_batch(now=now), f"batch {k + 1} of {ag.node_id} differs"
        if compact:   # the same points as the Sample messages of that batch
            from xpusense.common.compact import decode_columns
            from xpusense.v1 import telemetry_pb2 as pb
            full = pb.AgentMessage.FromString(ag._bytes(ag.seq, now)).batch
            block = pb.AgentMessage.FromString(bytes.fromhex(line)).batch.columns
            alone = reader.receive(block) if compact == 2 else block
            assert (alone != block) == (compact == 2 and k > 0)   # chained: every block after the first
            got = decode_columns(alone, 5000)
            assert got.rows() == [(s.series_ref, s.time_unix_nano, s.value) for s in full.samples]


def test_c_agents_name_a_collector_they_cannot_reach(binary):
    """Nothing listens on the port: every agent gives up after its connect attempts, and says why."""
    from helpers import free_port
    gen = load_agents.CAgents([0, 1], f"127.0.0.1:{free_port()}", 1.0, 8, [])
    try:
        fails, retries, codes = gen.wait_ready(120.0)
    finally:
        gen.close()
    assert len(fails) == 2 and all("Connection refused" in f for f in fails), fails
    assert retries == 2 * 4 and codes == ["Connection refused"]


def test_collector_ingest_bench_stores_every_batch_the_c_agents_had_acknowledged():
    """The bench end to end on a real collector: 20 agents x 4 batches/s; what they counted as
    acknowledged is what the collector says it stored, and the agents sent on their schedule."""
    r = subprocess.run([sys.executable, str(BENCH / "collector_ingest.py"), "--agents", "20", "--rate", "4",
                        "--seconds", "3", "--warmup-s", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["generator"] == "c" and summary["errors"] == 0
    assert summary["cross_check_ok"], summary
    # go .. t1 is 5 s at 4 batches/s: 20 batches an agent on schedule; one the generator sends
    # late, past t1 (a busy machine), is not sent at all
    assert 20 * 10 <= summary["acked"] <= 20 * 20, summary
    assert summary["p99_ms"] == summary["p99_ms"]   # latencies were recorded (not NaN)


def test_c_place_client_times_calls_a_real_scheduler_answers():
    """bench/loadgen/place_calls.c against the collector's real gRPC server: a call a few ms for a
    second, each answered with grpc-status 0 (the bench's figure over gRPC)."""
    from helpers import InProcessCollector
    from place_latency import PlaceCalls
    col = InProcessCollector()
    try:
        lat = PlaceCalls("c", col.addr, 1.0, 0.002).latencies(120.0)
    finally:
        col.stop()
    assert len(lat) >= 10 and all(ms > 0 for ms in lat), lat[:10]


def test_c_place_client_names_a_call_the_scheduler_refused(tmp_path):
    """A request the scheduler refuses (weights out of the platform's ranges) is counted as an error
    with its grpc-status and message, not as a latency."""
    from helpers import InProcessCollector

    from xpusense.v1 import scheduler_pb2 as spb
    good = spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=2**30, count=1)
    bad = spb.PlaceRequest(accelerator=spb.ACCELERATOR_GPU, memory_bytes=2**30, count=1,
                           weights=spb.Weights(compute=0.9))
    reqs = tmp_path / "requests.hex"
    reqs.write_text(good.SerializeToString().hex() + "\n" + bad.SerializeToString().hex() + "\n")
    col = InProcessCollector()
    try:
        r = subprocess.run([load_agents.build_c("place_calls"), col.addr, str(reqs), "0.5", "0.002"],
                           capture_output=True, text=True, timeout=120)
    finally:
        col.stop()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["errors"] >= 1 and out["latencies_ms"], out
    assert out["first_error"].startswith("grpc-status 3: ") and "compute" in out["first_error"], out["first_error"]
