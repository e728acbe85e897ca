"""Write docs/figures.md from the benches' JSON lines in bench/results/*.jsonl.

Each figure below says what it measures, the command, the goal, which lines are its runs and which
of their numbers the table shows. `--check` exits 1 when docs/figures.md is not what it would write.
Standard library only: .venv/bin/python bench/figures.py [--check]
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "figures.md"
MAX_LINE = 400
PY = ".venv/bin/python"
# kube-scheduler's extender, on one collector and on a cluster replica
EXTENDER_GOAL = "pair p99 <= Place's p99 over gRPC in the same run"
EXTENDER_COLS = [("pair p50 ms", "extender_pair.p50_ms"), ("pair p99 ms", "extender_pair.p99_ms"),
                  ("its round trips p99 ms", "extender_round_trips.p99_ms"),
                  ("Place gRPC p50 ms", "grpc_place.p50_ms"), ("Place gRPC p99 ms", "grpc_place.p99_ms"),
                  ("p99 ratio", "pair_p99_over_place_p99")]
EXTENDER_CHECKS = [("pair_p99_over_place_p99", "<=", 1.0)]

# A figure: "match" holds key -> wanted value (None: absent or false; a tuple: any of these) and
# "has" a path a line must hold; "cols" are (header, path); "checks" (path, op, limit) make the goal:
# met when every check whose figure the line has holds, missed when one does not.
FIGURES: list[dict[str, Any]] = [
    {"title": "Agent, host source alone", "bench": "agent_overhead", "match": {"tiers": ("default", None)},
     "what": "What the agent costs its node with the host source alone at the default tiers (1 s / 15 s / 5 min), "
             "streaming to a local collector: CPU of all its threads and peak RSS (VmHWM).",
     "command": f"{PY} bench/agent_overhead.py --seconds 30", "goal": "<= 1% of one core, peak RSS <= 80 MB",
     "cols": [("CPU, % of a core", "cpu_pct_one_core"), ("peak RSS, MB", "peak_rss_mb")],
     "checks": [("cpu_pct_one_core", "<=", 1.0), ("peak_rss_mb", "<=", 80.0)]},
    {"title": "Collector ingest at saturation, in memory", "bench": "collector_ingest",
     "match": {"compact": None, "mode": "saturation", "durable": None},
     "what": "How many batches (8 devices x 20 series) one collector core stores when 8 agents keep 8 batches "
             "each in flight, and the collector's CPU a batch.",
     "command": f"{PY} bench/collector_ingest.py --agents 8 --rate 0 --seconds 15",
     "goal": ">= 2,500 batches/s on one core",
     "cols": [("batches/s", "batches_per_s"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("p99 ms", "p99_ms")],
     "checks": [("batches_per_s", ">=", 2500)]},
    {"title": "Collector ingest at saturation, durable", "bench": "collector_ingest",
     "match": {"compact": None, "mode": "saturation", "durable": True},
     "what": "The same with the durable store: every batch fsync'ed (group commit) before its ack.",
     "command": f"{PY} bench/collector_ingest.py --agents 8 --rate 0 --seconds 15 --durable",
     "goal": ">= 2,000 batches/s",
     "cols": [("batches/s", "batches_per_s"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("p99 ms", "p99_ms"), ("bytes a batch", "bytes_per_batch")],
     "checks": [("batches_per_s", ">=", 2000)]},
    {"title": "Collector ingest at saturation, compact encoding", "bench": "collector_ingest",
     "match": {"compact": True, "chained": None, "mode": "saturation", "durable": None},
     "what": "The first figure with the agents sending the compact encoding (series defined once, then "
             "zlib-compressed columns): the collector's CPU a stored batch against Sample messages' in the same run.",
     "command": f"{PY} bench/collector_ingest.py --agents 8 --rate 0 --seconds 15 --compact",
     "goal": "CPU a batch no higher than Sample messages'",
     "cols": [("batches/s", "batches_per_s"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("p99 ms", "p99_ms")],
     "checks": [("batches_per_s", ">=", 2500)]},
    {"title": "Collector ingest at saturation, compact encoding chained", "bench": "collector_ingest",
     "match": {"chained": True, "mode": "saturation", "durable": None},
     "what": "The same with each agent's blocks chained (columns-zlib-2-chained): the collector inflates each "
             "on the block before it and deflates it alone again. Run right after the --compact run above, so "
             "that the two lines of one date compare the chain's cost on one VM.",
     "command": f"{PY} bench/collector_ingest.py --agents 8 --rate 0 --seconds 15 --chained",
     "goal": "none: the chain's cost a batch, against the compact run before it",
     "cols": [("batches/s", "batches_per_s"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("p99 ms", "p99_ms")],
     "checks": []},
    {"title": "Collector, 2,000 agents at 1 s, compact encoding", "bench": "collector_ingest",
     "match": {"compact": True, "chained": None, "mode": "cadence", "agents": 2000, "durable": None},
     "what": "The 2,000-agent run with the agents sending the compact encoding.",
     "command": f"{PY} bench/collector_ingest.py --agents 2000 --rate 1 --seconds 30 --warmup-s 40 --compact",
     "goal": "everything stored, p99 <= 100 ms, within one core",
     "cols": [("p99 ms", "p99_ms"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("steal %", "steal_pct"), ("all stored", "cross_check_ok")],
     "checks": [("p99_ms", "<=", 100.0), ("cross_check_ok", "==", True), ("collector_cpu_pct", "<=", 100)]},
    {"title": "Collector, 2,000 agents at 1 s, durable", "bench": "collector_ingest",
     "match": {"mode": "cadence", "agents": 2000, "durable": True},
     "what": "2,000 agents into a durable collector, in Sample messages and in the compact encoding: the bytes "
             "the collector wrote to disk (log and snapshots, /proc write_bytes) a batch of 160 points, latency, CPU.",
     "command": f"{PY} bench/collector_ingest.py --agents 2000 --rate 1 --seconds 30 --warmup-s 40 --durable [--compact]",
     "goal": "compact: <= 6 bytes a point on disk (960 a batch)",
     "cols": [("compact", "compact"), ("bytes a batch", "bytes_per_batch"), ("p99 ms", "p99_ms"),
              ("us a batch", "collector_cpu_us_per_batch"), ("collector CPU %", "collector_cpu_pct"),
              ("all stored", "cross_check_ok")],
     "checks": [("cross_check_ok", "==", True), ("bytes_per_batch", "<=", 960)]},
    {"title": "Collector, 500 agents at 1 s, durable: disk writes", "bench": "collector_ingest",
     "match": {"mode": "cadence", "agents": 500, "durable": True},
     "what": "500 agents (compact encoding, 160 points a batch) into a durable collector for 120 s: everything the "
             "collector wrote to disk in the window (write_bytes: log, snapshots, a page again at each group commit's "
             "fsync) a point, and what the store wrote to its log and to snapshots over the run, by "
             "`[store] commit_interval_s` (blank: the default of the commit).",
     "command": f"{PY} bench/collector_ingest.py --agents 500 --rate 1 --seconds 120 --durable --compact "
                "[--commit-interval-s S]",
     "goal": "<= 6 B a point written (log, snapshots, everything)",
     "cols": [("commit interval s", "commit_interval_s"), ("written B/pt", "disk_write_bytes_per_sample"),
              ("log B/pt", "store_log_bytes_per_sample"), ("snapshots B/pt", "store_snapshot_bytes_per_sample"),
              ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms"), ("us a batch", "collector_cpu_us_per_batch")],
     "checks": [("disk_write_bytes_per_sample", "<=", 6.0)]},
    {"title": "Collector, 1,000 agents at 1 s", "bench": "collector_ingest",
     "match": {"compact": None, "mode": "cadence", "agents": 1000, "idle_share": None, "collector": None, "durable": None},
     "what": "Sample-to-acknowledged latency and the collector's CPU a batch with 1,000 agents sending a batch "
             "a second each; every ack counted against what the collector says it stored.",
     "command": f"{PY} bench/collector_ingest.py --agents 1000 --rate 1 --seconds 20 --warmup-s 15",
     "goal": "everything stored, p99 <= 100 ms",
     "cols": [("p99 ms", "p99_ms"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("all stored", "cross_check_ok")],
     "checks": [("p99_ms", "<=", 100.0), ("cross_check_ok", "==", True)]},
    {"title": "Collector, 2,000 agents at 1 s", "bench": "collector_ingest",
     "match": {"compact": None, "mode": "cadence", "agents": 2000, "idle_share": None, "collector": None, "durable": None},
     "what": "The same at 2,000 agents, the fleet one collector is sized for on 2 cores; the warm-up covers "
             "the start-up, when every agent's first batch brings 160 new series.",
     "command": f"{PY} bench/collector_ingest.py --agents 2000 --rate 1 --seconds 30 --warmup-s 40",
     "goal": "everything stored, p99 <= 100 ms, within one core",
     "cols": [("p99 ms", "p99_ms"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("steal %", "steal_pct"), ("all stored", "cross_check_ok")],
     "checks": [("p99_ms", "<=", 100.0), ("cross_check_ok", "==", True), ("collector_cpu_pct", "<=", 100)]},
    {"title": "The floor under the collector, 2,000 agents at 1 s", "bench": "collector_ingest",
     "match": {"compact": None, "collector": "bench/grpc_floor.py"},
     "what": "bench/grpc_floor.py in the collector's place: a server that only speaks the Ingest stream and reads "
             "each batch with the collector's C reader. What gRPC's asyncio server costs on the machine.",
     "command": f"{PY} bench/collector_ingest.py --agents 2000 --rate 1 --seconds 30 --warmup-s 40 "
                f"--collector-cmd \"{PY} bench/grpc_floor.py\"",
     "goal": "none: a reference for the row above",
     "cols": [("p99 ms", "p99_ms"), ("us a batch", "collector_cpu_us_per_batch"),
              ("server CPU %", "collector_cpu_pct")],
     "checks": []},
    {"title": "Collector, 3,000 agents at 1 s", "bench": "collector_ingest",
     "match": {"compact": None, "mode": "cadence", "agents": 3000, "collector": None, "durable": None},
     "what": "Headroom: the fleet that saturates one collector core.",
     "command": f"{PY} bench/collector_ingest.py --agents 3000 --rate 1 --seconds 30 --warmup-s 40",
     "goal": "none: where the collector saturates",
     "cols": [("p99 ms", "p99_ms"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("all stored", "cross_check_ok")],
     "checks": []},
    {"title": "Collector, 1,500 agents at 1 s, half of them idle", "bench": "collector_ingest",
     "match": {"compact": None, "mode": "cadence", "agents": 1500, "idle_share": 0.5, "durable": None},
     "what": "Half the agents send the same gauges every round, as a fleet's nodes between jobs do.",
     "command": f"{PY} bench/collector_ingest.py --agents 1500 --rate 1 --seconds 20 --warmup-s 30 --idle-share 0.5",
     "goal": "none set",
     "cols": [("p99 ms", "p99_ms"), ("us a batch", "collector_cpu_us_per_batch"),
              ("collector CPU %", "collector_cpu_pct"), ("all stored", "cross_check_ok")],
     "checks": []},
    {"title": "Collector memory per node", "bench": "collector_memory", "match": {},
     "what": "RSS a node with 15 min of 1 s history held for every series (160 a node), and the state's own "
             "estimate; also run with `--memory-nodes 40`.",
     "command": f"{PY} bench/collector_ingest.py --memory-nodes 20", "goal": "<= 3 MB a node",
     "cols": [("nodes", "nodes"), ("RSS a node, MB", "rss_per_node_mb"), ("estimate, MB", "estimate_per_node_mb")],
     "checks": [("rss_per_node_mb", "<=", 3.0)]},
    {"title": "Collector restart, durable, 15 min of 1,000 nodes at 1 s", "bench": "collector_restart", "match": {},
     "what": "Time from start to serving after a restart just before the next full snapshot (the largest diff "
             "and a 10 s tail to replay), and what writing the snapshots costs.",
     "command": f"{PY} bench/collector_restart.py --direct --nodes 1000 --minutes 15 --run-s 10 --no-full-cycle",
     "goal": "ready <= 10 s",
     "cols": [("ready s", "ready_with_snapshot_s"), ("snapshot load s", "snapshot_load_s"),
              ("tail replay s", "replay_s"), ("full snapshot MB", "full_mb"), ("written in s", "full_write_s"),
              ("on the loop ms", "full_loop_ms")],
     "checks": [("ready_with_snapshot_s", "<=", 10.0)]},
    {"title": "eBPF tcp_rtt against ss -ti", "bench": "tcp_rtt_vs_ss", "match": {},
     "what": "The tcp_rtt probe's mean RTT against the kernel's srtt as `ss -ti` shows it, one connection between "
             "two network namespaces through a relay that holds each packet 10 ms each way.",
     "command": "sudo .venv/bin/python -m pytest tests/privileged/test_tcp_rtt.py -s",
     "goal": "within 20%",
     "cols": [("probe mean ms", "probe_mean_ms"), ("ss srtt ms", "ss_srtt_ms"), ("within %", "diff_within_pct")],
     "checks": [("diff_within_pct", "<=", 20)]},
    {"title": "NVML source, 1 s round, 8 GPUs", "bench": "nvml_round", "match": {},
     "what": "The realtime round of the NVML source against the fake libnvidia-ml.so.1 (NVML's own latency not "
             "included): agent CPU a round and NVML calls a round.",
     "command": f"{PY} bench/nvml_round.py --rounds 30", "goal": "<= 100 ms a round",
     "cols": [("NVML calls a round", "nvml_calls_per_round"), ("CPU ms mean", "cpu_ms_mean"),
              ("CPU ms p99", "cpu_ms_p99")],
     "checks": [("cpu_ms_p99", "<=", 100.0), ("cpu_ms_mean", "<=", 100.0)]},
    {"title": "HBM watch trigger latency", "bench": "hbm_trigger", "match": {},
     "what": "From the bandwidth crossing the threshold to the training-side helper's callback, beyond the "
             "watch's window.",
     "command": f"{PY} bench/hbm_trigger.py --cycles 6", "goal": "none set",
     "cols": [("window s", "window_s"), ("p50 beyond ms", "p50_over_window_ms"), ("p99 beyond ms", "p99_over_window_ms")],
     "checks": []},
    {"title": "Whole agent beside node_exporter", "bench": "footprint", "has": "quiet",
     "what": "The agent as deployed (host source, 8 fake GPUs at 1 s, every eBPF probe that runs, diagnosis on) "
             "against node_exporter on the same host over a quiet window.",
     "command": f"sudo {PY} bench/footprint.py", "goal": "CPU <= 0.7x node_exporter's, RSS <= 100 MB steady and "
                                                         "<= 130 MB peak",
     "cols": [("CPU ratio", "quiet.cpu_ratio"), ("agent CPU %", "quiet.agent.cpu_pct"),
              ("node_exporter CPU %", "quiet.node_exporter.cpu_pct"), ("RSS steady MB", "quiet.agent.rss_steady_mb"),
              ("RSS peak MB", "quiet.agent.rss_peak_mb")],
     "checks": [("quiet.cpu_ratio", "<=", 0.7), ("quiet.agent.rss_steady_mb", "<=", 100.0),
                ("quiet.agent.rss_peak_mb", "<=", 130.0)]},
    {"title": "eBPF probes attached after start", "bench": "footprint", "has": "start.exec_to_probes_held_s",
     "what": "From the agent's exec to every eBPF probe attached and held by the agent, in the runs above; "
             "`--seconds 5 --warmup-s 2 --load-seconds 0` measures the start alone.",
     "command": f"sudo {PY} bench/footprint.py",
     "goal": "<= 1 s", "cols": [("seconds", "start.exec_to_probes_held_s")],
     "checks": [("start.exec_to_probes_held_s", "<=", 1.0)]},
    {"title": "eBPF probes at ~50k context switches/s", "bench": "footprint", "has": "load",
     "what": "The agent and its programs under a workload of ~50k context switches/s, each probe against its peer "
             "tool (runqlat-bpfcc, bpftrace, ...) alone on the same workload, in ns an event.",
     "command": f"sudo {PY} bench/footprint.py", "goal": "every probe <= 1.0x its peer, agent + programs <= 2% of a core",
     "cols": [("agent + programs %", "load.total_pct"), ("switches/s", "load.context_switches_per_s"),
              ("worst ratio to peer", "load.ratio_max")],
     "checks": [("load.total_pct", "<=", 2.0), ("load.ratio_max", "<=", 1.0)]},
    {"title": "Scheduler decision", "bench": "place_latency", "match": {},
     "what": "Place latency in process and over gRPC with 1,000 and 10,000 nodes x 8 devices in one collector, "
             "ingest at 1 batch/s a node beside it.",
     "command": f"{PY} bench/place_latency.py --nodes 1000,10000 --seconds 15", "goal": "p99 <= 1 ms at 1,000 nodes",
     "cols": [("1k p50 ms", "results.nodes=1000.inproc.p50_ms"), ("1k p99 ms", "results.nodes=1000.inproc.p99_ms"),
              ("1k CPU p99 ms", "results.nodes=1000.inproc_cpu.p99_ms"),
              ("1k gRPC p99 ms", "results.nodes=1000.grpc.p99_ms"), ("10k p99 ms", "results.nodes=10000.inproc.p99_ms"),
              ("10k ingest batches/s", "results.nodes=10000.ingest_batches_s")],
     "checks": [("results.nodes=1000.inproc.p99_ms", "<=", 1.0)]},
    {"title": "kube-scheduler's extender", "bench": "extender_latency", "match": {"replica": None},
     "what": "One filter + prioritize pair over HTTP (NodeNames of all 5,000 nodes x 8 devices, nodeCacheCapable), "
             "and Place over gRPC, in the same run on one collector, ingest at 1 batch/s a node beside them.",
     "command": f"{PY} bench/extender_latency.py", "goal": EXTENDER_GOAL,
     "cols": [*EXTENDER_COLS, ("ingest batches/s", "ingest_batches_s")], "checks": EXTENDER_CHECKS},
    {"title": "kube-scheduler's extender on a cluster replica", "bench": "extender_latency", "match": {"replica": True},
     "what": "The same pair and Place over gRPC against a cluster-mode scheduler replica (a CPU of its own) following "
             "5,000 nodes' summaries, each written again once a second; NATS and the clients on the other CPUs.",
     "command": f"{PY} bench/extender_latency.py --replica", "goal": EXTENDER_GOAL,
     "cols": [*EXTENDER_COLS, ("summary updates/s", "summary_updates_s")], "checks": EXTENDER_CHECKS},
    {"title": "Cluster mode, whole runs", "bench": "fleet_scale", "match": {"place_only": None, "ack_only": None},
     "what": "3 nats-servers (R3) on loopback, gateways, a worker and a scheduler replica: per-core throughput, "
             "state a node, ack p99 at 1,000 agents, Place p99 at 11,000 nodes (docs/scale.md for sizing); stream MB/s "
             "\"a real agent\": with wire_bytes' newest batches and series tables in place of the simulated batch.",
     "command": f"{PY} bench/fleet_scale.py --seconds 15",
     "goal": "gateway >= 2,500 and worker >= 3,000 batches/s a core, <= 64 KiB a node, ack p99 <= 100 ms, "
             "Place p99 <= 1 ms in process and <= 5 ms over gRPC, <= 100 MB/s a stream replica at 100,000 nodes "
             "(JetStream's bytes a message, --compact)",
     "cols": [("compact", "compact"), ("gateway/core", "gateway_per_core"), ("worker/core", "worker_per_core"),
              ("B a node, worker", "worker_bytes_per_node"), ("B a node, replica", "scheduler_bytes_per_node"),
              ("ack p99 ms", "ack_p99_ms"), ("Place p99 ms", "place_inproc_p99_ms"), ("gRPC p99 ms", "place_grpc_p99_ms"),
              ("stream MB/s a replica", "projection.stream_mb_s_per_replica_stored"),
              ("the same, a real agent", "projection.stream_mb_s_per_replica_measured")],
     "checks": [("gateway_per_core", ">=", 2500), ("worker_per_core", ">=", 3000),
                ("worker_bytes_per_node", "<=", 65536), ("scheduler_bytes_per_node", "<=", 65536),
                ("ack_p99_ms", "<=", 100.0), ("place_inproc_p99_ms", "<=", 1.0), ("place_grpc_p99_ms", "<=", 5.0),
                ("projection.stream_mb_s_per_replica_stored", "<=", 100.0)]},
    {"title": "Cluster mode, Place alone", "bench": "fleet_scale", "match": {"place_only": True},
     "what": "Place at 10,000 nodes from the fleet bucket, 1,000 updates/s followed, the decisions on a CPU of "
             "their own.",
     "command": f"{PY} bench/fleet_scale.py --place-only --seconds 15",
     "goal": "p99 <= 1 ms in process, <= 5 ms over gRPC",
     "cols": [("p99 ms in process", "place_inproc.p99_ms"), ("p99 ms over gRPC", "place_grpc.p99_ms")],
     "checks": [("place_inproc.p99_ms", "<=", 1.0), ("place_grpc.p99_ms", "<=", 5.0)]},
    {"title": "Cluster mode, acks alone", "bench": "fleet_scale", "match": {"ack_only": True},
     "what": "Ack latency at 1,000 agents x 1 batch/s through one gateway, and the gateway's CPU a batch.",
     "command": f"{PY} bench/fleet_scale.py --ack-only --seconds 20", "goal": "p99 <= 100 ms",
     "cols": [("ack p99 ms", "p99_ms"), ("gateway us a batch", "gateway_us_per_batch")],
     "checks": [("p99_ms", "<=", 100.0)]},
]
# bench/wire_bytes.py: the same figures for NVIDIA GPUs and for Ascend NPUs.
WIRE_COLS = [("points/s", "runs.after.points_per_s"), ("after", "runs.after.encoding"),
             ("wire B/pt before", "runs.before.wire_bytes_per_point"),
             ("wire B/pt columns-zlib-1", "runs.columns-1.wire_bytes_per_point"),
             ("wire B/pt columns-zlib-2", "runs.columns-2.wire_bytes_per_point"),
             ("wire B/pt chained", "runs.chained.wire_bytes_per_point"),
             ("wire B/pt", "runs.after.wire_bytes_per_point"),
             ("of it batches", "runs.after.batch_bytes_per_point"), ("series tables", "runs.after.series_bytes_per_point"),
             ("disk B/pt before", "runs.before.collector_disk_bytes_per_point"),
             ("disk B/pt", "runs.after.collector_disk_bytes_per_point"),
             ("store log B/pt", "runs.after.store_log_bytes_per_point"),
             ("store snapshots B/pt", "runs.after.store_snapshot_bytes_per_point"),
             ("spool B/pt", "runs.after.agent_spool_bytes_per_point"),
             ("spool files B/pt", "runs.after.agent_spool_file_bytes_per_point")]
WIRE_CHECKS = [("runs.after.wire_bytes_per_point", "<=", 4.0), ("runs.after.collector_disk_bytes_per_point", "<=", 6.0),
               ("goals.agent spool <= wire per point", "==", True)]
FIGURES += [
    {"title": f"Bytes a point, {kind}", "bench": "wire_bytes", "match": {"npu": npu},
     "what": f"A real agent ({devices} at 1 s, the host, every eBPF probe that runs here) streaming through a "
             "byte-counting relay, cut once, to a durable collector: bytes on the wire (agent to collector), written "
             "to the collector's disk (write_bytes) and to the agent's spool, per point the collector serves, with "
             "Sample messages (before), the compact encoding's version 1 (columns-1), the agent's default encoding "
             "(after) and its blocks chained (chained; a run that has it; where a run has columns-2, the agent's "
             "default was chained and columns-2 is version 2's blocks alone). "
             "With one agent fsyncing a batch a second, write_bytes counts a 4 KiB page a fsync (~20 B a point "
             "whatever the encoding); what the store wrote itself (log and snapshots, its own counters) and the "
             "spool's files are the bytes at rest.",
     "command": f"sudo {PY} bench/wire_bytes.py" + (" --npu" if npu else ""),
     "goal": "after: wire <= 4, collector disk <= 6 B a point, spool no more than the wire",
     "cols": WIRE_COLS, "checks": WIRE_CHECKS}
    for kind, npu, devices in (("NVIDIA", None, "8 fake H100s"), ("Ascend", True, "8 Ascend 910B4s, fake npu-smi"))]

INTRO = """\
# Figures

