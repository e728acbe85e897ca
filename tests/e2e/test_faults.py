"""Delivery under faults, with real processes: every batch produced is stored exactly once, or
counted as dropped. Each test records its figures (produced, stored, duplicated, dropped); they
are printed at the end of the run (tests/conftest.py)."""

from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time

import pytest
from helpers import BIN, HOST_SOURCES_ONLY, free_port, nodes_json, series, wait_until
from helpers import record_figure as record

from xpusense.agent.sources.base import Sample
from xpusense.agent.spool.peek import unacked
from xpusense.agent.stream import StreamClient
from xpusense.collector.store import stored_batches
from xpusense.v1 import telemetry_pb2 as pb

FAST = """
[tiers]
realtime_s = 0.2
nearline_s = 0.2
offline_s = 5.0
[stream]
flush_s = 0.05
backoff_initial_s = 0.05
backoff_max_s = 0.5
""" + HOST_SOURCES_ONLY

def spooled(spool_dir) -> list[tuple[str, int]]:
    """(boot, seq) of the batches a (killed) agent left in its spool, not acknowledged."""
    return unacked(str(spool_dir))


class Rig:
    def __init__(self, procs, tmp_path, node="fault-node", extra_config=""):
        self.procs, self.tmp, self.node = procs, tmp_path, node
        self.addr = f"127.0.0.1:{free_port()}"
        self.data = tmp_path / "collector-data"
        self.spool_base = tmp_path / "spool"
        self.spool = self.spool_base / node
        self.cfg = tmp_path / "agent.toml"
        self.cfg.write_text(FAST + extra_config)
        self.collector = self.agent = None

    def start_collector(self):
        self.collector = self.procs([str(BIN / "xpusense-collector"), "serve", "--listen", self.addr,
                                     "--data-dir", str(self.data)], "collector")
        wait_until(lambda: nodes_json(self.addr) is not None, what="collector")

    def start_agent(self):
        self.agent = self.procs([str(BIN / "xpusense-agent"), "run", "--config", str(self.cfg), "--collector",
                                 self.addr, "--node-id", self.node], "agent",
                                env={"XPUSENSE_SPOOL_DIR": str(self.spool_base)})

    def view(self):
        return next((n for n in nodes_json(self.addr)["nodes"] if n["node_id"] == self.node), None)

    def stored(self):
        return [(b.boot_id, b.seq, len(b.samples)) for b in stored_batches(str(self.data)) if b.node_id == self.node]


def check_exactly_once(stored, dropped_by_boot=None):
    """Per boot: no (boot, seq) twice; seqs contiguous from 1, except the ones counted as dropped."""
    per_boot = collections.defaultdict(list)
    for boot, seq, _ in stored:
        per_boot[boot].append(seq)
    dups = sum(len(v) - len(set(v)) for v in per_boot.values())
    assert dups == 0, "a batch was stored twice"
    missing = {}
    for boot, seqs in per_boot.items():
        missing[boot] = sorted(set(range(1, max(seqs) + 1)) - set(seqs))
        allowed = (dropped_by_boot or {}).get(boot, 0)
        assert len(missing[boot]) == allowed, f"boot {boot}: lost {missing[boot]}"
    return per_boot, missing


def test_agent_killed_and_restarted_replays_its_spool(procs, tmp_path):
    rig = Rig(procs, tmp_path)
    rig.start_collector()
    rig.start_agent()
    wait_until(lambda: (n := rig.view()) and n["stored_up_to"] >= 5, what="first batches stored")
    rig.collector.kill(signal.SIGKILL)     # the agent keeps producing into its spool...
    wait_until(lambda: len(spooled(rig.spool)) >= 10, what="batches piling up in the spool")
    rig.agent.kill(signal.SIGKILL)         # ...and is killed with them unacknowledged
    left = spooled(rig.spool)
    boot1 = left[0][0]
    rig.start_collector()
    rig.start_agent()
    # The new agent (a new boot) sends the old boot's batches first, with their own seq numbers.
    wait_until(lambda: {(b, s) for b, s, _ in rig.stored()} >= set(left), timeout_s=90,
               what="the killed agent's spooled batches to be stored")
    n = wait_until(lambda: (n := rig.view()) and n["boot_id"] != boot1 and n["stored_up_to"] >= 3 and n,
                   what="the new boot streaming")
    rig.agent.kill(signal.SIGTERM)         # a clean stop drains what is left
    stored = rig.stored()
    per_boot, _ = check_exactly_once(stored)
    assert set(per_boot) == {boot1, n["boot_id"]}
    assert max(per_boot[boot1]) == max(s for _, s in left)
    record("agent SIGKILL + restart", produced=len(stored), spooled_at_kill=len(left), stored=len(stored),
           duplicated=0, dropped=0, samples_stored=sum(k for *_, k in stored))


