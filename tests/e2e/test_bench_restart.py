"""bench/collector_restart.py end to end at a small size, both ways it builds a store (a whole log
written beside the collector, or a fleet built in process with its snapshots): a real durable
collector restarts from it and replays what the bench wrote. The bench had stopped running when its
simulated agents changed under it (c1716fb), and no test saw it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
NODES, TAIL_S = 10, 10


def _run(*extra: str) -> dict:
    r = subprocess.run([sys.executable, str(BENCH / "collector_restart.py"), "--nodes", str(NODES),
                        "--minutes", "1", "--tail-s", str(TAIL_S), *extra],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_restart_bench_replays_the_whole_log_it_wrote():
    got = _run("--segment-s", "20")
    assert got["batches"] == NODES * 60, got
    assert got["replayed_without_snapshot"] == NODES * 60, got   # every batch written came back
    # after the stop's snapshot only the bench's tail is read from the log
    assert got["replayed_tail"] == NODES * TAIL_S, got


@pytest.mark.parametrize("full_cycle", [False, True])
def test_restart_bench_direct_restarts_from_its_snapshots_and_tail(full_cycle):
    got = _run("--direct", "--run-s", "10", "--full-cycle" if full_cycle else "--no-full-cycle")
    assert got["snapshots"] >= 1 and got["full_mb"] > 0, got
    assert got["diff_loaded"] is True, got   # the last snapshot was a diff over the full one
    assert got["replayed_tail"] == NODES * TAIL_S, got
    if full_cycle:
        assert got["full_snapshots"] >= 1, got