Generated by `bench/figures.py` from `bench/results/*.jsonl`: do not edit by hand; add a run with a
bench's `--record FILE` flag (or its JSON line), then run `.venv/bin/python bench/figures.py`.
Figures come from this project's 2-core VMs (the CPU model is in each row), on loopback, with the
whole product in (limits, scheduler index; exporters off by default). The same code ran up to 1.5x
slower on some of these VMs than on others, and the host sometimes stole CPU time (`steal`): compare
rows taken on the same machine. Rows marked `record` were transcribed from the earlier written record
of the runs, not re-run; `bench` rows are the line the bench printed. A row's goal is met when every
figure of the goal that the row holds is within it. `bench/README.md` says how each bench measures.
"""


def get(line: dict[str, Any], path: str) -> Any:
    """The value at a dotted path; a `key=value` step picks the list element whose key has that value."""
    cur: Any = line
    for step in path.split("."):
        if isinstance(cur, list) and "=" in step:
            key, want = step.split("=", 1)
            cur = next((x for x in cur if isinstance(x, dict) and str(x.get(key)) == want), None)
        elif isinstance(cur, dict):
            cur = cur.get(step)
        else:
            return None
        if cur is None:
            return None
    return cur


def matches(fig: dict[str, Any], line: dict[str, Any]) -> bool:
    if line.get("bench") != fig["bench"]:
        return False
    if "has" in fig and get(line, fig["has"]) is None:
        return False
    for key, want in fig.get("match", {}).items():
        have = line.get(key)
        if isinstance(want, tuple):
            if have not in want:
                return False
        elif want is None:
            if have:
                return False
        elif have != want:
            return False
    return True


def verdict(fig: dict[str, Any], line: dict[str, Any]) -> str:
    seen = False
    for path, op, limit in fig["checks"]:
        v = get(line, path)
        if v is None:
            continue
        seen = True
        worst = v if not isinstance(v, list) else (max(v) if op == "<=" else min(v))
        ok = worst <= limit if op == "<=" else worst >= limit if op == ">=" else worst == limit
        if not ok:
            return "missed"
    return "met" if seen else "-"


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return "-".join(fmt(x) for x in v)
    if isinstance(v, int | float):
        return f"{v:,}"
    return str(v)


def remark(fig: dict[str, Any], line: dict[str, Any]) -> str:
    parts = []
    args = line.get("args")
    if args is not None and args and not fig["command"].endswith(args):
        parts.append(f"`{args}`")
    for key, label in (("nats", "NATS "), ("commit", "at ")):
        if line.get(key) is not None:
            parts.append(f"{label}{line[key]}")
    if line.get("note"):
        parts.append(str(line["note"]))
    return "; ".join(parts).replace("|", "/")


def newest(line: dict[str, Any]) -> tuple[str, int]:
    """Sort key, newest first with reverse=True: the date, then the later line of a file."""
    return str(line.get("date", "")), line["_n"]


def table(fig: dict[str, Any], lines: list[dict[str, Any]]) -> list[str]:
    heads = ["date", "CPU", *(h for h, _ in fig["cols"]), "goal", "from", "note"]
    out = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    for line in sorted(lines, key=newest, reverse=True):
        cells = [str(line.get("date", "-"))[:10], str(line.get("cpu_model", "-")),
                 *(fmt(get(line, p)) for _, p in fig["cols"]), verdict(fig, line),
                 "record" if line.get("transcribed") else "bench", remark(fig, line)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def load() -> list[dict[str, Any]]:
    lines = []
    for path in sorted(RESULTS.glob("*.jsonl")):
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if text.strip():
                line = json.loads(text)
                line.setdefault("bench", path.stem)
                line["_at"], line["_n"] = f"{path.name}:{n}", len(lines)
                lines.append(line)
    return lines


def render(lines: list[dict[str, Any]]) -> str:
    unplaced = [x["_at"] for x in lines if not any(matches(f, x) for f in FIGURES)]
    if unplaced:
        raise SystemExit(f"lines no figure in bench/figures.py takes (add a figure or a match): {', '.join(unplaced)}")
    out = [INTRO.rstrip("\n"), "", "| figure | goal | latest | met in latest |", "| --- | --- | --- | --- |"]
    for fig in FIGURES:
        runs = sorted((x for x in lines if matches(fig, x)), key=newest, reverse=True)
        latest = str(runs[0].get("date", "-"))[:10] if runs else "-"
        anchor = fig["title"].lower().replace(",", "").replace(" ", "-")
        out.append(f"| [{fig['title']}](#{''.join(c for c in anchor if c.isalnum() or c in '-_')}) | {fig['goal']} | "
                   f"{latest} | {verdict(fig, runs[0]) if runs else '-'} |")
    for fig in FIGURES:
        runs = [x for x in lines if matches(fig, x)]
        out += ["", f"## {fig['title']}", "", textwrap.fill(fig["what"], 100), "", f"Command: `{fig['command']}`", "",
                f"Goal: {fig['goal']}.", "", *table(fig, runs)]
    text = "\n".join(out) + "\n"
    long = [n for n, t in enumerate(text.splitlines(), 1) if len(t) > MAX_LINE]
    if long:
        raise SystemExit(f"docs/figures.md would have lines over {MAX_LINE} characters: {long[:10]}")
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/figures.md differs from what would be written")
    args = p.parse_args()
    text = render(load())
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("docs/figures.md is not what bench/figures.py writes: run .venv/bin/python bench/figures.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