@pytest.mark.skipif(os.environ.get("XPUSENSE_SHORT_FAULTS") == "1", reason="XPUSENSE_SHORT_FAULTS=1")
def test_collector_down_two_minutes_spool_grows_then_drains(procs, tmp_path):
    rig = Rig(procs, tmp_path)
    rig.start_collector()
    rig.start_agent()
    first = wait_until(lambda: (n := rig.view()) and n["stored_up_to"] >= 5 and n, what="first batches")
    rig.collector.kill(signal.SIGKILL)
    down_at = time.monotonic()
    sizes = []
    while time.monotonic() - down_at < 120:          # two minutes without a collector
        sizes.append(sum(p.stat().st_size for p in rig.spool.glob("*.seg")))
        time.sleep(5)                                  # sampling the spool's size, not synchronising
    pending = spooled(rig.spool)
    assert sizes[-1] > sizes[0] and len(pending) >= 300, (sizes, len(pending))
    rig.start_collector()
    wait_until(lambda: len(spooled(rig.spool)) < 5 and (n := rig.view()) and n["connected"], timeout_s=60,
               what="the spool to drain")
    rig.agent.kill(signal.SIGTERM)
    stored = rig.stored()
    check_exactly_once(stored)
    assert {(first["boot_id"], s) for _, s in pending} <= {(b, s) for b, s, _ in stored}
    record("collector down 120 s", produced=len(stored), spooled_peak_bytes=max(sizes), spooled_batches=len(pending),
           stored=len(stored), duplicated=0, dropped=0, samples_stored=sum(k for *_, k in stored))


def test_spool_over_budget_drops_are_counted_and_nothing_else_is_lost(procs, tmp_path):
    rig = Rig(procs, tmp_path, extra_config="[spool]\nmax_bytes = 60000\nsegment_bytes = 8000\n")
    rig.start_collector()
    rig.start_agent()
    wait_until(lambda: (n := rig.view()) and n["stored_up_to"] >= 3, what="first batches")
    rig.collector.kill(signal.SIGKILL)
    wait_until(lambda: "spool over its disk budget" in rig.agent.output(), timeout_s=60,
               what="the spool to pass its budget")
    rig.start_collector()
    # The agent reports what it dropped as its own series; wait until it is there and drained.
    n = wait_until(lambda: (n := rig.view()) and n["connected"] and len(spooled(rig.spool)) < 5
                   and series(n, "xpusense.agent.stream.dropped_batches")
                   and series(n, "xpusense.agent.stream.dropped_batches")[0]["value"] > 0 and n,
                   timeout_s=60, what="drops reported and the spool drained")
    rig.agent.kill(signal.SIGTERM)
    stored = rig.stored()
    boot = n["boot_id"]
    per_boot = collections.defaultdict(set)
    for b, s, _ in stored:
        per_boot[b].add(s)
    missing = sorted(set(range(1, max(per_boot[boot]) + 1)) - per_boot[boot])
    reported = series(n, "xpusense.agent.stream.dropped_batches")[0]["value"]
    # Every missing batch was dropped and counted; the count can only have grown since it was read.
    assert missing and len(missing) >= reported
    wait_until(lambda: "stopped: boot" in rig.agent.output(), what="the agent's stop line")
    log = rig.agent.output()
    # The stream's final count is exact: a batch dropped from the spool while in flight counts only when
    # its acknowledgement does not come. The spool's running total counts it at once, so is at least that.
    stop = next(ln for ln in log.splitlines() if "stopped: boot" in ln)
    assert f"next start), {len(missing)} batches (" in stop, (stop, len(missing))
    last = [ln for ln in log.splitlines() if "over its budget" in ln][-1]
    spool_total = int(re.search(r"\((\d+) batches, \d+ samples dropped so far", last).group(1))
    assert spool_total >= len(missing), (last, len(missing))
    check_exactly_once(stored, {boot: len(missing)})
    record("spool over budget", produced=len(stored) + len(missing), stored=len(stored), duplicated=0,
           dropped=len(missing), reported_dropped=int(reported))


def test_200_agents_for_60_seconds(procs, tmp_path):
    """200 agents, each its own stream (StreamClient, its own connection), one batch a second."""
    addr = f"127.0.0.1:{free_port()}"
    data = tmp_path / "data"
    procs([str(BIN / "xpusense-collector"), "serve", "--listen", addr, "--data-dir", str(data),
           "--log-level", "warning"], "collector")
    wait_until(lambda: nodes_json(addr) is not None, what="collector")
    clients = [StreamClient(addr, f"a{i:03d}", f"boot{i}", lambda: pb.Inventory(hostname="x"), flush_s=3600,
                            backoff_initial_s=0.1, backoff_max_s=1.0) for i in range(200)]
    for c in clients:
        c.start()
    stop = threading.Event()
    duration_s = float(os.environ.get("XPUSENSE_FAULT_200_S", "60"))

    def produce():
        t_end = time.monotonic() + duration_s
        tick = 0
        while time.monotonic() < t_end and not stop.is_set():
            tick += 1
            for c in clients:
                c.put([Sample("test.v", float(tick), "1", {"device": str(d)}, time_ns=time.time_ns())
                       for d in range(20)])
                c.flush()
            stop.wait(1.0)

    t = threading.Thread(target=produce)
    t.start()
    t.join()
    try:
        wait_until(lambda: all(c.pending() == 0 for c in clients), timeout_s=60, what="every batch acknowledged")
    finally:
        for c in clients:
            c.stop(drain_s=0)
    produced = sum(c.last_seq() for c in clients)
    stored = [(b.node_id, b.seq) for b in stored_batches(str(data))]
    assert len(stored) == len(set(stored)), "stored twice"
    assert len(stored) == produced and produced >= 200 * int(duration_s * 0.8)
    for c in clients:
        assert sorted(s for n, s in stored if n == c.node_id) == list(range(1, c.last_seq() + 1))
    record("200 agents", produced=produced, stored=len(stored), duplicated=sum(c.duplicates for c in clients),
           dropped=sum(c.dropped_batches for c in clients), samples_stored=len(stored) * 20)
